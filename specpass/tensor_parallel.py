"""Tensor-parallel models on local shards: torch's plan applied, or a DTensor model's shards taken.

    parallelize(model, group, {"layers.0.attn.q_proj": ColwiseParallel(), ...})   # torch's plan, in place
    shards, group = localize(hf_model)      # transformers' tp_plan="auto": a copy on its local shards
    drafter = follow(drafter, hf_model, shards)   # a drafter holding hf_model's modules: the copy's instead
    shard(drafter, group)                   # specpass's own layers (a DFlash or EAGLE-3 head), in place

specpass's IR is traced with `make_fx(pre_dispatch=True)`, which cannot run compute on a DTensor
("RuntimeError: Unable to cast NotImplemented to Tensor" at the first `linear` on a DTensor
weight); below that level DTensor expands, but linear, softmax and SDPA are decomposed there, not
the ops the passes read (docs/design.md, "Tensor parallel"). So a sharded model runs here as
Megatron's layers do: each linear on its local shard, and the collective its style ends in written
as a functional one, which Dynamo captures and the live-row pass moves past:

    column-parallel   output features sharded: the local output is this rank's slice, no collective
                      (gathered, `gather_last`, where the plan replicates the output: the lm_head)
    row-parallel      input features sharded: the partial products all-reduced (a bias added after)
    anything else     sharded weights (a vocabulary-parallel embedding) gathered whole once: exact,
                      a copy of that weight on every rank
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from specpass.drafters.attention import Attention
from specpass.drafters.dflash import DFlashDraft
from specpass.drafters.layers import SwiGLU

_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # the old name before torch 2.13

# transformers' style names -> what their output is: local shard, all-reduced, gathered
_HF_STYLES = {"colwise": "local", "packed_colwise": "local", "rowwise": "reduced", "packed_rowwise": "reduced",
              "colwise_gather_output": "gathered"}


def shard(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """`model` (specpass's layers: the zoo's models, specpass's drafters) on this rank's shard of
    every `Attention` and `SwiGLU` and of its own lm_head (`shard_plan`), in place (`parallelize`)."""
    world = dist.get_world_size(group)
    plan = shard_plan(model, world)
    for module in model.modules():
        if isinstance(module, Attention):
            module.n_heads //= world  # the reshapes to heads read these: this rank's heads
            module.n_kv_heads //= min(world, module.n_kv_heads)
    return parallelize(model, group, plan)


def shard_plan(model: nn.Module, world: int) -> dict[str, ParallelStyle]:
    """torch's styles for specpass's layers in `model` over `world` ranks: module name -> style. Every
    `Attention`'s q/k/v_proj column-parallel (its heads: the contiguous query heads a rank keeps read
    the K/V heads it keeps; a single K/V head stays whole on every rank) and o_proj row-parallel
    (all-reduced); every `SwiGLU`'s gate/up_proj column-parallel, down_proj row-parallel; the
    lm_head column-parallel over the vocabulary with its logits gathered (Replicate), but a DFlash
    draft's, which is its target's (sharded with the target). Embeddings, norms and the heads' fc
    stay whole. Raises ValueError where a size does not split."""
    plan: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            if module.n_heads % world or (module.n_kv_heads % world and module.n_kv_heads != 1):
                raise ValueError(f"{name}: {module.n_heads} query and {module.n_kv_heads} K/V heads do not split "
                                 f"over {world} ranks: use a world size that divides both (a single K/V head "
                                 "stays whole on every rank)")
            sharded = ("q_proj", "k_proj", "v_proj") if module.n_kv_heads % world == 0 else ("q_proj",)
            plan.update({f"{name}.{p}": ColwiseParallel() for p in sharded})
            plan[f"{name}.o_proj"] = RowwiseParallel()
        elif isinstance(module, SwiGLU):
            _check_split(name, "intermediate size", module.gate_proj.out_features, world)
            plan.update({f"{name}.gate_proj": ColwiseParallel(), f"{name}.up_proj": ColwiseParallel(),
                         f"{name}.down_proj": RowwiseParallel()})
    if isinstance(getattr(model, "lm_head", None), nn.Linear) and not isinstance(model, DFlashDraft):
        _check_split("lm_head", "vocabulary", model.lm_head.out_features, world)
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())  # the logits gathered on every rank
    return plan


def _check_split(name: str, what: str, size: int, world: int) -> None:
    if size % world:
        raise ValueError(f"{name}: the {what} {size} does not split over {world} ranks: use a world size that "
                         "divides it (an uneven shard would give ranks different shapes)")


def parallelize(model: nn.Module, group: dist.ProcessGroup, plan: dict[str, ParallelStyle]) -> nn.Module:
    """`parallelize_module(model, mesh over group, plan)`, in place (torch cuts the weights:
    `distribute_tensor`), then each sharded module on its local shard: parameters as plain tensors,
    the collective its style ends in as a functional one. Styles: ColwiseParallel (output
    Shard(-1) kept local, or Replicate: gathered), RowwiseParallel (output Replicate:
    all-reduced); bias-free linears."""
    for name, style in plan.items():
        _check_style(name, model.get_submodule(name), style)
    device = next(model.parameters()).device.type
    if device == "meta":  # a model built on the meta device, materialised after (its shard alone)
        device = "cuda" if "nccl" in dist.get_backend(group) else "cpu"
    parallelize_module(model, DeviceMesh.from_group(group, device), plan)
    for name, style in plan.items():
        module = model.get_submodule(name)
        module._forward_pre_hooks.clear()  # the styles' DTensor hooks: redistribute, to_local
        module._forward_hooks.clear()
        _on_local_shard(module, group, "reduced" if isinstance(style, RowwiseParallel)
                        else "gathered" if style.output_layouts == (Replicate(),) else "local")
    return model


def localize(model: nn.Module, plan: Mapping[str, str] | None = None) -> tuple[nn.Module, dist.ProcessGroup]:
    """A model whose parameters are DTensors (transformers' `from_pretrained(..., tp_plan="auto")`)
    -> (a copy on this rank's local shards, the process group they are sharded over). The copy
    shares every tensor with `model` (a DTensor's local shard is a view), which stays as it was.

    plan: module name pattern ("model.layers.*.self_attn.q_proj", `*` a layer number) -> transformers'
    style name (default: the model's `tp_plan`). Each module with a sharded weight must be named by
    it, with a style of `_HF_STYLES`, and its placements must agree; other sharded weights (a
    vocabulary-parallel embedding) are gathered whole."""
    params = dict(model.named_parameters())
    sharded = {name: p for name, p in params.items() if isinstance(p, DTensor)}
    if not sharded:
        raise ValueError("localize takes a model whose parameters are DTensors (tp_plan='auto'); this one has none")
    group = _group_of(next(iter(sharded.values())).device_mesh)
    plan = dict(plan if plan is not None else getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", {}))
    memo: dict[int, object] = {id(t): t for t in [*params.values(), *model.buffers()]}  # shared, not copied
    memo.update({id(p): nn.Parameter(p.to_local(), requires_grad=False) for p in sharded.values()})
    local = copy.deepcopy(model, memo)
    world = dist.get_world_size(group)
    for name, module in local.named_modules():
        style = _style_of(name, plan)
        if style is not None:  # transformers' own TP forward (a replaced forward, or hooks) goes
            module.__dict__.pop("forward", None)
            module._forward_pre_hooks.clear()
            module._forward_hooks.clear()
        weight = getattr(model.get_submodule(name), "weight", None)
        if not isinstance(weight, DTensor) or all(isinstance(p, Replicate) for p in weight.placements):
            continue
        output = _HF_STYLES.get(style)
        want = {"local": Shard(0), "gathered": Shard(0), "reduced": Shard(1)}.get(output)
        even = want is not None and weight.to_local().shape[want.dim] * world == weight.shape[want.dim]
        if isinstance(module, nn.Linear) and output is not None and weight.placements == (want,) and not even:
            raise ValueError(f"{name}: its {weight.shape[want.dim]} features do not split evenly over {world} "
                             "ranks (transformers gives the last rank a shorter slice): use a world size that "
                             "divides them")
        if isinstance(module, nn.Linear) and output is not None and weight.placements == (want,):
            _on_local_shard(module, group, output, _bias_of(model.get_submodule(name)))
        elif isinstance(module, nn.Linear) or style in _HF_STYLES:
            raise ValueError(f"{name}: specpass runs a tensor-parallel linear under transformers' styles "
                             f"{', '.join(_HF_STYLES)} with a weight sharded as they shard it; got style {style!r}, "
                             f"placements {weight.placements}. Load the model without this style (a custom tp_plan)")
        else:  # an embedding or other module: the whole weight, gathered once
            module.weight = nn.Parameter(weight.full_tensor(), requires_grad=False)
    return local, group


def follow(module: nn.Module, model: nn.Module, local: nn.Module) -> nn.Module:
    """`module` (a drafter holding some of `model`'s submodules by reference: a DFlash draft's
    embedding and lm_head) -> a copy holding the submodules of `model`'s copy `local` of the same
    names instead; its own tensors shared, not copied. A module holding none of them: itself."""
    memo: dict[int, object] = {id(m): local.get_submodule(name) for name, m in model.named_modules()}
    if not any(id(m) in memo for m in module.modules()):
        return module
    memo.update({id(t): t for t in [*module.parameters(), *module.buffers()]})  # the held modules' never reached
    return copy.deepcopy(module, memo)


def gather_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's [..., N] -> [..., world * N], rank order. Gathered along a new leading axis, then
    moved next to the last: the collective runs along no axis of the input (funcol's gather_dim=-1,
    which DTensor's Shard(-1) -> Replicate runs, gathers along the request axis and re-cats, which a
    live-row selection per request cannot pass: docs/passes.md)."""
    gathered = _all_gather(x.unsqueeze(0), 0, group)  # [world, ..., N]
    return gathered.movedim(0, -2).flatten(-2)


def _on_local_shard(module: nn.Module, group: dist.ProcessGroup, output: str,
                    bias: torch.Tensor | None = None) -> None:
    """`module` (a linear) on its weight's local shard; its output kept local, all-reduced (then the
    replicated `bias` added: once, not once per rank) or gathered."""
    shard = module.weight.to_local() if isinstance(module.weight, DTensor) else module.weight
    module.weight = nn.Parameter(shard, requires_grad=False)
    module.out_features, module.in_features = shard.shape
    if module.bias is not None:
        module.bias = None if output == "reduced" else nn.Parameter(_local(module.bias), requires_grad=False)
    if output == "reduced":
        module.register_forward_hook(lambda m, args, out: _reduced(out, group, bias))
    elif output == "gathered":
        module.register_forward_hook(lambda m, args, out: gather_last(out, group))


def _reduced(out: torch.Tensor, group: dist.ProcessGroup, bias: torch.Tensor | None) -> torch.Tensor:
    out = funcol.all_reduce(out, "sum", group)
    return out if bias is None else out + bias


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bias_of(module: nn.Module) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return None if bias is None else (bias.full_tensor() if isinstance(bias, DTensor) else bias).detach()


def _style_of(name: str, plan: Mapping[str, str]) -> str | None:
    for pattern, style in plan.items():
        if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name):
            return style
    return None


def _group_of(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The one mesh dimension of more than one rank: specpass runs tensor parallel alone."""
    dims = [d for d in range(mesh.ndim) if mesh.size(d) > 1]
    if len(dims) != 1:
        raise ValueError(f"the model is sharded over a {mesh.ndim}-D mesh of sizes "
                         f"{[mesh.size(d) for d in range(mesh.ndim)]}: specpass runs one tensor-parallel "
                         "dimension (tp_plan='auto' alone, no pipeline or data parallel)")
    return mesh.get_group(dims[0])


def _check_style(name: str, module: nn.Module, style: ParallelStyle) -> None:
    supported = isinstance(style, RowwiseParallel) and style.output_layouts == (Replicate(),) or \
        isinstance(style, ColwiseParallel) and style.output_layouts in ((Shard(-1),), (Replicate(),))
    if not isinstance(module, nn.Linear) or module.bias is not None or not supported \
            or not getattr(style, "use_local_output", False):
        raise ValueError(f"{name}: parallelize runs bias-free nn.Linear layers under ColwiseParallel (output "
                         f"Shard(-1) or Replicate) or RowwiseParallel (output Replicate), with local outputs; got "
                         f"{type(module).__name__} under {style!r}")

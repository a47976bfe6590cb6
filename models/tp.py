"""Tensor-parallel zoo models: torch's own plan (`parallelize_module` with ColwiseParallel /
RowwiseParallel), Megatron-style, run on local shards with functional collectives.

    tp = tensor_parallel(zoo.build("tiny-llama-eagle3"), group)   # this rank's shard (a copy)
    tp.setup_caches(B, S)                                         # this rank's K/V heads only
    logits, hidden_out = tp.catch_up(tokens, positions, hidden, live)   # the same on every rank

`zoo_plan` names, per model, what torch's styles shard: every `Attention`'s q/k/v_proj
column-parallel (its heads: the contiguous query heads a rank keeps read the K/V heads it keeps;
a single K/V head stays whole on every rank) and o_proj row-parallel (all-reduced); every
`SwiGLU`'s gate/up_proj column-parallel, down_proj row-parallel; the lm_head column-parallel
over the vocabulary with its logits gathered (Replicate). Embeddings, norms and EAGLE-3's fc stay
whole. Every rank must get the same inputs (SPMD), and gets the same outputs.

`parallelize` applies a plan with `parallelize_module` (torch cuts the weights: `distribute_tensor`)
and then keeps each shard as a plain tensor, the styles' DTensor hooks replaced by the functional
collectives they run (an all-reduce for a row-parallel output, an all-gather for a gathered
column-parallel one). Why not DTensor parameters at run time: specpass's IR is traced with
`make_fx(pre_dispatch=True)`, which cannot run compute on a DTensor ("RuntimeError: Unable to
cast NotImplemented to Tensor" at the first `linear` on a DTensor weight); traced below the
pre-dispatch level DTensor expands, but linear, softmax and SDPA are decomposed there, not the ops
the passes read (docs/design.md, "Tensor parallel").
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from specpass.drafters.attention import Attention
from specpass.drafters.layers import SwiGLU


def tensor_parallel(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """A copy of `model` holding this rank's shard of every Attention, SwiGLU and the lm_head
    (`zoo_plan`), on plain tensors (`parallelize`)."""
    tp = copy.deepcopy(model)
    plan = zoo_plan(tp, dist.get_world_size(group))
    world = dist.get_world_size(group)
    for module in tp.modules():
        if isinstance(module, Attention):
            module.n_heads //= world  # the reshapes to heads read these: this rank's heads
            module.n_kv_heads //= min(world, module.n_kv_heads)
    return parallelize(tp, group, plan)


def zoo_plan(model: nn.Module, world: int) -> dict[str, ParallelStyle]:
    """The plan of a zoo model (Llama, EAGLE-3 and NextN heads with GQA attention) over `world`
    ranks: module name -> torch's style. Raises ValueError where a size does not split."""
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
    _check_split("lm_head", "vocabulary", model.lm_head.out_features, world)
    plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())  # the logits gathered on every rank
    return plan


def parallelize(model: nn.Module, group: dist.ProcessGroup, plan: dict[str, ParallelStyle]) -> nn.Module:
    """`parallelize_module(model, mesh over group, plan)`, in place, then each sharded module on its
    local shard: parameters as plain tensors, the collective its style ends in as a functional one.
    Styles: ColwiseParallel (output Shard(-1) kept local, or Replicate: gathered), RowwiseParallel
    (output Replicate: all-reduced); linears without bias."""
    for name, style in plan.items():
        _check_style(name, model.get_submodule(name), style)
    device = next(model.parameters()).device.type
    parallelize_module(model, DeviceMesh.from_group(group, device), plan)
    for name, style in plan.items():
        module = model.get_submodule(name)
        module._forward_pre_hooks.clear()  # the styles' DTensor hooks: redistribute, to_local
        module._forward_hooks.clear()
        shard = module.weight.to_local() if isinstance(module.weight, DTensor) else module.weight
        module.weight = nn.Parameter(shard, requires_grad=False)
        module.out_features, module.in_features = shard.shape
        if isinstance(style, RowwiseParallel):
            module.register_forward_hook(lambda m, args, out: funcol.all_reduce(out, "sum", group))
        elif style.output_layouts == (Replicate(),):
            module.register_forward_hook(lambda m, args, out: gather_last(out, group))
    return model


def gather_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's [..., N] -> [..., world * N], rank order. Gathered along a new leading axis, then
    moved next to the last: the collective runs along no axis of the input (funcol's gather_dim=-1,
    which DTensor's Shard(-1) -> Replicate runs, gathers along the request axis and re-cats, which a
    live-row selection per request cannot pass: docs/passes.md)."""
    gathered = funcol.all_gather_tensor(x.unsqueeze(0), 0, group)  # [world, ..., N]
    return gathered.movedim(0, -2).flatten(-2)


def _check_split(name: str, what: str, size: int, world: int) -> None:
    if size % world:
        raise ValueError(f"{name}: the {what} {size} does not split over {world} ranks: use a world size that "
                         "divides it (an uneven shard would give ranks different shapes)")


def _check_style(name: str, module: nn.Module, style: ParallelStyle) -> None:
    supported = isinstance(style, RowwiseParallel) and style.output_layouts == (Replicate(),) or \
        isinstance(style, ColwiseParallel) and style.output_layouts in ((Shard(-1),), (Replicate(),))
    if not isinstance(module, nn.Linear) or module.bias is not None or not supported \
            or not getattr(style, "use_local_output", False):
        raise ValueError(f"{name}: parallelize runs bias-free nn.Linear layers under ColwiseParallel (output "
                         f"Shard(-1) or Replicate) or RowwiseParallel (output Replicate), with local outputs; got "
                         f"{type(module).__name__} under {style!r}")

"""Tensor-parallel zoo models: torch's own plan (`parallelize_module` with ColwiseParallel /
RowwiseParallel), Megatron-style, run on local shards with functional collectives.

    tp = tensor_parallel(zoo.build("tiny-llama-eagle3"), group)   # this rank's shard (a copy)
    tp.setup_caches(B, S)                                         # this rank's K/V heads only
    logits, hidden_out = tp.catch_up(tokens, positions, hidden, live)   # the same on every rank

`zoo_plan` names, per model, what torch's styles shard: every `Attention`'s q/k/v_proj
column-parallel (its heads: the contiguous query heads a rank keeps read the K/V heads it keeps;
a single K/V head stays whole on every rank) and o_proj row-parallel (all-reduced); every
`SwiGLU`'s gate/up_proj column-parallel, down_proj row-parallel; the lm_head column-parallel
over the vocabulary with its logits gathered (Replicate). Embeddings, norms and EAGLE-3's and
DFlash's fc stay whole; a DFlash draft's embedding and lm_head are its target's (`target=`). Every rank must get the same inputs (SPMD), and gets the same outputs.

`specpass.tensor_parallel.parallelize` applies the plan with `parallelize_module` (torch cuts the
weights: `distribute_tensor`) and keeps each shard as a plain tensor, the styles' DTensor hooks
replaced by the functional collectives they run: DTensor parameters cannot enter specpass's IR
(docs/design.md, "Tensor parallel").
"""

from __future__ import annotations

import copy

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from specpass.drafters import DFlashDraft
from specpass.drafters.attention import Attention
from specpass.drafters.layers import SwiGLU
from specpass.tensor_parallel import parallelize


def tensor_parallel(model: nn.Module, group: dist.ProcessGroup, target: nn.Module | None = None) -> nn.Module:
    """A copy of `model` holding this rank's shard of every Attention, SwiGLU and the lm_head
    (`zoo_plan`), on plain tensors (`parallelize`). target: a DFlash draft's, already sharded: the
    copy holds its input embedding and lm_head in place of the ones `model` holds."""
    held = {} if target is None else {id(model.embed_tokens): target.get_input_embeddings(),
                                      id(model.lm_head): target.lm_head}
    tp = copy.deepcopy(model, held)
    world = dist.get_world_size(group)
    plan = zoo_plan(tp, world)
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
    if not isinstance(model, DFlashDraft):  # whose lm_head is its target's, sharded with the target
        _check_split("lm_head", "vocabulary", model.lm_head.out_features, world)
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())  # the logits gathered on every rank
    return plan


def _check_split(name: str, what: str, size: int, world: int) -> None:
    if size % world:
        raise ValueError(f"{name}: the {what} {size} does not split over {world} ranks: use a world size that "
                         "divides it (an uneven shard would give ranks different shapes)")

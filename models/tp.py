"""Tensor-parallel zoo drafts: a full-weight model sharded Megatron-style over a process group.

    tp = tensor_parallel(zoo.build("tiny-llama-eagle3"), group)   # this rank's shard (a copy)
    tp.setup_caches(B, S)                                         # this rank's K/V heads only
    logits, hidden_out = tp.catch_up(tokens, positions, hidden, live)   # the same on every rank

Every `Attention` (specpass.drafters) keeps its slice of the heads: its rows of q/k/v_proj (column-parallel)
and the matching columns of o_proj (row-parallel: the partial sums are all-reduced). Every
`SwiGLU` keeps its slice of gate/up_proj and the matching columns of down_proj
(all-reduced). `lm_head` keeps its slice of the vocabulary; the logits are all-gathered.
Embeddings, norms and EAGLE-3's fc stay whole on every rank. The collectives are
torch.distributed's functional ones, as torch-native TP code writes them (DTensor's redistribute
traces to the same ops). Every rank must get the same inputs, as in any tensor-parallel step.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

from specpass.drafters.attention import Attention
from specpass.drafters.layers import SwiGLU


def tensor_parallel(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """A copy of `model` holding this rank's shard of every Attention, SwiGLU and the lm_head."""
    tp = copy.deepcopy(model)
    world = dist.get_world_size(group)
    for module in tp.modules():
        if isinstance(module, Attention):
            kv_parts = min(world, module.n_kv_heads)  # fewer K/V heads than ranks: each is replicated
            if module.n_heads % world or module.n_kv_heads % kv_parts or world % kv_parts:
                raise ValueError(f"{module.n_heads} query and {module.n_kv_heads} K/V heads do not split over "
                                 f"{world} ranks")
            for name, parts in (("q_proj", world), ("k_proj", kv_parts), ("v_proj", kv_parts)):
                _column_parallel(getattr(module, name), group, parts)
            module.n_heads //= world  # contiguous heads: the query heads a rank keeps read the K/V heads it keeps
            module.n_kv_heads //= kv_parts
            module.o_proj = RowParallelLinear(module.o_proj, group)
        elif isinstance(module, SwiGLU):
            _column_parallel(module.gate_proj, group, world)
            _column_parallel(module.up_proj, group, world)
            module.down_proj = RowParallelLinear(module.down_proj, group)
    tp.lm_head = VocabParallelLinear(tp.lm_head, group)  # unties a tied embedding: it stays whole
    return tp


def shard(weight: torch.Tensor, dim: int, group: dist.ProcessGroup, parts: int | None = None) -> torch.Tensor:
    """This rank's part of `weight` cut into `parts` (default: one per rank) along `dim`; with fewer
    parts than ranks, consecutive ranks share one."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    parts = parts or world
    if weight.shape[dim] % parts:
        raise ValueError(f"size {weight.shape[dim]} of {list(weight.shape)} does not split into {parts} parts")
    return weight.detach().chunk(parts, dim)[rank * parts // world].clone()


def _column_parallel(linear: nn.Linear, group: dist.ProcessGroup, parts: int) -> None:
    """Keep this rank's output features (the zoo's projections have no bias)."""
    linear.weight = nn.Parameter(shard(linear.weight, 0, group, parts))
    linear.out_features = linear.weight.shape[0]


class _ShardedLinear(nn.Module):
    """This rank's part of a linear's weight, cut along `dim`, and the group of its other parts."""

    def __init__(self, full: nn.Linear, group: dist.ProcessGroup, dim: int):
        super().__init__()
        self.weight = nn.Parameter(shard(full.weight, dim, group))
        self.group = group


class RowParallelLinear(_ShardedLinear):
    """This rank's input features of a linear; the partial products are summed over the group."""

    def __init__(self, full: nn.Linear, group: dist.ProcessGroup):
        super().__init__(full, group, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(F.linear(x, self.weight), "sum", self.group)


class VocabParallelLinear(_ShardedLinear):
    """This rank's slice of the vocabulary; the logits are gathered from every rank."""

    def __init__(self, full: nn.Linear, group: dist.ProcessGroup):
        super().__init__(full, group, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)  # [..., V / world]
        # Gathered along a new leading axis, then moved next to the vocabulary: the collective runs
        # along no axis of the input. (funcol's gather_dim=-1 gathers along the request axis and
        # re-cats, which a live-row selection per request cannot pass: docs/passes.md.)
        gathered = funcol.all_gather_tensor(logits.unsqueeze(0), 0, self.group)  # [world, ..., V / world]
        return gathered.movedim(0, -2).flatten(-2)

"""The plan of one softmax's rewrite: what the matcher proved, and every choice a lowering reads.

Immutable: matcher.py builds one per softmax; the lowerings (lowering.py) and the findings
(messages.py) only read it. The choice of lowering is made once, here, per output:

    indices_by  "topk"      topk of the input (a topk that does not return the first of equal values)
                "one_pass"  top1_lse's index (one_pass.py)
                "argmax"    the input's arg-max, 0 where the max is not finite (fused.py)
                "eager"     the first position rounding to the max probability (eager_ties.py)
    values_by   "ones"      max_probs="ones"
                "one_pass"  top1_lse's value
                "formula"   exp(top - m) / z, from m and z (fused.py)
    Gather.by   "own_index" the gather reads the op's own arg-max: top1_lse's value
                "one_pass"  s_c[ids] - top1_lse's log-sum-exp
                "formula"   exp(s_c[ids] - m) / z
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import torch
import torch.fx as fx

HALF = (torch.float16, torch.bfloat16)

IndicesBy = Literal["topk", "one_pass", "argmax", "eager"]
ValuesBy = Literal["ones", "one_pass", "formula"]
GatherBy = Literal["own_index", "one_pass", "formula"]


class Prologue(NamedTuple):
    """s = round(logits ÷ or × factor) as top1_lse computes it (kernels/__init__.py)."""

    logits: fx.Node  # what the op reads: f32, bf16 or f16, the softmax's shape
    factor: fx.Node | float  # a tensor broadcast over the rows, or a number; 1.0: no scaling
    divide: bool
    rounding: torch.dtype | None  # the quotient's 16-bit dtype, where torch rounds it
    spelled: str  # for the report


@dataclasses.dataclass(frozen=True)
class Reduction:
    """max.dim / max / amax / argmax / topk over the softmax, and the outputs it must still produce."""

    node: fx.Node
    dtypes: tuple[torch.dtype, ...]  # the softmax's dtype, then the casts to the consumer: where it rounded
    dims: tuple[int, ...]  # the reduced axes, normalised; the softmax's among them
    k: int  # topk's k; 1 for the others
    keepdim: bool  # always for topk
    sorted: bool | None  # topk's sorted=; None for the others
    values: tuple[fx.Node, ...]  # the nodes holding its values that have users
    indices: tuple[fx.Node, ...]  # the nodes holding its indices that have users
    indices_by: IndicesBy | None  # None: no indices used
    values_by: ValuesBy | None  # None: no values used


@dataclasses.dataclass(frozen=True)
class Gather:
    """gather(p', d, ids) along the softmax's axis: the probabilities of given tokens. The ids are read
    from the node when it is lowered: an earlier consumer's lowering may have replaced them."""

    node: fx.Node
    dtypes: tuple[torch.dtype, ...]  # as Reduction.dtypes
    by: GatherBy


@dataclasses.dataclass(frozen=True)
class Plan:
    """One softmax, what it consumed, and its accepted consumers in program order."""

    softmax: fx.Node
    s: fx.Node  # the softmax's input
    is_log: bool
    dim: int  # normalised
    shape: tuple  # the softmax's (sizes may be symbolic)
    out_dtype: torch.dtype  # the softmax's
    device: torch.device
    cast_to: torch.dtype | None  # softmax's dtype= where it is not s's: s_in = s.to(cast_to), else s
    compute_dtype: torch.dtype  # of m, z and the values: f32 for a 16-bit softmax, as its kernels
    eager_ties: bool  # argmax_ties="eager"
    ties_by_op: bool  # ... with the graph run eagerly: the tie rule reads the softmax op's own probabilities
    one_pass: bool  # k = 1 consumers and gathers read top1_lse (one_pass.py)
    prologue: Prologue | None  # folded into top1_lse's read (prologue.py)
    unfolded: str  # why a prologue was not folded ("" where there was none to fold)
    with_stats: bool = False  # m and z are built: exact values, or eager ties, need them
    chunks: int = 1  # the softmax axis cut into `chunks` of `chunk` (chunks.py); 1: uncut
    chunk: int = 0
    consumers: tuple[Reduction | Gather, ...] = ()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def cuts(self, dims: list[int] | tuple[int, ...]) -> bool:
        """Is a reduction over `dims` done in chunks? (the softmax's axis alone, where it was cut)"""
        return self.chunks > 1 and list(dims) == [self.dim]

"""argmax_ties="eager": the first position whose rounded probability equals the maximum's.

Ties (docs/passes.md, "Ties"): the original picks among the rounded probabilities, where rounding
can merge distinct inputs into one value (bf16 probabilities merge many). argmax_ties="input"
(fused.py, one_pass.py) returns the position of the largest input, the first among exactly equal
inputs; that is the original's index wherever its maximum probability is unique.
argmax_ties="eager" returns the first position whose probability, computed and rounded as the
values are, equals the maximum's:

    hits    = (round(exp(s_c - m) / z) == round(exp(m - m) / z)).to(int32)   (16-bit: as bits)
    indices = argmax(hits, d)                    (a NaN row has no hit: index 0, as the original)

one more pass over each row behind m and z (in their kernel on CPU). That formula is how Inductor
computes the original's probabilities, and how ATen's CPU kernel does, but not with ATen's own
ops: its softmax kernel has an exp of its own under AVX-512, which `aten.exp` does not round alike.
So where the rewritten graph runs eagerly (handoff="eager"), the rule reads the softmax op itself,
the kernel the original ran, at the cost of the full normalised tensor the original made:

    p       = round(softmax(s_in, d));  hits = (p == amax(p, d)) & (the max is not NaN)

It leaves alone the indices
it cannot reproduce (matcher.py): of a topk that does not return the first of equal values (any
k > 1), and of a log_softmax on CPU.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from specpass.passes.argmax.chunks import chunk_argmax, chunked_c, cut
from specpass.passes.argmax.fused import prob, stats
from specpass.passes.argmax.nodes import Nodes
from specpass.passes.argmax.plan import HALF, Reduction

aten = torch.ops.aten


def indices(nodes: Nodes, c: Reduction) -> fx.Node:
    """The first position of a hit along the softmax's axis (in chunks where the plan cut it)."""
    x = hits(nodes, c.dims, c.dtypes)
    if nodes.plan.cuts(c.dims):
        index = chunk_argmax(nodes, x, nodes.emit(aten.amax.default, (x, [nodes.plan.ndim])))
    else:  # along the softmax's axis: the same index wherever the other reduced axes have size 1
        index = nodes.emit(aten.argmax.default, (x, nodes.plan.dim, True))
    return nodes.reduced(index, c)


def hits(nodes: Nodes, dims: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> fx.Node:
    """int32, 1 where the probability rounds to the maximum's, as the original rounds both
    (through `dtypes`); none in a row whose maximum is NaN. (Not int8: Inductor's CPU argmax over
    int8 returns garbage for an all-zero row, torch 2.13.)"""

    def build() -> fx.Node:
        if nodes.plan.ties_by_op:
            return _hits_of_the_op(nodes, dims, dtypes)
        m, z = stats(nodes, dims)
        if nodes.plan.cuts(dims):
            x = chunked_c(nodes)
            m, z = (nodes.emit(aten.unsqueeze.default, (n, -1)) for n in (m, z))
        else:
            x = nodes.s_c()
        short = any(dtype in HALF for dtype in dtypes)
        p, top = (nodes.round(prob(nodes, n, m, z), _through_last_half(dtypes)) for n in (x, m))
        if short:
            p, top = (nodes.emit(aten.view.dtype, (n, torch.int16)) for n in (p, top))
        return nodes.emit(aten.to.dtype, (nodes.emit(aten.eq.Tensor, (p, top)), torch.int32))

    return nodes.once(("hits", tuple(dims), dtypes), build)


def _hits_of_the_op(nodes: Nodes, dims: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> fx.Node:
    """hits from the softmax op's probabilities (see the module docstring), cut into chunks where the
    plan cuts the reduction (no hit in the padding)."""
    plan = nodes.plan
    softmax = aten._log_softmax.default if plan.is_log else aten._softmax.default
    p = nodes.round(nodes.emit(softmax, (nodes.s_in(), plan.dim, False)), _through_last_half(dtypes))
    top = nodes.emit(aten.amax.default, (p, list(dims), True))
    numbers = nodes.emit(aten.eq.Tensor, (top, top))  # False where the max is NaN
    if any(dtype in HALF for dtype in dtypes):
        p, top = (nodes.emit(aten.view.dtype, (n, torch.int16)) for n in (p, top))
    hit = nodes.emit(aten.logical_and.default, (nodes.emit(aten.eq.Tensor, (p, top)), numbers))
    x = nodes.emit(aten.to.dtype, (hit, torch.int32))
    return cut(nodes, x, 0) if plan.cuts(dims) else x


def _through_last_half(dtypes: tuple[torch.dtype, ...]) -> tuple[torch.dtype, ...]:
    """The casts up to the last 16-bit one, whose bits are compared (widening after it is exact;
    Inductor keeps a bf16/fp16 cast inside a kernel unrounded, not a bitcast)."""
    short = [i for i, dtype in enumerate(dtypes) if dtype in HALF]
    return dtypes[: short[-1] + 1] if short else dtypes

"""argmax_ties="eager": the first position whose rounded probability equals the maximum's.

Ties (docs/passes.md, "Ties"): the original picks among the rounded probabilities, where rounding
can merge distinct inputs into one value (bf16 probabilities merge many). argmax_ties="input"
(fused.py, one_pass.py) returns the position of the largest input, the first among exactly equal
inputs; that is the original's index wherever its maximum probability is unique.
argmax_ties="eager" returns the first position whose probability, computed and rounded as the
values are, equals the maximum's:

    hits    = (round(exp(s_c - m) / z) == round(exp(m - m) / z)).to(int32)   (16-bit: as bits)
    indices = argmax(hits, d)                    (a NaN row has no hit: index 0, as the original)

one more pass over each row behind m and z (in their kernel on CPU). It leaves alone the indices
it cannot reproduce (matcher.py): of a topk that does not return the first of equal values (any
k > 1), and of a log_softmax on CPU.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from specpass.passes.argmax.chunks import chunk_argmax, chunked_c
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
        m, z = stats(nodes, dims)
        if nodes.plan.cuts(dims):
            x = chunked_c(nodes)
            m, z = (nodes.emit(aten.unsqueeze.default, (n, -1)) for n in (m, z))
        else:
            x = nodes.s_c()
        rounds = dtypes
        short = [i for i, dtype in enumerate(rounds) if dtype in HALF]
        if short:  # compare the bits of the last 16-bit value (widening it after is exact): Inductor
            rounds = rounds[: short[-1] + 1]  # keeps a bf16/fp16 cast inside a kernel unrounded, not a bitcast
        p, top = (nodes.round(prob(nodes, n, m, z), rounds) for n in (x, m))
        if short:
            p, top = (nodes.emit(aten.view.dtype, (n, torch.int16)) for n in (p, top))
        return nodes.emit(aten.to.dtype, (nodes.emit(aten.eq.Tensor, (p, top)), torch.int32))

    return nodes.once(("hits", tuple(dims), dtypes), build)

"""Chunks: few rows over a long softmax axis, reduced in two stages.

Inductor never splits an arg-reduction (one block per row, so bs=1 reads a 150K vocabulary with
one SM), and it splits any other reduction of fewer than 2 x SMs rows longer than 8192 (its
threshold below compute capability 10), which turns its one-pass online softmax off. So when the
rows are fewer than CHUNK_ROWS, the softmax's (last) axis is cut into chunks of >= CHUNK_MIN (a
multiple of CHUNK_ALIGN, the tail padded with -inf): stage 1 reduces each chunk (max, sum, argmax;
one kernel), stage 2 combines the chunks per row:

    m = max(m_c), z = sum(z_c * exp(m_c - m)), index = w * chunk + i_c[w]

with w the first chunk holding the row's maximum (of s, or of hits), so the index is the first
position of it, as argmax's. With m and z (exact values, or argmax_ties="eager"): from 2 chunks;
indices only: from 4 (a plain argmax is as fast below that; measured: docs/passes.md).
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from specpass.graph import is_symbolic
from specpass.passes.argmax.nodes import Nodes

aten = torch.ops.aten

CHUNK_ROWS, CHUNK_MIN, CHUNK_ALIGN = 512, 2048, 128


def plan_chunks(shape: tuple, dim: int, stats: bool) -> tuple[int, int]:
    """(chunks, chunk): the softmax axis cut when the rows alone are too few; (1, 0) uncut.
    `stats`: m and z are computed (they make 2 chunks worth it)."""
    if any(map(is_symbolic, shape)):
        return 1, 0  # the choice depends on the rows: one plan for every size is the unchunked one
    vocab = shape[dim]
    rows = math.prod(shape) // max(vocab, 1)
    if dim != len(shape) - 1 or rows == 0:
        return 1, 0
    want = min(_ceil_div(CHUNK_ROWS, rows), vocab // CHUNK_MIN)
    if want < 2:
        return 1, 0
    chunk = _ceil_div(_ceil_div(vocab, want), CHUNK_ALIGN) * CHUNK_ALIGN
    chunks = _ceil_div(vocab, chunk)
    return (chunks, chunk) if chunks >= (2 if stats else 4) else (1, 0)


def chunked(nodes: Nodes) -> fx.Node:
    """s_in as [..., chunks, chunk], padded with -inf (never the max, exp(-inf) = 0)."""
    return nodes.once("xs", lambda: cut(nodes, nodes.s_in(), float("-inf")))


def cut(nodes: Nodes, x: fx.Node, fill: float) -> fx.Node:
    """x [..., V] along the softmax's axis as [..., chunks, chunk], the padding `fill`."""
    plan = nodes.plan
    pad = plan.chunks * plan.chunk - plan.shape[plan.dim]
    if pad:
        x = nodes.emit(aten.constant_pad_nd.default, (x, [0, pad], fill))
    return nodes.emit(aten.view.default, (x, list(plan.shape[:-1]) + [plan.chunks, plan.chunk]))


def chunked_c(nodes: Nodes) -> fx.Node:
    """The chunks in the compute dtype."""
    return nodes.once("xs_c", lambda: nodes.up(chunked(nodes)))


def chunk_stats(nodes: Nodes) -> tuple[fx.Node, fx.Node]:
    """(m, z) of each row, [..., 1], from each chunk's: stage 1 over the chunks, stage 2 per row."""
    inner, outer = nodes.plan.ndim, nodes.plan.dim  # the chunk axis and the chunk-index axis

    def build() -> tuple[fx.Node, fx.Node]:
        xc = chunked_c(nodes)
        m_kept = nodes.emit(aten.amax.default, (xc, [inner], True))
        e = nodes.emit(aten.exp.default, (nodes.emit(aten.sub.Tensor, (xc, m_kept)),))
        z_kept = nodes.emit(aten.sum.dim_IntList, (e, [inner], True))
        m_c = nodes.once("m_c", lambda: nodes.emit(aten.squeeze.dims, (m_kept, [inner])))
        z_c = nodes.emit(aten.squeeze.dims, (z_kept, [inner]))
        m = nodes.emit(aten.amax.default, (m_c, [outer], True))
        # a chunk of -inf only adds 0 (its own sum is undefined); a row of -inf stays NaN
        z_c = nodes.emit(aten.masked_fill.Scalar, (z_c, nodes.emit(aten.eq.Scalar, (m_c, float("-inf"))), 0.0))
        shift = nodes.emit(aten.exp.default, (nodes.emit(aten.sub.Tensor, (m_c, m)),))
        return m, nodes.emit(aten.sum.dim_IntList, (nodes.emit(aten.mul.Tensor, (z_c, shift)), [outer], True))

    return nodes.once("chunk stats", build)


def chunk_max(nodes: Nodes) -> fx.Node:
    """Each chunk's max [..., chunks]: the stats' when they are computed."""
    if nodes.plan.with_stats:
        chunk_stats(nodes)
    return nodes.once("m_c", lambda: nodes.emit(aten.amax.default, (chunked(nodes), [nodes.plan.ndim])))


def chunk_argmax(nodes: Nodes, xs: fx.Node, m_c: fx.Node) -> fx.Node:
    """The first position of the maximum of xs [..., chunks, chunk] (m_c: each chunk's), [..., 1]:
    w * chunk + the arg-max in chunk w, w the first chunk holding the maximum."""
    inner, outer = nodes.plan.ndim, nodes.plan.dim
    w = nodes.emit(aten.argmax.default, (m_c, outer, True))
    at = nodes.emit(aten.gather.default, (nodes.emit(aten.argmax.default, (xs, inner)), outer, w))
    return nodes.emit(aten.add.Tensor, (nodes.emit(aten.mul.Tensor, (w, nodes.plan.chunk)), at))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)

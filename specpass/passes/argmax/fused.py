"""The formulation Inductor fuses: m, z, the arg-max and topk of the input, the values.

With `s_in` the tensor softmax actually consumed (`s`, cast to `dtype=` if given),
m = amax(s_c, d), z = sum(exp(s_c - m), d), s_c = s_in upcast to f32 if it is f16/bf16 (what
softmax kernels accumulate in):

    indices = where(top < inf, argmax(s_in, d), 0)          k = 1 (max.dim, argmax, topk(1))
              top: m where the values compute it, else s_in at the index (argmax's own max)
            = topk(where(m < inf, s_in, nan), k, d).indices  k > 1, or a topk(1) that does not
                                                             return the first of equal values
    values  = exp(top - m) / z                softmax (times 1 / z on CPU, as ATen's CPU kernel)
            = (top - m) - log(z)              log_softmax
      for k = 1 the top element is m itself; the result is cast to the dtype the original produced
      and through its casts after p, so it rounds where the original rounded.
    gather(p', d, ids) = exp(s_c[ids] - m) / z, log_softmax: s_c[ids] - m - log z
      (the probability of given tokens: a verifier reading the draft's tokens, or the
      log-probability of the sampled one), without the full normalised tensor.

Non-finite rows: where m is +inf or NaN, softmax gives NaN everywhere and the original's index
is the one its reduction gives an all-NaN row: 0 for max and argmax, topk's own order for topk
(which is why topk's input becomes NaN there); the values come out NaN through m and z.

Values are computed only where they have users, so an indices-only consumer is one argmax.
`amax, sub, exp, sum(keepdim=True)` over one axis is the pattern Inductor's post-grad pass turns
into a single online-softmax reduction (prepare_softmax_online) on GPU, which fuses with the
argmax over the same input. Few rows over a long last axis are cut into chunks (chunks.py).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from specpass.passes.argmax.chunks import chunk_argmax, chunk_max, chunk_stats, chunked
from specpass.passes.argmax.nodes import Nodes
from specpass.passes.argmax.plan import Reduction

aten = torch.ops.aten


def stats(nodes: Nodes, dims: list[int] | tuple[int, ...]) -> tuple[fx.Node, fx.Node]:
    """(m, z) = (max, sum(exp(s - max))) over `dims`, keepdim, in the compute dtype."""
    if nodes.plan.cuts(dims):
        return chunk_stats(nodes)

    def build() -> tuple[fx.Node, fx.Node]:
        s_c = nodes.s_c()
        # amax, sub, exp, sum(keepdim): Inductor's online-softmax pattern (one pass)
        m = nodes.emit(aten.amax.default, (s_c, list(dims), True))
        e = nodes.emit(aten.exp.default, (nodes.emit(aten.sub.Tensor, (s_c, m)),))
        return m, nodes.emit(aten.sum.dim_IntList, (e, list(dims), True))

    return nodes.once(("stats", tuple(dims)), build)


def prob(nodes: Nodes, top: fx.Node, m: fx.Node, z: fx.Node) -> fx.Node:
    """exp(top - m) / z (log_softmax: top - m - log z) in the compute dtype, as softmax kernels
    compute it; ATen's CPU kernel multiplies by 1 / z, and so does this on CPU. Over a whole row
    this is recomputed, not shared with z's exp: Inductor would store a shared one."""
    shifted = nodes.emit(aten.sub.Tensor, (top, m))
    if nodes.plan.is_log:
        return nodes.emit(aten.sub.Tensor, (shifted, _of_z(nodes, aten.log.default, z)))
    e = nodes.emit(aten.exp.default, (shifted,))
    if nodes.plan.device.type == "cpu":
        return nodes.emit(aten.mul.Tensor, (e, _of_z(nodes, aten.reciprocal.default, z)))
    return nodes.emit(aten.div.Tensor, (e, z))


def _of_z(nodes: Nodes, target: Any, z: fx.Node) -> fx.Node:
    """1 / z or log z, once per z: the values and the probabilities compared share it."""
    return nodes.once((target, z), lambda: nodes.emit(target, (z,)))


def argmax_indices(nodes: Nodes, c: Reduction) -> fx.Node:
    """The first position of the input's maximum along the softmax's axis (the same index wherever
    the other reduced axes have size 1), 0 where the max is not finite."""
    plan = nodes.plan
    x = nodes.s_in()
    if plan.cuts(c.dims):
        index = chunk_argmax(nodes, chunked(nodes), chunk_max(nodes))
    else:
        index = nodes.emit(aten.argmax.default, (x, plan.dim, True))
    # where the row holds NaN or +inf, softmax gives NaN everywhere and max's index is 0. The
    # row max tells, where the values need it anyway; else the input at the index (argmax points
    # at a NaN, else at a +inf, when the row has one): an amax beside the argmax would be a
    # second reduction, which Inductor splits off into kernels of its own at few long rows
    top = (stats(nodes, c.dims)[0] if plan.with_stats
           else nodes.emit(aten.gather.default, (nodes.s_in(), plan.dim, index)))
    index = nodes.emit(aten.where.ScalarOther, (nodes.emit(aten.lt.Scalar, (top, float("inf"))), index, 0))
    return nodes.reduced(index, c)


def topk_indices(nodes: Nodes, c: Reduction) -> fx.Node:
    """topk's indices of the input, for a topk that does not return the first of equal values."""
    return nodes.emit(operator.getitem, (topk(nodes, c.k, c.sorted), 1))


def topk(nodes: Nodes, k: int, sorted_: bool | None) -> fx.Node:
    """topk of s_in, with the rows whose max is +inf or NaN all NaN, as the original's
    probabilities there, so topk orders them as it ordered those."""
    plan = nodes.plan

    def build() -> fx.Node:
        m = (stats(nodes, [plan.dim])[0] if plan.with_stats
             else nodes.emit(aten.amax.default, (nodes.s_in(), [plan.dim], True)))
        finite = nodes.emit(aten.lt.Scalar, (m, float("inf")))
        x = nodes.emit(aten.where.ScalarOther, (finite, nodes.s_in(), float("nan")))
        return nodes.emit(aten.topk.default, (x, k, plan.dim, True, sorted_))

    return nodes.once(("topk", k, sorted_), build)


def values(nodes: Nodes, c: Reduction) -> fx.Node:
    """exp(top - m) / z (log_softmax: top - m - log z); for k = 1 the top is m itself."""
    m, z = stats(nodes, c.dims)
    if not c.keepdim:
        m, z = (nodes.emit(aten.squeeze.dims, (n, list(c.dims))) for n in (m, z))
    top = m if c.k == 1 else nodes.up(nodes.emit(operator.getitem, (topk(nodes, c.k, c.sorted), 0)))
    return prob(nodes, top, m, z)  # k = 1: 1 / z, or NaN where the max is not finite

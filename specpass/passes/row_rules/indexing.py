"""Rules of the indexing ops: embedding, advanced indexing, gather, scatter. The indices carry
the output's rows; the table indexed is read whole along the indexed axis."""

from __future__ import annotations

import torch
import torch.fx as fx

from specpass.graph import bind, known, op_name, val
from specpass.options import Options
from specpass.passes.row_rules.engine import (Operand, Rule, Selection, Stop, out_shape_of, rank, rule, same_axes,
                                              shape_of)

aten = torch.ops.aten


@rule(aten.embedding.default)
def _embedding(node: fx.Node, spec: Selection, options: Options) -> Rule:
    r, ids = rank(node), node.args[1]
    return Rule([Operand(ids, list(range(r - 1)) + [None], r - 1), Operand(node.args[0], [None] * r, 2)])


@rule(aten.index.Tensor)
def _advanced_index(node: fx.Node, spec: Selection, options: Options) -> Rule:
    x, indices = node.args[0], list(node.args[1])
    used = [i for i, t in enumerate(indices) if t is not None]
    if used != list(range(used[0], used[-1] + 1)):
        raise Stop("advanced indexing with separated index tensors")
    if any(val(indices[i]).dtype == torch.bool for i in used):
        raise Stop("boolean-mask indexing")
    first, last, r = used[0], used[-1], rank(node)
    block = len(torch.broadcast_shapes(*[val(indices[i]).shape for i in used]))
    x_axes = [i if i < first else (None if i < first + block else i - block + last + 1) for i in range(r)]
    index_axes = [None] * first + list(range(block)) + [None] * (r - first - block)
    return Rule([Operand(x, x_axes, len(shape_of(x)))] + [Operand(indices[i], index_axes, block, True) for i in used])


@rule(aten.gather.default)
def _gather(node: fx.Node, spec: Selection, options: Options) -> Rule:
    r, out = rank(node), out_shape_of(node)
    dim = bind(node)["dim"] % r
    if dim in spec.axes:
        raise Stop(f"gather along the selected axis {dim}")
    x, index = node.args[0], node.args[2]
    x_axes = [a if a == dim or known(shape_of(x)[a] == out[a]) else None for a in range(r)]
    return Rule([Operand(x, x_axes, r), same_axes(index, r)])


@rule(aten.scatter.value, aten.scatter.src, aten.scatter_add.default, aten.scatter_reduce.two)
def _scatter(node: fx.Node, spec: Selection, options: Options) -> Rule:
    r = rank(node)
    if bind(node)["dim"] % r in spec.axes:
        raise Stop(f"{op_name(node.target)} along the selected axis")
    operands = [a for a in (node.args[0], node.args[2], *node.args[3:4]) if isinstance(val(a), torch.Tensor)]
    return Rule([same_axes(a, r) for a in operands])

"""Rules of the contractions: linear, mm / bmm / matmul / addmm / baddbmm, einsum. An output row
is a row of one operand against all of the other (a weight, or the other matrix of a batch)."""

from __future__ import annotations

import torch
import torch.fx as fx

from specpass.graph import bind
from specpass.options import Options
from specpass.passes.row_rules.engine import Operand, Rule, Selection, Stop, rank, rule, same_axes, shape_of

aten = torch.ops.aten


@rule(aten.linear.default)
def _linear(node: fx.Node, spec: Selection, options: Options) -> Rule:
    r = rank(node)
    x, w, b = node.args[0], node.args[1], bind(node)["bias"]
    ops = [Operand(x, list(range(r - 1)) + [None], r), Operand(w, [None] * (r - 1) + [0], 2)]
    if isinstance(b, fx.Node):
        ops.append(Operand(b, [None] * (r - 1) + [0], 1))
    return Rule(ops)


_MATMULS = {aten.mm.default: 0, aten.bmm.default: 0, aten.matmul.default: 0, aten.addmm.default: 1,
            aten.baddbmm.default: 1}  # op -> position of the first matrix operand


@rule(*_MATMULS)
def _matmul(node: fx.Node, spec: Selection, options: Options) -> Rule:
    r, first = rank(node), _MATMULS[node.target]
    a, b = node.args[first], node.args[first + 1]
    if len(shape_of(a)) < 2 or len(shape_of(b)) < 2:
        raise Stop("matmul with a vector operand")
    batch = list(range(r - 2))
    ops = [Operand(a, batch + [r - 2, None], r, True), Operand(b, batch + [None, r - 1], r, True)]
    if first:
        ops.append(same_axes(node.args[0], r, expandable=True))
    return Rule(ops)


@rule(aten.einsum.default)
def _einsum(node: fx.Node, spec: Selection, options: Options) -> Rule:
    equation = node.args[0].replace(" ", "")
    if "..." in equation or "->" not in equation:
        raise Stop("einsum with an implicit output or an ellipsis")
    inputs, output = equation.split("->")
    return Rule([Operand(t, [letters.index(c) if c in letters else None for c in output], len(letters), True)
                 for letters, t in zip(inputs.split(","), node.args[1])])

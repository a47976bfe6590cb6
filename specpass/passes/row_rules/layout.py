"""Rules of ops that move or copy values without combining them: casts and copies, `*_like`,
expand, permute, transpose, select / unbind, cat, stack. Each output element is one element of
an operand, so the rule is where each output axis comes from."""

from __future__ import annotations

import torch
import torch.fx as fx

from specpass.graph import bind, known
from specpass.options import Options
from specpass.passes.op_sets import EXPANDS, SAME_VALUES
from specpass.passes.row_rules.engine import Operand, Rule, Selection, Stop, rank, rule, same_axes, shape_of

aten = torch.ops.aten


@rule(*SAME_VALUES, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
      aten.empty_like.default)
def _same_shape(node: fx.Node, spec: Selection, options: Options) -> Rule:
    """One tensor operand, the same axes; any other tensor argument (type_as's) only lends a dtype."""
    return Rule([same_axes(node.args[0], rank(node))])


@rule(aten.copy.default)
def _copy(node: fx.Node, spec: Selection, options: Options) -> Rule:
    """src's values in self's shape and dtype (an in-place copy_ made functional): both operands
    gathered alike, as a broadcasting pointwise op's."""
    return Rule([same_axes(a, rank(node), expandable=True) for a in node.args[:2]])


@rule(*EXPANDS)
def _expand(node: fx.Node, spec: Selection, options: Options) -> Rule:
    return Rule([same_axes(node.args[0], rank(node), expandable=True)], needs_carrier=False)


@rule(aten.permute.default)
def _permute(node: fx.Node, spec: Selection, options: Options) -> Rule:
    r = rank(node)
    return Rule([Operand(node.args[0], [d % r for d in node.args[1]], r)])


@rule(aten.transpose.int, aten.t.default)
def _transpose(node: fx.Node, spec: Selection, options: Options) -> Rule:
    r = rank(node)
    perm = list(range(r))
    d0, d1 = (node.args[1] % r, node.args[2] % r) if node.target is aten.transpose.int else (0, r - 1)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return Rule([Operand(node.args[0], perm, r)])


@rule(aten.select.int, aten.unbind.int)
def _select(node: fx.Node, spec: Selection, options: Options) -> Rule:
    r = rank(node)
    return Rule([_drop_axis(node.args[0], r, bind(node)["dim"] % (r + 1))])


def _drop_axis(x: fx.Node, out_rank: int, dropped: int) -> Operand:
    return Operand(x, [i if i < dropped else i + 1 for i in range(out_rank)], out_rank + 1)


@rule(aten.cat.default)
def _cat(node: fx.Node, spec: Selection, options: Options) -> Rule:
    """Inputs joined along `dim`, in the output's frame: row-local along every other axis. A
    1-D empty input (`torch.tensor([])`, a cache created empty) has no axes and adds nothing:
    torch skips it, and so does the rule (it is used as is)."""
    r = rank(node)
    dim = bind(node)["dim"] % r
    joined = [t for t in node.args[0] if not (len(shape_of(t)) == 1 != r and known(shape_of(t)[0] == 0))]
    if dim in spec.axes and len(joined) > 1:  # (one input joined to nothing is itself)
        sizes = " + ".join(str(shape_of(t)[dim]) for t in joined)
        raise Stop(f"cat joins {len(joined)} inputs along the selected axis {dim} ({sizes} rows, one input after "
                   "another): the selected rows are not the same rows of each input")
    return Rule([same_axes(t, r) for t in joined])


@rule(aten.stack.default)
def _stack(node: fx.Node, spec: Selection, options: Options) -> Rule:
    r = rank(node)
    dim = bind(node)["dim"] % r
    if dim in spec.axes:
        raise Stop(f"stack creates the selected axis {dim}")
    return Rule([Operand(t, [None if i == dim else i - (i > dim) for i in range(r)], r - 1) for t in node.args[0]])

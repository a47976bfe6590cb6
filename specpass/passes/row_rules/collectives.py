"""Rules of the functional collectives (torch.ops._c10d_functional).

A functional collective combines the same tensor of every rank of its group: element by element
(all_reduce), or in blocks along axis 0 (all_gather_into_tensor
concatenates the ranks' tensors, reduce_scatter_tensor sums them and keeps this rank's block).
Each output row is then made of the same row of every rank, so the collective commutes with a
gather of rows that every rank selects alike: SPMD, as in a tensor-parallel step, where every rank
runs the same graph on the same inputs. Along axis 0 of a block collective the rows are other
ranks' rows, so a selection there is refused. The in-place spellings (`dist.all_reduce(x)`) trace
to these plus a `copy_` back into `x`, a write that stays on every row.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from specpass.graph import op_name
from specpass.options import Options
from specpass.passes.row_rules.engine import Rule, Selection, Stop, rank, rule, rule_for, same_axes

_c10d = torch.ops._c10d_functional


@rule(_c10d.all_reduce.default)
def _elementwise_collective(node: fx.Node, spec: Selection, options: Options) -> Rule:
    return Rule([same_axes(node.args[0], rank(node))])


@rule(_c10d.all_gather_into_tensor.default, _c10d.reduce_scatter_tensor.default)
def _blockwise_collective(node: fx.Node, spec: Selection, options: Options) -> Rule:
    if 0 in spec.axes:
        verb = "gathers" if node.target is _c10d.all_gather_into_tensor.default else "scatters"
        axis = "token" if 0 in spec.row_axes else "request"
        raise Stop(f"{op_name(node.target)} {verb} along axis 0 across ranks, the selection's {axis} axis: "
                   "the rows it picks there are not only this rank's")
    return Rule([same_axes(node.args[0], rank(node))])


@rule(_c10d.wait_tensor.default)
def _wait(node: fx.Node, spec: Selection, options: Options) -> Rule:
    """A wait moves only together with the collective right before it: a gather between them would
    read the collective's result before it is complete."""
    collective = node.args[0]
    if collective is not node.prev or len(collective.users) > 1:
        raise Stop(f"{node.name} does not directly follow its collective {collective.name} as its only user")
    rule_for(collective, spec, options)  # Stop: the collective does not move, so neither does its wait
    return Rule([same_axes(collective, rank(node))])

"""The rule of scaled_dot_product_attention: the Q-slice."""

from __future__ import annotations

import torch
import torch.fx as fx

from specpass.graph import bind
from specpass.options import Options
from specpass.passes.row_rules.engine import Operand, Rule, Selection, Stop, rank, rule

aten = torch.ops.aten


@rule(aten.scaled_dot_product_attention.default)
def _attention(node: fx.Node, spec: Selection, options: Options) -> Rule:
    """Row-local in the query (and batch) axes: each output row reads its own query row, its own
    mask row, and all of K/V — so gathering query and mask rows is exact (the Q-slice)."""
    q, k, v = node.args[:3]
    mask = bind(node)["attn_mask"]
    if bind(node)["dropout_p"]:
        raise Stop("attention with dropout")
    r = rank(node)
    query = r - 2
    if query in spec.axes and not options.q_slice:
        raise Stop("q_slice=False keeps attention on every query row")
    if r - 1 in spec.axes:
        raise Stop("attention's feature axis is selected")
    batch = list(range(r - 2))
    if spec.flattens(batch):
        raise Stop("the rows are flat ids across requests, not provably per request: "
                   "gathering before attention would copy K/V for every row")
    ops = [Operand(q, batch + [query, None], r), Operand(k, batch + [None, None], r),
           Operand(v, batch + [None, None], r)]
    if isinstance(mask, fx.Node):
        ops.append(Operand(mask, batch + [query, None], r, True))
    return Rule(ops)

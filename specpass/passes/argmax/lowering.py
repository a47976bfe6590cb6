"""Lowering: each consumer of a plan rewritten, each output by the lowering the plan chose.

    indices  topk: fused.topk_indices   one_pass: one_pass.indices   argmax: fused.argmax_indices
             eager: eager_ties.indices
    values   ones: (indices >= 0).to(dtype), all ones, fused into the argmax kernel (max_probs="ones")
             one_pass: one_pass.values  formula: fused.values; rounded as the original rounded
    gather   own_index: top1_lse's value    one_pass: s_c[ids] - lse    formula: exp(s_c[ids] - m) / z

New nodes are inserted right after the softmax, so they read `s` at the same program point
the softmax did (a later in-place write to `s` cannot leak in); a gather's reads of the logits at
its ids go right before it, after the ids. The softmax, the consumer and its getitems are left
for the pipeline's dead-code elimination; a softmax with other users stays for them.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from specpass.graph import bind, same_shape, val
from specpass.passes.argmax import eager_ties, fused, one_pass
from specpass.passes.argmax.messages import message
from specpass.passes.argmax.nodes import Nodes
from specpass.passes.argmax.plan import Gather, Plan, Reduction

aten = torch.ops.aten

_INDICES: dict[str, Callable[[Nodes, Reduction], fx.Node]] = {
    "topk": fused.topk_indices, "one_pass": one_pass.indices, "argmax": fused.argmax_indices,
    "eager": eager_ties.indices,
}
_VALUES: dict[str, Callable[[Nodes, Reduction], fx.Node]] = {"one_pass": one_pass.values, "formula": fused.values}


def lower(plan: Plan, graph: fx.Graph) -> dict[fx.Node, str]:
    """Rewrite the plan's consumers in `graph`; -> each one's finding message."""
    nodes = Nodes(plan, graph)
    said = {}
    with graph.inserting_before(plan.softmax.next):  # new nodes read s where the softmax read it
        for consumer in plan.consumers:
            if isinstance(consumer, Gather):
                _lower_gather(nodes, consumer)
            else:
                _lower_reduction(nodes, consumer)
            said[consumer.node] = message(plan, consumer, nodes.s_in_name())
    return said


def _lower_reduction(nodes: Nodes, c: Reduction) -> None:
    indices = None
    if c.indices_by is not None:
        indices = _INDICES[c.indices_by](nodes, c)
        for node in c.indices:
            node.replace_all_uses_with(indices)
    if c.values_by is not None:
        if c.values_by == "ones":
            values = _ones(nodes, c, indices)
        else:
            values = nodes.round(_VALUES[c.values_by](nodes, c), c.dtypes)
        assert same_shape(val(values).shape, val(c.values[0]).shape), (values, c.values)
        for node in c.values:
            node.replace_all_uses_with(values)


def _ones(nodes: Nodes, c: Reduction, indices: fx.Node | None) -> fx.Node:
    """max_probs="ones": ones of the values' shape and dtype."""
    out = val(c.values[0])
    if indices is not None:  # computed from the indices so it fuses into their kernel
        return nodes.emit(aten.to.dtype, (nodes.emit(aten.ge.Scalar, (indices, 0)), out.dtype))
    return nodes.emit(aten.new_ones.default, (nodes.s_in(), list(out.shape)), {"dtype": out.dtype})


def _lower_gather(nodes: Nodes, c: Gather) -> None:
    if c.by == "own_index":  # the sampled token's: the op's own value
        value = nodes.round(one_pass.top1_lse(nodes)[3], c.dtypes)
    elif c.by == "one_pass":
        lse = one_pass.top1_lse(nodes)[2]
        value = _at_ids(nodes, c, lambda top: one_pass.given(nodes, top, lse))
    else:
        m, z = fused.stats(nodes, [nodes.plan.dim])
        value = _at_ids(nodes, c, lambda top: fused.prob(nodes, top, m, z))
    c.node.replace_all_uses_with(value)


def _at_ids(nodes: Nodes, c: Gather, of_logits: Callable[[fx.Node], fx.Node]) -> fx.Node:
    """of_logits(s_c at the gather's ids), rounded as the gather's probabilities were."""
    with nodes.graph.inserting_before(c.node):  # after ids: they may be computed from these rows
        top = nodes.up(nodes.emit(aten.gather.default, (nodes.s_in(), nodes.plan.dim, bind(c.node)["index"])))
        return nodes.round(of_logits(top), c.dtypes)

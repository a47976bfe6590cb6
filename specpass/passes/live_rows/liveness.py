"""Backward liveness: which nodes can run on the selected rows only.

In reverse program order each node learns what its users need: every row (FULL), or one
selection. A node whose users all need the same selection, whose op is row-local for it
(row_rules/), and whose storage is not written in place before its users read it, is *pulled*:
its operands then need the selection mapped onto their own axes. Anything else — an in-place
write, a returned tensor, a row-mixing or unknown op — needs every row, and says why.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx

from specpass.graph import is_mutation, is_symbolic, op_name, val
from specpass.options import Options
from specpass.passes.live_rows.gathers import Candidate, as_static
from specpass.passes.live_rows.program import Program
from specpass.passes.live_rows.reshape import through_reshape
from specpass.passes.live_rows.rows import Rows, Static, keeps_less
from specpass.passes.op_sets import RESHAPES, VIEWS
from specpass.passes.row_rules import Gather, Keep, Stop, out_shape_of, plan_operands, shape_of

aten = torch.ops.aten
FULL = "full"  # the node is needed on every row


@dataclasses.dataclass
class Liveness:
    need: dict[fx.Node, Any]  # FULL, or the selection its users need
    plans: dict[fx.Node, dict[fx.Node, Keep | Gather]]  # pulled nodes: what each operand needs
    why: dict[fx.Node, str]  # why a node is needed on every row
    asked: dict[fx.Node, Any]  # what its users asked for: their one selection, or FULL

    def fired(self, candidate: Candidate) -> bool:
        """Did this gather's selection move above its source?"""
        return candidate.source in self.plans and self.need[candidate.source] == candidate.spec


def analyse(prog: Program, candidates: dict[fx.Node, Candidate], options: Options) -> Liveness:
    live = Liveness({}, {}, {}, {})
    demands: dict[fx.Node, list[tuple[Any, str]]] = defaultdict(list)

    def demand_all(node: fx.Node) -> None:
        candidate = candidates.get(node)
        if is_mutation(node):
            reason = f"used by the in-place {op_name(node.target)} {node.name}"
        elif node.target is operator.getitem or node.target in VIEWS:
            reason = live.why[node]  # views pass the reason through
        else:
            reason = f"needed in full by {node.name}"
        for a in node.all_input_nodes:
            if candidate is not None and a is candidate.source:
                demands[a].append((candidate.spec, ""))
            else:
                demands[a].append((FULL, reason))

    def stay_full(node: fx.Node, reason: str) -> None:
        live.need[node] = FULL
        live.why[node] = reason
        demand_all(node)
        for user in node.users:  # elements of a tuple that stays whole are gathered one by one
            if user.target is operator.getitem and live.plans.pop(user, None) is not None:
                live.need[user], live.why[user] = FULL, f"{reason} (via {node.name})"

    for node in reversed(list(prog.graph.nodes)):
        if node.op == "output":
            for a in node.all_input_nodes:
                demands[a].append((FULL, "returned as an output"))
            continue
        wanted = demands.get(node, [])
        if not wanted and not is_mutation(node):
            continue  # dead
        specs = {spec for spec, _ in wanted}
        live.asked[node] = next(iter(specs)) if len(specs) == 1 else FULL
        if is_mutation(node):  # a region call that writes a cache too: its outputs' getitems stay whole
            stay_full(node, f"an in-place {op_name(node.target)}")
            continue
        if node.op != "call_function":
            stay_full(node, "a graph input")
            continue
        if FULL in specs or len(specs) > 1:
            stay_full(node, next((r for s, r in wanted if s == FULL), "its users need different rows"))
            continue
        spec = specs.pop()
        if node in candidates and compose(node, spec) is None and \
                keeps_less((candidates[node].spec, shape_of(candidates[node].source)), (spec, out_shape_of(node))):
            # A gather of a gather on another axis, one selection per tensor: the one that keeps
            # fewer elements moves (logits[:, -1][:, :V] moves the -1), the other stays after it.
            stay_full(node, "a row gather that keeps fewer rows than its users' selection")
            continue
        try:
            live.plans[node] = _pull(prog, node, spec, options, candidates)
        except Stop as stop:
            stay_full(node, str(stop))
            continue
        live.need[node] = spec
        for operand, action in live.plans[node].items():
            if isinstance(action, Gather) and action.expand_to is None:
                demands[operand].append((action.spec, ""))
            else:
                demands[operand].append((FULL, f"needed in full by {node.name}"))
    return live


def _pull(prog: Program, node: fx.Node, spec: Rows, options: Options, candidates: dict[fx.Node, Candidate]
          ) -> dict[fx.Node, Keep | Gather]:
    """Operand plans for running `node` on `spec`'s rows only, or Stop(reason)."""
    late = [i for i in spec.index_nodes() if prog.pos[i] >= prog.pos[node]]
    if late:
        raise Stop(f"the row index {late[0].name} is only known after {node.name}")
    for user in node.users:
        # A fired gather's result is a fresh tensor where the original was a view that later
        # writes would show through: it counts as read at the end of the graph.
        read = prog.pos[prog.graph.output_node()] if user in candidates else prog.pos[user]
        writer = prog.written_between(node, node, read)
        if writer is not None:
            raise Stop(f"{writer.name} writes it in place before {user.name}'s result is read")
    if node.target in RESHAPES:
        x = node.args[0]
        inner = through_reshape(prog, spec, shape_of(x), out_shape_of(node), val(x).device)
        return {x: Keep() if inner is None else Gather(inner)}
    composed = compose(node, spec)
    if composed is not None:
        return {node.args[0]: Gather(composed)}
    return plan_operands(node, spec, options)


def compose(node: fx.Node, spec: Rows) -> Static | None:
    """A range of a range of the same axis (`x[:, -4:][:, -1]`) is one range of x."""
    if node.target is aten.select.int:  # it drops its axis: the selection is on another one
        return None
    candidate = as_static(node)
    if candidate is None or not isinstance(spec, Static) or candidate.axis != spec.axis \
            or any(map(is_symbolic, (candidate.start, candidate.stop, spec.start, spec.stop))):
        return None
    outer = range(candidate.start, candidate.stop, candidate.step)[spec.start: spec.stop: spec.step]
    return Static(spec.axis, outer.start, outer.stop, outer.step)

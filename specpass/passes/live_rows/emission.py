"""Forward emission: each pulled node is rewritten in place on gathered operands.

Same name, same position — so every read keeps its place relative to the KV writes. A needed-in-
full operand is gathered right before its first pulled consumer, once per write epoch of its
storage; view sizes come from the gathered shapes, not from the trace; and each fired gather
becomes a reshape of its (already gathered) source.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from specpass.graph import bind, emit, same_shape, set_val, size_args, val
from specpass.passes.live_rows.gathers import Candidate
from specpass.passes.live_rows.liveness import FULL, Liveness, compose
from specpass.passes.live_rows.program import Program
from specpass.passes.live_rows.rows import Rows
from specpass.passes.op_sets import EXPANDS, RESHAPES
from specpass.passes.row_rules import Gather, Keep, out_shape_of, shape_of

aten = torch.ops.aten


def emit_live_rows(prog: Program, live: Liveness, candidates: dict[fx.Node, Candidate]) -> None:
    stop_gathers: dict[tuple, fx.Node] = {}
    replaced: dict[fx.Node, fx.Node] = {}  # a fired gather -> the source its readers now read
    for node in list(prog.graph.nodes):
        if node in live.plans:
            operands = {}
            with prog.graph.inserting_before(node):
                for operand, action in live.plans[node].items():
                    if isinstance(action, Keep) or operand in live.plans:
                        continue  # pulled operands were rewritten in place already
                    # A fired gather's rows are gathered from its source (`exp()[:, :2]` then a
                    # gather by index: the range fired first): the old gather node, run on the
                    # gathered source, would select again (`x[:, 1:]` of rows 1: is rows 2:).
                    read = replaced.get(operand, operand)
                    # The rows are read where the consumer read them: one gather per write epoch.
                    key = (read, action, prog.epoch(read, node))
                    if key not in stop_gathers:
                        x = read
                        if action.expand_to is not None:
                            x = emit(prog.graph, aten.expand.default, (x, list(action.expand_to)))
                        stop_gathers[key] = action.spec.gather(prog, x, f"{operand.name}_rows")
                    operands[operand] = stop_gathers[key]  # by the argument: `node` may read `read` too
                _rewrite(prog, node, live.need[node], operands)
        candidate = candidates.get(node)
        if candidate is not None and live.fired(candidate) and live.need.get(node) == FULL:
            if same_shape(shape_of(candidate.source), shape_of(node)):
                # A pulled reader that gathers rows of it is rewritten on them later, by this argument.
                node.replace_all_uses_with(candidate.source, lambda user: not _gathers_from(live, user, node))
                replaced[node] = candidate.source
            else:
                node.target, node.kwargs = aten.reshape.default, {}
                node.args = size_args(prog.graph, (candidate.source, shape_of(node)))
                set_val(node)


def _gathers_from(live: Liveness, user: fx.Node, operand: fx.Node) -> bool:
    return isinstance(live.plans.get(user, {}).get(operand), Gather)


def _rewrite(prog: Program, node: fx.Node, spec: Rows, operands: dict[fx.Node, fx.Node]) -> None:
    """Turn `node` in place into its gathered version (every user of it reads gathered rows)."""
    want = [spec.gathered_shape(list(v.shape)) for v in tree_leaves(val(node)) if isinstance(v, torch.Tensor)]
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: operands.get(a, a))
    if node.target in RESHAPES or node.target in EXPANDS or compose(node, spec) is not None:
        # a view: its operand is already gathered (a composed range: by the range of the range)
        node.target = aten.expand.default if node.target in EXPANDS else aten.reshape.default
        args, kwargs = (args[0], want[0]), {}
    elif node.target is aten.scaled_dot_product_attention.default and bind(node)["is_causal"] \
            and len(shape_of(node.args[0])) - 2 in spec.axes:
        # is_causal=True is top-left aligned: query row i sees key j <= i. The same mask for the
        # selected query rows only, as an explicit boolean mask.
        names = [a.name for a in node.target._schema.arguments]
        kwargs = dict(zip(names[3:], args[3:])) | kwargs
        keys = prog.arange(0, val(node.args[1]).shape[-2], 1, val(node.args[1]).device)
        kwargs.update(attn_mask=spec.causal_mask(prog, out_shape_of(node), keys), is_causal=False)
        args = args[:3]
    node.args, node.kwargs = size_args(prog.graph, (args, kwargs))
    set_val(node)
    got = [list(v.shape) for v in tree_leaves(val(node)) if isinstance(v, torch.Tensor)]
    if len(want) != len(got) or not all(map(same_shape, want, got)):
        raise RuntimeError(f"gathered {node.name} has shapes {got}, expected {want}")

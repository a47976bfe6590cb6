"""Rules of ops along an axis that keep every axis: softmax, scans, topk / sort, flip, the
slicing ops (split, chunk, slice, narrow, index_select), and the norms over the trailing axes.
Row-local unless a selected axis is the one they work along."""

from __future__ import annotations

import torch
import torch.fx as fx

from specpass.graph import bind, known, op_name, to_the_end
from specpass.options import Options
from specpass.passes.row_rules.engine import Rule, Selection, Stop, along, rank, rule, same_axes, shape_of

aten = torch.ops.aten


_ALONG_DIM = {  # op -> its dims argument: ops along an axis that keep every axis
    aten.softmax.int: "dim", aten.log_softmax.int: "dim", aten._softmax.default: "dim",
    aten._log_softmax.default: "dim", aten.cumsum.default: "dim", aten.cumprod.default: "dim",
    aten.topk.default: "dim", aten.sort.default: "dim", aten.flip.default: "dims",
    aten.split.Tensor: "dim", aten.split_with_sizes.default: "dim", aten.chunk.default: "dim",
    aten.slice.Tensor: "dim", aten.narrow.default: "dim", aten.index_select.default: "dim",
}


@rule(*_ALONG_DIM)
def _along_dim(node: fx.Node, spec: Selection, options: Options) -> Rule:
    if _whole_axis(node):  # x[:, 0:] — in dynamic graphs `pos[:, None]` keeps such a slice
        return Rule([same_axes(node.args[0], rank(node))])
    return along(node, spec, [node.args[0]], bind(node)[_ALONG_DIM[node.target]], keepdim=True)


def _whole_axis(node: fx.Node) -> bool:
    """A slice that keeps every row of its axis, in order: the identity."""
    if node.target is not aten.slice.Tensor:
        return False
    args = bind(node)
    size = shape_of(node.args[0])[args["dim"] % rank(node)]
    end = args["end"]
    return args["start"] in (None, 0) and args["step"] == 1 and not isinstance(end, fx.Node) and (
        to_the_end(end) or known(end >= size))


@rule(aten.rms_norm.default, aten.layer_norm.default, aten.native_layer_norm.default)
def _norm(node: fx.Node, spec: Selection, options: Options) -> Rule:
    r, normalized = rank(node), len(bind(node)["normalized_shape"])
    if any(a >= r - normalized for a in spec.axes):
        raise Stop(f"{op_name(node.target)} normalises over the selected axis")
    return Rule([same_axes(node.args[0], r)])

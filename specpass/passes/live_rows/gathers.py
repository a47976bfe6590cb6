"""Gather nodes read as row selections: every spelling of "keep these rows" the pass knows.

select / slice / narrow are a `Static` range; `x[arange(B), idx]` and `torch.gather` with an
index that varies along the batch and one axis are `PerBatch`; `index_select`, `x[ids]` and any
other advanced index are `Flat` ids. A new spelling is one reader here.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from specpass.graph import bind, is_symbolic, known, same_shape, static_int, to_the_end, val
from specpass.passes.live_rows.program import Program
from specpass.passes.live_rows.reshape import canonical
from specpass.passes.live_rows.rows import Flat, PerBatch, Rows, Static
from specpass.passes.row_rules import Stop, shape_of

aten = torch.ops.aten


@dataclasses.dataclass
class Candidate:
    source: fx.Node
    spec: Rows


def read_gather(prog: Program, node: fx.Node) -> Candidate | None:
    """Read a gather node as a row selection on its source, or None."""
    if node.op != "call_function" or not isinstance(val(node), torch.Tensor) or not node.args:
        return None
    target, x = node.target, node.args[0]
    if not isinstance(x, fx.Node) or not isinstance(val(x), torch.Tensor):
        return None
    shape = shape_of(x)
    static = as_static(node)
    if static is not None:
        return Candidate(x, static) if known(static.rows < shape[static.axis]) else None
    if target is aten.index_select.default:
        ids = _index_leaf(prog, node, node.args[2])
        return Candidate(x, Flat((node.args[1] % len(shape),), prog.index_op(aten.reshape.default, ids, [-1])))
    read = {aten.index.Tensor: _advanced_index, aten.gather.default: _gather}.get(target)
    spec = read(prog, node, shape) if read is not None else None
    if spec is None:
        return None
    # One request (`x[arange(1), live]`): the flat ids a reshape reads the same rows as, so that
    # this gather and one reached through a reshape (a gathered lm_head's logits) meet as one selection.
    spec = canonical(spec, shape).normalize(prog, shape)
    return None if spec is None else Candidate(x, spec)


def as_static(node: fx.Node) -> Static | None:
    """select / slice / narrow as a range of one axis of their input."""
    if node.target not in (aten.select.int, aten.slice.Tensor, aten.narrow.default):
        return None
    args, shape = bind(node), shape_of(node.args[0])
    if any(isinstance(v, fx.Node) for v in args.values() if v is not node.args[0]):
        return None  # bounds known only at run time (a slice by `.item()`): not a static range
    dim = args["dim"] % len(shape)
    if node.target is aten.select.int:
        i = _position(args["index"], shape[dim])
        return Static(dim, i, i + 1)
    if node.target is aten.narrow.default:
        start = _position(args["start"], shape[dim])
        return Static(dim, start, start + args["length"])
    size, start, end = shape[dim], args["start"], args["end"]
    if not is_symbolic(size):
        r = range(size)[start: end: args["step"]]
        return Static(dim, r.start, r.stop, r.step)
    # A symbolic axis: the bounds a dynamic graph spells, from the start (0, k) or from the end
    # (-k, None); a bound that may fall outside the axis is not a static range.
    start = _position(start or 0, size)
    end = size if to_the_end(end) else _position(end, size)
    if not (known(0 <= start) and known(start <= end) and known(end <= size)):
        return None
    return Static(dim, start, end, args["step"])


def _position(index: int, size: int) -> int:
    """A Python index (negative: from the end) as a position along an axis of `size`."""
    return static_int(index + size) if index < 0 else index


def _index_leaf(prog: Program, gather: fx.Node, index: fx.Node) -> fx.Node:
    """Hoist the index computation as early as it can go; refuse if it is written in place."""
    prog.hoist(index)
    writer = prog.written_between(index, index, gather)
    if writer is not None:
        raise Stop(f"the row index is written in place by {writer.name} before {gather.name}")
    return index


def _is_arange(node: object, size: int) -> bool:
    while isinstance(node, fx.Node) and node.target in (aten.view.default, aten.unsqueeze.default,
                                                         aten.reshape.default):
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.target not in (aten.arange.default, aten.arange.start,
                                                            aten.arange.start_step):
        return False
    bounds = [val(a) for a in node.args if not isinstance(a, torch.dtype)]
    start, end, step = (0, bounds[0], 1) if len(bounds) == 1 else (bounds + [1])[:3]
    return known(start == 0) and known(end == size) and known(step == 1) and \
        val(node).dtype in (torch.int64, torch.int32)


def _advanced_index(prog: Program, node: fx.Node, shape: list[int]) -> Rows | None:
    indices = list(node.args[1])
    used = [i for i, t in enumerate(indices) if t is not None]
    if not used or used != list(range(used[0], used[-1] + 1)):
        return None
    if any(val(indices[i]).dtype == torch.bool for i in used):
        return None
    p = used[0]
    leaves = [_index_leaf(prog, node, indices[i]) for i in used]
    bshape = list(torch.broadcast_shapes(*[val(t).shape for t in leaves]))
    B = shape[p]
    if len(used) == 2 and _is_arange(leaves[0], B) and same_shape(shape_of(leaves[0]), [B] if len(bshape) == 1 else [B, 1]):
        # x[arange(B), idx] / x[arange(B)[:, None], idx]: rows idx[b] of request b
        index = leaves[1] if same_shape(shape_of(leaves[1]), bshape) else \
            prog.index_op(aten.expand.default, leaves[1], bshape)
        if len(bshape) == 1:
            index = prog.index_op(aten.unsqueeze.default, index, 1)
        return PerBatch(p, p + 1, index)
    ids = None
    for axis, t in zip(used, leaves):
        wrapped = prog.index_op(aten.remainder.Scalar, t, shape[axis])  # x[-1] wraps; index_select does not
        ids = wrapped if ids is None else prog.index_op(
            aten.add.Tensor, prog.index_op(aten.mul.Tensor, ids, shape[axis]), wrapped)
    ids = prog.index_op(aten.reshape.default, prog.index_op(aten.expand.default, ids, bshape), [-1])
    return Flat(tuple(used), ids)


def _gather(prog: Program, node: fx.Node, shape: list[int]) -> Rows | None:
    """torch.gather(x, d, idx) is a row gather when idx only varies along axes 0 and d."""
    dim, index = node.args[1] % len(shape), node.args[2]
    if index.target is not aten.expand.default or \
            not same_shape(shape_of(index)[:dim] + shape_of(index)[dim + 1:], shape[:dim] + shape[dim + 1:]):
        return None
    base = index.args[0]
    base_shape = [1] * (len(shape) - len(shape_of(base))) + shape_of(base)
    if not all(known(s == 1) for a, s in enumerate(base_shape) if a not in (0, dim)):
        return None
    base = _index_leaf(prog, node, base)
    k = base_shape[dim]
    if dim == 0 or known(base_shape[0] == 1):
        return Flat((dim,), prog.index_op(aten.reshape.default, base, [-1]))
    if not known(base_shape[0] == shape[0]):
        return None
    return PerBatch(0, dim, prog.index_op(aten.reshape.default, base, [shape[0], k]))

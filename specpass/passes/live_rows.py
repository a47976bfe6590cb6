"""Live rows: a row gather at the end of a draft graph moves up to right after the KV write.

IR: the canonical pre-dispatch ATen of `specpass.capture` (static shapes, in-place KV writes in
program order, `meta["val"]` on every node).

A draft's catch-up step computes T rows per request and keeps one: `logits[:, -1]`,
`h[arange(B), live]`, `h.index_select(0, last)`. Every op that is *row-local* along the gathered
axes commutes with the gather, gather(op(x, y)) = op(gather(x), gather(y)), so the gather can
run first and the op on the live rows only.

Design: global liveness, in three steps.
1. Every gather (select, slice, narrow, index, index_select, gather) is read as a row selection
   on its source (`Static`, `PerBatch`, `Flat`, below).
2. Backward, in reverse program order, each node learns what its users need: every row, or one
   selection. A node whose users all need the same selection, whose op is row-local for it
   (row_rules.py), and whose storage is not written in place before its users read it, is *pulled*:
   its operands need the selection mapped onto their axes. Anything else — an in-place write, a
   returned tensor, a row-mixing or unknown op — needs every row, and the gather lands right
   before the first pulled consumer.
3. Forward, each pulled node is rewritten in place — same name, same position — on gathered
   operands, so every read keeps its place relative to the KV writes. Gathered tensors keep
   their rank (a selected axis keeps length k; Flat keeps 1s and n), view sizes are recomputed
   from meta shapes, and the original gather becomes a reshape of its gathered source.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from specpass.graph import bind, emit, is_impure, is_mutation, op_name, set_val, storage, val, written_storages
from specpass.options import Options
from specpass.passes.row_rules import (RESHAPES, VIEWS, Gather, Keep, Stop, out_shape_of, plan_operands,
                                       shape_of)
from specpass.passes.rows import Flat, PerBatch, Rows, Static, gathered_shape, index_nodes, kept
from specpass.report import Finding, node_matmul_flops

aten = torch.ops.aten
NAME = "live_rows"
FULL = "full"  # the node is needed on every row


# ----------------------------------------------------------------------------- index nodes


class _Graph:
    """The graph under rewrite: program positions, in-place writes, and index-node creation."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self._memo: dict[tuple, fx.Node] = {}
        self._hoisted: set[fx.Node] = set()
        self.per_request: dict[fx.Node, tuple[fx.Node, int, int]] = {}  # flat ids -> (index [B, k], B, T)
        self.spread: dict[fx.Node, tuple[fx.Node, list[int]]] = {}  # index -> (coarser index, axis sizes)
        self.refresh()

    def refresh(self) -> None:
        self.pos = {n: i for i, n in enumerate(self.graph.nodes)}
        self.writes = [(self.pos[n], written_storages(n), n) for n in self.graph.nodes if is_mutation(n)]

    def written_between(self, node: fx.Node, start: fx.Node | int, end: fx.Node | int) -> fx.Node | None:
        """An in-place write to `node`'s storage strictly between two positions, if any."""
        written = storage(node)
        if written is None:
            return None
        lo = self.pos[start] if isinstance(start, fx.Node) else start
        hi = self.pos[end] if isinstance(end, fx.Node) else end
        return next((w for p, s, w in self.writes if lo < p < hi and written in s), None)

    def epoch(self, node: fx.Node, at: fx.Node) -> int:
        """How many in-place writes to `node`'s storage come before `at`."""
        written = storage(node)
        return sum(1 for p, s, _ in self.writes if p < self.pos[at] and written in s)

    def index_op(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        """An index computation, placed right after its latest input (memoized: equal inputs, one node)."""
        key = (target, _hashable(args), _hashable(kwargs))
        if key in self._memo:
            return self._memo[key]
        with self.graph.inserting_after(self._after(a for a in tree_leaves(args) if isinstance(a, fx.Node))):
            node = emit(self.graph, target, args, kwargs)
        self._memo[key] = node
        self.refresh()
        return node

    def _after(self, inputs: Any) -> fx.Node:
        """The earliest node a computation of `inputs` can follow (placeholders stay first)."""
        last_input = list(self.graph.find_nodes(op="placeholder"))[-1]
        return max([last_input, *inputs], key=self.pos.__getitem__)

    def arange(self, start: int, stop: int, step: int, device: torch.device) -> fx.Node:
        return self.index_op(aten.arange.start_step, start, stop, step, dtype=torch.int64, device=device)

    def hoist(self, node: fx.Node) -> None:
        """Move the pure integer computation of `node` (an index) as early as its inputs allow,
        but never across a write to something it reads. Float values are not index arithmetic:
        an index computed from activations stays where it is."""
        value = val(node)
        if node in self._hoisted or node.op != "call_function" or is_impure(node) \
                or not isinstance(value, torch.Tensor) or value.is_floating_point():
            return
        self._hoisted.add(node)  # shared inputs are visited once
        for a in node.all_input_nodes:
            self.hoist(a)
        anchor = self._after(node.all_input_nodes)
        if self.pos[anchor] + 1 >= self.pos[node]:
            return
        if any(self.written_between(a, anchor, node) for a in node.all_input_nodes):
            return
        anchor.append(node)
        self.refresh()


def _hashable(x: Any) -> Any:
    if isinstance(x, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_hashable(v) for v in x)
    return x


def _flat_ids(g: _Graph, factors: list[tuple[int, fx.Node]]) -> fx.Node:
    """Row-major ids of a grid whose axes have these sizes and 1-D coordinates."""
    ids = None
    for size, coord in factors:
        if ids is None:
            ids = coord
        else:
            outer = g.index_op(aten.mul.Tensor, g.index_op(aten.unsqueeze.default, ids, 1), size)
            grid = g.index_op(aten.add.Tensor, outer, g.index_op(aten.unsqueeze.default, coord, 0))
            ids = g.index_op(aten.reshape.default, grid, [-1])
    return ids


def _per_request_flat(g: _Graph, spec: PerBatch, axes: list[int], shape: list[int]) -> Flat:
    """PerBatch as flat ids over `axes` = (batch, ...): request b's rows are b * inner + rows[b],
    with rows[b] the row-major ids of its selected rows within the other axes."""
    B, device = shape[spec.batch], val(spec.index).device
    rows = None  # [B, m]
    for a in axes[1:]:
        if a == spec.axis:
            coord = g.index_op(aten.remainder.Scalar, spec.index, shape[a])  # [B, k]; -1 wraps, as x[...] does
        else:
            coord = g.index_op(aten.unsqueeze.default, g.arange(0, shape[a], 1, device), 0)  # [1, n]
        if rows is None:
            rows = g.index_op(aten.expand.default, coord, [B, val(coord).shape[1]])
        else:
            outer = g.index_op(aten.mul.Tensor, g.index_op(aten.unsqueeze.default, rows, 2), shape[a])
            rows = g.index_op(aten.reshape.default, g.index_op(
                aten.add.Tensor, outer, g.index_op(aten.unsqueeze.default, coord, 1)), [B, -1])
    if axes[1] == spec.axis:  # rows = index x every row of the trailing axes: reversible
        g.spread[rows] = (spec.index, [shape[a] for a in axes[2:]])
    inner = math.prod(shape[a] for a in axes[1:])
    base = g.index_op(aten.mul.Tensor, g.index_op(aten.unsqueeze.default, g.arange(0, B, 1, device), 1), inner)
    ids = g.index_op(aten.reshape.default, g.index_op(aten.add.Tensor, base, rows), [-1])
    g.per_request[ids] = (rows, B, inner)  # a reshape that splits [B, inner] again gets it back
    return Flat(tuple(axes), ids)


def _to_flat(g: _Graph, spec: Rows, axes: list[int], shape: list[int], device: torch.device) -> Flat:
    """The same rows as a Flat selection over `axes` (ordered; includes the selected axes)."""
    if isinstance(spec, PerBatch):
        if axes[0] != spec.batch:
            raise Stop("a reshape merges the request axis into a less significant axis")
        return _per_request_flat(g, spec, axes, shape)
    factors, i = [], 0
    while i < len(axes):
        a = axes[i]
        if isinstance(spec, Static) and a == spec.axis:
            factors.append((shape[a], g.arange(spec.start, spec.stop, spec.step, device)))
            i += 1
        elif isinstance(spec, Flat) and a == spec.axes[0]:
            if tuple(axes[i : i + len(spec.axes)]) != spec.axes:
                raise Stop("flat rows interleaved with other axes by a reshape")
            factors.append((math.prod(shape[x] for x in spec.axes), spec.index))
            i += len(spec.axes)
        elif a in spec.axes:
            raise Stop("selected axes reordered by a reshape")
        else:
            factors.append((shape[a], g.arange(0, shape[a], 1, device)))
            i += 1
    return Flat(tuple(axes), _flat_ids(g, factors))


def _normalize(g: _Graph, spec: Rows, shape: list[int]) -> Rows | None:
    """Drop selected axes of size 1 (they select nothing); None if nothing is left to select."""
    if isinstance(spec, Static):
        return None if shape[spec.axis] == 1 and spec.rows == 1 else spec
    if isinstance(spec, PerBatch):
        if shape[spec.axis] == 1 and spec.rows == 1:
            return None
        if shape[spec.batch] == 1:
            return Flat((spec.axis,), g.index_op(aten.reshape.default, spec.index, [-1]))
        return spec
    axes = tuple(a for a in spec.axes if shape[a] != 1)
    if not axes:
        return None if spec.rows == 1 else spec
    ids = _constant(spec.index)
    if ids is not None and torch.equal(ids, torch.arange(math.prod(shape[a] for a in axes))):
        return None  # every row, in order
    return Flat(axes, spec.index)


def _reshape_groups(in_shape: list[int], out_shape: list[int]) -> list[tuple[list[int], list[int]]]:
    """Split a reshape into (input axes, output axes) groups with equal element counts."""
    groups, i, j = [], 0, 0
    while i < len(in_shape) or j < len(out_shape):
        gi, go, pi, po = [], [], 1, 1
        while True:
            if i < len(in_shape) and (not gi or pi < po):
                gi.append(i)
                pi *= in_shape[i]
                i += 1
            elif j < len(out_shape) and (not go or po < pi):
                go.append(j)
                po *= out_shape[j]
                j += 1
            elif pi == po:
                break
            else:
                raise Stop("reshape with a zero-size axis")
        groups.append((gi, go))
    return groups


def _through_reshape(g: _Graph, spec: Rows, in_shape: list[int], out_shape: list[int],
                     device: torch.device) -> Rows | None:
    """The input selection of a reshape whose output is gathered by `spec`.

    Axes the reshape leaves alone keep the selection; where it merges or splits a selected axis
    with others, the rows become flat ids over the merged axes (`arange(B) * T + T - 1` for a
    static -1 on [B, T, H] read as [B * T, H]).
    """
    spec = _normalize(g, spec, out_shape)
    if spec is None:
        return None
    groups = _reshape_groups(in_shape, out_shape)
    touched = [(ins, outs) for ins, outs in groups if set(outs) & set(spec.axes)]
    outs_big = [a for _, outs in touched for a in outs if out_shape[a] != 1]
    ins_big = [a for ins, _ in touched for a in ins if in_shape[a] != 1]
    if isinstance(spec, Static) and outs_big == [spec.axis] and len(ins_big) == 1:
        return dataclasses.replace(spec, axis=ins_big[0])
    if isinstance(spec, PerBatch) and len(touched) == 2 and outs_big == [spec.batch, spec.axis]:
        if len(ins_big) == 2:
            return dataclasses.replace(spec, batch=ins_big[0], axis=ins_big[1])
        coarser, sizes = g.spread.get(spec.index, (None, None))
        if coarser is not None and [in_shape[a] for a in ins_big[2:]] == sizes:
            # The reshape splits the row axis back into (rows, every row of the rest), e.g.
            # attention's query rows T * heads -> [T, heads]: select the coarser rows.
            return PerBatch(ins_big[0], ins_big[1], coarser)
    if not (isinstance(spec, Flat) and list(spec.axes) == outs_big):
        spec = _to_flat(g, spec, outs_big, out_shape, device)
    if len(ins_big) == 2:
        per_batch = _split_per_batch(g, spec.index, in_shape[ins_big[0]], in_shape[ins_big[1]])
        if per_batch is not None:  # same row order, and attention can take it without copying K/V
            return _canonical(PerBatch(ins_big[0], ins_big[1], per_batch), in_shape)
    return Flat(tuple(ins_big), spec.index)


def _canonical(spec: Rows, shape: list[int]) -> Rows:
    """A per-request selection of the same constant range in every request is the static slice it
    spells (`arange(B) * T + T - 1` on [B * T], `x[arange(B), full(B, T - 1)]`: `x[:, -1]`), so
    that two spellings of the same rows meet as one selection."""
    if not isinstance(spec, PerBatch):
        return spec
    rows = _constant(spec.index)
    if rows is None or rows.numel() == 0:
        return spec
    rows = rows % shape[spec.axis]
    first = rows[0].tolist()
    step = first[1] - first[0] if len(first) > 1 else 1
    span = range(first[0], first[0] + step * len(first), step) if step > 0 else None
    if span is None or not torch.equal(rows, torch.tensor(list(span)).expand_as(rows)):
        return spec
    return Static(spec.axis, span.start, span.stop, span.step)


def _split_per_batch(g: _Graph, ids: fx.Node, B: int, T: int) -> fx.Node | None:
    """Flat ids over [B * T] that provably pick k rows of every request in order — built from a
    per-request index, or computed from constants only (arange(B) * T + T - 1) — as a [B, k]
    per-request index; else None."""
    known = g.per_request.get(ids)
    if known is not None and known[1:] == (B, T):
        return known[0]
    value = _constant(ids)
    if value is None or value.numel() % B:
        return None
    rows = value.reshape(B, -1)
    if not torch.equal(rows // T, torch.arange(B).unsqueeze(1).expand_as(rows)):
        return None
    return g.index_op(aten.reshape.default, g.index_op(aten.remainder.Scalar, ids, T), [B, rows.shape[1]])


def _constant(node: fx.Node, budget: int = 64) -> torch.Tensor | None:
    """The value of a small index computation that reads no graph input, evaluated on the CPU."""
    values: dict[fx.Node, Any] = {}

    def evaluate(n: fx.Node) -> Any:
        if n in values:
            return values[n]
        if len(values) >= budget or n.op != "call_function" or is_impure(n):
            raise Stop("not a constant")
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), evaluate)
        if "device" in kwargs:
            kwargs = kwargs | {"device": "cpu"}
        values[n] = n.target(*args, **kwargs)
        return values[n]

    try:
        value = evaluate(node)
    except Stop:
        return None
    return value if isinstance(value, torch.Tensor) and not value.is_floating_point() else None


def _plan(g: _Graph, node: fx.Node, spec: Rows, options: Options) -> dict[fx.Node, Keep | Gather]:
    """Per operand of a node gathered by `spec`: keep it, or gather it (Stop if impossible)."""
    if node.target in RESHAPES:
        x = node.args[0]
        inner = _through_reshape(g, spec, shape_of(x), out_shape_of(node), val(x).device)
        return {x: Keep() if inner is None else Gather(inner)}
    composed = _compose(node, spec)
    if composed is not None:
        return {node.args[0]: Gather(composed)}
    return plan_operands(node, spec, options)


def _compose(node: fx.Node, spec: Rows) -> Static | None:
    """A range of a range of the same axis (`x[:, -4:][:, -1]`) is one range of x."""
    if node.target is aten.select.int:  # it drops its axis: the selection is on another one
        return None
    candidate = _as_static(node)
    if candidate is None or not isinstance(spec, Static) or candidate.axis != spec.axis:
        return None
    outer = range(candidate.start, candidate.stop, candidate.step)[spec.start : spec.stop : spec.step]
    return Static(spec.axis, outer.start, outer.stop, outer.step)


# ----------------------------------------------------------------------------- gathers


@dataclasses.dataclass
class Candidate:
    source: fx.Node
    spec: Rows


def _as_rows(g: _Graph, node: fx.Node) -> Candidate | None:
    """Read a gather node as a row selection on its source, or None."""
    if node.op != "call_function" or not isinstance(val(node), torch.Tensor) or not node.args:
        return None
    target, x = node.target, node.args[0]
    if not isinstance(x, fx.Node) or not isinstance(val(x), torch.Tensor):
        return None
    shape = shape_of(x)
    rank = len(shape)
    static = _as_static(node)
    if static is not None:
        return Candidate(x, static) if static.rows < shape[static.axis] else None
    if target is aten.index_select.default:
        ids = _index_leaf(g, node, node.args[2])
        return Candidate(x, Flat((node.args[1] % rank,), g.index_op(aten.reshape.default, ids, [-1])))
    read = {aten.index.Tensor: _advanced_index_rows, aten.gather.default: _gather_rows}.get(target)
    candidate = read(g, node, x, shape) if read is not None else None
    return None if candidate is None else Candidate(x, _canonical(candidate.spec, shape))


def _as_static(node: fx.Node) -> Static | None:
    """select / slice / narrow as a range of one axis of their input."""
    if node.target not in (aten.select.int, aten.slice.Tensor, aten.narrow.default):
        return None
    args, shape = bind(node), shape_of(node.args[0])
    if any(isinstance(v, fx.Node) for v in args.values() if v is not node.args[0]):
        return None  # bounds known only at run time (a slice by `.item()`): not a static range
    dim = args["dim"] % len(shape)
    if node.target is aten.select.int:
        i = args["index"] % shape[dim]
        return Static(dim, i, i + 1)
    if node.target is aten.narrow.default:
        start = args["start"] % shape[dim]
        return Static(dim, start, start + args["length"])
    r = range(shape[dim])[args["start"] : args["end"] : args["step"]]
    return Static(dim, r.start, r.stop, r.step)


def _index_leaf(g: _Graph, gather: fx.Node, index: fx.Node) -> fx.Node:
    """Hoist the index computation as early as it can go; refuse if it is written in place."""
    g.hoist(index)
    writer = g.written_between(index, index, gather)
    if writer is not None:
        raise Stop(f"the row index is written in place by {writer.name} before {gather.name}")
    return index


def _is_arange(node: Any, size: int) -> bool:
    while isinstance(node, fx.Node) and node.target in (aten.view.default, aten.unsqueeze.default, aten.reshape.default):
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.target not in (aten.arange.default, aten.arange.start, aten.arange.start_step):
        return False
    bounds = [a for a in node.args if not isinstance(a, torch.dtype)]
    start, end, step = (0, bounds[0], 1) if len(bounds) == 1 else (bounds + [1])[:3]
    return (start, end, step) == (0, size, 1) and val(node).dtype in (torch.int64, torch.int32)


def _advanced_index_rows(g: _Graph, node: fx.Node, x: fx.Node, shape: list[int]) -> Candidate | None:
    indices = list(node.args[1])
    used = [i for i, t in enumerate(indices) if t is not None]
    if not used or used != list(range(used[0], used[-1] + 1)):
        return None
    if any(val(indices[i]).dtype == torch.bool for i in used):
        return None
    p = used[0]
    leaves = [_index_leaf(g, node, indices[i]) for i in used]
    bshape = list(torch.broadcast_shapes(*[val(t).shape for t in leaves]))
    B = shape[p]
    if len(used) == 2 and _is_arange(leaves[0], B) and shape_of(leaves[0]) == ([B] if len(bshape) == 1 else [B, 1]):
        # x[arange(B), idx] / x[arange(B)[:, None], idx]: rows idx[b] of request b
        index = leaves[1] if shape_of(leaves[1]) == bshape else g.index_op(aten.expand.default, leaves[1], bshape)
        if len(bshape) == 1:
            index = g.index_op(aten.unsqueeze.default, index, 1)
        return Candidate(x, PerBatch(p, p + 1, index))
    ids = None
    for axis, t in zip(used, leaves):
        wrapped = g.index_op(aten.remainder.Scalar, t, shape[axis])  # x[-1] wraps; index_select does not
        ids = wrapped if ids is None else g.index_op(aten.add.Tensor, g.index_op(aten.mul.Tensor, ids, shape[axis]), wrapped)
    ids = g.index_op(aten.reshape.default, g.index_op(aten.expand.default, ids, bshape), [-1])
    return Candidate(x, Flat(tuple(used), ids))


def _gather_rows(g: _Graph, node: fx.Node, x: fx.Node, shape: list[int]) -> Candidate | None:
    """torch.gather(x, d, idx) is a row gather when idx only varies along axes 0 and d."""
    dim, index = node.args[1] % len(shape), node.args[2]
    if index.target is not aten.expand.default or shape_of(index)[:dim] + shape_of(index)[dim + 1:] != shape[:dim] + shape[dim + 1:]:
        return None
    base = index.args[0]
    base_shape = [1] * (len(shape) - len(shape_of(base))) + shape_of(base)
    if any(s != 1 for a, s in enumerate(base_shape) if a not in (0, dim)):
        return None
    base = _index_leaf(g, node, base)
    k = base_shape[dim]
    if dim == 0 or base_shape[0] == 1:
        return Candidate(x, Flat((dim,), g.index_op(aten.reshape.default, base, [-1])))
    if base_shape[0] != shape[0]:
        return None
    return Candidate(x, PerBatch(0, dim, g.index_op(aten.reshape.default, base, [shape[0], k])))


# ----------------------------------------------------------------------------- liveness


@dataclasses.dataclass
class _Liveness:
    need: dict[fx.Node, Any]  # FULL, or the selection its users need
    plans: dict[fx.Node, dict[fx.Node, Keep | Gather]]  # pulled nodes: what each operand needs
    why: dict[fx.Node, str]  # why a node is needed on every row


def _analyse(g: _Graph, candidates: dict[fx.Node, Candidate], options: Options) -> _Liveness:
    """Backward over program order: which nodes can run on the selected rows only."""
    live = _Liveness({}, {}, {})
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

    for node in reversed(list(g.graph.nodes)):
        if node.op == "output":
            for a in node.all_input_nodes:
                demands[a].append((FULL, "returned as an output"))
            continue
        wanted = demands.get(node, [])
        if not wanted and not is_mutation(node):
            continue  # dead
        specs = {spec for spec, _ in wanted}
        if is_mutation(node):
            live.need[node] = FULL
            live.why[node] = f"an in-place {op_name(node.target)}"
            demand_all(node)
            continue
        if node.op != "call_function":
            stay_full(node, "a graph input")
            continue
        if FULL in specs or len(specs) > 1:
            stay_full(node, next((r for s, r in wanted if s == FULL), "its users need different rows"))
            continue
        spec = specs.pop()
        if node in candidates and _compose(node, spec) is None and \
                kept(candidates[node].spec, shape_of(candidates[node].source)) < kept(spec, out_shape_of(node)):
            # A gather of a gather on another axis, one selection per tensor: the one that keeps
            # fewer elements moves (logits[:, -1][:, :V] moves the -1), the other stays after it.
            stay_full(node, "a row gather that keeps fewer rows than its users' selection")
            continue
        try:
            live.plans[node] = _pull(g, node, spec, options, candidates)
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


def _pull(g: _Graph, node: fx.Node, spec: Rows, options: Options, candidates: dict[fx.Node, Candidate]
          ) -> dict[fx.Node, Keep | Gather]:
    """Operand plans for running `node` on `spec`'s rows only, or Stop(reason)."""
    if any(isinstance(s, torch.SymInt) for s in tree_leaves([list(v.shape) for v in tree_leaves(val(node))
                                                             if isinstance(v, torch.Tensor)])):
        raise Stop("dynamic shape")
    late = [i for i in index_nodes(spec) if g.pos[i] >= g.pos[node]]
    if late:
        raise Stop(f"the row index {late[0].name} is only known after {node.name}")
    for user in node.users:
        # A fired gather's result is a fresh tensor where the original was a view that later
        # writes would show through: it counts as read at the end of the graph.
        read = g.pos[g.graph.output_node()] if user in candidates else g.pos[user]
        writer = g.written_between(node, node, read)
        if writer is not None:
            raise Stop(f"{writer.name} writes it in place before {user.name}'s result is read")
    return _plan(g, node, spec, options)


# ----------------------------------------------------------------------------- emission


def _materialize(g: _Graph, x: fx.Node, spec: Rows, name: str) -> fx.Node:
    """Emit the gather of `x` by `spec`, rank kept (at the graph's insert point)."""
    if isinstance(spec, Static):
        return emit(g.graph, aten.slice.Tensor, (x, spec.axis, spec.start, spec.stop, spec.step), name=name)
    shape = shape_of(x)
    front = [spec.batch, spec.axis] if isinstance(spec, PerBatch) else list(spec.axes)
    perm = front + [a for a in range(len(shape)) if a not in front]
    xp = x if perm == sorted(perm) else emit(g.graph, aten.permute.default, (x, perm))
    rest = [shape[a] for a in perm[len(front):]]
    if isinstance(spec, PerBatch):
        B = shape[spec.batch]
        batch = g.index_op(aten.unsqueeze.default, g.arange(0, B, 1, val(x).device), 1)
        out = emit(g.graph, aten.index.Tensor, (xp, [batch, spec.index]), name=name)
    else:
        flat = emit(g.graph, aten.reshape.default, (xp, [math.prod(shape[a] for a in front)] + rest))
        picked = emit(g.graph, aten.index_select.default, (flat, 0, spec.index))
        out = emit(g.graph, aten.reshape.default, (picked, [1] * (len(front) - 1) + [spec.rows] + rest), name=name)
    if perm == sorted(perm):
        return out
    inverse = sorted(range(len(perm)), key=perm.__getitem__)
    return emit(g.graph, aten.permute.default, (out, inverse), name=name)


def _causal_mask(g: _Graph, node: fx.Node, spec: Rows) -> fx.Node:
    """is_causal=True is top-left aligned: query row i sees key j <= i. The same mask for the
    selected query rows only, as an explicit boolean mask."""
    out, k = out_shape_of(node), val(node.args[1])  # the query operand may already be gathered
    rank, L, S = len(out), out[-2], k.shape[-2]
    device = k.device
    keys = g.arange(0, S, 1, device)
    if isinstance(spec, Static):
        rows = g.arange(spec.start, spec.stop, spec.step, device)  # [k]
        return emit(g.graph, aten.le.Tensor, (keys, g.index_op(aten.unsqueeze.default, rows, 1)))  # [k, S]
    if isinstance(spec, PerBatch):
        rows = g.index_op(aten.remainder.Scalar, spec.index, L)  # [B, k]
        mask = emit(g.graph, aten.le.Tensor, (keys, g.index_op(aten.unsqueeze.default, rows, 2)))  # [B, k, S]
        shape = [1] * rank
        shape[spec.batch], shape[-2], shape[-1] = out[spec.batch], spec.rows, S
        return emit(g.graph, aten.reshape.default, (mask, shape))
    rows = g.index_op(aten.remainder.Scalar, spec.index, L)  # [n]
    return emit(g.graph, aten.le.Tensor, (keys, g.index_op(aten.unsqueeze.default, rows, 1)))


def _rewrite(g: _Graph, node: fx.Node, spec: Rows, operands: dict[fx.Node, fx.Node]) -> None:
    """Turn `node` in place into its gathered version (every user of it reads gathered rows);
    view sizes come from the gathered shape, not from the trace."""
    want = [gathered_shape(spec, list(v.shape)) for v in tree_leaves(val(node)) if isinstance(v, torch.Tensor)]
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: operands.get(a, a))
    if node.target in RESHAPES or node.target is aten.expand.default:
        node.target = aten.reshape.default if node.target in RESHAPES else aten.expand.default
        args, kwargs = (args[0], want[0]), {}
    elif node.target is aten.scaled_dot_product_attention.default and bind(node)["is_causal"] \
            and len(shape_of(node.args[0])) - 2 in spec.axes:
        names = [a.name for a in node.target._schema.arguments]
        kwargs = dict(zip(names[3:], args[3:])) | kwargs
        kwargs.update(attn_mask=_causal_mask(g, node, spec), is_causal=False)
        args = args[:3]
    node.args, node.kwargs = args, kwargs
    set_val(node)
    got = [list(v.shape) for v in tree_leaves(val(node)) if isinstance(v, torch.Tensor)]
    if want != got:
        raise RuntimeError(f"gathered {node.name} has shapes {got}, expected {want}")


def _emit(g: _Graph, live: _Liveness, candidates: dict[fx.Node, Candidate]) -> None:
    """Forward over program order: gather what pulled nodes read, rewrite them in place, and
    turn each fired gather into a reshape of its gathered source."""
    stop_gathers: dict[tuple, fx.Node] = {}
    for node in list(g.graph.nodes):
        if node in live.plans:
            operands = {}
            with g.graph.inserting_before(node):
                for operand, action in live.plans[node].items():
                    if isinstance(action, Keep) or operand in live.plans:
                        continue  # pulled operands were rewritten in place already
                    # The rows are read where the consumer read them: one gather per write epoch.
                    key = (operand, action, g.epoch(operand, node))
                    if key not in stop_gathers:
                        x = operand
                        if action.expand_to is not None:
                            x = emit(g.graph, aten.expand.default, (x, list(action.expand_to)))
                        stop_gathers[key] = _materialize(g, x, action.spec, f"{operand.name}_rows")
                    operands[operand] = stop_gathers[key]
                _rewrite(g, node, live.need[node], operands)
        candidate = candidates.get(node)
        if candidate is not None and _fired(candidate, live) and live.need.get(node) == FULL:
            if shape_of(candidate.source) == shape_of(node):
                node.replace_all_uses_with(candidate.source)
            else:
                node.target, node.args, node.kwargs = aten.reshape.default, (candidate.source, shape_of(node)), {}
                set_val(node)


def _fired(candidate: Candidate, live: _Liveness) -> bool:
    return candidate.source in live.plans and live.need[candidate.source] == candidate.spec


# ----------------------------------------------------------------------------- the pass


def _selects_rows(candidate: Candidate) -> bool:
    """A row gather worth a verdict: it keeps fewer elements (a permutation saves nothing), on
    some axis other than the feature axis — the last axis of a rank >= 3 tensor ([B, T, H],
    [B, T, heads, d]: RoPE's halves, a vocabulary slice; in [B, T] the last axis may be the
    tokens) — of a value computed in the graph (a weight or a view of one, like one expert of a
    stacked MoE weight, has nothing above it to move past)."""
    source = shape_of(candidate.source)
    feature = len(source) - 1 if len(source) >= 3 else None
    root = candidate.source
    while root.op == "call_function" and root.target in VIEWS:
        root = root.args[0]
    return kept(candidate.spec, source) < 1 and any(a != feature for a in candidate.spec.axes) \
        and root.op == "call_function"


def run(gm: fx.GraphModule, options: Options) -> list[Finding]:
    """Move every row gather as far up as it is exact; report what moved and what stayed."""
    work = gm.graph.__deepcopy__()  # left unused (and gm untouched) if nothing fires
    g = _Graph(work)
    candidates: dict[fx.Node, Candidate] = {}
    findings: list[Finding] = []
    for node in list(work.nodes):
        try:
            candidate = _as_rows(g, node)
        except Stop as stop:
            findings.append(Finding(NAME, node.name, False, str(stop)))
            continue
        if candidate is not None and _selects_rows(candidate):
            candidates[node] = candidate
    g.refresh()
    live = _analyse(g, candidates, options)
    before = {n: (node_matmul_flops(n), out_shape_of(n)) for n in live.plans}
    _emit(g, live, candidates)
    findings += _findings(live, candidates, before)
    outputs = [val(a) for a in work.output_node().all_input_nodes]
    if not findings and any(isinstance(v, torch.Tensor) and v.dim() >= 3 for v in outputs):
        findings.append(Finding(NAME, "graph", False, "no row gather at the outputs: the graph returns every "
                                "row. Compile the step that slices (logits[:, -1] inside the compiled function) "
                                "or pass logits_to_keep=1 to Hugging Face models"))
    missing = sorted({n.name for n in candidates} - {name for f in findings for name in f.nodes})
    if missing:
        raise RuntimeError(f"row gathers without a finding: {missing}")
    if live.plans:
        gm.graph = work
        gm.recompile()
    return findings


def _findings(live: _Liveness, candidates: dict[fx.Node, Candidate],
              before: dict[fx.Node, tuple[int, list[int]]]) -> list[Finding]:
    # Pulled nodes linked through gathered operands form one moved gather; outputs that select
    # the same rows share it.
    parent = {n: n for n in live.plans}

    def root(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            n = parent[n]
        return n

    for node, plan in live.plans.items():
        for operand, action in plan.items():
            if operand in parent and isinstance(action, Gather):
                parent[root(operand)] = root(node)
    findings = []
    fired: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node, candidate in candidates.items():
        source = candidate.source
        if _fired(candidate, live) and live.need.get(node) == FULL:
            fired[root(source)].append(node)
        elif node not in live.plans:  # a pulled gather is reported with the group it moved in
            findings.append(Finding(NAME, node.name, False, f"{source.name}: {live.why[source]}"))
    for group, gathers in fired.items():
        members = [n for n in live.plans if root(n) is group]
        landed = {}
        for n in members:
            for operand, action in live.plans[n].items():
                if isinstance(action, Gather) and operand not in live.plans:
                    landed.setdefault(operand.name, live.why[operand])
        source, spec = candidates[gathers[0]].source, candidates[gathers[0]].spec
        last = max(spec.axes)
        shape = before[source][1]
        rows = (math.prod(shape[: last + 1]), math.prod(gathered_shape(spec, shape)[: last + 1]))
        flops = (sum(before[n][0] for n in members), sum(node_matmul_flops(n) for n in members))
        computed = sum(1 for n in members if n.target not in VIEWS and n.target is not operator.getitem)
        where = "; ".join(f"{name} ({why})" for name, why in landed.items())
        gathers += [n for n in members if n in candidates and n not in gathers]
        findings.append(Finding(NAME, ", ".join(n.name for n in gathers), True,
                                f"{computed} ops run on the selected rows only; gathered after {where}",
                                rows=rows, matmul_flops=flops))
    return findings

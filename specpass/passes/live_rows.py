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
   (`_rule`), and whose storage is not written in place before its users read it, is *pulled*:
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
from typing import Any, Union

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from specpass.graph import bind, emit, is_impure, is_mutation, op_name, set_val, storage, val, written_storages
from specpass.options import Options
from specpass.report import Finding, node_matmul_flops

aten = torch.ops.aten
NAME = "live_rows"


# ----------------------------------------------------------------------------- row selections


@dataclasses.dataclass(frozen=True)
class Static:
    """Rows start:stop:step of one axis (a select is a length-1 range)."""

    axis: int
    start: int
    stop: int
    step: int = 1

    @property
    def axes(self) -> tuple[int, ...]:
        return (self.axis,)

    @property
    def rows(self) -> int:
        return len(range(self.start, self.stop, self.step))


@dataclasses.dataclass(frozen=True)
class PerBatch:
    """x[arange(B)[:, None], index]: for each entry of axis `batch`, rows index[b] ([B, k]) of `axis`."""

    batch: int
    axis: int
    index: fx.Node

    @property
    def axes(self) -> tuple[int, ...]:
        return (self.batch, self.axis)

    @property
    def rows(self) -> int:
        return val(self.index).shape[1]


@dataclasses.dataclass(frozen=True)
class Flat:
    """Rows `index` ([n]) of the row-major flattening of `axes` (in order of significance)."""

    axes: tuple[int, ...]
    index: fx.Node

    @property
    def rows(self) -> int:
        return val(self.index).shape[0]


Rows = Union[Static, PerBatch, Flat]
FULL = "full"  # the node is needed on every row


def _index_nodes(spec: Rows) -> list[fx.Node]:
    return [] if isinstance(spec, Static) else [spec.index]


def _remap(spec: Rows, axis_map: dict[int, int]) -> Rows:
    if isinstance(spec, Static):
        return dataclasses.replace(spec, axis=axis_map[spec.axis])
    if isinstance(spec, PerBatch):
        return dataclasses.replace(spec, batch=axis_map[spec.batch], axis=axis_map[spec.axis])
    return dataclasses.replace(spec, axes=tuple(axis_map[a] for a in spec.axes))


def gathered_shape(spec: Rows, shape: list[int]) -> list[int]:
    """Shape of `x` gathered by `spec`, rank kept."""
    shape = list(shape)
    if isinstance(spec, (Static, PerBatch)):
        shape[spec.axis] = spec.rows
    else:
        for a in spec.axes:
            shape[a] = 1
        shape[spec.axes[-1]] = spec.rows
    return shape


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


# ----------------------------------------------------------------------------- op rules
# A rule maps a node's output axes onto each tensor operand: for every output axis, the
# operand's axis — in the operand's frame aligned to the output's rank, for broadcasting ops —
# or None where the operand has no such axis (a weight's rows, K/V's query axis).


class Stop(Exception):
    """The op is not row-local for this selection; the message says why."""


@dataclasses.dataclass
class Operand:
    node: fx.Node
    axes: list[int | None]  # per output axis
    rank: int  # the aligned frame's rank; more than the operand's adds leading broadcast dims
    expandable: bool = False  # may broadcast along a selected axis (elementwise alignment)
    shape: list[int] | None = None  # for one element of a tuple-valued operand


@dataclasses.dataclass
class Rule:
    operands: list[Operand]
    needs_carrier: bool = True  # every selected axis must come from some operand


@dataclasses.dataclass(frozen=True)
class Keep:
    """The operand is used as is (a weight, K/V, or broadcast along the selected axes)."""


@dataclasses.dataclass(frozen=True)
class Gather:
    spec: Rows
    expand_to: tuple[int, ...] | None = None  # expand along broadcast selected axes first


def _shape(x: Any) -> list[int]:
    return list(val(x).shape)


def _out_shape(node: fx.Node) -> list[int]:
    v = val(node)
    return list((v[0] if isinstance(v, (tuple, list)) else v).shape)


def _same_axes(x: fx.Node, rank: int, expandable: bool = False) -> Operand:
    return Operand(x, list(range(rank)), rank, expandable)


def _drop_axis(x: fx.Node, out_rank: int, dropped: int) -> Operand:
    return Operand(x, [i if i < dropped else i + 1 for i in range(out_rank)], out_rank + 1)


_DIM_OPS = {  # op -> (dims argument, keepdim argument; None: the op keeps every axis)
    aten.sum.dim_IntList: ("dim", "keepdim"), aten.mean.dim: ("dim", "keepdim"),
    aten.amax.default: ("dim", "keepdim"), aten.amin.default: ("dim", "keepdim"),
    aten.max.dim: ("dim", "keepdim"), aten.min.dim: ("dim", "keepdim"),
    aten.argmax.default: ("dim", "keepdim"), aten.argmin.default: ("dim", "keepdim"),
    aten.logsumexp.default: ("dim", "keepdim"), aten.prod.dim_int: ("dim", "keepdim"),
    aten.any.dim: ("dim", "keepdim"), aten.all.dim: ("dim", "keepdim"),
    aten.var.correction: ("dim", "keepdim"), aten.std.correction: ("dim", "keepdim"),
    aten.var_mean.correction: ("dim", "keepdim"), aten.linalg_vector_norm.default: ("dim", "keepdim"),
    aten.norm.ScalarOpt_dim: ("dim", "keepdim"),
    aten.softmax.int: ("dim", None), aten.log_softmax.int: ("dim", None),
    aten._softmax.default: ("dim", None), aten._log_softmax.default: ("dim", None),
    aten.cumsum.default: ("dim", None), aten.cumprod.default: ("dim", None),
    aten.topk.default: ("dim", None), aten.sort.default: ("dim", None), aten.flip.default: ("dims", None),
    aten.split.Tensor: ("dim", None), aten.split_with_sizes.default: ("dim", None),
    aten.chunk.default: ("dim", None), aten.slice.Tensor: ("dim", None), aten.narrow.default: ("dim", None),
    aten.index_select.default: ("dim", None), aten.cat.default: ("dim", None),
}
_SAME_AXES = {  # one tensor operand, same axes, arguments unchanged
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.clone.default,
    aten.contiguous.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default,
    torch.ops._c10d_functional.all_reduce.default, torch.ops._c10d_functional.wait_tensor.default,
    aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default,
}
_SCATTERS = {aten.scatter.value, aten.scatter.src, aten.scatter_add.default, aten.scatter_reduce.two}
_RESHAPES = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.squeeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default, aten.flatten.using_ints,
    aten.unflatten.int,
}
_MATMULS = {aten.mm.default: 0, aten.bmm.default: 0, aten.matmul.default: 0, aten.addmm.default: 1,
            aten.baddbmm.default: 1}
_NORMS = {aten.rms_norm.default, aten.layer_norm.default, aten.native_layer_norm.default}


def _rule(node: fx.Node, spec: Rows, options: Options) -> Rule:
    """How `node`'s rows map onto its operands; Stop(reason) if it is not row-local for `spec`."""
    target, out_shape = node.target, _out_shape(node)
    rank, name = len(out_shape), op_name(node.target)
    if target is operator.getitem:
        element = list(val(node.args[0])[node.args[1]].shape)
        return Rule([Operand(node.args[0], list(range(rank)), rank, shape=element)])
    if not isinstance(target, torch._ops.OpOverload):
        raise Stop(f"{name} is not an ATen op")
    if is_mutation(node):
        raise Stop(f"{name} writes in place")
    if target in _SAME_AXES:
        return Rule([_same_axes(node.args[0], rank)])
    if target in _DIM_OPS:
        return _dim_op(node, spec)
    if torch.Tag.pointwise in target.tags and torch.Tag.nondeterministic_seeded not in target.tags:
        operands = [a for a in tree_leaves((node.args, node.kwargs)) if isinstance(val(a), torch.Tensor)]
        return Rule([_same_axes(a, rank, expandable=True) for a in operands])
    if target is aten.expand.default:
        return Rule([_same_axes(node.args[0], rank, expandable=True)], needs_carrier=False)
    if target is aten.permute.default:
        return Rule([Operand(node.args[0], [d % rank for d in node.args[1]], rank)])
    if target in (aten.transpose.int, aten.t.default):
        perm = list(range(rank))
        d0, d1 = (node.args[1] % rank, node.args[2] % rank) if target is aten.transpose.int else (0, rank - 1)
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return Rule([Operand(node.args[0], perm, rank)])
    if target in (aten.select.int, aten.unbind.int):
        return Rule([_drop_axis(node.args[0], rank, bind(node)["dim"] % (rank + 1))])
    if target is aten.stack.default:
        dim = bind(node)["dim"] % rank
        if dim in spec.axes:
            raise Stop(f"stack creates the selected axis {dim}")
        return Rule([Operand(t, [None if i == dim else i - (i > dim) for i in range(rank)], rank - 1)
                     for t in node.args[0]])
    if target in _NORMS:
        normalized = len(bind(node)["normalized_shape"])
        if any(a >= rank - normalized for a in spec.axes):
            raise Stop(f"{name} normalises over the selected axis")
        return Rule([_same_axes(node.args[0], rank)])
    if target is aten.linear.default:
        x, w, b = node.args[0], node.args[1], bind(node)["bias"]
        ops = [Operand(x, list(range(rank - 1)) + [None], rank), Operand(w, [None] * (rank - 1) + [0], 2)]
        if isinstance(b, fx.Node):
            ops.append(Operand(b, [None] * (rank - 1) + [0], 1))
        return Rule(ops)
    if target in _MATMULS:
        first = _MATMULS[target]
        a, b = node.args[first], node.args[first + 1]
        if len(_shape(a)) < 2 or len(_shape(b)) < 2:
            raise Stop("matmul with a vector operand")
        batch = list(range(rank - 2))
        ops = [Operand(a, batch + [rank - 2, None], rank, True), Operand(b, batch + [None, rank - 1], rank, True)]
        if first:
            ops.append(_same_axes(node.args[0], rank, expandable=True))
        return Rule(ops)
    if target is aten.einsum.default:
        return _einsum(node, out_shape)
    if target is aten.embedding.default:
        ids = node.args[1]
        return Rule([Operand(ids, list(range(rank - 1)) + [None], rank - 1), Operand(node.args[0], [None] * rank, 2)])
    if target is aten.index.Tensor:
        return _advanced_index(node, out_shape)
    if target is aten.gather.default:
        dim = bind(node)["dim"] % rank
        if dim in spec.axes:
            raise Stop(f"gather along the selected axis {dim}")
        x, index = node.args[0], node.args[2]
        x_axes = [a if a == dim or _shape(x)[a] == out_shape[a] else None for a in range(rank)]
        return Rule([Operand(x, x_axes, rank), _same_axes(index, rank)])
    if target in _SCATTERS:
        if bind(node)["dim"] % rank in spec.axes:
            raise Stop(f"{name} along the selected axis")
        operands = [a for a in (node.args[0], node.args[2], *node.args[3:4]) if isinstance(val(a), torch.Tensor)]
        return Rule([_same_axes(a, rank) for a in operands])
    if target is aten.scaled_dot_product_attention.default:
        return _attention(node, spec, rank, options)
    raise Stop(f"{name} is not known to be row-local; assumed to mix rows")


def _dim_op(node: fx.Node, spec: Rows) -> Rule:
    dim_name, keep_name = _DIM_OPS[node.target]
    name = op_name(node.target)
    inputs = node.args[0] if node.target is aten.cat.default else [node.args[0]]
    in_rank = len(_shape(inputs[0]))
    args = bind(node)
    dims = args[dim_name]
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        raise Stop(f"{name} reduces over every axis")
    dims = {d % in_rank for d in ([dims] if isinstance(dims, int) else dims)} if in_rank else set()
    keepdim = keep_name is None or bool(args[keep_name])
    kept = list(range(in_rank)) if keepdim else [d for d in range(in_rank) if d not in dims]
    mixed = sorted(dims & {kept[a] for a in spec.axes})
    if mixed:
        raise Stop(f"{name} mixes rows along axis {mixed[0]}")
    return Rule([Operand(x, kept, in_rank) for x in inputs])


def _einsum(node: fx.Node, out_shape: list[int]) -> Rule:
    equation = node.args[0].replace(" ", "")
    if "..." in equation or "->" not in equation:
        raise Stop("einsum with an implicit output or an ellipsis")
    inputs, output = equation.split("->")
    return Rule([Operand(t, [letters.index(c) if c in letters else None for c in output], len(letters), True)
                 for letters, t in zip(inputs.split(","), node.args[1])])


def _advanced_index(node: fx.Node, out_shape: list[int]) -> Rule:
    x, indices = node.args[0], list(node.args[1])
    used = [i for i, t in enumerate(indices) if t is not None]
    if used != list(range(used[0], used[-1] + 1)):
        raise Stop("advanced indexing with separated index tensors")
    if any(val(indices[i]).dtype == torch.bool for i in used):
        raise Stop("boolean-mask indexing")
    first, last, rank = used[0], used[-1], len(out_shape)
    block = len(torch.broadcast_shapes(*[val(indices[i]).shape for i in used]))
    x_axes = [i if i < first else (None if i < first + block else i - block + last + 1) for i in range(rank)]
    index_axes = [None] * first + list(range(block)) + [None] * (rank - first - block)
    return Rule([Operand(x, x_axes, len(_shape(x)))] + [Operand(indices[i], index_axes, block, True) for i in used])


def _attention(node: fx.Node, spec: Rows, rank: int, options: Options) -> Rule:
    """Row-local in the query (and batch) axes: each output row reads its own query row, its own
    mask row, and all of K/V — so gathering query and mask rows is exact (the Q-slice)."""
    q, k, v = node.args[:3]
    mask = bind(node)["attn_mask"]
    if bind(node)["dropout_p"]:
        raise Stop("attention with dropout")
    query = rank - 2
    if query in spec.axes and not options.q_slice:
        raise Stop("q_slice=False keeps attention on every query row")
    if rank - 1 in spec.axes:
        raise Stop("attention's feature axis is selected")
    batch = list(range(rank - 2))
    if isinstance(spec, Flat) and set(batch) & set(spec.axes):
        raise Stop("the rows are flat ids across requests, not provably per request: "
                   "gathering before attention would copy K/V for every row")
    ops = [Operand(q, batch + [query, None], rank), Operand(k, batch + [None, None], rank),
           Operand(v, batch + [None, None], rank)]
    if isinstance(mask, fx.Node):
        ops.append(Operand(mask, batch + [query, None], rank, True))
    return Rule(ops)


# ----------------------------------------------------------------------------- operands


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
            return PerBatch(ins_big[0], ins_big[1], per_batch)
    return Flat(tuple(ins_big), spec.index)


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


ABSENT, BCAST, CARRIED = "absent", "bcast", "carried"


def _operand_action(op: Operand, spec: Rows, out_shape: list[int]) -> tuple[Keep | Gather, set[int]]:
    """What one operand needs for the output to be gathered by `spec`, and which selected
    output axes it provides."""
    own_shape = op.shape or _shape(op.node)
    offset = op.rank - len(own_shape)

    def kind(a: int) -> str:
        j = op.axes[a]
        if j is None:
            return ABSENT
        size = 1 if j < offset else own_shape[j - offset]
        if j >= offset and size == out_shape[a]:
            return CARRIED
        if size == 1:
            return BCAST
        raise Stop(f"{op.node.name} has {size} rows on an axis of {out_shape[a]}")

    kinds = {a: kind(a) for a in spec.axes}
    own = {a: op.axes[a] - offset for a in spec.axes if kinds[a] == CARRIED}
    aligned = {a: op.axes[a] for a in spec.axes if kinds[a] != ABSENT}
    expanded = [1] * offset + own_shape
    for a in spec.axes:
        if kinds[a] == BCAST:
            expanded[op.axes[a]] = out_shape[a]

    if isinstance(spec, PerBatch) and kinds[spec.axis] != CARRIED:
        return Keep(), set()
    if all(k != CARRIED for k in kinds.values()):
        return Keep(), set()
    if all(k == CARRIED for k in kinds.values()):
        return Gather(_remap(spec, own)), set(spec.axes)
    if ABSENT in kinds.values() or not op.expandable:
        raise Stop(f"{op.node.name} carries only some of the selected axes")
    return Gather(_remap(spec, aligned), tuple(expanded)), set(spec.axes)


def _plan(g: _Graph, node: fx.Node, spec: Rows, options: Options) -> dict[fx.Node, Keep | Gather]:
    """Per operand of a node gathered by `spec`: keep it, or gather it (Stop if impossible)."""
    if node.target in _RESHAPES:
        x = node.args[0]
        inner = _through_reshape(g, spec, _shape(x), _out_shape(node), val(x).device)
        return {x: Keep() if inner is None else Gather(inner)}
    composed = _compose(node, spec)
    if composed is not None:
        return {node.args[0]: Gather(composed)}
    rule = _rule(node, spec, options)
    out_shape = _out_shape(node)
    plans: dict[fx.Node, Keep | Gather] = {}
    provided: set[int] = set()
    for op in rule.operands:
        action, axes = _operand_action(op, spec, out_shape)
        if plans.setdefault(op.node, action) != action:
            raise Stop(f"{op.node.name} is used with two row layouts")
        provided |= axes
    required = {spec.axis} if isinstance(spec, PerBatch) else set(spec.axes)
    if rule.needs_carrier and not required <= provided:
        raise Stop(f"{op_name(node.target)} creates the selected rows")
    return plans


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
    shape = _shape(x)
    rank = len(shape)
    static = _as_static(node)
    if static is not None:
        return Candidate(x, static) if static.rows < shape[static.axis] else None
    if target is aten.index_select.default:
        ids = _index_leaf(g, node, node.args[2])
        return Candidate(x, Flat((node.args[1] % rank,), g.index_op(aten.reshape.default, ids, [-1])))
    if target is aten.index.Tensor:
        return _advanced_index_rows(g, node, x, shape)
    if target is aten.gather.default:
        return _gather_rows(g, node, x, shape)
    return None


def _as_static(node: fx.Node) -> Static | None:
    """select / slice / narrow as a range of one axis of their input."""
    if node.target not in (aten.select.int, aten.slice.Tensor, aten.narrow.default):
        return None
    args, shape = bind(node), _shape(node.args[0])
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
    if len(used) == 2 and _is_arange(leaves[0], B) and _shape(leaves[0]) == ([B] if len(bshape) == 1 else [B, 1]):
        # x[arange(B), idx] / x[arange(B)[:, None], idx]: rows idx[b] of request b
        index = leaves[1] if _shape(leaves[1]) == bshape else g.index_op(aten.expand.default, leaves[1], bshape)
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
    if index.target is not aten.expand.default or _shape(index)[:dim] + _shape(index)[dim + 1:] != shape[:dim] + shape[dim + 1:]:
        return None
    base = index.args[0]
    base_shape = [1] * (len(shape) - len(_shape(base))) + _shape(base)
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
        elif node.target is operator.getitem or node.target in _VIEWS:
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
                _kept(candidates[node].spec, _shape(candidates[node].source)) < _kept(spec, _out_shape(node)):
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
    late = [i for i in _index_nodes(spec) if g.pos[i] >= g.pos[node]]
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
    shape = _shape(x)
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
    out, k = _out_shape(node), val(node.args[1])  # the query operand may already be gathered
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
    if node.target in _RESHAPES or node.target is aten.expand.default:
        node.target = aten.reshape.default if node.target in _RESHAPES else aten.expand.default
        args, kwargs = (args[0], want[0]), {}
    elif node.target is aten.scaled_dot_product_attention.default and bind(node)["is_causal"] \
            and len(_shape(node.args[0])) - 2 in spec.axes:
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
            if _shape(candidate.source) == _shape(node):
                node.replace_all_uses_with(candidate.source)
            else:
                node.target, node.args, node.kwargs = aten.reshape.default, (candidate.source, _shape(node)), {}
                set_val(node)


def _kept(spec: Rows, shape: list[int]) -> float:
    """The fraction of a tensor's elements a selection keeps."""
    return math.prod(gathered_shape(spec, shape)) / math.prod(shape)


def _fired(candidate: Candidate, live: _Liveness) -> bool:
    return candidate.source in live.plans and live.need[candidate.source] == candidate.spec


# ----------------------------------------------------------------------------- the pass


_VIEWS = _RESHAPES | {aten.expand.default, aten.permute.default, aten.transpose.int, aten.t.default,
                      aten.select.int, aten.slice.Tensor, aten.alias.default, aten.detach.default}


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
        if candidate is not None and _kept(candidate.spec, _shape(candidate.source)) < 1:  # a permutation saves nothing
            candidates[node] = candidate
    g.refresh()
    live = _analyse(g, candidates, options)
    before = {n: (node_matmul_flops(n), _out_shape(n)) for n in live.plans}
    _emit(g, live, candidates)
    findings += _findings(live, candidates, before)
    outputs = [val(a) for a in work.output_node().all_input_nodes]
    if not findings and any(isinstance(v, torch.Tensor) and v.dim() >= 3 for v in outputs):
        findings.append(Finding(NAME, "graph", False, "no row gather at the outputs: the graph returns every "
                                "row. Compile the step that slices (logits[:, -1] inside the compiled function) "
                                "or pass logits_to_keep=1 to Hugging Face models"))
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
        elif live.need.get(node) == FULL and source in live.why and source.op == "call_function" \
                and source.target not in _VIEWS and not is_mutation(source) \
                and max(candidate.spec.axes) < len(_shape(source)) - 1:
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
        computed = sum(1 for n in members if n.target not in _VIEWS and n.target is not operator.getitem)
        where = "; ".join(f"{name} ({why})" for name, why in landed.items())
        findings.append(Finding(NAME, ", ".join(n.name for n in gathers), True,
                                f"{computed} ops run on the selected rows only; gathered after {where}",
                                rows=rows, matmul_flops=flops))
    return findings

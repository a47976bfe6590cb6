"""Row rules: how each op's output rows relate to its operands' rows.

An op is *row-local* for a selection when gathering its output equals running it on gathered
operands. A rule says, for one node and one selection of its output, which operand axes carry
each output axis (`Rule`), or raises `Stop(reason)`. Supporting a new op is one rule here:

    @rule(aten.my_op.default)
    def _my_op(node, spec, options):
        return Rule([same_axes(node.args[0], rank(node))])   # or raise Stop("why not")

Most ops need no rule of their own; they are classified from torch's own metadata, in this order:
1. a registered rule (`@rule`): the ops whose axis mapping is structural — linear/matmul/einsum,
   embedding, index/gather/scatter, attention, cat/stack, norms, softmax, topk/sort, scans,
   collectives — and the custom ops an engine declares with `register_row_rule` (bottom of this file);
2. `torch.Tag.reduction` with the schema's `dim` / `keepdim` (sum, std, nansum, aminmax, ...);
3. `torch.Tag.pointwise` (broadcasting elementwise ops);
4. an op with a decomposition (CompositeImplicitAutograd, or torch._decomp's table — dropout,
   type_as, nanmean, glu, ...): traced on the node's fake values and analysed op by op; the
   original op is kept, run on the gathered operands.
Anything else is assumed to mix rows. Ops that draw random numbers never move (on fewer rows
they would draw different ones).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any, Callable, Protocol

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from specpass.graph import (bind, fake_mode, is_mutation, known, make_local_writes_functional, op_name, same_shape,
                            size_key, to_the_end, val)
from specpass.options import Options
from specpass.passes.op_sets import EXPANDS, SAME_VALUES


aten = torch.ops.aten


class Selection(Protocol):
    """Rows selected along axes of a node's output, as the rules read it. The engine only maps
    axes; what the rows are and how they are gathered is the live-row pass's (its selections,
    live_rows/rows.py, implement this)."""

    @property
    def axes(self) -> tuple[int, ...]: ...  # every axis the selection indexes (a per-request one: batch, rows)

    @property
    def row_axes(self) -> tuple[int, ...]: ...  # the axes whose rows an operand must carry

    def remap(self, axis_map: dict[int, int]) -> "Selection": ...  # the same rows, on an operand's axes

    def flattens(self, axes: list[int]) -> bool: ...  # are its rows flat ids across any of these axes


class Stop(Exception):
    """The op is not row-local for this selection; the message says why."""


class Unknown(Stop):
    """No rule and no tag says how the op treats rows; its decomposition may."""


@dataclasses.dataclass
class Operand:
    node: fx.Node
    axes: list[int | None]  # per output axis: the operand's axis in the aligned frame, or None
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


@dataclasses.dataclass(frozen=True, eq=False)
class Gather:
    spec: Selection
    expand_to: tuple[int, ...] | None = None  # expand along broadcast selected axes first

    def _key(self) -> tuple:
        return self.spec, size_key(self.expand_to)

    def __eq__(self, other: object) -> bool:  # symbolic sizes compare as expressions: no guard
        return isinstance(other, Gather) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


RuleFn = Callable[[fx.Node, "Selection", Options], Rule]
_RULES: dict[Any, RuleFn] = {}


def rule(*targets: Any) -> Callable[[RuleFn], RuleFn]:
    """Register `fn(node, spec, options) -> Rule` as the rule of these op overloads."""

    def register(fn: RuleFn) -> RuleFn:
        for target in targets:
            _RULES[target] = fn
        return fn

    return register


def shape_of(x: Any) -> list[int]:
    return list(val(x).shape)


def out_shape_of(node: fx.Node) -> list[int]:
    v = val(node)
    return list((v[0] if isinstance(v, (tuple, list)) else v).shape)


def rank(node: fx.Node) -> int:
    return len(out_shape_of(node))


def same_axes(x: fx.Node, rank: int, expandable: bool = False) -> Operand:
    return Operand(x, list(range(rank)), rank, expandable)


def _drop_axis(x: fx.Node, out_rank: int, dropped: int) -> Operand:
    return Operand(x, [i if i < dropped else i + 1 for i in range(out_rank)], out_rank + 1)


# ----------------------------------------------------------------------------- lookup


def rule_for(node: fx.Node, spec: Selection, options: Options) -> Rule:
    """How `node`'s rows map onto its operands; Stop(reason) if it is not row-local for `spec`."""
    target, name = node.target, op_name(node.target)
    if target is operator.getitem:
        element = list(val(node.args[0])[node.args[1]].shape)
        return Rule([Operand(node.args[0], list(range(rank(node))), rank(node), shape=element)])
    if not isinstance(target, torch._ops.OpOverload):
        raise Stop(f"{name} is not an ATen op")
    if is_mutation(node):
        raise Stop(f"{name} writes in place")
    if target in _RULES:
        return _RULES[target](node, spec, options)
    if torch.Tag.nondeterministic_seeded in target.tags:  # dropout: its decomposition may say more
        raise Unknown(f"{name} draws random numbers: on fewer rows it would draw different ones")
    if torch.Tag.reduction in target.tags:
        return _reduction(node, spec)
    if torch.Tag.pointwise in target.tags:
        operands = [a for a in tree_leaves((node.args, node.kwargs)) if isinstance(val(a), torch.Tensor)]
        return Rule([same_axes(a, rank(node), expandable=True) for a in operands])
    raise Unknown(f"{name} is not known to be row-local; assumed to mix rows")


def plan_operands(node: fx.Node, spec: Selection, options: Options) -> dict[fx.Node, Keep | Gather]:
    """Per operand of `node` gathered by `spec`: keep it, or gather it; Stop if impossible."""
    try:
        found = rule_for(node, spec, options)
    except Unknown as unknown:
        decomposition = _decomposition(node.target)
        if decomposition is None:
            raise
        try:
            return _plan_through(decomposition, node, spec, options)
        except Stop:
            if torch.Tag.nondeterministic_seeded in node.target.tags:
                raise unknown from None  # the randomness is the reason, wherever it sits
            raise
    plans: dict[fx.Node, Keep | Gather] = {}
    provided: set[int] = set()
    for op in found.operands:
        action, axes = _operand_action(op, spec, out_shape_of(node))
        if plans.setdefault(op.node, action) != action:
            raise Stop(f"{op.node.name} is used with two row layouts")
        provided |= axes
    required = set(spec.row_axes)
    if found.needs_carrier and not required <= provided:
        raise Stop(f"{op_name(node.target)} creates the selected rows")
    return plans


ABSENT, BCAST, CARRIED = "absent", "bcast", "carried"


def _operand_action(op: Operand, spec: Selection, out: list[int]) -> tuple[Keep | Gather, set[int]]:
    """What one operand needs for the output to be gathered by `spec`, and which selected
    output axes it provides."""
    own_shape = op.shape or shape_of(op.node)
    offset = op.rank - len(own_shape)

    def kind(a: int) -> str:
        j = op.axes[a]
        if j is None:
            return ABSENT
        size = 1 if j < offset else own_shape[j - offset]
        if j >= offset and known(size == out[a]):
            return CARRIED
        if known(size == 1):
            return BCAST
        raise Stop(f"{op.node.name} has {size} rows on an axis of {out[a]}")

    kinds = {a: kind(a) for a in spec.axes}
    own = {a: op.axes[a] - offset for a in spec.axes if kinds[a] == CARRIED}
    aligned = {a: op.axes[a] for a in spec.axes if kinds[a] != ABSENT}
    expanded = [1] * offset + own_shape
    for a in spec.axes:
        if kinds[a] == BCAST:
            expanded[op.axes[a]] = out[a]

    if all(kinds[a] != CARRIED for a in spec.row_axes):  # broadcast along the rows: used as is
        return Keep(), set()
    if all(k == CARRIED for k in kinds.values()):
        return Gather(spec.remap(own)), set(spec.axes)
    if ABSENT in kinds.values() or not op.expandable:
        raise Stop(f"{op.node.name} carries only some of the selected axes")
    return Gather(spec.remap(aligned), tuple(expanded)), set(spec.axes)


# ----------------------------------------------------------------------------- derived rules


def _reduction(node: fx.Node, spec: Selection) -> Rule:
    """torch.Tag.reduction: reduces `self` over the schema's `dim` (every axis when absent or
    None), dropping the reduced axes unless `keepdim`."""
    args = bind(node)
    return _along(node, spec, [node.args[0]], args.get("dim"), bool(args.get("keepdim", False)))


def _along(node: fx.Node, spec: Selection, inputs: list[fx.Node], dims: Any, keepdim: bool) -> Rule:
    """An op of `inputs` along `dims`: row-local unless a selected axis is among them."""
    name = op_name(node.target)
    in_rank = len(shape_of(inputs[0]))
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        raise Stop(f"{name} reduces over every axis")
    dims = {d % in_rank for d in ([dims] if isinstance(dims, int) else dims)} if in_rank else set()
    kept = list(range(in_rank)) if keepdim else [d for d in range(in_rank) if d not in dims]
    mixed = sorted(dims & {kept[a] for a in spec.axes})
    if mixed:
        raise Stop(f"{name} mixes rows along axis {mixed[0]}")
    return Rule([Operand(x, kept, in_rank) for x in inputs])


def _decomposition(target: Any) -> Callable | None:
    """torch's own definition of an op in terms of other ops, if it has one."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    if torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd"):
        return target.decompose
    from torch._decomp import decomposition_table  # imported late: it loads every decomposition

    return decomposition_table.get(target)


def _plan_through(decomposition: Callable, node: fx.Node, spec: Selection, options: Options
                  ) -> dict[fx.Node, Keep | Gather]:
    """Row-locality of `node` read off its decomposition, traced on its fake values.

    Backward over the decomposition, each op is planned with the rules above. The original op
    will run on gathered operands, so every value inside it is computed from gathered inputs:
    a value that some op needs in full (`Keep`) must not depend on a gathered input.
    """
    name = op_name(node.target)
    if not _tensor_args(node):  # arange, full, ...: nothing to trace the rows through
        raise Stop(f"{name} makes its rows from no tensor (a factory op): there is no operand to gather")
    try:
        sub = _trace(decomposition, node)
    except Exception as exc:  # a decomposition that does not trace on these values says nothing
        raise Stop(f"{name}'s decomposition does not trace ({type(exc).__name__}: {exc})") from None
    inputs = {p: a for p, a in zip(sub.graph.find_nodes(op="placeholder"), _tensor_args(node))}
    results = tree_leaves(sub.graph.output_node().args)
    if any(not isinstance(val(r), torch.Tensor) or len(shape_of(r)) != len(out_shape_of(node)) for r in results):
        raise Stop(f"{name}'s decomposition returns values of another rank")
    need: dict[fx.Node, Keep | Gather] = {r: Gather(spec) for r in results}  # tuple elements keep the rows
    for n in reversed(list(sub.graph.nodes)):
        action = need.get(n)
        if n.op != "call_function" or not isinstance(action, Gather):
            continue
        if n.target is node.target:
            raise Stop(f"{name} decomposes into itself")
        try:
            plans = plan_operands(n, action.spec, options)
        except Stop as stop:
            raise Stop(f"{name}: {stop}") from None
        for operand, step in plans.items():
            if isinstance(step, Gather) and step.expand_to is not None:
                raise Stop(f"{name}: its decomposition broadcasts {operand.name} along the selected rows")
            if need.setdefault(operand, step) != step:
                raise Stop(f"{name}: {operand.name} is used with two row layouts inside its decomposition")
    gathered = {p for p, a in need.items() if isinstance(a, Gather) and p.op == "placeholder"}
    for n, action in need.items():
        if isinstance(action, Keep) and n.op != "placeholder" and _reads(n, gathered):
            raise Stop(f"{name}: inside its decomposition {n.name} needs every row")
    plans: dict[fx.Node, Keep | Gather] = {}
    for p, arg in inputs.items():
        if plans.setdefault(arg, need.get(p, Keep())) != need.get(p, Keep()):
            raise Stop(f"{name} uses {arg.name} with two row layouts")
    if not any(isinstance(a, Gather) for a in plans.values()):
        raise Stop(f"{name} creates the selected rows")
    return plans


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, fx.Node)]


def _trace(decomposition: Callable, node: fx.Node) -> fx.GraphModule:
    """The decomposition of `node` as an ATen graph over its tensor arguments, in-place ops on
    its own temporaries made functional."""
    from torch.fx.experimental.proxy_tensor import make_fx

    leaves, tree = tree_flatten((node.args, node.kwargs))
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, fx.Node)]

    def call(*tensors: torch.Tensor) -> Any:
        filled = list(leaves)
        for i, t in zip(slots, tensors):
            filled[i] = t
        args, kwargs = tree_unflatten(filled, tree)
        return decomposition(*args, **kwargs)

    with fake_mode(node.graph):
        sub = make_fx(call)(*[val(leaves[i]) for i in slots])
    make_local_writes_functional(sub)  # `foo_(t)` on a fresh t is `foo(t)`
    return sub


def _reads(node: fx.Node, inputs: set[fx.Node]) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in inputs:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


# ----------------------------------------------------------------------------- structural rules
# A rule maps a node's output axes onto each tensor operand: for every output axis, the
# operand's axis — in the operand's frame aligned to the output's rank, for broadcasting ops —
# or None where the operand has no such axis (a weight's rows, K/V's query axis).


@rule(*SAME_VALUES, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
      aten.empty_like.default, torch.ops._c10d_functional.all_reduce.default)
def _same_shape(node: fx.Node, spec: Selection, options: Options) -> Rule:
    """One tensor operand, the same axes; any other tensor argument (type_as's) only lends a dtype."""
    return Rule([same_axes(node.args[0], rank(node))])


@rule(aten.copy.default)
def _copy(node: fx.Node, spec: Selection, options: Options) -> Rule:
    """src's values in self's shape and dtype (an in-place copy_ made functional): both operands
    gathered alike, as a broadcasting pointwise op's."""
    return Rule([same_axes(a, rank(node), expandable=True) for a in node.args[:2]])


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
    return _along(node, spec, [node.args[0]], bind(node)[_ALONG_DIM[node.target]], keepdim=True)


def _whole_axis(node: fx.Node) -> bool:
    """A slice that keeps every row of its axis, in order: the identity."""
    if node.target is not aten.slice.Tensor:
        return False
    args = bind(node)
    size = shape_of(node.args[0])[args["dim"] % rank(node)]
    end = args["end"]
    return args["start"] in (None, 0) and args["step"] == 1 and not isinstance(end, fx.Node) and (
        to_the_end(end) or known(end >= size))


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


@rule(aten.stack.default)
def _stack(node: fx.Node, spec: Selection, options: Options) -> Rule:
    r = rank(node)
    dim = bind(node)["dim"] % r
    if dim in spec.axes:
        raise Stop(f"stack creates the selected axis {dim}")
    return Rule([Operand(t, [None if i == dim else i - (i > dim) for i in range(r)], r - 1) for t in node.args[0]])


@rule(aten.rms_norm.default, aten.layer_norm.default, aten.native_layer_norm.default)
def _norm(node: fx.Node, spec: Selection, options: Options) -> Rule:
    r, normalized = rank(node), len(bind(node)["normalized_shape"])
    if any(a >= r - normalized for a in spec.axes):
        raise Stop(f"{op_name(node.target)} normalises over the selected axis")
    return Rule([same_axes(node.args[0], r)])


@rule(aten.linear.default)
def _linear(node: fx.Node, spec: Selection, options: Options) -> Rule:
    r = rank(node)
    x, w, b = node.args[0], node.args[1], bind(node)["bias"]
    ops = [Operand(x, list(range(r - 1)) + [None], r), Operand(w, [None] * (r - 1) + [0], 2)]
    if isinstance(b, fx.Node):
        ops.append(Operand(b, [None] * (r - 1) + [0], 1))
    return Rule(ops)


_MATMULS = {aten.mm.default: 0, aten.bmm.default: 0, aten.matmul.default: 0, aten.addmm.default: 1,
            aten.baddbmm.default: 1}  # op -> position of the first matrix operand


@rule(*_MATMULS)
def _matmul(node: fx.Node, spec: Selection, options: Options) -> Rule:
    r, first = rank(node), _MATMULS[node.target]
    a, b = node.args[first], node.args[first + 1]
    if len(shape_of(a)) < 2 or len(shape_of(b)) < 2:
        raise Stop("matmul with a vector operand")
    batch = list(range(r - 2))
    ops = [Operand(a, batch + [r - 2, None], r, True), Operand(b, batch + [None, r - 1], r, True)]
    if first:
        ops.append(same_axes(node.args[0], r, expandable=True))
    return Rule(ops)


@rule(aten.einsum.default)
def _einsum(node: fx.Node, spec: Selection, options: Options) -> Rule:
    equation = node.args[0].replace(" ", "")
    if "..." in equation or "->" not in equation:
        raise Stop("einsum with an implicit output or an ellipsis")
    inputs, output = equation.split("->")
    return Rule([Operand(t, [letters.index(c) if c in letters else None for c in output], len(letters), True)
                 for letters, t in zip(inputs.split(","), node.args[1])])


@rule(aten.embedding.default)
def _embedding(node: fx.Node, spec: Selection, options: Options) -> Rule:
    r, ids = rank(node), node.args[1]
    return Rule([Operand(ids, list(range(r - 1)) + [None], r - 1), Operand(node.args[0], [None] * r, 2)])


@rule(aten.index.Tensor)
def _advanced_index(node: fx.Node, spec: Selection, options: Options) -> Rule:
    x, indices = node.args[0], list(node.args[1])
    used = [i for i, t in enumerate(indices) if t is not None]
    if used != list(range(used[0], used[-1] + 1)):
        raise Stop("advanced indexing with separated index tensors")
    if any(val(indices[i]).dtype == torch.bool for i in used):
        raise Stop("boolean-mask indexing")
    first, last, r = used[0], used[-1], rank(node)
    block = len(torch.broadcast_shapes(*[val(indices[i]).shape for i in used]))
    x_axes = [i if i < first else (None if i < first + block else i - block + last + 1) for i in range(r)]
    index_axes = [None] * first + list(range(block)) + [None] * (r - first - block)
    return Rule([Operand(x, x_axes, len(shape_of(x)))] + [Operand(indices[i], index_axes, block, True) for i in used])


@rule(aten.gather.default)
def _gather(node: fx.Node, spec: Selection, options: Options) -> Rule:
    r, out = rank(node), out_shape_of(node)
    dim = bind(node)["dim"] % r
    if dim in spec.axes:
        raise Stop(f"gather along the selected axis {dim}")
    x, index = node.args[0], node.args[2]
    x_axes = [a if a == dim or known(shape_of(x)[a] == out[a]) else None for a in range(r)]
    return Rule([Operand(x, x_axes, r), same_axes(index, r)])


@rule(aten.scatter.value, aten.scatter.src, aten.scatter_add.default, aten.scatter_reduce.two)
def _scatter(node: fx.Node, spec: Selection, options: Options) -> Rule:
    r = rank(node)
    if bind(node)["dim"] % r in spec.axes:
        raise Stop(f"{op_name(node.target)} along the selected axis")
    operands = [a for a in (node.args[0], node.args[2], *node.args[3:4]) if isinstance(val(a), torch.Tensor)]
    return Rule([same_axes(a, r) for a in operands])


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


# ----------------------------------------------------------------------------- collectives
# A functional collective combines the same tensor of every rank of its group: element by element
# (all_reduce, with the same-shape ops above), or in blocks along axis 0 (all_gather_into_tensor
# concatenates the ranks' tensors, reduce_scatter_tensor sums them and keeps this rank's block).
# Each output row is then made of the same row of every rank, so the collective commutes with a
# gather of rows that every rank selects alike: SPMD, as in a tensor-parallel step, where every rank
# runs the same graph on the same inputs. Along axis 0 of a block collective the rows are other
# ranks' rows, so a selection there is refused. The in-place spellings (`dist.all_reduce(x)`) trace
# to these plus a `copy_` back into `x`, a write that stays on every row.

_c10d = torch.ops._c10d_functional


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


# ----------------------------------------------------------------------------- custom ops


def register_row_rule(op: Any, rows: Sequence[str], full: Sequence[str] = (), row_dims: int = 1,
                      query: bool = False, replace: bool = False) -> None:
    """Declare an engine's custom op row-local, so that the live-row gather moves through it.

    Every tensor output of `op` follows the rows: its axis a < `row_dims` is axis a of each tensor
    argument named in `rows` (where such an argument has size 1 it broadcasts); the arguments
    named in `full` (KV caches, block tables, weights) are read whole. `query=True` marks
    attention: gathering through it is a Q-slice, which `q_slice=False` keeps off. `op` is an
    OpOverload, or an OpOverloadPacket for every overload. A declaration that cannot describe the
    op raises TypeError or ValueError, saying what to change.
    """
    overloads = _overloads(op)
    rows, full = _names(rows), _names(full)
    if not isinstance(row_dims, int) or row_dims < 1:
        raise ValueError(f"row_dims={row_dims!r}: it counts the leading token axes of the outputs and of the rows= "
                         "arguments, at least 1 (1 for flat [num_tokens, ...] tensors, 2 for [batch, tokens, ...])")
    for overload in overloads:  # all checked before any is registered
        _check_declaration(overload, rows, full, replace)
    declared = _declared_rule(rows, full, row_dims, query)
    for overload in overloads:
        _RULES[overload] = declared


def _overloads(op: Any) -> list[torch._ops.OpOverload]:
    if isinstance(op, torch._ops.OpOverload):
        return [op]
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    raise TypeError(f"register_row_rule takes an op of torch.ops: torch.ops.<namespace>.<name>.<overload>, or "
                    f"torch.ops.<namespace>.<name> for all its overloads (also for a torch.library.custom_op); "
                    f"got {op!r}")


def _names(names: Sequence[str]) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names)  # full="weight" is one name, not six letters


def _check_declaration(op: torch._ops.OpOverload, rows: tuple[str, ...], full: tuple[str, ...],
                       replace: bool) -> None:
    schema = op._schema
    if schema.is_mutable:
        written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        raise ValueError(f"{op} writes {', '.join(written)} in place, and an in-place write is never row-local: "
                         "run on fewer rows it would write fewer rows, so the pass keeps it on every row. "
                         "Register the functional ops that read what it writes, with that tensor in full=")
    tensors = [a.name for a in schema.arguments if _holds_tensors(a.type)]
    unknown = [name for name in rows + full if name not in tensors]
    if unknown:
        raise ValueError(f"{op} has no tensor argument {', '.join(unknown)}; its tensor arguments are "
                         f"{', '.join(tensors) or 'none'} ({schema})")
    both = [name for name in rows if name in full]
    if both:
        raise ValueError(f"{op}: {', '.join(both)} named in both rows= and full=: an argument either carries the "
                         "output's rows (rows=) or is read whole (full=)")
    undeclared = [name for name in tensors if name not in rows + full]
    if undeclared:
        raise ValueError(f"{op}: tensor argument(s) {', '.join(undeclared)} declared in neither rows= nor full=: "
                         "name each in rows= if its leading row_dims axes are the output's token rows, or in full= "
                         "if the op reads it whole (a KV cache, a block table, a weight)")
    if not rows:
        raise ValueError(f"{op}: rows= names no argument, so no argument carries the output's rows; an op that "
                         "makes its rows from what it reads whole is not row-local")
    if op in _RULES and not replace:
        raise ValueError(f"{op} already has a row rule (built in or registered); pass replace=True to replace it")


def _holds_tensors(t: Any) -> bool:
    """Tensor, Tensor?, Tensor[], Tensor?[]: the schema types that carry tensors."""
    while isinstance(t, (torch._C.OptionalType, torch._C.ListType)):
        t = t.getElementType()
    return isinstance(t, torch._C.TensorType)


def _declared_rule(rows: tuple[str, ...], full: tuple[str, ...], row_dims: int, query: bool) -> RuleFn:
    def declared(node: fx.Node, spec: Selection, options: Options) -> Rule:
        name = op_name(node.target)
        feature = [a for a in spec.axes if a >= row_dims]
        if feature:
            raise Stop(f"{name} selects a feature axis: axis {feature[0]} is not among its first row_dims={row_dims}")
        if query and not options.q_slice:
            raise Stop(f"q_slice=False keeps {name} on every query row")
        out = out_shape_of(node)
        if any(v.dim() < row_dims or not same_shape(list(v.shape[:row_dims]), out[:row_dims])
               for v in tree_leaves(val(node)) if isinstance(v, torch.Tensor)):
            raise Stop(f"{name}'s outputs do not share their first {row_dims} axes")
        args = bind(node)
        row_axes = [a if a < row_dims else None for a in range(len(out))]
        operands = []
        for x in _tensor_nodes(args, rows):
            if len(shape_of(x)) < row_dims:
                raise Stop(f"{x.name} has fewer than row_dims={row_dims} axes")
            operands.append(Operand(x, row_axes, len(shape_of(x)), expandable=True))  # size 1 broadcasts
        operands += [Operand(x, [None] * len(out), len(shape_of(x))) for x in _tensor_nodes(args, full)]
        return Rule(operands)

    return declared


def _tensor_nodes(args: dict[str, Any], names: tuple[str, ...]) -> list[fx.Node]:
    return [x for name in names for x in tree_leaves(args[name]) if isinstance(x, fx.Node)]

"""The row-rule engine: the registry of rules, the lookup, and the plan of a node's operands.

A rule says, for one node and one selection of its output, which operand axes carry each output
axis (`Rule`), or raises `Stop(reason)`. The lookup (`rule_for`), in order: a registered rule
(`@rule`, the modules next to this one, and `register_row_rule`); `torch.Tag.reduction` with the
schema's `dim` / `keepdim`; `torch.Tag.pointwise`; else `Unknown`, and then `plan_operands` reads
the op's decomposition, if it has one, op by op. A leaf of the passes: the live-row pass's
selections implement `Selection`, and the rules read nothing else of it.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Protocol

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from specpass.graph import bind, fake_mode, is_mutation, known, make_local_writes_functional, op_name, size_key, val
from specpass.options import Options


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


def registered_rules() -> dict[Any, RuleFn]:
    """Every op overload with a rule, built in or declared (the compile cache keys on them)."""
    return dict(_RULES)


def has_rule(target: Any) -> bool:
    """Is a rule registered for this op overload (built in or declared)?"""
    return target in _RULES


def shape_of(x: Any) -> list[int]:
    return list(val(x).shape)


def out_shape_of(node: fx.Node) -> list[int]:
    v = val(node)
    return list((v[0] if isinstance(v, (tuple, list)) else v).shape)


def rank(node: fx.Node) -> int:
    return len(out_shape_of(node))


def same_axes(x: fx.Node, rank: int, expandable: bool = False) -> Operand:
    return Operand(x, list(range(rank)), rank, expandable)


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
    return along(node, spec, [node.args[0]], args.get("dim"), bool(args.get("keepdim", False)))


def along(node: fx.Node, spec: Selection, inputs: list[fx.Node], dims: Any, keepdim: bool) -> Rule:
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

"""`register_row_rule`: an engine declares its own custom op row-local."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from specpass.graph import bind, op_name, same_shape, val
from specpass.options import Options
from specpass.passes.row_rules.engine import (Operand, Rule, RuleFn, Selection, Stop, has_rule, out_shape_of, rule,
                                              shape_of)


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
    rule(*overloads)(declared)


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
    if has_rule(op) and not replace:
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

"""Row selections: which rows of which axes a gather keeps, independent of how it was spelled.

`x[:, -1]` is `Static(1, T-1, T)`; `x[arange(B), live]` is `PerBatch(0, 1, live[:, None])`;
`x.reshape(B*T, H).index_select(0, ids)` is `Flat((0, 1), ids)`. Gathers are read as one of
these (gathers.py), the rules map them from an op's output onto its operands (row_rules/), and
each turns itself back into a gather (`gather`). A gathered tensor keeps its rank: a selected axis
keeps length k; Flat keeps 1s and n.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Union

import torch
import torch.fx as fx

from specpass.graph import emit, hint, is_symbolic, known, size_key, static_int, val
from specpass.passes.live_rows.program import Program, constant
from specpass.passes.row_rules import Stop

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True, eq=False)
class Static:
    """Rows start:stop:step of one axis (a select is a length-1 range). The bounds may be symbolic
    (`x[:, -1]` on a dynamic T is T-1:T); two selections are equal when their bounds are the same
    expressions."""

    axis: int
    start: int
    stop: int
    step: int = 1

    def _key(self) -> tuple:
        return size_key((self.axis, self.start, self.stop, self.step))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Static) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def axes(self) -> tuple[int, ...]:
        return (self.axis,)

    row_axes = axes  # the axes whose rows an operand must carry

    @property
    def rows(self) -> int:
        if not any(map(is_symbolic, (self.start, self.stop))):
            return len(range(self.start, self.stop, self.step))
        return static_int((self.stop - self.start + self.step - 1) // self.step)  # a range within the axis

    def index_nodes(self) -> list[fx.Node]:
        return []

    def gathered_shape(self, shape: list[int]) -> list[int]:
        """Shape of `x` gathered by this selection, rank kept."""
        return [self.rows if a == self.axis else s for a, s in enumerate(shape)]

    def remap(self, axis_map: dict[int, int]) -> Static:
        return dataclasses.replace(self, axis=axis_map[self.axis])

    def flattens(self, axes: list[int]) -> bool:
        return False

    def normalize(self, prog: Program, shape: list[int]) -> Static | None:
        return None if known(shape[self.axis] == 1) and known(self.rows == 1) else self

    def as_flat(self, prog: Program, axes: list[int], shape: list[int], device: torch.device) -> Flat:
        return _grid_flat(self, prog, axes, shape, device)

    def _factor(self, prog: Program, axes: list[int], i: int, shape: list[int], device: torch.device):
        if axes[i] != self.axis:
            return None
        return 1, shape[self.axis], prog.arange(self.start, self.stop, self.step, device)

    def gather(self, prog: Program, x: fx.Node, name: str) -> fx.Node:
        return emit(prog.graph, aten.slice.Tensor, (x, self.axis, self.start, self.stop, self.step), name=name)

    def causal_mask(self, prog: Program, out: list[int], keys: fx.Node) -> fx.Node:
        rows = prog.arange(self.start, self.stop, self.step, val(keys).device)  # [k]
        return emit(prog.graph, aten.le.Tensor, (keys, prog.index_op(aten.unsqueeze.default, rows, 1)))  # [k, S]


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
    def row_axes(self) -> tuple[int, ...]:
        return (self.axis,)  # an operand broadcast along the rows is used as is, whatever its batch

    @property
    def rows(self) -> int:
        return val(self.index).shape[1]

    def index_nodes(self) -> list[fx.Node]:
        return [self.index]

    def gathered_shape(self, shape: list[int]) -> list[int]:
        return [self.rows if a == self.axis else s for a, s in enumerate(shape)]

    def remap(self, axis_map: dict[int, int]) -> PerBatch:
        return dataclasses.replace(self, batch=axis_map[self.batch], axis=axis_map[self.axis])

    def flattens(self, axes: list[int]) -> bool:
        return False

    def normalize(self, prog: Program, shape: list[int]) -> Rows | None:
        if known(shape[self.axis] == 1) and known(self.rows == 1):
            return None
        if known(shape[self.batch] == 1):  # flat ids are not wrapped as x[b, -1] is: wrap them first
            rows = prog.index_op(aten.remainder.Scalar, self.index, shape[self.axis])
            return Flat((self.axis,), prog.index_op(aten.reshape.default, rows, [-1]))
        return self

    def as_flat(self, prog: Program, axes: list[int], shape: list[int], device: torch.device) -> Flat:
        """Flat ids over `axes` = (batch, ...): request b's rows are b * inner + rows[b], with
        rows[b] the row-major ids of its selected rows within the other axes."""
        if axes[0] != self.batch:
            raise Stop("a reshape merges the request axis into a less significant axis")
        B = shape[self.batch]
        rows = None  # [B, m]
        for a in axes[1:]:
            if a == self.axis:
                coord = prog.index_op(aten.remainder.Scalar, self.index, shape[a])  # [B, k]; -1 wraps, as x[...] does
            else:
                coord = prog.index_op(aten.unsqueeze.default, prog.arange(0, shape[a], 1, device), 0)  # [1, n]
            if rows is None:
                rows = prog.index_op(aten.expand.default, coord, [B, val(coord).shape[1]])
            else:
                outer = prog.index_op(aten.mul.Tensor, prog.index_op(aten.unsqueeze.default, rows, 2), shape[a])
                rows = prog.index_op(aten.reshape.default, prog.index_op(
                    aten.add.Tensor, outer, prog.index_op(aten.unsqueeze.default, coord, 1)), [B, -1])
        if axes[1] == self.axis:  # rows = index x every row of the trailing axes: reversible
            prog.spread[rows] = (self.index, [shape[a] for a in axes[2:]])
        inner = math.prod(shape[a] for a in axes[1:])
        base = prog.index_op(aten.mul.Tensor, prog.index_op(aten.unsqueeze.default, prog.arange(0, B, 1, device), 1),
                             inner)
        ids = prog.index_op(aten.reshape.default, prog.index_op(aten.add.Tensor, base, rows), [-1])
        prog.per_request[ids] = (rows, B, inner)  # a reshape that splits [B, inner] again gets it back
        return Flat(tuple(axes), ids)

    def gather(self, prog: Program, x: fx.Node, name: str) -> fx.Node:
        def pick(xp: fx.Node, shape: list[int], rest: list[int]) -> fx.Node:
            batch = prog.index_op(aten.unsqueeze.default, prog.arange(0, shape[self.batch], 1, val(x).device), 1)
            return emit(prog.graph, aten.index.Tensor, (xp, [batch, self.index]), name=name)

        return _gather_to_front(prog, x, [self.batch, self.axis], pick, name)

    def causal_mask(self, prog: Program, out: list[int], keys: fx.Node) -> fx.Node:
        rows = prog.index_op(aten.remainder.Scalar, self.index, out[-2])  # [B, k]
        mask = emit(prog.graph, aten.le.Tensor, (keys, prog.index_op(aten.unsqueeze.default, rows, 2)))  # [B, k, S]
        shape = [1] * len(out)
        shape[self.batch], shape[-2], shape[-1] = out[self.batch], self.rows, val(keys).shape[0]
        return emit(prog.graph, aten.reshape.default, (mask, shape))


@dataclasses.dataclass(frozen=True)
class Flat:
    """Rows `index` ([n]) of the row-major flattening of `axes` (in order of significance)."""

    axes: tuple[int, ...]
    index: fx.Node

    @property
    def row_axes(self) -> tuple[int, ...]:
        return self.axes

    @property
    def rows(self) -> int:
        return val(self.index).shape[0]

    def index_nodes(self) -> list[fx.Node]:
        return [self.index]

    def gathered_shape(self, shape: list[int]) -> list[int]:
        """1 on every flattened axis but the last, which keeps the n rows."""
        return [(self.rows if a == self.axes[-1] else 1) if a in self.axes else s for a, s in enumerate(shape)]

    def remap(self, axis_map: dict[int, int]) -> Flat:
        return dataclasses.replace(self, axes=tuple(axis_map[a] for a in self.axes))

    def flattens(self, axes: list[int]) -> bool:
        """Are these ids flat across any of `axes` (not provably per entry of them)?"""
        return bool(set(axes) & set(self.axes))

    def normalize(self, prog: Program, shape: list[int]) -> Flat | None:
        axes = tuple(a for a in self.axes if not known(shape[a] == 1))
        if not axes:
            return None if known(self.rows == 1) else self
        ids, size = constant(self.index), math.prod(shape[a] for a in axes)
        if ids is not None and not is_symbolic(size) and torch.equal(ids, torch.arange(size)):
            return None  # every row, in order
        return Flat(axes, self.index)

    def as_flat(self, prog: Program, axes: list[int], shape: list[int], device: torch.device) -> Flat:
        return _grid_flat(self, prog, axes, shape, device)

    def _factor(self, prog: Program, axes: list[int], i: int, shape: list[int], device: torch.device):
        if axes[i] != self.axes[0]:
            return None
        if tuple(axes[i: i + len(self.axes)]) != self.axes:
            raise Stop("flat rows interleaved with other axes by a reshape")
        return len(self.axes), math.prod(shape[x] for x in self.axes), self.index

    def gather(self, prog: Program, x: fx.Node, name: str) -> fx.Node:
        front = list(self.axes)

        def pick(xp: fx.Node, shape: list[int], rest: list[int]) -> fx.Node:
            flat = emit(prog.graph, aten.reshape.default, (xp, [math.prod(shape[a] for a in front)] + rest))
            picked = emit(prog.graph, aten.index_select.default, (flat, 0, self.index))
            return emit(prog.graph, aten.reshape.default, (picked, [1] * (len(front) - 1) + [self.rows] + rest),
                        name=name)

        return _gather_to_front(prog, x, front, pick, name)

    def causal_mask(self, prog: Program, out: list[int], keys: fx.Node) -> fx.Node:
        rows = prog.index_op(aten.remainder.Scalar, self.index, out[-2])  # [n]
        return emit(prog.graph, aten.le.Tensor, (keys, prog.index_op(aten.unsqueeze.default, rows, 1)))


Rows = Union[Static, PerBatch, Flat]


def keeps_less(a: tuple[Rows, list[int]], b: tuple[Rows, list[int]] | None = None) -> bool:
    """Does selection a keep a smaller fraction of its tensor than b does of its own (b None: than
    all of it)? Fractions are compared cross-multiplied; with symbolic sizes whose order is not
    provable (requests and tokens are two free sizes), at the sizes of the captured call: this only
    decides what is worth moving, never what is exact."""
    kept_a, all_a = math.prod(a[0].gathered_shape(a[1])), math.prod(a[1])
    kept_b, all_b = (1, 1) if b is None else (math.prod(b[0].gathered_shape(b[1])), math.prod(b[1]))
    less, more = kept_a * all_b, kept_b * all_a
    if known(less < more) or known(less >= more):
        return known(less < more)
    return None not in (hint(less), hint(more)) and hint(less) < hint(more)


def _grid_flat(spec: Static | Flat, prog: Program, axes: list[int], shape: list[int], device: torch.device) -> Flat:
    """The same rows as flat ids over `axes` (ordered; they include the selected axes): the
    selection's own coordinates on its axes, every row on the others."""
    factors, i = [], 0
    while i < len(axes):
        factor = spec._factor(prog, axes, i, shape, device)
        if factor is None:
            if axes[i] in spec.axes:
                raise Stop("selected axes reordered by a reshape")
            factor = 1, shape[axes[i]], prog.arange(0, shape[axes[i]], 1, device)
        consumed, size, coord = factor
        factors.append((size, coord))
        i += consumed
    return Flat(tuple(axes), prog.flat_ids(factors))


def _gather_to_front(prog: Program, x: fx.Node, front: list[int], pick, name: str) -> fx.Node:
    """Permute the selected axes to the front, gather with `pick`, permute back."""
    shape = list(val(x).shape)
    perm = front + [a for a in range(len(shape)) if a not in front]
    xp = x if perm == sorted(perm) else emit(prog.graph, aten.permute.default, (x, perm))
    out = pick(xp, shape, [shape[a] for a in perm[len(front):]])
    if perm == sorted(perm):
        return out
    inverse = sorted(range(len(perm)), key=perm.__getitem__)
    return emit(prog.graph, aten.permute.default, (out, inverse), name=name)

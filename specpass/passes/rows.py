"""Row selections: which rows of which axes a gather keeps, independent of how it was spelled.

`x[:, -1]` is `Static(1, T-1, T)`; `x[arange(B), live]` is `PerBatch(0, 1, live[:, None])`;
`x.reshape(B*T, H).index_select(0, ids)` is `Flat((0, 1), ids)`. The live-row pass reads every
gather as one of these, the rules map them from an op's output onto its operands, and the
emission turns them back into a gather.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Union

import torch.fx as fx

from specpass.graph import val


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


def index_nodes(spec: Rows) -> list[fx.Node]:
    return [] if isinstance(spec, Static) else [spec.index]


def remap(spec: Rows, axis_map: dict[int, int]) -> Rows:
    """The same rows, on renumbered axes."""
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


def kept(spec: Rows, shape: list[int]) -> float:
    """The fraction of a tensor's elements a selection keeps."""
    return math.prod(gathered_shape(spec, shape)) / math.prod(shape)

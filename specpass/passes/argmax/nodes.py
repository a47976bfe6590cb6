"""The new nodes of one plan's rewrite: each shared node built once, in the order consumers ask.

Every node goes in at the graph's insert point (lowering.py: right after the softmax, or before a
gather). A node that several consumers of the softmax read (s_in and its upcast, m and z, the
chunks, top1_lse's outputs, ...) is built under a key by the first consumer that needs it; the
others read it. Every node a consumer's output is replaced by is new, so no two outputs alias.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
import torch.fx as fx

from specpass.graph import emit, val
from specpass.passes.argmax.plan import Plan, Reduction

aten = torch.ops.aten
T = TypeVar("T")


class Nodes:
    """The nodes built for `plan` in `graph`, by key."""

    def __init__(self, plan: Plan, graph: fx.Graph):
        self.plan, self.graph = plan, graph
        self._built: dict[Any, Any] = {}

    def emit(self, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        return emit(self.graph, target, args, kwargs)

    def once(self, key: Any, build: Callable[[], T]) -> T:
        """What `build` made the first time `key` was asked for."""
        if key not in self._built:
            self._built[key] = build()
        return self._built[key]

    def s_in(self) -> fx.Node:
        """The tensor softmax reduced: its input, cast to `dtype=` first when one is given."""
        if self.plan.cast_to is None:
            return self.plan.s
        return self.once("s_in", lambda: self.emit(aten.to.dtype, (self.plan.s, self.plan.cast_to)))

    def s_in_name(self) -> str | None:
        """s_in's name where it is s itself or has been built (the findings name what was read)."""
        if self.plan.cast_to is None:
            return self.plan.s.name
        return self._built["s_in"].name if "s_in" in self._built else None

    def s_c(self) -> fx.Node:
        """s_in in the compute dtype."""
        return self.once("s_c", lambda: self.up(self.s_in()))

    def up(self, node: fx.Node) -> fx.Node:
        """`node` in the compute dtype: f32 for a 16-bit softmax (what its kernels accumulate in)."""
        if val(node).dtype == self.plan.compute_dtype:
            return node
        return self.emit(aten.to.dtype, (node, self.plan.compute_dtype))

    def round(self, node: fx.Node, dtypes: tuple[torch.dtype, ...]) -> fx.Node:
        """Cast through `dtypes` (the softmax's, then the casts to the consumer): round where the original rounded."""
        for dtype in dtypes:
            if val(node).dtype != dtype:
                node = self.emit(aten.to.dtype, (node, dtype))
        return node

    def reduced(self, node: fx.Node, c: Reduction) -> fx.Node:
        """`node`, kept [..., 1, ...] along c's axes, shaped as c returns it."""
        return node if c.keepdim else self.emit(aten.squeeze.dims, (node, list(c.dims)))

"""The graph under rewrite: program order, in-place writes, and the index arithmetic the pass emits.

Index nodes (aranges, flat ids, remainders) are memoized — equal inputs, one node — and placed
right after their latest input, so an index built for a gather late in the graph exists wherever
the gather lands.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves, tree_map_only

from specpass.graph import emit, is_impure, is_mutation, size_args, storage, val, written_storages

aten = torch.ops.aten


class Program:
    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self._memo: dict[tuple, fx.Node] = {}
        self._hoisted: set[fx.Node] = set()
        self.per_request: dict[fx.Node, tuple[fx.Node, int, int]] = {}  # flat ids -> (index [B, k], B, T)
        self.spread: dict[fx.Node, tuple[fx.Node, list[int]]] = {}  # index -> (coarser index, axis sizes)
        self.refresh()

    def refresh(self) -> None:
        self.pos = _Positions(self.graph)
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

    # ------------------------------------------------------------------------- index arithmetic

    def index_op(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        """An index computation, placed right after its latest input (memoized: equal inputs, one node)."""
        args, kwargs = size_args(self.graph, (args, kwargs))  # symbolic sizes as nodes: hashable, and in the graph
        key = (target, _hashable(args), _hashable(kwargs))
        if key in self._memo:
            return self._memo[key]
        with self.graph.inserting_after(self._after(a for a in tree_leaves(args) if isinstance(a, fx.Node))):
            node = emit(self.graph, target, args, kwargs)
        self._memo[key] = node
        self.refresh()
        return node

    def arange(self, start: int, stop: int, step: int, device: torch.device) -> fx.Node:
        return self.index_op(aten.arange.start_step, start, stop, step, dtype=torch.int64, device=device)

    def flat_ids(self, factors: list[tuple[int, fx.Node]]) -> fx.Node:
        """Row-major ids of a grid whose axes have these sizes and 1-D coordinates."""
        ids = None
        for size, coord in factors:
            if ids is None:
                ids = coord
            else:
                outer = self.index_op(aten.mul.Tensor, self.index_op(aten.unsqueeze.default, ids, 1), size)
                grid = self.index_op(aten.add.Tensor, outer, self.index_op(aten.unsqueeze.default, coord, 0))
                ids = self.index_op(aten.reshape.default, grid, [-1])
        return ids

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

    def _after(self, inputs: Any) -> fx.Node:
        """The earliest node a computation of `inputs` can follow (placeholders stay first)."""
        last_input = list(self.graph.find_nodes(op="placeholder"))[-1]
        return max([last_input, *inputs], key=self.pos.__getitem__)


class _Positions(dict):
    """Program positions; a node inserted since (a symbolic size's node) renumbers them."""

    def __init__(self, graph: fx.Graph):
        super().__init__((n, i) for i, n in enumerate(graph.nodes))
        self.graph = graph

    def __missing__(self, node: fx.Node) -> int:
        self.clear()
        self.update((n, i) for i, n in enumerate(self.graph.nodes))
        return self[node]


def constant(node: fx.Node, budget: int = 64) -> torch.Tensor | None:
    """The value of a small integer computation that reads no graph input, evaluated on the CPU."""
    values: dict[fx.Node, Any] = {}

    class NotConstant(Exception):
        pass

    def evaluate(n: fx.Node) -> Any:
        if n in values:
            return values[n]
        if len(values) >= budget or n.op != "call_function" or is_impure(n):
            raise NotConstant
        # every device the graph names, keyword or positional (`to.device`'s), is the CPU here
        args, kwargs = tree_map_only(torch.device, lambda _: torch.device("cpu"),
                                     fx.node.map_arg((n.args, n.kwargs), evaluate))
        values[n] = n.target(*args, **kwargs)
        return values[n]

    try:
        value = evaluate(node)
    except NotConstant:
        return None
    return value if isinstance(value, torch.Tensor) and not value.is_floating_point() else None


def _hashable(x: Any) -> Any:
    if isinstance(x, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_hashable(v) for v in x)
    return x

"""Fused projections split by liveness.

A fused QKV (or gate_up) projection feeds users with different needs: the K/V columns are
written to the cache on every row, the Q columns only matter on the live rows. Liveness then
keeps the whole matmul on every row ("its users need different rows"). When every user reads one
column range of the matmul's output (`split`, `slice`, `narrow` of the last axis, directly or
after a view that keeps the last axis), the columns commute with the op — slice(op(x, W)) =
op(x, slice(W)), read off the same row rules with a selection of the column axis — so the
matmul is split into one matmul per need, over contiguous blocks of the weight, and the next
liveness round runs the live block on the live rows only. Exact: the same values, column by column.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator

import torch
import torch.fx as fx

from specpass.graph import bind, emit, is_symbolic, known, set_val, static_int, val
from specpass.options import Options
from specpass.passes.live_rows.gathers import Candidate, as_static
from specpass.passes.live_rows.liveness import FULL, Liveness
from specpass.passes.live_rows.program import Program
from specpass.passes.live_rows.rows import Static
from specpass.passes.op_sets import RESHAPES
from specpass.passes.row_rules import Gather, Stop, plan_operands, shape_of
from specpass.report import node_matmul_flops

aten = torch.ops.aten
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}


@dataclasses.dataclass
class Split:
    """One fused op cut into column blocks: the blocks' nodes and the FLOPs of the whole op."""

    name: str
    blocks: list[tuple[int, int, fx.Node, object]]  # (first column, end column, the block's op, its need)
    matmul_flops: int


def split_fused(prog: Program, live: Liveness, candidates: dict[fx.Node, Candidate],
                options: Options) -> list[Split]:
    """Split every matmul (on at least `split_min_rows` rows) whose column blocks have different
    needs; the graph is edited in place."""
    splits = []
    for node in list(prog.graph.nodes):
        if live.need.get(node) != FULL or not known(node_matmul_flops(node) > 0) \
                or not known(math.prod(shape_of(node)[:-1]) >= options.split_min_rows):
            continue
        found = _column_readers(node)
        if found is None or any(r in candidates for r, _, _ in found[1]):
            continue
        base, readers = found
        readers = [(r, start, stop) for r, start, stop in readers if r.users]  # dead columns: no block
        blocks = _blocks([(live.asked.get(r, FULL), start, stop) for r, start, stop in readers])
        if blocks is None:
            continue
        try:
            splits.append(_cut(prog, node, base, readers, blocks, options))
        except Stop:
            continue
    return splits


def _column_readers(node: fx.Node) -> tuple[fx.Node, list[tuple[fx.Node, int, int]]] | None:
    """The node whose last axis is read (`node`, or a view of it that keeps the last axis) and
    each of its readers as (reader, first column, end column); None if some user reads it otherwise."""
    base = node
    if len(node.users) == 1:
        (user,) = node.users
        if user.target in RESHAPES and known(shape_of(user)[-1] == shape_of(node)[-1]):
            base = user
    last = len(shape_of(base)) - 1
    readers = []
    for user in base.users:
        static = as_static(user)
        if static is not None and static.axis == last and static.step == 1 and user.target is not aten.select.int \
                and not is_symbolic(static.start) and not is_symbolic(static.stop):
            readers.append((user, static.start, static.stop))
        elif user.target in _SPLITS and bind(user)["dim"] % (last + 1) == last \
                and not any(is_symbolic(v.shape[last]) for v in val(user)):
            ends = list(itertools.accumulate(static_int(v.shape[last]) for v in val(user)))
            for element in user.users:
                if element.target is not operator.getitem:
                    return None
                i = element.args[1]
                readers.append((element, ends[i - 1] if i else 0, ends[i]))
        else:
            return None
    return base, readers


def _blocks(reads: list[tuple[object, int, int]]) -> list[tuple[object, int, int]] | None:
    """One contiguous column block per need, or None: a single need (nothing to split), no need
    that saves rows, or needs whose columns interleave."""
    spans: dict[object, list[int]] = {}
    for need, start, stop in reads:
        span = spans.setdefault(need, [start, stop])
        span[0], span[1] = min(span[0], start), max(span[1], stop)
    if len(spans) < 2 or all(need == FULL for need in spans):
        return None
    blocks = sorted(((need, a, b) for need, (a, b) in spans.items()), key=lambda block: block[1])
    if any(blocks[i][2] > blocks[i + 1][1] for i in range(len(blocks) - 1)):
        return None
    return blocks


def _cut(prog: Program, node: fx.Node, base: fx.Node, readers: list[tuple[fx.Node, int, int]],
         blocks: list[tuple[object, int, int]], options: Options) -> Split:
    """One op per block, on the block's columns of each operand that carries them (weight rows,
    bias entries: views); each reader then reads its block."""
    last, flops = len(shape_of(node)) - 1, node_matmul_flops(node)
    # Stop (the graph untouched) if the columns do not commute with the op
    block_plans = [plan_operands(node, Static(last, start, stop), options) for _, start, stop in blocks]
    made = []
    for (need, start, stop), plans in zip(blocks, block_plans):
        with prog.graph.inserting_before(node):
            operands = {operand: action.spec.gather(prog, operand, f"{operand.name}_cols")
                        for operand, action in plans.items() if isinstance(action, Gather)}
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: operands.get(a, a))
            block = emit(prog.graph, node.target, args, kwargs, name=f"{node.name}_cols")
            out = block if base is node else emit(prog.graph, aten.reshape.default,
                                                  (block, shape_of(base)[:-1] + [stop - start]))
        made.append((start, stop, block, out, need))
    for reader, start, stop in readers:
        first, end, _, out, _ = next(m for m in made if m[0] <= start and stop <= m[1])
        if (start, stop) == (first, end):
            reader.replace_all_uses_with(out)
        else:
            reader.target, reader.kwargs = aten.slice.Tensor, {}
            reader.args = (out, len(shape_of(out)) - 1, start - first, stop - first)
            set_val(reader)
    _erase_dead(prog.graph, node)
    prog.refresh()
    return Split(node.name, [(start, stop, block, need) for start, stop, block, _, need in made], flops)


def _erase_dead(graph: fx.Graph, node: fx.Node) -> None:
    """Erase `node` and what hangs off it (the view, the split, its unread elements) once unused."""
    for user in list(node.users):
        _erase_dead(graph, user)
    if not node.users:
        graph.erase_node(node)

"""Topk as one Triton kernel: a top-k over a short row runs as k rounds of selection (a small k) or
as a stable sort and a slice, which Inductor lowers to one Triton kernel fused with what produces the
row, instead of ATen's top-k (a radix select and a bitonic sort of its k results: two kernels
whose time does not shrink with the row's length).

    values, indices = topk(x, k, dim, largest, sorted)
->  selection (k <= 8, a float row longer than 256): each element's key, its value's order and
    then its index's as one int64; round j takes the largest key below round j-1's (an amax): k
    dependent reductions over the row, which Inductor fuses into one persistent kernel. The
    indices decoded from the keys, values = gather(x, dim, indices).
->  sort (otherwise): values, indices = sort(x, dim, descending=largest, stable=True)[:k along dim]

A tree round makes many such calls on short rows: each draft step's top-k of its children, the
re-rank over topk² candidates, and the draft's top-k over a small vocabulary, so the ATen pair's
time adds up a round (docs/results.md, draft trees; a call of each form: docs/passes.md#topk-as-sort).

Exact, both forms: the first k in the order (value descending, or ascending with largest=False;
equal values by index) are the k largest (smallest), in order: topk's values, sorted or not
(sorted=False leaves the order unspecified). On equal values topk promises no index order; both
forms give the first index first, as the stable sort does. NaN is the largest value, as in topk and
sort, and all NaNs are equal; -0.0 equals 0.0. The selection's keys are distinct (the index is part
of each), so each round picks exactly one element, and the values are gathered from x itself.
Inductor's own `decompose_sort_ops` (torch 2.13) makes the sort rewrite.

The sort's slice is a view of the sorted rows, not contiguous as topk's outputs are; where one is a
graph output, the pipeline copies it back to topk's layout (`pipeline._keep_dense_outputs`).

When, proven from the fake tensors: CUDA; the row's length along dim a static int of at most 512
(Inductor reduces and sorts rows up to 512 in one persistent kernel; above, it falls back to ATen's
sort, which on a long row is slower than topk's select); k static; neither output written in place
(the new output would then be the buffer written). The selection also needs a float16, bfloat16 or
float32 row (its value order as an int32 key) longer than 256 (shorter rows sort faster). Not a
candidate: a topk on another device (no finding).

Order: last, after argmax (which emits the exact top-k of a softmax's input as topk).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from specpass.graph import emit, is_written_in_place, static_int, val
from specpass.options import Options
from specpass.report import Finding

aten = torch.ops.aten
NAME = "topk_sort"
_TOPK = aten.topk.default
SORT_MAX_ROW = 512  # Inductor's persistent sort kernel takes rows up to this (ir.Sort.create)
# k rounds of a reduction against a sort's log²(row) stages over the row padded to a power of two:
# at k up to 8 the selection is the faster on rows of 258 and 512, the sort on short rows
# (benchmarks/topk_sort.py, docs/passes.md#topk-as-sort)
SELECT_MAX_K = 8
SELECT_MIN_ROW = 257  # a row of up to 256 sorts in 256 lanes: faster than the selection on the short rows measured
_SELECT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # exact in float32, whose bits order as int32


def run(gm: fx.GraphModule, options: Options) -> list[Finding]:
    findings = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _TOPK:
            continue
        x = val(node.args[0])
        if not (isinstance(x, torch.Tensor) and x.device.type == "cuda"):
            continue  # Inductor's Triton kernel is the gain: not a candidate
        why = _refusal(node, x)
        if why is not None:
            findings.append(Finding(NAME, node.name, False, why))
            continue
        findings.append(Finding(NAME, node.name, True, _rewrite(node, x)))
    return findings


def _args(node: fx.Node) -> tuple[fx.Node, int, int, bool]:
    x, k, dim, largest = (list(node.args) + [None] * 4)[:4]
    dim = node.kwargs.get("dim", -1 if dim is None else dim)
    largest = node.kwargs.get("largest", True if largest is None else largest)
    return x, static_int(k), dim, largest


def _refusal(node: fx.Node, x: torch.Tensor) -> str | None:
    _, k, dim, largest = _args(node)
    if x.dim() == 0:
        return "a topk of a 0-d tensor"
    row = static_int(x.shape[dim])
    if not isinstance(row, int) or not isinstance(k, int):
        return f"the row ({row}) or k ({k}) is symbolic: Inductor's sort kernel needs a static row"
    if row > SORT_MAX_ROW:
        return (f"a row of {row} > {SORT_MAX_ROW}: Inductor sorts longer rows with ATen's sort, slower than "
                "topk's select")
    if not isinstance(largest, bool):
        return f"largest={largest!r} is not a constant"
    outputs = [u for u in node.users if u.target is operator.getitem]
    if len(outputs) != len(node.users):
        return "an output is read other than by indexing the (values, indices) pair"
    if any(is_written_in_place(u) for u in outputs):
        return "an output is written in place: the new output would be the buffer written"
    return None


def _rewrite(node: fx.Node, x: torch.Tensor) -> str:
    source, k, dim, largest = _args(node)
    dim = dim % x.dim()
    graph = node.graph
    row = static_int(x.shape[dim])
    selection = k <= SELECT_MAX_K and row >= SELECT_MIN_ROW and x.dtype in _SELECT_DTYPES
    with graph.inserting_before(node):
        parts = _selection(graph, source, x, k, dim, largest) if selection else _sort(graph, source, k, dim, largest)
    for user in list(node.users):
        user.replace_all_uses_with(parts[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)
    if selection:
        return (f"topk({k}) of rows of {row} runs as {k} rounds of selection (one Triton kernel under Inductor "
                "instead of ATen's select and sort)")
    return (f"topk({k}) of rows of {row} runs as a stable sort and a slice (one Triton kernel under Inductor "
            "instead of ATen's select and sort)")


def _sort(graph: fx.Graph, source: fx.Node, k: int, dim: int, largest: bool) -> list[fx.Node]:
    pair = emit(graph, aten.sort.stable, (source,), {"stable": True, "dim": dim, "descending": largest})
    return [emit(graph, aten.slice.Tensor, (emit(graph, operator.getitem, (pair, i)), dim, 0, k)) for i in (0, 1)]


def _selection(graph: fx.Graph, source: fx.Node, x: torch.Tensor, k: int, dim: int, largest: bool) -> list[fx.Node]:
    """-> [values, indices]: k rounds of an amax over keys (value order << 32 | reversed index), each
    round below the last one's key; every key is distinct, so a round picks one element."""
    row = static_int(x.shape[dim])
    xf = source if x.dtype == torch.float32 else emit(graph, aten._to_copy.default, (source,), {"dtype": torch.float32})
    xf = emit(graph, aten.where.ScalarSelf, (emit(graph, aten.eq.Scalar, (xf, 0)), 0.0, xf))  # -0.0 as 0.0: one key
    bits = emit(graph, aten.view.dtype, (xf, torch.int32))
    # a float's order as an int32: non-negative floats order as their bits, negative ones reversed
    flipped = emit(graph, aten.bitwise_xor.Scalar, (bits, 0x7FFFFFFF))
    key = emit(graph, aten.where.self, (emit(graph, aten.lt.Scalar, (bits, 0)), flipped, bits))
    key = emit(graph, aten.where.ScalarSelf, (emit(graph, aten.isnan.default, (xf,)), 0x7FFFFFFF, key))  # NaN: largest
    if not largest:
        key = emit(graph, aten.bitwise_not.default, (key,))
    shape = [1] * x.dim()
    shape[dim] = row
    arange = emit(graph, aten.arange.start, (0, row), {"dtype": torch.int64, "device": x.device})
    reversed_index = emit(graph, aten.rsub.Scalar, (emit(graph, aten.view.default, (arange, shape)), row - 1))
    key64 = emit(graph, aten._to_copy.default, (key,), {"dtype": torch.int64})
    # key << 32 | (row - 1 - index): distinct, and the first index the largest among equal values
    keys = emit(graph, aten.add.Tensor, (emit(graph, aten.mul.Tensor, (key64, 1 << 32)), reversed_index))
    picked = [emit(graph, aten.amax.default, (keys, [dim], True))]
    for _ in range(k - 1):
        below = emit(graph, aten.lt.Tensor, (keys, picked[-1]))
        picked.append(emit(graph, aten.amax.default, (emit(graph, aten.where.ScalarOther,
                                                            (below, keys, torch.iinfo(torch.int64).min)), [dim], True)))
    low = emit(graph, aten.bitwise_and.Scalar, (emit(graph, aten.cat.default, (picked, dim)), 0xFFFFFFFF))
    indices = emit(graph, aten.rsub.Scalar, (low, row - 1))
    return [emit(graph, aten.gather.default, (source, dim, indices)), indices]

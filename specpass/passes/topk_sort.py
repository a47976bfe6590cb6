"""Topk as sort: a top-k over a short row runs as a stable sort and a slice, which Inductor lowers
to one Triton kernel fused with what produces the row, instead of ATen's top-k (a radix select
and a bitonic sort of its k results: two kernels of a few µs each, whatever the row's length).

    values, indices = topk(x, k, dim, largest, sorted)
->  values, indices = sort(x, dim, descending=largest, stable=True)[:k along dim]

A tree round makes many such calls on short rows: each draft step's top-k of its children, the
re-rank over topk² candidates, and the draft's top-k over a small vocabulary. On an H100 the
ATen pair cost a tree round 84 µs per round (docs/results.md).

Exact: the first k of the sorted row are the k largest (smallest with largest=False) in order,
which is what topk returns, sorted or not (sorted=False leaves the order unspecified). On equal
values topk promises no index order; the stable sort gives the first index. NaN sorts as the
largest value in both. Inductor's own `decompose_sort_ops` (torch 2.13) makes the same rewrite.

The slice is a view of the sorted rows, not contiguous as topk's outputs are; where one is a graph
output, the pipeline copies it back to topk's layout (`pipeline._keep_dense_outputs`).

When, proven from the fake tensors: CUDA; the row's length along dim a static int of at most 512
(Inductor sorts rows up to 512 in one persistent kernel and falls back to ATen's sort above, which
on a long row is slower than topk's select); k static; neither output written in place (the sort's
output would then be the buffer written). Not a candidate: a topk on another device (no finding).

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


def run(gm: fx.GraphModule, options: Options) -> list[Finding]:
    findings = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _TOPK:
            continue
        x = val(node.args[0])
        if not (isinstance(x, torch.Tensor) and x.device.type == "cuda"):
            continue  # Inductor's Triton sort is the gain: not a candidate
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
        return "an output is written in place: the sort's output would be the buffer written"
    return None


def _rewrite(node: fx.Node, x: torch.Tensor) -> str:
    source, k, dim, largest = _args(node)
    dim = dim % x.dim()
    graph = node.graph
    with graph.inserting_before(node):
        pair = emit(graph, aten.sort.stable, (source,), {"stable": True, "dim": dim, "descending": largest})
        parts = [emit(graph, aten.slice.Tensor, (emit(graph, operator.getitem, (pair, i)), dim, 0, k))
                 for i in (0, 1)]
    for user in list(node.users):
        user.replace_all_uses_with(parts[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)
    return (f"topk({k}) of rows of {static_int(x.shape[dim])} runs as a stable sort and a slice "
            "(one Triton kernel under Inductor instead of ATen's select and sort)")

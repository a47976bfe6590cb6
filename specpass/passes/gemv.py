"""GEMV: a linear of a few rows runs as the library's one-pass kernel
(`torch.ops.specpass.gemv`) instead of cuBLAS.

    y = linear(x, w, b)          # x [..., K] of one row (up to 4 of a small w, or symbolic), w [N, K] contiguous
->  y = gemv(x, w, b)
    y = mm(x, wt) / matmul(x, wt)   # wt [K, N] the transpose of a contiguous [N, K] (x @ w.t())
->  y = gemv(x, wt.t())             # a view: the weight as it is stored

At one row a linear reads its weight once and does two FLOPs a weight element: its time is the
weight's bytes. cuBLAS's kernels for it run well above that floor, the kernel near it; a weight of
a few hundred KB is its launch's latency, shorter for the kernel than for cuBLAS's at 1 to 4 rows
(docs/results.md, the GEMV pass in a step). Its value differs from cuBLAS's by the order of the
fp32 sums, as cuBLAS's own choice of kernel makes it differ between row counts.

Where a CUDA graph replays the step (the backend turns the pass off elsewhere:
compile_backend._REPLAYED_ONLY), and when, proven from the fake tensors: CUDA; x and w (and b) of
one dtype, bf16, fp16 or fp32; w 2-D and contiguous (the kernel reads its rows; a copy each call
would cost more than it saves); b None or [N]; the rows (x's elements over K) not known to be more
than `kernels.gemv.kernel_rows` (1, or 4 for a weight of at most 2 MiB: past one row a large
weight's GEMM is faster). Symbolic rows (a batch compiled once for every size) are the op's to
settle at each call; Dynamo's symbolic sizes are at least 2, so only small weights fire there. N
and K static. Not a candidate: a linear on another device, a matmul whose second operand is not 2-D.

With `gemv_group`, the linears of one input (q, k and v; gate and up, kept apart as transformers'
models keep them) run as one launch over their weights, each read in place:

    q, k, v = linear(x, wq), linear(x, wk), linear(x, wv)
->  q, k, v = split(gemv_group(x, [wq, wk, wv], []), [Nq, Nk, Nv], -1)    # views: columns of one row

Each column's value is the single op's, bit for bit. A group holds up to MAX_GROUP linears of one
dtype, all with biases or none, at static rows, and runs where its first linear was: a sibling
whose weight is computed later, whose user needs it contiguous, or whose value is the graph's
output runs alone, with the reason.

On by default, groups too (measured in a step: docs/results.md, the linears of one input in one
launch).
Exact mode routes linears to its row-invariant kernel instead and turns this off.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher

from specpass.graph import bind, emit, fake_mode, known, static_int, val
from specpass.kernels.gemv import MAX_GROUP, MAX_ROWS, kernel_rows
from specpass.options import Options
from specpass.report import Finding

aten = torch.ops.aten
NAME = "gemv"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MATMULS = (aten.mm.default, aten.matmul.default)


@dataclasses.dataclass
class _Linear:
    node: fx.Node
    x: fx.Node
    weight: fx.Node  # as the node has it: [K, N] where transposed
    bias: fx.Node | None
    transposed: bool
    rows: Any  # an int, or a SymInt where the batch is symbolic
    slot: int  # its finding's place in the pass's findings


def run(gm: fx.GraphModule, options: Options) -> list[Finding]:
    findings: list[Finding | None] = []
    linears = []
    for node in list(gm.graph.nodes):
        operands = _operands(node)
        if operands is None:
            continue
        x, weight, bias, transposed = operands
        rows = static_int(math.prod(val(x).shape[:-1]))
        why = _refusal(val(x), val(weight), val(bias), transposed, rows)
        if why is not None:
            findings.append(Finding(NAME, node.name, False, why))
            continue
        linears.append(_Linear(node, x, weight, bias, transposed, rows, len(findings)))
        findings.append(None)
    for group, alone in _groups(gm.graph, linears, options.gemv_group):
        if len(group) == 1:
            findings[group[0].slot] = _rewrite_one(gm.graph, group[0], alone)
        else:
            _rewrite_group(gm.graph, group, findings)
    return findings


def _rewrite_one(graph: fx.Graph, linear: _Linear, alone: str | None) -> Finding:
    with graph.inserting_before(linear.node):
        w = _stored(graph, linear.weight) if linear.transposed else linear.weight
        out = emit(graph, torch.ops.specpass.gemv.default, (linear.x, w, linear.bias), name="gemv")
    linear.node.replace_all_uses_with(out)
    graph.erase_node(linear.node)
    message = _fired(linear.rows, *val(w).shape, val(w).dtype.itemsize)
    return Finding(NAME, linear.node.name, True, message + (f"; alone: {alone}" if alone else ""))


def _rewrite_group(graph: fx.Graph, group: list[_Linear], findings: list[Finding | None]) -> None:
    """One gemv_group before the first of `group` (their weights and biases are defined before it);
    each linear's value its columns of the group's output."""
    with graph.inserting_before(group[0].node):
        weights = [_stored(graph, g.weight) if g.transposed else g.weight for g in group]
        biases = [g.bias for g in group if g.bias is not None]
        out = emit(graph, torch.ops.specpass.gemv_group.default, (group[0].x, weights, biases), name="gemv_group")
        sizes = [val(w).shape[0] for w in weights]
        parts = emit(graph, aten.split_with_sizes.default, (out, sizes, -1))
        items = [emit(graph, operator.getitem, (parts, i)) for i in range(len(group))]
    names = [g.node.name for g in group]
    n, k = sum(sizes), val(weights[0]).shape[1]
    for g, item in zip(group, items):
        g.node.replace_all_uses_with(item)
        graph.erase_node(g.node)
        findings[g.slot] = Finding(NAME, g.node.name, True, (
            f"runs in specpass.gemv_group with {', '.join(m for m in names if m != g.node.name)} ({g.rows} "
            f"row{'s' * (g.rows != 1)} against {len(group)} weights, {n} x {k} in all, one launch) instead of cuBLAS"))


def _groups(graph: fx.Graph, linears: list[_Linear], grouping: bool) -> Iterator[tuple[list[_Linear], str | None]]:
    """The linears in groups of one input (up to MAX_GROUP each, in graph order), each with why it
    runs alone where it has siblings."""
    by_input: dict[fx.Node, list[_Linear]] = {}
    for linear in linears:
        by_input.setdefault(linear.x, []).append(linear)
    order = {node: i for i, node in enumerate(graph.nodes)}
    for siblings in by_input.values():
        if not grouping or len(siblings) == 1:
            yield from (([s], None) for s in siblings)
            continue
        if not isinstance(siblings[0].rows, int):
            yield from (([s], "a group runs at static rows only (each call of a symbolic batch is settled "
                              "alone)") for s in siblings)
            continue
        kinds: dict[tuple[Any, bool], list[_Linear]] = {}
        for s in siblings:
            kinds.setdefault((val(s.weight).dtype, s.bias is None), []).append(s)
        for kind in kinds.values():
            if len(kind) == 1:
                yield [kind[0]], "its siblings differ in dtype or in having a bias"
                continue
            size = math.ceil(len(kind) / math.ceil(len(kind) / MAX_GROUP))  # 5 siblings: 3 and 2
            for start in range(0, len(kind), size):
                yield from _placed(order, kind[start:start + size])


def _placed(order: dict[fx.Node, int], group: list[_Linear]) -> Iterator[tuple[list[_Linear], str | None]]:
    """`group` runs where its first linear is: those whose weight or bias comes later, or whose users
    cannot take its strided columns, run alone."""
    first = order[group[0].node]
    fit, alone = [], []
    for g in group:
        operands = [n for n in (_unwrapped(g.weight) if g.transposed else g.weight, g.bias) if n is not None]
        if any(order[n] > first for n in operands):
            alone.append((g, f"its weight or bias is computed after {group[0].node.name}, where the group runs"))
        elif (why := _columns_refusal(g)) is not None:
            alone.append((g, why))
        else:
            fit.append(g)
    if len(fit) == 1:
        alone.append((fit.pop(), "no sibling could join its group"))
    if fit:
        yield fit, None
    yield from (([g], why) for g, why in alone)


def _columns_refusal(linear: _Linear) -> str | None:
    """Why the linear's users cannot take its value as columns of a wider row (a strided view);
    None where they all can."""
    value = val(linear.node)
    users = list(linear.node.users)
    if any(u.op != "call_function" for u in users):
        return "its value is the graph's output, which stays dense"
    with fake_mode(linear.node.graph), enable_python_dispatcher():
        columns = value.new_empty(*value.shape[:-1], 2 * value.shape[-1]).narrow(-1, 0, value.shape[-1])
        for u in users:
            args, kwargs = fx.node.map_arg((u.args, u.kwargs), lambda a: columns if a is linear.node else val(a))
            try:
                u.target(*args, **kwargs)
            except Exception:  # any op may refuse the layout: a view across the rows' stride, say
                return f"its user {u.name} needs it contiguous, not a group's columns"
    return None


def _operands(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None, bool] | None:
    """(x, weight, bias, transposed) of a linear on CUDA, the weight as the node has it ([K, N] where
    transposed); None where the node is not a candidate."""
    if node.op != "call_function":
        return None
    if node.target is aten.linear.default:
        a = bind(node)
        x, weight, bias, transposed = a["input"], a["weight"], a.get("bias"), False
    elif node.target in _MATMULS:
        x, weight = node.args[:2]
        bias, transposed = None, True
        if not (isinstance(val(weight), torch.Tensor) and val(weight).dim() == 2):
            return None  # a batched matmul: not a linear
    else:
        return None
    xv = val(x)
    if not (isinstance(xv, torch.Tensor) and xv.device.type == "cuda"):
        return None  # the kernel is CUDA's
    return x, weight, bias, transposed


def _fired(rows: Any, n: int, k: int, itemsize: int) -> str:
    if isinstance(rows, int):
        return (f"runs as specpass.gemv ({rows} row{'s' * (rows != 1)} against a {n} x {k} weight, one pass over "
                "it) instead of cuBLAS")
    return (f"runs as specpass.gemv ({rows} rows, symbolic, against a {n} x {k} weight): one pass over it at up to "
            f"{kernel_rows(n, k, itemsize)} rows a call, cuBLAS above")


def _unwrapped(wt: fx.Node) -> fx.Node:
    """w where `wt` is `w.t()`, else wt."""
    return wt.args[0] if wt.op == "call_function" and wt.target is aten.t.default else wt


def _stored(graph: fx.Graph, wt: fx.Node) -> fx.Node:
    """The [N, K] weight that `wt` ([K, N]) is the transpose of: w itself where wt is `w.t()`."""
    w = _unwrapped(wt)
    return w if w is not wt else emit(graph, aten.t.default, (wt,))


def _refusal(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool, rows: Any) -> str | None:
    dtypes = {t.dtype for t in (x, w, b) if t is not None}
    if len(dtypes) != 1 or x.dtype not in _DTYPES:
        return (f"{', '.join(str(d) for d in sorted(dtypes, key=str))}: the kernel takes one dtype for x, the weight "
                "and the bias, bf16, fp16 or fp32")
    if w.dim() != 2 or x.dim() == 0:
        return f"x is {list(x.shape)} and the weight {list(w.shape)}: not x [..., K] against a 2-D weight"
    stored = w.t() if transposed else w
    n, k = (static_int(s) for s in stored.shape)
    if not (isinstance(n, int) and isinstance(k, int)):
        return f"the weight is [{n}, {k}], a symbolic size: the kernel's configuration is chosen for static ones"
    if not stored.is_contiguous():
        what = "x @ w.t() of a contiguous [N, K] w" if transposed else "a contiguous [N, K] weight"
        return (f"the weight's strides are {list(w.stride())}, not {what}: the kernel reads the weight's rows, and "
                "a copy each call would cost more than the kernel saves")
    if b is not None and list(b.shape) != [n]:
        return f"the bias is {list(b.shape)}, not [{n}]: the kernel adds one value per output column"
    most = kernel_rows(n, k, w.dtype.itemsize)
    if known(rows > most):
        return (f"{rows} rows > {most} against a {n} x {k} weight: the kernel takes up to {MAX_ROWS} rows "
                f"of a small weight and one of a larger one (kernels.gemv.kernel_rows); a GEMM is faster past that")
    return None

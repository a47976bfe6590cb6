"""GEMV: a linear of a few rows runs as the library's one-pass kernel
(`torch.ops.specpass.gemv`) instead of cuBLAS.

    y = linear(x, w, b)          # x [..., K] of one row (up to 4 of a small w, or symbolic), w [N, K] contiguous
->  y = gemv(x, w, b)
    y = mm(x, wt) / matmul(x, wt)   # wt [K, N] the transpose of a contiguous [N, K] (x @ w.t())
->  y = gemv(x, wt.t())             # a view: the weight as it is stored

At one row a linear reads its weight once and does two FLOPs a weight element: its time is the
weight's bytes. cuBLAS's kernels for it run at 1.01-1.68x that floor on an H200 at Llama-3-8B
shape (1.13x over a decode step's linears), the kernel at 0.95-1.32x (1.06x); a weight of a few
hundred KB is its launch's latency, where the kernel takes 1.5-1.8 us at 1 to 4 rows and cuBLAS
2.1-2.5 us (docs/results.md, issue 49's seventh measurement). Its value differs from cuBLAS's by the
order of the fp32 sums, as cuBLAS's own choice of kernel makes it differ between row counts.

When, proven from the fake tensors: CUDA; x and w (and b) of one dtype, bf16, fp16 or fp32; w 2-D
and contiguous (the kernel reads its rows; a copy each call would cost more than it saves); b
None or [N]; the rows (x's elements over K) not known to be more than `kernels.gemv.kernel_rows`
(1, or 4 for a weight of at most 2 MiB: past one row a large weight's GEMM is faster). Symbolic
rows (a batch compiled once for every size) are the op's to settle at each call; Dynamo's symbolic
sizes are at least 2, so only small weights fire there. N and K static. Not a candidate: a linear
on another device, a matmul whose second operand is not 2-D.

On by default. Exact mode routes linears to its row-invariant kernel instead and turns this off.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from specpass.graph import bind, emit, known, static_int, val
from specpass.kernels.gemv import MAX_ROWS, kernel_rows
from specpass.options import Options
from specpass.report import Finding

aten = torch.ops.aten
NAME = "gemv"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MATMULS = (aten.mm.default, aten.matmul.default)


def run(gm: fx.GraphModule, options: Options) -> list[Finding]:
    findings = []
    for node in list(gm.graph.nodes):
        operands = _operands(node)
        if operands is None:
            continue
        x, weight, bias, transposed = operands
        rows = static_int(math.prod(val(x).shape[:-1]))  # a SymInt where the batch is symbolic
        why = _refusal(val(x), val(weight), val(bias), transposed, rows)
        if why is not None:
            findings.append(Finding(NAME, node.name, False, why))
            continue
        graph = node.graph
        with graph.inserting_before(node):
            w = _stored(graph, weight) if transposed else weight
            out = emit(graph, torch.ops.specpass.gemv.default, (x, w, bias), name="gemv")
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        findings.append(Finding(NAME, node.name, True, _fired(rows, *val(w).shape, val(w).dtype.itemsize)))
    return findings


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


def _stored(graph: fx.Graph, wt: fx.Node) -> fx.Node:
    """The [N, K] weight that `wt` ([K, N]) is the transpose of: w itself where wt is `w.t()`."""
    if wt.op == "call_function" and wt.target is aten.t.default:
        return wt.args[0]
    return emit(graph, aten.t.default, (wt,))


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

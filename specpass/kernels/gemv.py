"""A linear of a few rows as one pass over its weight: `torch.ops.specpass.gemv` (passes/gemv.py
routes to it). On CUDA kernels/triton_gemv.py, imported on first use; elsewhere `F.linear`.

    y = gemv(x, w, b)    # x [..., K], w [N, K], b [N] or None -> [..., N], x's dtype

The same value as `F.linear` up to the order of its fp32 sums: products of x's dtype summed in
fp32, the bias added in fp32, rounded once. Which calls the kernel takes (`kernel_rows`), from
`python -m benchmarks.linears` (docs/results.md, the GEMV pass in a step):

- one row, any weight: the kernel reads a weight nearer its bytes' floor than cuBLAS's kernels do;
- up to MAX_ROWS rows of a weight of at most SMALL_WEIGHT_BYTES: a call of such a weight is its
  launch's latency, shorter for the kernel than for cuBLAS's;
- anything else `F.linear`: past one row of a larger weight, cuBLAS's GEMM is faster.

A graph whose rows are symbolic (a batch compiled once for every size) gets each call settled at
its own size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

MAX_ROWS = 4  # rows the kernel takes at most: its programs hold every row's sums at once
MAX_GROUP = 4  # weights one launch of gemv_group reads (q, k and v; gate and up): triton_gemv.WEIGHT_SLOTS
SMALL_WEIGHT_BYTES = 2 << 20  # weights up to this take the kernel at up to MAX_ROWS rows, larger ones at one


def kernel_rows(n: int, k: int, itemsize: int) -> int:
    """The most rows a call of an [n, k] weight runs through the kernel (more: F.linear)."""
    return MAX_ROWS if n * k * itemsize <= SMALL_WEIGHT_BYTES else 1


def _linears(x: Tensor, weights: list[Tensor], biases: list[Tensor]) -> Tensor:
    """cuBLAS's linears of x, side by side."""
    outs = [F.linear(x, w, b) for w, b in zip(weights, biases or [None] * len(weights))]
    return outs[0] if len(outs) == 1 else torch.cat(outs, -1)


def _on_cuda(x: Tensor, weights: list[Tensor], biases: list[Tensor]) -> Tensor:
    """The kernel where a call's rows are within every weight's `kernel_rows`, else cuBLAS."""
    if x.numel() > min(kernel_rows(*w.shape, w.element_size()) for w in weights) * x.shape[-1]:
        return _linears(x, weights, biases)
    from specpass.kernels import triton_gemv

    return triton_gemv.gemv(x, weights, biases or None)


@torch.library.custom_op("specpass::gemv", mutates_args=())
def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return F.linear(x, weight, bias)


@gemv.register_kernel("cuda")
def _(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return _on_cuda(x, [weight], [] if bias is None else [bias])


@gemv.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _checked(weights: list[Tensor], biases: list[Tensor]) -> None:
    if not 1 <= len(weights) <= MAX_GROUP or len(biases) not in (0, len(weights)):
        raise ValueError(f"specpass.gemv_group takes 1 to {MAX_GROUP} weights and a bias for each or none; got "
                         f"{len(weights)} weights and {len(biases)} biases")


@torch.library.custom_op("specpass::gemv_group", mutates_args=())
def gemv_group(x: Tensor, weights: list[Tensor], biases: list[Tensor]) -> Tensor:
    """The linears of one input against 2 to 4 weights (q, k and v; gate and up), their outputs side
    by side: [..., N_0 + N_1 + ...]; `biases` one per weight, or none ([]). On CUDA one launch reads
    every weight, with no copy of them."""
    _checked(weights, biases)
    return _linears(x, weights, biases)


@gemv_group.register_kernel("cuda")
def _(x: Tensor, weights: list[Tensor], biases: list[Tensor]) -> Tensor:
    _checked(weights, biases)
    return _on_cuda(x, weights, biases)


@gemv_group.register_fake
def _(x: Tensor, weights: list[Tensor], biases: list[Tensor]) -> Tensor:
    return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))

"""A linear of a few rows as one pass over its weight: `torch.ops.specpass.gemv` (passes/gemv.py
routes to it). On CUDA kernels/triton_gemv.py, imported on first use; elsewhere `F.linear`.

    y = gemv(x, w, b)    # x [..., K], w [N, K], b [N] or None -> [..., N], x's dtype

The same value as `F.linear` up to the order of its fp32 sums: products of x's dtype summed in
fp32, the bias added in fp32, rounded once. The kernel reads the weight once per row (the rows'
programs side by side, so the second row on reads it from L2): a call of more than MAX_ROWS rows
runs `F.linear` instead, whose GEMM reads it once for all. A graph whose rows are symbolic (a
batch compiled once for every size) gets each at its own size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

MAX_ROWS = 4


@torch.library.custom_op("specpass::gemv", mutates_args=())
def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return F.linear(x, weight, bias)


@gemv.register_kernel("cuda")
def _(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    if x.numel() > MAX_ROWS * x.shape[-1]:
        return F.linear(x, weight, bias)
    from specpass.kernels import triton_gemv

    return triton_gemv.gemv(x, weight, bias)


@gemv.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])

"""A linear of a few rows as one pass over its weight: `torch.ops.specpass.gemv` (passes/gemv.py
routes to it). On CUDA kernels/triton_gemv.py, imported on first use; elsewhere `F.linear`.

    y = gemv(x, w, b)    # x [..., K], w [N, K], b [N] or None -> [..., N], x's dtype

The same value as `F.linear` up to the order of its fp32 sums: products of x's dtype summed in
fp32, the bias added in fp32, rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


@torch.library.custom_op("specpass::gemv", mutates_args=())
def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return F.linear(x, weight, bias)


@gemv.register_kernel("cuda")
def _(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    from specpass.kernels import triton_gemv

    return triton_gemv.gemv(x, weight, bias)


@gemv.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])

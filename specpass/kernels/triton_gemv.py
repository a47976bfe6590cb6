"""The CUDA implementation of `specpass::gemv` (kernels/gemv.py): a linear of a few rows, one
pass over the weight.

One program per (block of BN weight rows, input row), the input row fastest, so that the programs
of a block run side by side and its weight comes from DRAM once. A program reads its BN rows of
the weight in chunks of BK along K into a [BN, BK] fp32 accumulator (one product per element per
chunk, no shuffle in the loop) and sums it once at the end; the bias is added in fp32 and the
output rounded once, as cuBLAS's epilogue does. Every weight byte is read by a coalesced load of
BK elements a row: with 4 rows a program there are N / 4 programs, enough to keep every SM's
loads in flight at any decode size.

The configuration is one for every shape: 4 rows a program, chunks of 1,024 (the largest power of
two up to 1,024 that divides K, at least 128; else 1,024 and a masked tail), 4 warps, 3 stages.
A probe's sweep of 33-83 configurations a Llama-3-8B linear (rows a program 4-32, chunks 256-1,024,
4 or 8 warps, K split 1-16 ways; H200, one row) found it the best of them all but at lm_head, within
1% there: docs/results.md, the sixth measurement of issue 49. The kernel launches on the current
CUDA device, as every op of the library's does.

Triton is imported here only, on the first call on a CUDA tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BN = 4  # weight rows a program
MAX_BK = 1024  # K per step, at most
MIN_EVEN_BK = 128  # a smaller power of two dividing K reads too few bytes a step: mask a tail instead
NUM_WARPS, NUM_STAGES = 4, 3


@triton.jit
def _gemv(X, W, B, Out, M, N, K, sx_m, so_m, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr,
          EVEN_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    row = pid % M
    rn = (pid // M) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    x_row = X + row.to(tl.int64) * sx_m
    w_rows = W + rn.to(tl.int64)[:, None] * K
    acc = tl.zeros([BN, BK], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        if EVEN_N and EVEN_K:
            w = tl.load(w_rows + kk[None, :])
            x = tl.load(x_row + kk)
        else:
            w = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
            x = tl.load(x_row + kk, mask=kk < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(Out + row.to(tl.int64) * so_m + rn, y.to(Out.dtype.element_ty), mask=rn < N)


def chunk(k: int) -> int:
    """BK for a reduction of length k: the largest power of two up to MAX_BK dividing k if at least
    MIN_EVEN_BK (no mask), else MAX_BK or k's next power of two, with a masked tail."""
    even = k & -k
    if even >= MIN_EVEN_BK:
        return min(even, MAX_BK)
    return min(MAX_BK, triton.next_power_of_2(k))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight.contiguous()  # a no-op for the weights the pass routes here (it requires it)
    m = rows.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m and n:
        bk = chunk(k)
        grid = (triton.cdiv(n, BN) * m,)
        _gemv[grid](rows, weight, weight if bias is None else bias, out, m, n, k, rows.stride(0), out.stride(0),
                    HAS_BIAS=bias is not None, EVEN_N=n % BN == 0, EVEN_K=k % bk == 0, BN=BN, BK=bk,
                    num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out.reshape(*x.shape[:-1], n)

"""The CUDA implementation of `specpass::gemv` (kernels/gemv.py): a linear of a few rows, one
pass over the weight.

One program per block of BN weight rows, for every input row at once: it reads its BN rows of the
weight in chunks of BK along K, and each chunk once, into a [BM, BN, BK] fp32 accumulator (BM the
rows rounded up to a power of two; one product per element per chunk, no shuffle in the loop),
summed once at the end; the bias is added in fp32 and the output rounded once, as cuBLAS's
epilogue does. Every weight byte is read by a coalesced load of BK elements a row: with 4 rows a
program there are N / 4 programs, enough to keep every SM's loads in flight at any decode size.

The configuration is one for every shape: 4 weight rows a program, chunks of 1,024 / BM (the
largest power of two up to that dividing K, at least 128; else that and a masked tail: the
accumulator's registers the same at every BM), 4 warps, 3 stages. A probe's sweep of
configurations at each Llama-3-8B linear at one row (rows a program 4-32, chunks 256-1,024, 4 or 8
warps, K split 1-16 ways) found it the best of them all but at lm_head, and near the best there
(docs/results.md, the 8B linears timed as a step runs them). Past one row it is slower than cuBLAS
for a large weight (docs/results.md, the GEMV pass in a step): the op sends those calls to
F.linear. The kernel launches on the current CUDA device, as every op of the library's does.

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
WEIGHT_SLOTS = 4  # weights one launch reads: the kernel's W0..W3 (gemv.MAX_GROUP)


@triton.jit(do_not_specialize=["N0", "N1", "N2", "N3"])
def _gemv(X, W0, W1, W2, W3, B0, B1, B2, B3, Out, M, K, sx_m, so_m, N0, N1, N2, N3, G: tl.constexpr,
          HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr):
    # The G weights laid end to end along N, W0's blocks first: this program's weight, its block in
    # it and the block's first output column.
    pid = tl.program_id(0)
    W = W0
    B = B0
    N = N0
    col = pid * 0
    blk = pid
    if G > 1:
        start = tl.cdiv(N0, BN)
        if pid >= start:
            W = W1
            B = B1
            N = N1
            col = N0 + pid * 0
            blk = pid - start
    if G > 2:
        start = tl.cdiv(N0, BN) + tl.cdiv(N1, BN)
        if pid >= start:
            W = W2
            B = B2
            N = N2
            col = N0 + N1 + pid * 0
            blk = pid - start
    if G > 3:
        start = tl.cdiv(N0, BN) + tl.cdiv(N1, BN) + tl.cdiv(N2, BN)
        if pid >= start:
            W = W3
            B = B3
            N = N3
            col = N0 + N1 + N2 + pid * 0
            blk = pid - start
    rm = tl.arange(0, BM)
    rn = blk * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    x_rows = X + rm.to(tl.int64)[:, None] * sx_m
    w_rows = W + rn.to(tl.int64)[:, None] * K
    acc = tl.zeros([BM, BN, BK], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        if EVEN_N and EVEN_K:
            w = tl.load(w_rows + kk[None, :])
        else:
            w = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        if BM == 1 and EVEN_K:
            x = tl.load(x_rows + kk[None, :])
        else:
            x = tl.load(x_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + rm.to(tl.int64)[:, None] * so_m + (col + rn)[None, :], y.to(Out.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def chunk(k: int, bm: int = 1) -> int:
    """BK for a reduction of length k over bm rows at once (the accumulator holds bm x BN x BK fp32,
    the same registers at every bm): the largest power of two up to MAX_BK / bm dividing k if at
    least MIN_EVEN_BK (no mask), else that bound or k's next power of two, with a masked tail."""
    most, even = MAX_BK // bm, k & -k
    if even >= MIN_EVEN_BK:
        return min(even, most)
    return min(most, triton.next_power_of_2(k))


def gemv(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor] | None) -> torch.Tensor:
    """x [..., K] against weights [N_i, K] (at most WEIGHT_SLOTS) -> [..., sum N_i]: each weight's
    linear in its columns, in one launch."""
    if not 1 <= len(weights) <= WEIGHT_SLOTS:
        raise ValueError(f"the GEMV kernel reads 1 to {WEIGHT_SLOTS} weights a launch, got {len(weights)}")
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weights = [w.contiguous() for w in weights]  # no-ops for the weights the pass routes here (it requires it)
    ns = [w.shape[0] for w in weights]
    m = rows.shape[0]
    out = torch.empty(m, sum(ns), device=x.device, dtype=x.dtype)
    if m and sum(ns):
        bm = triton.next_power_of_2(m)
        bk = chunk(k, bm)
        pad = WEIGHT_SLOTS - len(weights)
        w_args = weights + weights[:1] * pad
        b_args = (biases if biases is not None else weights) + weights[:1] * pad
        _gemv[(sum(triton.cdiv(n, BN) for n in ns),)](
            rows, *w_args, *b_args, out, m, k, rows.stride(0), out.stride(0), *ns, *[0] * pad, G=len(weights),
            HAS_BIAS=biases is not None, EVEN_N=all(n % BN == 0 for n in ns), EVEN_K=k % bk == 0, BM=bm, BN=BN,
            BK=bk, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out.reshape(*x.shape[:-1], sum(ns))

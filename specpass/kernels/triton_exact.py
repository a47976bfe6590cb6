"""Exact mode's row-invariant kernels in Triton: the CUDA forms of `torch.ops.specpass.exact_*`
(kernels/exact.py), imported on their first call (Triton is not needed on CPU).

Every kernel has one configuration, fixed by the sizes a row has (hidden size, head size) and never
by the number of rows: the rows only change the grid. A row is computed by the same instructions in
the same order whatever runs beside it:

- `linear`: one program per tile of 16 rows x 64 columns, the reduction in steps of 64 along K
  with `tl.dot` (fp32 accumulator), the bias added last; no split of K.
- `rows`: one program per row, the row read in blocks of a width fixed by its length, summed into
  a vector accumulator and reduced once (`tl.sum`): sums, means, RMS and layer norms, softmax, log-
  softmax, log-sum-exp.
- `attention`: one program per (request, query head, tile of 16 query rows), the slots in blocks
  of 64 from slot 0 with an online softmax. A block whose slots the mask hides adds exactly nothing
  (its scale is 1, its probabilities 0), so a row that sees the same keys at the same slots (a
  decode step, a chain's, a block's or a parallel round's verify, a prefill over the cache) gets
  the same bits, however many slots follow. A tree node's path sits at other slots than its
  positions: trees are exact on CPU only (`checks.check_exact`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BM, BN, BK = 16, 64, 64  # the linear's tile: fixed, whatever M
BS = 64  # attention: slots per block


@triton.jit
def _linear(X, W, B, Out, M, N, K, sx_m, sx_k, sw_n, sw_k, so_m, so_n,
            HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(X + rm[:, None] * sx_m + kk[None, :] * sx_k, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(W + rn[None, :] * sw_n + kk[:, None] * sw_k, mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + rm[:, None] * so_m + rn[None, :] * so_n, acc.to(Out.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    w = weight.to(x.dtype)
    M, K = rows.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
        _linear[grid](rows, w, bias if bias is not None else out, out, M, N, K, rows.stride(0), rows.stride(1),
                      w.stride(0), w.stride(1), out.stride(0), out.stride(1), HAS_BIAS=bias is not None,
                      IEEE=x.dtype == torch.float32, BM=BM, BN=BN, BK=BK, num_warps=4, num_stages=3)
    return out.reshape(*x.shape[:-1], N)


SUM, MEAN, RMS_NORM, LAYER_NORM, SOFTMAX, LOG_SOFTMAX, LOGSUMEXP = range(7)


@triton.jit
def _rows(X, Wt, Bs, Out, n, eps, MODE: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * n
    offs = tl.arange(0, BLOCK)
    top = 0.0
    if MODE >= 4:  # softmax, log-softmax, log-sum-exp: the row's maximum first (0 where infinite)
        mx = tl.full([BLOCK], float("-inf"), tl.float32)
        for s in range(0, n, BLOCK):
            mx = tl.maximum(mx, tl.load(x_row + s + offs, mask=s + offs < n, other=float("-inf")).to(tl.float32))
        top = tl.max(mx, 0)
        top = tl.where((top == float("inf")) | (top == float("-inf")), 0.0, top)
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(0, n, BLOCK):
        v = tl.load(x_row + s + offs, mask=s + offs < n, other=0.0).to(tl.float32)
        if MODE == 2:
            v = v * v
        if MODE >= 4:
            v = tl.where(s + offs < n, tl.exp(v - top), 0.0)
        acc += v
    total = tl.sum(acc, 0)
    if MODE == 0:
        tl.store(Out + row, total.to(Out.dtype.element_ty))
    if MODE == 1:
        tl.store(Out + row, (total / n).to(Out.dtype.element_ty))
    if MODE == 6:
        tl.store(Out + row, (tl.log(total) + top).to(Out.dtype.element_ty))
    if MODE == 3:  # layer norm: the centred squares, a second sum
        mean = total / n
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(0, n, BLOCK):
            v = tl.load(x_row + s + offs, mask=s + offs < n, other=0.0).to(tl.float32)
            d = tl.where(s + offs < n, v - mean, 0.0)
            acc += d * d
        scale = 1.0 / tl.sqrt(tl.sum(acc, 0) / n + eps)
    if MODE == 2:
        scale = 1.0 / tl.sqrt(total / n + eps)
    if MODE == 2 or MODE == 3 or MODE == 4 or MODE == 5:
        for s in range(0, n, BLOCK):
            inside = s + offs < n
            v = tl.load(x_row + s + offs, mask=inside, other=0.0).to(tl.float32)
            if MODE == 2:
                y = v * scale
            if MODE == 3:
                y = (v - mean) * scale
            if MODE == 4:
                y = tl.exp(v - top) / total
            if MODE == 5:
                y = v - top - tl.log(total)
            if HAS_W:
                y = y * tl.load(Wt + s + offs, mask=inside, other=0.0).to(tl.float32)
            if HAS_B:
                y = y + tl.load(Bs + s + offs, mask=inside, other=0.0).to(tl.float32)
            tl.store(Out + row * n + s + offs, y.to(Out.dtype.element_ty), mask=inside)


def rows(x: torch.Tensor, n: int, mode: int, out_dtype: torch.dtype, weight: torch.Tensor | None = None,
         bias: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """x's rows of n (contiguous after the call) reduced or normalised -> [R] or [R, n] in out_dtype."""
    flat = x.contiguous().view(-1, n)
    R = flat.shape[0]
    out = torch.empty((R,) if mode in (SUM, MEAN, LOGSUMEXP) else (R, n), dtype=out_dtype, device=x.device)
    if R:
        block = min(triton.next_power_of_2(max(n, 16)), 4096)  # fixed by n
        _rows[(R,)](flat, weight if weight is not None else flat, bias if bias is not None else flat, out, n,
                    float(eps), MODE=mode, HAS_W=weight is not None, HAS_B=bias is not None, BLOCK=block,
                    num_warps=4 if block <= 1024 else 8)
    return out


@triton.jit
def _attention(Q, K, V, Mask, Out, T, S, HQ, G, scale,
               sq_b, sq_h, sq_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_h, sm_t, sm_s, so_b, so_h, so_t,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr,
               D: tl.constexpr, DV: tl.constexpr, d_real, dv_real):
    bh = tl.program_id(0)
    b = bh // HQ
    h = bh % HQ
    hk = h // G
    t = tl.program_id(1) * BM + tl.arange(0, BM)
    live = t < T
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    q = tl.load(Q + b * sq_b + h * sq_h + t[:, None] * sq_t + offs_d[None, :],
                mask=live[:, None] & (offs_d[None, :] < d_real), other=0.0)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DV], tl.float32)
    for s0 in range(0, S, BS):
        n = s0 + tl.arange(0, BS)
        inside = n < S
        k = tl.load(K + b * sk_b + hk * sk_h + n[:, None] * sk_s + offs_d[None, :],
                    mask=inside[:, None] & (offs_d[None, :] < d_real), other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        seen = live[:, None] & inside[None, :]
        if CAUSAL:
            seen = seen & (n[None, :] <= t[:, None])
        if MASK == 1:  # bool
            seen = seen & (tl.load(Mask + b * sm_b + h * sm_h + t[:, None] * sm_t + n[None, :] * sm_s,
                                   mask=seen, other=0) != 0)
        if MASK == 2:  # additive
            s = s + tl.load(Mask + b * sm_b + h * sm_h + t[:, None] * sm_t + n[None, :] * sm_s,
                            mask=seen, other=0.0).to(tl.float32)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no slot seen yet: stays 0
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * sv_b + hk * sv_h + n[:, None] * sv_s + offs_dv[None, :],
                    mask=inside[:, None] & (offs_dv[None, :] < dv_real), other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + b * so_b + h * so_h + t[:, None] * so_t + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=live[:, None] & (offs_dv[None, :] < dv_real))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
              scale: float | None) -> torch.Tensor:
    """q [..., hq, T, d], k [..., hk, S, d], v [..., hk, S, dv], hk dividing hq (GQA by index)."""
    lead = q.shape[:-3]
    hq, T, d = q.shape[-3:]
    hk, S, dv = v.shape[-3:]

    def flat(t: torch.Tensor, heads: int, rows: int, width: int) -> torch.Tensor:  # [N, heads, rows, width], unit stride
        t = t.expand(*lead, heads, rows, width).reshape(-1, heads, rows, width)
        return t if t.stride(-1) == 1 else t.contiguous()

    q4, k4, v4 = flat(q, hq, T, d), flat(k, hk, S, d), flat(v, hk, S, dv)
    out = torch.empty(q4.shape[0], hq, T, dv, dtype=q.dtype, device=q.device)
    kind, m4, strides = 0, out, (0, 0, 0, 0)
    if mask is not None:
        kind = 1 if mask.dtype == torch.bool else 2
        m4 = mask.expand(*lead, hq, T, S).reshape(-1, hq, T, S)
        m4 = m4.view(torch.uint8) if kind == 1 else m4
        strides = m4.stride()
    scale = 1 / math.sqrt(d) if scale is None else scale
    D, DV = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
    grid = (q4.shape[0] * hq, triton.cdiv(T, BM))
    if T:
        _attention[grid](q4, k4, v4, m4, out, T, S, hq, hq // hk, scale, *q4.stride()[:3], *k4.stride()[:3],
                         *v4.stride()[:3], *strides, *out.stride()[:3], MASK=kind, CAUSAL=is_causal,
                         IEEE=q.dtype == torch.float32, BM=BM, BS=BS, D=D, DV=DV, d_real=d, dv_real=dv,
                         num_warps=4, num_stages=2)
    return out.reshape(*lead, hq, T, dv)

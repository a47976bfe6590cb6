"""Exact mode's row-invariant kernels in Triton: the CUDA forms of `torch.ops.specpass.exact_*`
(kernels/exact.py), imported on their first call (Triton is not needed on CPU).

Every kernel's reduction order is fixed by the sizes a row has (hidden size, head size) and never
by the number of rows: the rows change the grid and, for the linear, how many rows share a tile. A
row's sums take the same steps in the same order whatever runs beside it:

- `linear` (and batched `matmul`): one program per tile of 16 to 64 rows (`row_tile`) x 64 columns
  x one split of K, the reduction in steps of 64 with `tl.dot` (fp32 accumulator). K's split is
  fixed by the weight's shape alone (`k_split`), so that a few rows still fill the GPU; the splits'
  fp32 partials are then added in split order, the bias last.
- `rows`: one program per row, the row read in blocks of a width fixed by its length, summed into
  a vector accumulator and reduced once (`tl.sum`): sums, means, RMS and layer norms, softmax, log-
  softmax, log-sum-exp.
- `attention`: one program per (request, key head, query token), its rows the query heads that
  share the key head; the keys the token sees, in slot order, in blocks of 64 with an online
  softmax. Where the hidden slots sit changes nothing: a tree node, whose path sits among hidden
  siblings, adds its keys as the chain's or the decode step's row of the same token does. A mask's
  rows are listed once (`seen_slots`, one kernel) before the attention reads them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BN, BK = 64, 64  # the linear's tile: its columns and its reduction step, fixed
BM = 16  # attention: query heads per tile
BS = 64  # attention: slots per block


def row_tile(m: int) -> int:
    """The linear's rows per tile: 16 for a few rows, up to 64 so that a batch reads each weight
    tile once. It changes no row's bits (tested at 1 to 200 rows): a row's sum runs over the same
    splits and steps of K in the same order, whatever tile it sits in."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


@triton.jit
def _linear(X, W, B, Out, M, N, K, KC, SPLITS, sx_b, sx_m, sx_k, sw_b, sw_n, sw_k, so_b, so_m, so_n,
            SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    batch = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    X += batch.to(tl.int64) * sx_b
    W += batch.to(tl.int64) * sw_b
    k_begin = split * KC
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, KC, BK):  # the last split's steps past K add zeros
        kk = k_begin + k0 + rk
        a = tl.load(X + rm[:, None] * sx_m + kk[None, :] * sx_k, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(W + rn[None, :] * sw_n + kk[:, None] * sw_k, mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    inside = (rm[:, None] < M) & (rn[None, :] < N)
    out = Out + tl.program_id(2).to(tl.int64) * so_b + rm[:, None] * so_m + rn[None, :] * so_n
    if SPLIT:  # an fp32 partial; _add_splits adds them up
        tl.store(out, acc, mask=inside)
    else:
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(Out.dtype.element_ty), mask=inside)


@triton.jit
def _add_splits(P, B, Out, MN, N, SPLITS, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < MN
    P += tl.program_id(1).to(tl.int64) * SPLITS * MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(0, SPLITS):  # in split order, whatever the rows
        acc += tl.load(P + s * MN + offs, mask=inside, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + offs % N, mask=inside, other=0.0).to(tl.float32)
    tl.store(Out + tl.program_id(1).to(tl.int64) * MN + offs, acc.to(Out.dtype.element_ty), mask=inside)


def k_split(n: int, k: int) -> int:
    """The length of one split of K for an [n, k] weight: about 1024 programs at 16 rows or fewer,
    each split at least 256 of K and a multiple of BK. A function of the weight's shape, never of
    the rows."""
    splits = max(1, min(triton.cdiv(1024, triton.cdiv(n, BN)), k // 256))
    return triton.cdiv(triton.cdiv(k, splits), BK) * BK


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [Bt, M, K] @ w [Bt, N, K]^T (+ bias [N]) -> [Bt, M, N] in x's dtype; a batch stride may be 0."""
    Bt, M, K = x.shape
    N = w.shape[1]
    out = torch.empty(Bt, M, N, dtype=x.dtype, device=x.device)
    if Bt and M and N:
        kc = k_split(N, K)
        splits = triton.cdiv(K, kc)
        partial = torch.empty(Bt * splits, M, N, dtype=torch.float32, device=x.device) if splits > 1 else out
        bm = row_tile(M)
        _linear[(triton.cdiv(M, bm), triton.cdiv(N, BN), Bt * splits)](
            x, w, bias if bias is not None else out, partial, M, N, K, kc, splits, *x.stride(), *w.stride(),
            *partial.stride(), SPLIT=splits > 1, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
            BM=bm, BN=BN, BK=BK, num_warps=4, num_stages=3)
        if splits > 1:
            _add_splits[(triton.cdiv(M * N, 1024), Bt)](partial, bias if bias is not None else out, out, M * N, N,
                                                        splits, HAS_BIAS=bias is not None, BLOCK=1024, num_warps=4)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(1, -1, x.shape[-1])
    return matmul(rows, weight.to(x.dtype)[None], bias).reshape(*x.shape[:-1], weight.shape[0])


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


HIDDEN_BIAS = -1e3  # an additive mask's value below it hides its slot: its exp underflows to 0 in fp32


@triton.jit
def _seen_slots(Mask, Slot, Seen, S, D1, D2, sm_0, sm_1, sm_2, sm_s, ADDITIVE: tl.constexpr, HIDDEN: tl.constexpr,
                BLOCK: tl.constexpr):
    # one program per row of the mask [D0, D1, D2, S]: the slots it sees, in slot order, then its count
    row = tl.program_id(0)
    mask_row = Mask + (row // D2 // D1).to(tl.int64) * sm_0 + (row // D2 % D1) * sm_1 + (row % D2) * sm_2
    slot_row = Slot + row.to(tl.int64) * S
    count = 0
    for s0 in range(0, S, BLOCK):
        offs = s0 + tl.arange(0, BLOCK)
        inside = offs < S
        m = tl.load(mask_row + offs * sm_s, mask=inside, other=0)
        seen = inside & ((m.to(tl.float32) > HIDDEN) if ADDITIVE else (m != 0))
        order = tl.cumsum(seen.to(tl.int32), 0)
        tl.store(slot_row + count + order - 1, offs.to(tl.int32), mask=seen)
        count += tl.sum(seen.to(tl.int32), 0)
    tl.store(Seen + row, count)


def seen_slots(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mask [D0, D1, D2, S] (bool: True = seen; or additive; a dim of stride 0 broadcasts) -> (slots
    [D0', D1', D2', S] int32: each row's seen slots in slot order, then anything; count [D0', D1', D2']
    int32), a broadcast dim of size 1: one kernel, a program per distinct row."""
    S = mask.shape[-1]
    rows = [1 if stride == 0 else size for size, stride in zip(mask.shape[:-1], mask.stride()[:-1])]
    slots = torch.empty(*rows, S, dtype=torch.int32, device=mask.device)
    count = torch.empty(rows, dtype=torch.int32, device=mask.device)
    if math.prod(rows):
        _seen_slots[(math.prod(rows),)](mask, slots, count, S, rows[1], rows[2], *mask.stride(),
                                        ADDITIVE=mask.dtype != torch.bool, HIDDEN=HIDDEN_BIAS,
                                        BLOCK=min(1024, max(16, triton.next_power_of_2(S))), num_warps=4)
    return slots, count


@triton.jit
def _attention(Q, K, V, Mask, Slot, Seen, Out, T, S, HK, G, HT, scale,
               sq_b, sq_h, sq_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_h, sm_t, sm_s,
               sl_b, sl_h, sl_t, sn_b, sn_h, sn_t, so_b, so_h, so_t,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr,
               D: tl.constexpr, DV: tl.constexpr, d_real, dv_real):
    # one program per (request, key head, query token, tile of HT query heads): a row of the tile is
    # one query head; the keys it sees run in blocks of BS of its seen slots in slot order
    pid = tl.program_id(0)
    t = pid % T
    b = pid // T // HK
    hk = pid // T % HK
    g = tl.program_id(1) * HT + tl.arange(0, BM)
    live = (tl.arange(0, BM) < HT) & (g < G)
    h = hk * G + g
    h0 = hk * G + tl.program_id(1) * HT  # the tile's heads share the seen slots (HT is 1 if the mask has heads)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    q = tl.load(Q + b * sq_b + h[:, None] * sq_h + t * sq_t + offs_d[None, :],
                mask=live[:, None] & (offs_d[None, :] < d_real), other=0.0)
    if MASK > 0:
        seen_count = tl.load(Seen + b * sn_b + h0 * sn_h + t * sn_t)
    elif CAUSAL:
        seen_count = t + 1  # past S: masked below
    else:
        seen_count = S
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DV], tl.float32)
    for j0 in range(0, seen_count, BS):
        j = j0 + tl.arange(0, BS)
        inside = (j < seen_count) & (j < S)
        if MASK > 0:
            slot = tl.load(Slot + b * sl_b + h0 * sl_h + t * sl_t + j, mask=inside, other=0)
        else:
            slot = j
        k = tl.load(K + b * sk_b + hk * sk_h + slot[:, None] * sk_s + offs_d[None, :],
                    mask=inside[:, None] & (offs_d[None, :] < d_real), other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        seen = live[:, None] & inside[None, :]
        if MASK == 2:  # additive
            s = s + tl.load(Mask + b * sm_b + h[:, None] * sm_h + t * sm_t + slot[None, :] * sm_s,
                            mask=seen, other=0.0).to(tl.float32)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no slot seen yet: stays 0
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * sv_b + hk * sv_h + slot[:, None] * sv_s + offs_dv[None, :],
                    mask=inside[:, None] & (offs_dv[None, :] < dv_real), other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + b * so_b + h[:, None] * so_h + t * so_t + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=live[:, None] & (offs_dv[None, :] < dv_real))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
              scale: float | None) -> torch.Tensor:
    """q [..., hq, T, d], k [..., hk, S, d], v [..., hk, S, dv], hk dividing hq (GQA by index). A row
    adds the keys it sees in slot order in blocks of BS, so it gets the same bits wherever the
    hidden slots sit: a tree node (its path among hidden siblings) as a chain's row, a decode step
    as a verify's row."""
    lead = q.shape[:-3]
    hq, T, d = q.shape[-3:]
    hk, S, dv = v.shape[-3:]

    def flat(t: torch.Tensor, heads: int, rows: int, width: int) -> torch.Tensor:  # [N, heads, rows, width], unit stride
        t = t.expand(*lead, heads, rows, width).reshape(-1, heads, rows, width)
        return t if t.stride(-1) == 1 else t.contiguous()

    q4, k4, v4 = flat(q, hq, T, d), flat(k, hk, S, d), flat(v, hk, S, dv)
    N, G = q4.shape[0], hq // hk
    out = torch.empty(N, hq, T, dv, dtype=q.dtype, device=q.device)
    kind, m4, slots, count, heads = 0, out, out, out, min(G, BM)
    mask_strides, slot_strides, count_strides = (0,) * 4, (0,) * 3, (0,) * 3
    if mask is not None:
        kind = 1 if mask.dtype == torch.bool else 2
        m = mask.reshape((1,) * (q.dim() - mask.dim()) + tuple(mask.shape))
        m4 = m.expand(*lead, m.shape[-3], T, S).reshape(-1, m.shape[-3], T, S)  # [N or 1.., 1 or hq, T, S]
        slots, count = seen_slots(m4)
        heads = heads if m4.shape[1] == 1 else 1  # a mask per head: each head its own seen slots

        def broadcast(t: torch.Tensor) -> tuple[int, ...]:  # the strides of [N, hq, T(, S)], 0 where broadcast
            return tuple(0 if size == 1 else st for size, st in zip(t.shape, t.stride()))
        mask_strides, slot_strides, count_strides = broadcast(m4), broadcast(slots)[:3], broadcast(count)
    scale = 1 / math.sqrt(d) if scale is None else scale
    D, DV = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
    if T and N:
        grid = (N * hk * T, triton.cdiv(G, heads))
        _attention[grid](q4, k4, v4, m4, slots, count, out, T, S, hk, G, heads, scale, *q4.stride()[:3],
                         *k4.stride()[:3], *v4.stride()[:3], *mask_strides, *slot_strides, *count_strides,
                         *out.stride()[:3], MASK=kind, CAUSAL=is_causal, IEEE=q.dtype == torch.float32, BM=BM,
                         BS=BS, D=D, DV=DV, d_real=d, dv_real=dv, num_warps=4, num_stages=2)
    return out.reshape(*lead, hq, T, dv)

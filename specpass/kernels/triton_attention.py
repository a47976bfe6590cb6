"""Split-KV attention (flash-decoding) in Triton: the CUDA kernel of `torch.ops.specpass.attend_split`
(kernels/__init__.py), imported on its first call (Triton is not needed on CPU).

A few query rows per request against a long cache: one program per (request, K/V head) would stream
all S slots alone, 128 programs at bs 16 on 132 SMs, far from the copy bandwidth. Here each
program takes one chunk of the slots for all g query heads of its K/V head and every token (each
K/V element read once), writes its rows' partial output and log-sum-exp, and a second kernel merges
the chunks. q `[B, T, hq, d]`, k `[B, S, hk, d]`, v `[B, S, hk, dv]` (the caches' own layout),
mask `[B, 1, T, S]` bool -> `[B, T, hq, dv]`. More than 64 rows per K/V head (a tree verify: 32
nodes x 4 query heads) run in blocks of 64 rows, a third grid axis: each block reads the chunk's
K/V once, so 128 rows read it twice, still g times less than one program per query head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _partial(Q, K, V, Mask, Part, Lse, scale_log2,
             sq_b, sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, sm_b, sm_t, sm_s,
             T, S, HK, chunk,
             G: tl.constexpr, M: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // HK
    h = bh % HK
    rows = tl.program_id(2) * M + tl.arange(0, M)  # row r: token r // G, query head h * G + r % G
    t = rows // G
    live = t < T
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    q = tl.load(Q + b * sq_b + t[:, None] * sq_t + (h * G + rows % G)[:, None] * sq_h + offs_d[None, :],
                mask=live[:, None], other=0.0)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, DV], tl.float32)
    for n0 in range(0, chunk, BLOCK_N):  # chunk: a multiple of BLOCK_N
        n = split * chunk + n0 + tl.arange(0, BLOCK_N)
        inside = n < S
        k = tl.load(K + b * sk_b + n[:, None] * sk_s + h * sk_h + offs_d[None, :], mask=inside[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2  # [M, BLOCK_N], log2 units
        seen = tl.load(Mask + b * sm_b + t[:, None] * sm_t + n[None, :] * sm_s,
                       mask=live[:, None] & inside[None, :], other=0)
        s = tl.where(seen != 0, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no slot yet stays 0
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * sv_b + n[:, None] * sv_s + h * sv_h + offs_dv[None, :], mask=inside[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    part = (bh * tl.num_programs(1) + split) * (M * tl.num_programs(2)) + rows
    tl.store(Part + part[:, None] * DV + offs_dv[None, :], acc / tl.where(l_i > 0, l_i, 1.0)[:, None])
    tl.store(Lse + part, m_i + tl.log2(l_i))  # -inf where the chunk holds no slot the row sees


@triton.jit
def _merge(Part, Lse, Out, so_b, so_t, so_h, T, HK, splits,
           G: tl.constexpr, M: tl.constexpr, DV: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // HK
    h = bh % HK
    rows = tl.program_id(1) * M + tl.arange(0, M)
    t = rows // G
    offs_dv = tl.arange(0, DV)
    m = tl.full([M], float("-inf"), tl.float32)
    l = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, DV], tl.float32)
    for split in range(splits):
        part = (bh * splits + split) * (M * tl.num_programs(1)) + rows
        lse = tl.load(Lse + part)
        m_new = tl.maximum(m, lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        w = tl.exp2(lse - m_use)
        acc = acc * alpha[:, None] + w[:, None] * tl.load(Part + part[:, None] * DV + offs_dv[None, :])
        l = l * alpha + w
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # a row that sees no slot: 0, as SDPA's kernels
    tl.store(Out + b * so_b + t[:, None] * so_t + (h * G + rows % G)[:, None] * so_h + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=(t < T)[:, None])


def splits_for(batch_heads: int, slots: int, device: torch.device, block_n: int) -> int:
    """Chunks per (request, K/V head): about one program per SM, each chunk 2 blocks or more. From a
    sweep of chunk counts at 5 rows per request (benchmarks/verify_attention.py, docs/results.md):
    the fewer the requests, the more chunks pay, down to one where the requests' heads fill the SMs;
    one 128-slot block, 4 warps, 2 stages."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(sms, batch_heads), slots // (2 * block_n)))


def aligned_rows(mask: torch.Tensor) -> torch.Tensor:
    """The mask with each [S] row 16-byte aligned, copied where it is not: the kernel's mask reads
    vectorise only then: read byte by byte, a tree round's attention calls took several times as long
    (docs/results.md, draft trees). `cache_slots` rounds the caches so the loop's masks need no copy."""
    if mask.stride(3) == 1 and mask.data_ptr() % 16 == 0 and all(mask.stride(i) % 16 == 0 for i in range(3)):
        return mask
    B, _, T, S = mask.shape
    padded = mask.new_empty(B, 1, T, triton.cdiv(S, 16) * 16)[..., :S]
    return padded.copy_(mask)


def attend_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                 splits: int | None = None, block_n: int = 128, warps: int = 4, stages: int = 2) -> torch.Tensor:
    B, T, hq, d = q.shape
    S, hk, dv = v.shape[1], v.shape[2], v.shape[3]
    g = hq // hk
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    mask = aligned_rows(mask)
    M = min(64, max(16, triton.next_power_of_2(T * g)))  # rows per program: tl.dot needs 16 or more
    blocks = triton.cdiv(T * g, M)
    chunk = triton.cdiv(triton.cdiv(S, splits or splits_for(B * hk * blocks, S, q.device, block_n)), block_n) * block_n
    splits = triton.cdiv(S, chunk)
    part = torch.empty(B * hk * splits * blocks * M, dv, device=q.device, dtype=torch.float32)
    lse = torch.empty(B * hk * splits * blocks * M, device=q.device, dtype=torch.float32)
    out = q.new_empty(B, T, hq, dv)
    _partial[(B * hk, splits, blocks)](
        q, k, v, mask, part, lse, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), mask.stride(0), mask.stride(2), mask.stride(3),
        T, S, hk, chunk, G=g, M=M, D=d, DV=dv, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    _merge[(B * hk, blocks)](part, lse, out, out.stride(0), out.stride(1), out.stride(2), T, hk, splits,
                      G=g, M=M, DV=dv, num_warps=4)
    return out

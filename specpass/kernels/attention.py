"""`specpass::attend_split`: split-KV attention (flash-decoding) for a few query rows per request
against a long cache (contract in kernels/__init__.py). On CUDA triton_attention.py, imported on
first use; elsewhere `attend_folded`, the folded SDPA it replaces."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true


def attend_folded(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """`attend_split`'s reference: GQA folded into the query axis, SDPA. The g = hq / hk query heads
    of a K/V head become g rows per token, `[B, hk, T * g, d]` (token-major), so each K/V head is
    read once; the mask is repeated per folded row (a view)."""
    B, T, hq, d = q.shape
    S, hk, dv = v.shape[1], v.shape[2], v.shape[3]
    g = hq // hk
    q = q.view(B, T, hk, g, d).transpose(1, 2).reshape(B, hk, T * g, d)  # [B, hk, T*g, d]
    mask = mask[:, :, :, None, :].expand(B, 1, T, g, S).reshape(B, 1, T * g, S)
    out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    return out.view(B, hk, T, g, dv).transpose(1, 2).reshape(B, T, hq, dv)  # [B, hk, T*g, dv] -> [B, T, hq, dv]


# T * g query rows per K/V head, in programs of up to 64 (a tree verify of 32 nodes at g = 8 is
# 256); more rows than this are a prefill's, where SDPA's kernels are the right ones.
SPLIT_MAX_ROWS = 256


def attend_split_refusal(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> str | None:
    """Why `attend_split`'s CUDA kernel cannot take these (fake or real) tensors, in its layout
    (q [B, T, hq, d], k/v [B, S, hk, d]); None where it can. Decided for every size the tensors
    allow (a symbolic size never passes a size test: no guard is added)."""
    B, T, hq, d = q.shape
    S, hk, dv = v.shape[1], v.shape[2], v.shape[3]
    if q.device.type != "cuda":
        return f"on {q.device.type}: the split-KV kernel is CUDA's (Triton)"
    if not (q.dtype in (torch.bfloat16, torch.float16) and k.dtype == v.dtype == q.dtype):
        return f"{q.dtype} / {k.dtype} / {v.dtype}: the kernel's dots take bf16 or fp16 for q, k and v alike"
    sizes = [x for x in (d, dv) if not (isinstance(x, int) and 16 <= x <= 256 and x & (x - 1) == 0)]
    if sizes or k.shape[-1] != d:
        return f"head sizes {d} (q, k), {dv} (v): the kernel takes powers of two from 16 to 256, one for q and k"
    if not (isinstance(hq, int) and isinstance(hk, int) and hq % hk == 0):
        return f"{hq} query heads over {hk} K/V heads: not a whole group per K/V head"
    if not statically_known_true(T * (hq // hk) <= SPLIT_MAX_ROWS):
        return (f"T = {T} tokens x {hq // hk} query heads per K/V head: more than {SPLIT_MAX_ROWS} rows per "
                "K/V head (or a symbolic length), a prefill's shape")
    if mask is None or mask.dtype != torch.bool:
        return f"the mask is {'absent' if mask is None else mask.dtype}: the kernel reads a bool mask"
    if mask.dim() != 4 or not all(statically_known_true(a == b) for a, b in zip(mask.shape, (B, 1, T, S))):
        return f"the mask is {list(mask.shape)}, not [B, 1, T, S] = {[B, 1, T, S]}"
    return None


@torch.library.custom_op("specpass::attend_split", mutates_args=())
def attend_split(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Split-KV attention (flash-decoding): the slots in chunks, each chunk's partial output and
    log-sum-exp, merged (kernels/triton_attention.py, imported on first use; see
    `attend_split_refusal` for what it takes). Elsewhere the folded SDPA it replaces."""
    return attend_folded(q.contiguous(), k, v, mask, scale)  # any strides of q, as the kernel


@attend_split.register_kernel("cuda")
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    from specpass.kernels import triton_attention

    return triton_attention.attend_split(q, k, v, mask, scale)


@attend_split.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    return q.new_empty(*q.shape[:3], v.shape[3])

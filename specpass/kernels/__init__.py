"""Ops the passes emit where a kernel of ours beats Inductor's formulation.

    index, top, lse, value = torch.ops.specpass.top1_lse(logits, log, dtype, scale, scalar, divide, rounding)
    # logits [R, V], any float dtype; the rest optional: a prologue folded into the read,
    #   s = x * t (x / t with divide), x the fp32 logits, t = scale[row] ([R] or [1] fp32) or fp32(scalar),
    #   correctly rounded in fp32, then rounded to `rounding` (a 16-bit dtype) if given: what
    #   torch computes for (logits.float() / t).to(rounding). Without them s = x. Passes fold the
    #   casts and temperature before a softmax into these (passes/argmax.py), so s is never stored.
    # index [R] int64: softmax(s)'s arg-max: the first index of the row's maximum, as
    #                  torch.argmax of s; 0 where the maximum is +inf or NaN
    #                  (softmax is NaN everywhere there, and argmax of NaNs is 0)
    # top   [R] fp32:  the maximum (NaN counts as +inf)
    # lse   [R] fp32:  log(sum(exp(s))); NaN where top is +inf
    # value [R] dtype: the probability at the arg-max, exp(top - lse); with log, top - lse,
    #                  computed in fp32 and rounded to `dtype` (default fp32) to nearest even

    out = torch.ops.specpass.attend_split(q, k, v, mask, scale)
    # q [B, T, hq, d], k [B, S, hk, d], v [B, S, hk, dv] (any strides), mask [B, 1, T, S] bool
    #   (broadcast axes as stride 0 are fine), hk dividing hq -> [B, T, hq, dv]: attention of query
    #   head j against K/V head j // (hq / hk) over the slots the mask shows, the scale given.

The value is written by the kernel, in the dtype its user wants, so that a sampled token and its
(log-)probability need no second kernel; at a token t the log-probability is logits[t] - lse. On
CUDA it is one pass over the row in Triton (kernels/triton_top1.py, imported on first use: Triton
is not needed elsewhere); elsewhere it is the same thing written in torch ops, which the tests
compare it with. `sample` (below) runs the same kernel over x / T plus Gumbel noise. `attend_split`
is split-KV attention (flash-decoding) for a few query rows per request against a long cache, on
CUDA kernels/triton_attention.py; elsewhere the folded SDPA (`attend_folded`). All are custom ops
with a fake implementation: Inductor calls each as one extern kernel, CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true


@torch.library.custom_op("specpass::top1_lse", mutates_args=())
def top1_lse(logits: Tensor, log: bool = False, dtype: torch.dtype | None = None, scale: Tensor | None = None,
             scalar: float = 1.0, divide: bool = False, rounding: torch.dtype | None = None
             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    s = logits.float()
    t = scale[:, None] if scale is not None else torch.tensor(scalar, dtype=torch.float32, device=s.device)
    s = s / t if divide else s * t
    if rounding is not None:
        s = s.to(rounding).float()
    x = torch.nan_to_num(s, nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
    top, index = x.max(-1)
    finite = top < float("inf")
    lse = torch.where(finite, torch.logsumexp(x, -1), float("nan"))
    value = top - lse if log else torch.exp(top - lse)
    return torch.where(finite, index, 0), top, lse, value.to(dtype or torch.float32)


@top1_lse.register_kernel("cuda")
def _(logits: Tensor, log: bool = False, dtype: torch.dtype | None = None, scale: Tensor | None = None,
      scalar: float = 1.0, divide: bool = False, rounding: torch.dtype | None = None
      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from specpass.kernels import triton_top1

    return triton_top1.top1_lse(logits, log, dtype, scale, scalar, divide, rounding)


@top1_lse.register_fake
def _(logits: Tensor, log: bool = False, dtype: torch.dtype | None = None, scale: Tensor | None = None,
      scalar: float = 1.0, divide: bool = False, rounding: torch.dtype | None = None
      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    rows = logits.shape[0]
    return (logits.new_empty(rows, dtype=torch.int64), logits.new_empty(rows, dtype=torch.float32),
            logits.new_empty(rows, dtype=torch.float32), logits.new_empty(rows, dtype=dtype or torch.float32))


@torch.library.custom_op("specpass::sample", mutates_args=())
def sample(logits: Tensor, temperature: Tensor, key: Tensor, floor: Tensor | None = None) -> Tensor:
    """logits [R, V] (any float dtype), temperature [R] fp32, key [R] int64, floor [R] fp32 or None
    -> [R] int64: a draw from softmax(x / T) over the entries x >= floor (x: the fp32 logits), by
    the Gumbel-max trick with the noise of `specpass.sampling.gumbel(key, column)`; where T is 0
    the first arg-max of x (floor and noise unused). The distribution is specpass.sampling.logprobs'.
    On CUDA, top1_lse's kernel over x / T (correctly rounded) + noise from the same uint32 hash (uniforms bit
    for bit), one read of the logits; it applies the floor after the noise, so a uniform of 1.0
    (+inf noise) below the floor is -inf there, where this implementation makes it NaN, which wins."""
    from specpass.sampling import gumbel

    x = logits.float()
    T = temperature[:, None]
    s = x / torch.where(T > 0, T, 1.0)
    if floor is not None:
        s = torch.where(x >= floor[:, None], s, float("-inf"))
    drawn = (s + gumbel(key, torch.arange(x.shape[-1], device=x.device))).argmax(-1)
    return torch.where(temperature > 0, drawn, x.argmax(-1))


@sample.register_kernel("cuda")
def _(logits: Tensor, temperature: Tensor, key: Tensor, floor: Tensor | None = None) -> Tensor:
    from specpass.kernels import triton_top1

    return triton_top1.sample(logits, temperature, key, floor)


@sample.register_fake
def _(logits: Tensor, temperature: Tensor, key: Tensor, floor: Tensor | None = None) -> Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


# --- split-KV attention: a few query rows per request against the whole cache


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


# tl.dot's rows: T * g query rows per program (padded to a power of two, 16 at least); more
# rows per K/V head than this are a prefill's, where SDPA's kernels are the right ones.
SPLIT_MAX_ROWS = 64


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

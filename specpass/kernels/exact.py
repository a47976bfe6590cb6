"""Row-invariant kernels: exact mode's `torch.ops.specpass.exact_*` (passes/exact.py routes to them).

Each computes a row of its output in an order of additions fixed by the row's own sizes (the
hidden size, the head size, the slots), never by how many rows run with it or which: a decode step
(1 row a request), a verify (K + 1, a tree's nodes, a block) and a prefill then give a row the same
bits. Attention also adds its slots one after the other, in slot order, so a slot the mask hides
(exactly 0) changes nothing wherever it sits: a tree's node sees its path through masked siblings
and gets what a chain would. Every op computes in fp32 and rounds its output once (a
linear with a bias: the product, then the sum).

    y = exact_linear(x, w, b)                 # x [..., K], w [N, K], b [N] or None -> [..., N]
    y = exact_matmul(a, b)                    # a [..., M, K] @ b [..., K, N] (broadcast) -> [..., M, N]
    y = exact_sum(x, dims, keepdim, mean)     # sum (or mean) over dims
    y = exact_rms_norm(x, shape, w, eps)      # x * rsqrt(mean(x^2) + eps) * w over the last len(shape) dims
    y = exact_layer_norm(x, shape, w, b, eps)
    y = exact_softmax(x, dim, log, dtype)     # softmax or log_softmax, in `dtype` (default x's)
    y = exact_logsumexp(x, dims, keepdim)
    o = exact_attention(q, k, v, mask, is_causal, scale, enable_gqa)   # SDPA's layout and meaning

The implementations here are the reference in torch ops, which every device but CUDA runs: a
matmul in tiles of `TILE` rows (a row is computed by one matmul call of one shape, whatever M is),
every other sum a sequential scan (`cumsum`: one element after the other, in one accumulator per
output). On CUDA triton_exact.py, imported on first use: one kernel configuration per op, whatever
the rows (its docstring; attention there is exact for rows that see their keys at the same slots).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# Rows per matmul call: every call of a weight has this shape, so a row gets one code path.
TILE = 16


def _sequential_sum(x: Tensor, dim: int) -> Tensor:
    """x summed over `dim` one element after the other (a scan's last value): zeros anywhere add nothing."""
    return x.cumsum(dim).select(dim, -1).contiguous()


def _reduced_shape(x: Tensor, dims: list[int], keepdim: bool) -> list[int]:
    """The shape of x reduced over dims (none: all), as torch's sum gives it."""
    reduced = {d % x.dim() for d in dims} if dims else set(range(x.dim()))
    return [1 if d in reduced else s for d, s in enumerate(x.shape) if keepdim or d not in reduced]


def _flat_rows(x: Tensor, dims: list[int]) -> Tensor:
    """x with `dims` (none: all) moved last and flattened: [..., n]."""
    dims = sorted(d % x.dim() for d in dims) if dims else list(range(x.dim()))
    kept = [d for d in range(x.dim()) if d not in dims]
    moved = x.permute(*kept, *dims)
    return moved.reshape(*[x.shape[d] for d in kept], -1)


@torch.library.custom_op("specpass::exact_linear", mutates_args=())
def exact_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    rows = x.reshape(-1, x.shape[-1])
    padded = -(-rows.shape[0] // TILE) * TILE
    tiles = rows.new_zeros(padded, rows.shape[1])
    tiles[:rows.shape[0]] = rows
    w = weight.t().to(x.dtype)  # the matmul accumulates in fp32 and rounds once, in x's dtype
    out = torch.cat([tiles[i:i + TILE] @ w for i in range(0, padded, TILE)])[:rows.shape[0]]
    if bias is not None:
        out = (out.float() + bias.float()).to(x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0]).contiguous()


@exact_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("specpass::exact_matmul", mutates_args=())
def exact_matmul(a: Tensor, b: Tensor) -> Tensor:
    products = a.float()[..., :, :, None] * b.float()[..., None, :, :]  # [..., M, K, N]
    return _sequential_sum(products, -2).to(torch.promote_types(a.dtype, b.dtype))


@exact_matmul.register_fake
def _(a: Tensor, b: Tensor) -> Tensor:
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return a.new_empty(*batch, a.shape[-2], b.shape[-1], dtype=torch.promote_types(a.dtype, b.dtype))


@torch.library.custom_op("specpass::exact_sum", mutates_args=())
def exact_sum(x: Tensor, dims: list[int], keepdim: bool = False, mean: bool = False,
              dtype: torch.dtype | None = None) -> Tensor:
    flat = _flat_rows(x.float(), dims)
    out = _sequential_sum(flat, -1)
    if mean:
        out = out / flat.shape[-1]
    return out.reshape(_reduced_shape(x, dims, keepdim)).to(dtype or x.dtype).contiguous()


@exact_sum.register_fake
def _(x: Tensor, dims: list[int], keepdim: bool = False, mean: bool = False,
      dtype: torch.dtype | None = None) -> Tensor:
    return x.new_empty(_reduced_shape(x, dims, keepdim), dtype=dtype or x.dtype)


def _normalized(x: Tensor, ndim: int) -> tuple[Tensor, int]:
    flat = x.float().reshape(*x.shape[:x.dim() - ndim], -1)
    return flat, flat.shape[-1]


@torch.library.custom_op("specpass::exact_rms_norm", mutates_args=())
def exact_rms_norm(x: Tensor, shape: list[int], weight: Tensor | None = None, eps: float | None = None) -> Tensor:
    flat, n = _normalized(x, len(shape))
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    y = flat * torch.rsqrt(_sequential_sum(flat * flat, -1)[..., None] / n + eps)
    y = y.reshape(x.shape)
    return (y * weight.float() if weight is not None else y).to(x.dtype).contiguous()


@exact_rms_norm.register_fake
def _(x: Tensor, shape: list[int], weight: Tensor | None = None, eps: float | None = None) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("specpass::exact_layer_norm", mutates_args=())
def exact_layer_norm(x: Tensor, shape: list[int], weight: Tensor | None = None, bias: Tensor | None = None,
                     eps: float = 1e-5) -> Tensor:
    flat, n = _normalized(x, len(shape))
    centred = flat - _sequential_sum(flat, -1)[..., None] / n
    y = (centred * torch.rsqrt(_sequential_sum(centred * centred, -1)[..., None] / n + eps)).reshape(x.shape)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).contiguous()


@exact_layer_norm.register_fake
def _(x: Tensor, shape: list[int], weight: Tensor | None = None, bias: Tensor | None = None,
      eps: float = 1e-5) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _stable_max(x: Tensor, dim: int) -> Tensor:
    """The row's maximum (an exact reduction), 0 where it is infinite (softmax's convention)."""
    top = x.amax(dim, keepdim=True)
    return torch.where(torch.isinf(top), 0.0, top)


@torch.library.custom_op("specpass::exact_softmax", mutates_args=())
def exact_softmax(x: Tensor, dim: int, log: bool = False, dtype: torch.dtype | None = None) -> Tensor:
    x32 = x.float()
    shifted = x32 - _stable_max(x32, dim)
    total = _sequential_sum(torch.exp(shifted).movedim(dim, -1), -1).unsqueeze(-1).movedim(-1, dim)
    y = shifted - torch.log(total) if log else torch.exp(shifted) / total
    return y.to(dtype or x.dtype).contiguous()


@exact_softmax.register_fake
def _(x: Tensor, dim: int, log: bool = False, dtype: torch.dtype | None = None) -> Tensor:
    return torch.empty_like(x, dtype=dtype or x.dtype, memory_format=torch.contiguous_format)


@torch.library.custom_op("specpass::exact_logsumexp", mutates_args=())
def exact_logsumexp(x: Tensor, dims: list[int], keepdim: bool = False) -> Tensor:
    flat = _flat_rows(x.float(), dims)
    top = _stable_max(flat, -1)
    out = (torch.log(_sequential_sum(torch.exp(flat - top), -1)[..., None]) + top)[..., 0]
    return out.reshape(_reduced_shape(x, dims, keepdim)).to(x.dtype).contiguous()


@exact_logsumexp.register_fake
def _(x: Tensor, dims: list[int], keepdim: bool = False) -> Tensor:
    return x.new_empty(_reduced_shape(x, dims, keepdim))


@torch.library.custom_op("specpass::exact_attention", mutates_args=())
def exact_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, is_causal: bool = False,
                    scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    """SDPA (no dropout): q [..., hq, T, d], k [..., hk, S, d], v [..., hk, S, dv], a bool mask
    (True: attend) or an additive one broadcasting to [..., hq, T, S]. A row that sees no slot is 0."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    if mask is not None and mask.dtype == torch.bool and not is_causal and mask.shape[-1] == k.shape[-2]:
        seen = mask.flatten(0, -2).any(0).nonzero()  # the slots past the last any row sees add nothing: cut
        end = int(seen[-1]) + 1 if len(seen) else 1
        k, v, mask = k[..., :end, :], v[..., :end, :], mask[..., :end]
    q32, k32, v32 = q.float(), k.float(), v.float()
    scores = _sequential_sum(q32[..., :, None, :] * k32[..., None, :, :], -1) * scale  # [..., T, S]
    if is_causal:
        T, S = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(T, S, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    p = torch.exp(scores - _stable_max(scores, -1))  # exactly 0 where masked
    total = _sequential_sum(p, -1)[..., None]
    out = _sequential_sum(p[..., :, :, None] * v32[..., None, :, :], -2)  # [..., T, dv], slot after slot
    return torch.where(total > 0, out / total, 0.0).to(q.dtype).contiguous()


@exact_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, is_causal: bool = False,
      scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    return q.new_empty(*q.shape[:-1], v.shape[-1])


# CUDA: triton_exact.py's kernels, imported on first use.
def _triton():
    from specpass.kernels import triton_exact
    return triton_exact


@exact_linear.register_kernel("cuda")
def _(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return _triton().linear(x, weight, bias)


@exact_matmul.register_kernel("cuda")
def _(a: Tensor, b: Tensor) -> Tensor:
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    dtype = torch.promote_types(a.dtype, b.dtype)
    a3 = a.to(dtype).expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.to(dtype).expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return _triton().matmul(a3, b3.transpose(-1, -2)).reshape(*batch, a.shape[-2], b.shape[-1])


def _reduced(x: Tensor, dims: list[int], keepdim: bool, mode: int, dtype: torch.dtype) -> Tensor:
    flat = _flat_rows(x, dims)
    return _triton().rows(flat, flat.shape[-1], mode, dtype).reshape(_reduced_shape(x, dims, keepdim))


@exact_sum.register_kernel("cuda")
def _(x: Tensor, dims: list[int], keepdim: bool = False, mean: bool = False,
      dtype: torch.dtype | None = None) -> Tensor:
    t = _triton()
    return _reduced(x, dims, keepdim, t.MEAN if mean else t.SUM, dtype or x.dtype)


@exact_logsumexp.register_kernel("cuda")
def _(x: Tensor, dims: list[int], keepdim: bool = False) -> Tensor:
    return _reduced(x, dims, keepdim, _triton().LOGSUMEXP, x.dtype)


def _normalize(x: Tensor, shape: list[int], mode: int, weight: Tensor | None, bias: Tensor | None,
               eps: float) -> Tensor:
    n = math.prod(shape)
    flat = [t.contiguous().view(-1) if t is not None else None for t in (weight, bias)]
    return _triton().rows(x, n, mode, x.dtype, *flat, eps).view(x.shape)


@exact_rms_norm.register_kernel("cuda")
def _(x: Tensor, shape: list[int], weight: Tensor | None = None, eps: float | None = None) -> Tensor:
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    return _normalize(x, shape, _triton().RMS_NORM, weight, None, eps)


@exact_layer_norm.register_kernel("cuda")
def _(x: Tensor, shape: list[int], weight: Tensor | None = None, bias: Tensor | None = None,
      eps: float = 1e-5) -> Tensor:
    return _normalize(x, shape, _triton().LAYER_NORM, weight, bias, eps)


@exact_softmax.register_kernel("cuda")
def _(x: Tensor, dim: int, log: bool = False, dtype: torch.dtype | None = None) -> Tensor:
    t = _triton()
    last = x.movedim(dim, -1).contiguous()
    y = t.rows(last, last.shape[-1], t.LOG_SOFTMAX if log else t.SOFTMAX, dtype or x.dtype).view(last.shape)
    return y.movedim(-1, dim).contiguous()


@exact_attention.register_kernel("cuda")
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, is_causal: bool = False,
      scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    return _triton().attention(q, k, v, mask, is_causal, scale)

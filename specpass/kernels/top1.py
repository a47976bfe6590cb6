"""`specpass::top1_lse` and `specpass::sample`: one read of a row for its arg-max, log-sum-exp and
value, or for a Gumbel-max draw (see kernels/__init__.py for their contracts). Here the reference in
torch ops, which every device but CUDA runs; on CUDA triton_top1.py, imported on first use."""

from __future__ import annotations

import torch
from torch import Tensor

from specpass.kernels.counter import gumbel


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
    the Gumbel-max trick with the noise of `counter.gumbel(key, column)`; where T is 0
    the first arg-max of x (floor and noise unused). The distribution is specpass.sampling.logprobs'.
    On CUDA, top1_lse's kernel over x / T (correctly rounded) + noise from the same uint32 hash (uniforms bit
    for bit), one read of the logits; it applies the floor after the noise, so a uniform of 1.0
    (+inf noise) below the floor is -inf there, where this implementation makes it NaN, which wins."""
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

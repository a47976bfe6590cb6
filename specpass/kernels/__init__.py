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

The value is written by the kernel, in the dtype its user wants, so that a sampled token and its
(log-)probability need no second kernel; at a token t the log-probability is logits[t] - lse. On
CUDA it is one pass over the row in Triton (kernels/triton_top1.py, imported on first use: Triton
is not needed elsewhere); elsewhere it is the same thing written in torch ops, which the tests
compare it with. `sample` (below) runs the same kernel over x / T plus Gumbel noise. Both are custom
ops with a fake implementation: Inductor calls each as one extern kernel, CUDA graphs capture it.
"""

from __future__ import annotations

import torch
from torch import Tensor


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

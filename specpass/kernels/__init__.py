"""Ops the passes emit where a kernel of ours beats Inductor's formulation.

    index, top, lse = torch.ops.specpass.top1_lse(logits)   # logits [R, V], any float dtype
    # index [R] int64: the first index of the row's maximum, as torch.argmax of the fp32 logits
    #                  (NaN counts as +inf)
    # top   [R] fp32:  the maximum
    # lse   [R] fp32:  log(sum(exp(logits))); NaN where top is +inf (softmax is NaN there)

Every probability the arg-max pass needs follows: softmax's at the arg-max is exp(top - lse),
log_softmax's is top - lse, and at a token t, logits[t] - lse. On CUDA it is one pass over the
row in Triton (kernels/triton_top1.py, imported on first use: Triton is not needed elsewhere);
elsewhere it is the same thing written in torch ops, which the tests compare it with. A custom
op with a fake implementation: Inductor calls it as one extern kernel, CUDA graphs capture it.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("specpass::top1_lse", mutates_args=())
def top1_lse(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    x = torch.nan_to_num(logits.float(), nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
    top, index = x.max(-1)
    lse = torch.where(top == float("inf"), float("nan"), torch.logsumexp(x, -1))
    return index, top, lse


@top1_lse.register_kernel("cuda")
def _(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    from specpass.kernels import triton_top1

    return triton_top1.top1_lse(logits)


@top1_lse.register_fake
def _(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    rows = logits.shape[0]
    return (logits.new_empty(rows, dtype=torch.int64), logits.new_empty(rows, dtype=torch.float32),
            logits.new_empty(rows, dtype=torch.float32))

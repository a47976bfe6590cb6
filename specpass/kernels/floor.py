"""`specpass::floor`: each row's top-k / top-p threshold, one sort per row (what the loop's
sampling filters with, specpass/sampling.py)."""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("specpass::floor", mutates_args=())
def floor(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """logits [R, V], per row temperature, top_k (0: off), top_p (1: off) -> [R] fp32 threshold.

    top-k keeps the entries >= the k-th largest; top-p then keeps, in descending order, those
    whose probability mass before them (under temperature and the top-k cut) is < p: the smallest
    set reaching p, as transformers' TopPLogitsWarper. Ties at a threshold are all kept. One sort
    of each row; rows of temperature 0 ignore the floor. An op, run as these torch ops in every
    graph (Inductor calls it as one extern kernel): torch 2.11's Inductor fails to generate the
    cumulative sum over a 150K vocabulary, and the sort is the cost either way.
    """
    x = logits.float()
    V = x.shape[-1]
    ranked = x.sort(-1, descending=True).values  # [R, V]
    k = torch.where(top_k > 0, top_k.clamp(max=V), V)[:, None]
    floor_k = ranked.gather(-1, k - 1)  # [R, 1]
    p = torch.softmax(torch.where(ranked >= floor_k, ranked / temperature.clamp_min(1e-30)[:, None], float("-inf")), -1)
    before = p.cumsum(-1) - p  # mass strictly before each entry
    kept = (before < top_p[:, None]).sum(-1, keepdim=True).clamp(min=1)  # the top entry is always kept
    return torch.maximum(floor_k, ranked.gather(-1, kept - 1))[:, 0]


@floor.register_fake
def _(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.float32)

"""Sampling, as the loop defines it: counter-based random numbers, temperature / top-k / top-p, and
the accept / residual step of speculative sampling. Pure torch ops on device tensors with static
shapes: traceable, fused by Inductor, safe inside CUDA graphs (no generator state anywhere).

    params = Params.make(B, B, device, temperature=0.6, top_k=50, top_p=0.95, seed=0)  # per request
    floor = floor_of(logits, params)                   # [B] the top-k/top-p threshold (None: no filter)
    token = torch.ops.specpass.sample(logits, params.temperature, key(params.seed, pos, TARGET), floor)

A token's distribution is softmax(x / T) over the entries x >= floor, where x are the fp32 logits
(`logprobs` below writes it out; the sample op draws from it by the Gumbel-max trick, one read of
the logits). Temperature 0 is greedy: the first arg-max, with probability 1.

Random numbers are a pure function of (the request's seed, a position, a stream): `uniform`
(kernels/counter.py) hashes them (murmur3's 32-bit finaliser, computed exactly in int64 so that torch on any device,
Inductor's C++ and Triton give the same bits). A run is reproducible from its seeds whatever the
batch, the compiler or the device (up to float rounding in the transcendental functions), and a
CUDA graph replays no stale random state. Each emitted token consumes its own keys: a draft at
position m uses (DRAFT, m), its accept test (ACCEPT, m), and a token the target samples there
(TARGET, m): the residual at a rejection, the bonus, or plain sampling. A draw that decided nothing
emitted (a draft past the first rejection) may be drawn again at the same key in a later round:
it is independent of everything emitted, so nothing is biased.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

import specpass.kernels  # noqa: F401  registers torch.ops.specpass.* (imported here: Dynamo cannot trace an import)
from specpass.kernels.counter import gumbel

DRAFT, ACCEPT, TARGET = 1, 2, 3  # streams


class Params(NamedTuple):
    """Per-request sampling parameters, on the device. top_k / top_p are None when no request in
    the batch filters (a graph without the threshold's sort)."""

    temperature: Tensor  # [B] fp32; 0: greedy
    seed: Tensor  # [B] int64
    top_k: Tensor | None  # [B] int64; 0: off
    top_p: Tensor | None  # [B] fp32; 1: off

    @staticmethod
    def make(batch: int, rows: int, device: torch.device, temperature: float | Sequence[float] = 1.0,
             top_k: int | Sequence[int] | None = None, top_p: float | Sequence[float] | None = None,
             seed: int | Sequence[int] | None = None) -> "Params | None":
        """One value for every one of `batch` requests or one per request, padded to `rows` with
        idle rows (greedy); None when every request is greedy (temperature 0). An int seed gives
        each request its own stream (seed, request index); None draws one from torch's generator."""
        temperature = per_request(temperature, batch, "temperature", float, lambda t: t >= 0 and t < float("inf"),
                                   ">= 0 and finite (0: greedy)")
        top_k = None if top_k is None else per_request(top_k, batch, "top_k", int, lambda k: k >= 0, ">= 0 (0: off)")
        top_p = None if top_p is None else per_request(top_p, batch, "top_p", float, lambda p: 0 < p <= 1,
                                                        "in (0, 1] (1: off)")
        if not any(t > 0 for t in temperature):
            return None
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        if isinstance(seed, Sequence):
            seeds = per_request(seed, batch, "seed", int, lambda s: s >= 0, ">= 0")
        else:
            (base,) = per_request(seed, 1, "seed", int, lambda s: s >= 0, ">= 0")
            seeds = [base * 0x100000 + b for b in range(batch)]  # request b's own stream
        top_k, top_p = top_k or [0] * batch, top_p or [1.0] * batch
        on = any(t > 0 and (k > 0 or p < 1) for t, k, p in zip(temperature, top_k, top_p))  # the graph sorts
        idle = rows - batch
        return Params(
            temperature=torch.tensor(temperature + [0.0] * idle, dtype=torch.float32, device=device),
            seed=torch.tensor([s % 2**63 for s in seeds] + [0] * idle, dtype=torch.int64, device=device),
            top_k=torch.tensor(top_k + [0] * idle, dtype=torch.int64, device=device) if on else None,
            top_p=torch.tensor(top_p + [1.0] * idle, dtype=torch.float32, device=device) if on else None)


def per_request(value, n: int, name: str, kind: type, ok, rule: str) -> list:
    """One value of `kind` for every one of n requests, or one per request, each `ok` (`rule` says
    how, in the error) -> n values."""
    each = isinstance(value, Sequence) and not isinstance(value, (str, bytes))
    values = list(value) if each else [value] * n
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} values for {n} prompts: pass one per prompt, or one "
                         f"{'int' if kind is int else 'value'} for all")
    checked = []
    for i, v in enumerate(values):
        good_type = isinstance(v, numbers.Real) and not isinstance(v, bool) and (
            kind is float or isinstance(v, numbers.Integral))
        if not good_type or not ok(v):
            where = f"[{i}]" if each else ""
            raise ValueError(f"{name}{where} must be {'an int' if kind is int else 'a number'} {rule}, got {v!r}")
        checked.append(kind(v))
    return checked


def eos_ids(eos_id: Any, n: int) -> list[list[int]]:
    """Each of n requests' EOS ids, any of which stops it ([] for none): None, one int for all, or one
    entry per request, an int (-1: none) or a sequence of ints."""
    each = isinstance(eos_id, Sequence) and not isinstance(eos_id, (str, bytes))
    entries = list(eos_id) if each else [-1 if eos_id is None else eos_id] * n
    if len(entries) != n:
        raise ValueError(f"eos_id has {len(entries)} values for {n} prompts: pass one per prompt (an int or a "
                         "sequence of ints), or one int for all")
    rows = []
    for i, entry in enumerate(entries):
        several = isinstance(entry, Sequence) and not isinstance(entry, (str, bytes))
        ids = list(entry) if several else [entry]
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= -1 for v in ids):
            where = f"[{i}]" if each else ""
            raise ValueError(f"eos_id{where} must be an int >= -1 or a sequence of them, got {entry!r}")
        rows.append(sorted({int(v) for v in ids if v >= 0}))
    return rows


# --- the distribution of a token


def _per_row(t: Tensor, x: Tensor) -> Tensor:
    """A request's parameter [B] beside logits x [B, ..., V]: [B, 1, ..., 1]."""
    return t.reshape(t.shape + (1,) * (x.dim() - 1))


def floor_of(logits: Tensor, params: Params) -> Tensor | None:
    """The top-k / top-p threshold of each row, on the fp32 logits: [B, ..., V] -> [B, ...] (None:
    no filter); params are per request, [B]. See `floor`."""
    if params.top_k is None:
        return None
    rows = logits.shape[:-1]

    def each_row(t: Tensor) -> Tensor:
        return _per_row(t, logits)[..., 0].expand(rows).reshape(-1)

    flat = logits.reshape(-1, logits.shape[-1])
    return torch.ops.specpass.floor(flat, *map(each_row, (params.temperature, params.top_k, params.top_p))).view(rows)


def logprobs(logits: Tensor, params: Params, floor: Tensor | None) -> Tensor:
    """log of the distribution a token is sampled from: [B, ..., V] logits -> fp32, same shape (-inf
    outside the floor; temperature 0: 0 at the first arg-max, -inf elsewhere)."""
    x = logits.float()
    T = _per_row(params.temperature, x)
    s = x / torch.where(T > 0, T, 1.0)
    if floor is not None:
        s = torch.where(x >= floor[..., None], s, float("-inf"))
    greedy = torch.where(torch.arange(x.shape[-1], device=x.device) == x.argmax(-1, keepdim=True), 0.0,
                         float("-inf"))
    return torch.where(T > 0, torch.log_softmax(s, -1), greedy)


def draw(logits: Tensor, params: Params, keys: Tensor, floor: Tensor | None = None) -> Tensor:
    """A token from each row's distribution (see `logprobs`): [R, V] -> [R] int64, one read of
    the logits (torch.ops.specpass.sample)."""
    return torch.ops.specpass.sample(logits, params.temperature, keys, floor)


def gumbel_argmax(log_p: Tensor, keys: Tensor) -> Tensor:
    """A token from each row of log-probabilities (unnormalised: any per-row shift) [R, V] -> [R]
    int64, by the Gumbel-max trick with the sample op's noise, `gumbel(keys, column)`. For rows the
    loop writes out anyway (the draft's q, the residual): written in torch ops, the draw is computed
    by Inductor in the kernel that makes log_p, with no launch or second read of its own."""
    return (log_p + gumbel(keys, torch.arange(log_p.shape[-1], device=log_p.device))).argmax(-1)


# --- speculative sampling (Leviathan et al. 2023, Chen et al. 2023)


def accepts(u: Tensor, p: Tensor, q: Tensor) -> Tensor:
    """Draft accepted with probability min(1, p / q): u < p / q, with q > 0 (the draft was drawn from q)."""
    return u * q < p


def residual(p: Tensor, q: Tensor) -> Tensor:
    """log norm(max(0, p - q)) (unnormalised: the sample op needs no normaliser): where the token at
    the first rejection is drawn from. q = 0 (no draft: the bonus token) gives log p."""
    return torch.log((p - q).clamp_min(0))

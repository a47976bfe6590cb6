"""Counter-based random numbers: a pure function of (key, column), no generator state, so a draw is
the same under eager, Inductor's C++ and Triton, at any batch, and a CUDA graph replays nothing
stale. The hash is murmur3's 32-bit finaliser computed exactly in int64; its Triton twin
(`_mix32`, `_uniform` in triton_top1.py) is the same uint32 arithmetic, bit for bit.

    k = key(seed, position, stream)            # [B, ...] int64 in [0, 2**32)
    u = uniform(k)                             # one fp32 uniform in (0, 1) per key
    g = gumbel(k, torch.arange(V))             # [B, ..., V]: argmax(s + g) draws from softmax(s)
"""

from __future__ import annotations

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), in int64 without overflow (16-bit halves)."""
    lo = (x & 0xFFFF) * c
    hi = ((x >> 16) * c) & 0xFFFF
    return (lo + (hi << 16)) & _M32


def mix32(x: Tensor) -> Tensor:
    """murmur3's finaliser: a bijection of [0, 2**32) with full avalanche (int64 tensors)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def key(seed: Tensor, position: Tensor, stream: int) -> Tensor:
    """The key of a request's draw at `position` in `stream`: seed [B] (or broadcastable), position
    [B, ...] int64 -> int64 in [0, 2**32), the shape of position."""
    seed = seed.reshape(seed.shape + (1,) * (position.dim() - seed.dim()))
    s = mix32((seed & _M32) ^ mix32(((seed >> 32) & _M32) ^ _GOLDEN))
    return mix32(mix32(s ^ stream) ^ (position & _M32))


def uniform(keys: Tensor, columns: Tensor | None = None) -> Tensor:
    """fp32 uniforms in (0, 1): one per key, or [*keys.shape, V] for columns [V]: 23 random bits
    and the midpoint of their interval, exact in fp32 (24 bits would round 2**24 - 0.5 up to 1.0,
    an infinite Gumbel draw)."""
    h = keys if columns is None else mix32(keys[..., None] ^ mix32(columns ^ _GOLDEN))
    return ((h >> 9).float() + 0.5) * 2.0**-23


def gumbel(keys: Tensor, columns: Tensor) -> Tensor:
    """-log(-log(u)): argmax(s + gumbel) is a draw from softmax(s)."""
    return -torch.log(-torch.log(uniform(keys, columns)))

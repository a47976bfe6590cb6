"""The KV cache a transformers model runs on under specpass's loop: written at per-request positions.

The loop addresses every cache by position: request b's token at position p goes to slot p, a
rejected draft's slot is overwritten when that position comes again, and a query at position p
sees slots 0..p only. Hugging Face's caches write at one offset shared by the batch
(`StaticCache`: a running `cumulative_length`; 5.17 also a `cache_position` [T]), so requests of
different lengths cannot share one. `PositionCache` is a `transformers.Cache` whose layers write
`keys[b, :, positions[b, t]] = k[b, :, t]`, the positions being the ones passed as `position_ids`;
`visible` is the matching 4D mask, which every model that builds its mask with
`create_causal_mask` passes through unchanged. See docs/hf.md for the alternative and its cost.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin


class PositionLayer(CacheLayerMixin):
    """One attention layer's static K/V, [B, kv_heads, S, head_dim], written at the cache's positions.

    Allocated on the first write (as `StaticLayer` does), so heads and head sizes come from the
    model's own key states; that write is the loop's probe, run before anything is compiled.
    """

    is_compileable = True
    is_sliding = False

    def __init__(self, cache: "PositionCache"):
        super().__init__()
        self.cache = cache

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        B, heads, _, _ = key_states.shape
        S = self.cache.slots
        self.keys = key_states.new_zeros(B, heads, S, key_states.shape[-1])
        self.values = value_states.new_zeros(B, heads, S, value_states.shape[-1])
        torch._dynamo.mark_static_address(self.keys)  # CUDA graphs: not copied in per replay
        torch._dynamo.mark_static_address(self.values)
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """k, v [B, kv_heads, T, d] -> the whole cache [B, kv_heads, S, d], read under `visible`'s mask."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        positions = self.cache.positions  # [B, T]
        batch = torch.arange(positions.shape[0], device=positions.device)[:, None]  # [B, 1]
        # Advanced indices around a slice put [B, T] first: the values are [B, T, kv_heads, d].
        self.keys[batch, :, positions] = key_states.transpose(1, 2)
        self.values[batch, :, positions] = value_states.transpose(1, 2)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.slots, 0

    def get_seq_length(self) -> int:
        return 0  # unused: the loop always passes position_ids and a 4D mask

    def get_max_length(self) -> int:
        return self.cache.slots


class PositionCache(Cache):
    """`num_layers` `PositionLayer`s of `slots` positions each; set `positions` [B, T] before each forward."""

    def __init__(self, num_layers: int, slots: int):
        self.slots = slots
        self.positions: Tensor | None = None
        super().__init__(layers=[PositionLayer(self) for _ in range(num_layers)])


def visible(positions: Tensor, cache_len: int, window: int | None, dtype: torch.dtype) -> Tensor:
    """positions [B, T] -> the mask [B, 1, T, S]: row t of request b sees slots
    positions[b, t] - window < s <= positions[b, t] (no lower bound without a sliding window).
    dtype bool: True where seen, what SDPA reads and transformers itself passes it (and what the
    split-KV kernel takes, passes/split_kv.py); a float dtype: additive (0 / the dtype's min), what
    eager attention adds to its scores."""
    slots = torch.arange(cache_len, device=positions.device)  # [S]
    query = positions[:, None, :, None]  # [B, 1, T, 1]
    seen = slots <= query
    if window is not None:
        seen &= slots > query - window
    return seen if dtype == torch.bool else (~seen).to(dtype) * torch.finfo(dtype).min

"""The KV cache a transformers model runs on under specpass's loop: written at per-request positions.

The loop addresses every cache by position: request b's token at position p goes to slot p, a
rejected draft's slot is overwritten when that position comes again, and a query at position p
sees slots 0..p only. Hugging Face's caches write at one offset shared by the batch
(`StaticCache`: a running `cumulative_length`; 5.17 also a `cache_position` [T]), so requests of
different lengths cannot share one. `PositionCache` is a `transformers.Cache` whose layers write
`keys[b, :, slots[b, t]] = k[b, :, t]`, the slots being the positions passed as `position_ids`
(a draft tree's rows pass their own: siblings share a position, not a slot); `causal` and
`visible` make the matching 4D mask, which every model that builds its mask with
`create_causal_mask` passes through unchanged. See docs/hf.md for the alternative and its cost.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin


class PositionLayer(CacheLayerMixin):
    """One attention layer's static K/V, [capacity, kv_heads, S, head_dim], written at the cache's `write_slots`.

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
        """k, v [B, kv_heads, T, d] -> rows 0..B-1 of the cache [B, kv_heads, S, d], read under
        `visible`'s mask. B may be below the capacity allocated (the probe's batch): request b
        is row b, and a compiled step with B symbolic reads the one buffer at every batch size."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slots = self.cache.write_slots  # [B, T]
        B = slots.shape[0]
        batch = torch.arange(B, device=slots.device)[:, None]  # [B, 1]
        # Advanced indices around a slice put [B, T] first: the values are [B, T, kv_heads, d].
        self.keys[batch, :, slots] = key_states.transpose(1, 2)
        self.values[batch, :, slots] = value_states.transpose(1, 2)
        return self.keys[:B], self.values[:B]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.slots, 0

    def get_seq_length(self) -> int:
        return 0  # unused: the loop always passes position_ids and a 4D mask

    def get_max_length(self) -> int:
        return self.cache.slots


class PositionCache(Cache):
    """`num_layers` `PositionLayer`s of `slots` slots each; set `write_slots` [B, T] before each forward."""

    def __init__(self, num_layers: int, slots: int):
        self.slots = slots
        self.write_slots: Tensor | None = None  # [B, T] where each row's K/V goes: its position, but in a tree
        super().__init__(layers=[PositionLayer(self) for _ in range(num_layers)])

    def copy_slots(self, src: Tensor, dst: Tensor) -> None:
        """Every layer's slot dst[b, t] takes what slot src[b, t] holds (src, dst [B, T]; each
        layer's sources gathered before its writes)."""
        batch = torch.arange(src.shape[0], device=src.device)[:, None]  # [B, 1]
        for layer in self.layers:
            layer.keys[batch, :, dst] = layer.keys[batch, :, src]  # [B, T, kv_heads, d]
            layer.values[batch, :, dst] = layer.values[batch, :, src]


def causal(positions: Tensor, cache_len: int) -> Tensor:
    """positions [B, T] -> [B, 1, T, S] bool: row t of request b sees slots s <= positions[b, t]
    (slot = position: what every call but a draft tree's passes)."""
    slots = torch.arange(cache_len, device=positions.device)  # [S]
    return slots <= positions[:, None, :, None]


def visible(positions: Tensor, seen: Tensor, window: int | None, dtype: torch.dtype) -> Tensor:
    """positions [B, T], seen [B, 1, T, S] bool (the slots each row may see) -> the model's mask:
    `seen`, cut to slots s > positions[b, t] - window under a sliding window. The window is read
    on slot numbers: exact below a draft tree (slot = position), and over the tree's own slots
    (all at or past its root's) while the tree is shallower than the window (adapters.check_tree).
    dtype bool: True where seen, what SDPA reads and transformers itself passes it (and what the
    split-KV kernel takes, passes/split_kv.py); a float dtype: additive (0 / the dtype's min), what
    eager attention adds to its scores."""
    if window is not None:
        slots = torch.arange(seen.shape[-1], device=positions.device)  # [S]
        seen = seen & (slots > positions[:, None, :, None] - window)
    return seen if dtype == torch.bool else (~seen).to(dtype) * torch.finfo(dtype).min

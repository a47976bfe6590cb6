"""The draft-model base: a model whose attention layers own static caches, and the catch-up and
draft steps every draft runs, with the live row selected only at the very end.

A subclass defines `forward_rows(tokens [B, T], positions [B, T], hidden, slots=None, mask=None) ->
(logits [B, T, V], hidden_out [B, T, H])`, which runs every row (writing every row's K/V at its slot,
by default its position: `layout`); `hidden_out` is the state before the final norm. `catch_up`,
`draft_step` and a tree's steps reuse it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from specpass.drafters.attention import attention_mask


def select_live(x: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Row `live[b]` of request b: `[B, T, ...] -> [B, ...]`. The one row per request sampled."""
    return x[torch.arange(x.shape[0], device=x.device), live]


class CachedModel(nn.Module):
    """A model whose attention layers own static caches, allocated by `setup_caches`."""

    cache_len: int | None = None
    cache_batch: int | None = None

    def setup_caches(self, max_batch: int, max_len: int, device=None, dtype=None) -> None:
        """(Re)allocate every layer's cache `[max_batch, max_len, ...]`, zeroed.

        Calls then pass up to `max_batch` requests (request b in cache row b: one compiled graph,
        its batch symbolic, serves every size) and positions below `max_len`. Defaults: the
        parameters' device and dtype.
        """
        param = next(self.parameters())
        device = param.device if device is None else device
        dtype = param.dtype if dtype is None else dtype
        for module in self.modules():
            if module is not self and hasattr(module, "setup_cache"):
                module.setup_cache(max_batch, max_len, device, dtype)
        self.cache_batch, self.cache_len = max_batch, max_len

    def mask(self, positions: torch.Tensor) -> torch.Tensor:
        """The `[B, 1, T, S]` cache mask; also checks the call against the caches (static shapes)."""
        if self.cache_len is None:
            raise RuntimeError(f"{type(self).__name__}: call setup_caches(max_batch, max_len) first")
        if positions.shape[0] > self.cache_batch:
            raise ValueError(f"{positions.shape[0]} requests, but the caches hold {self.cache_batch}: "
                             "call setup_caches again with a larger max_batch")
        return attention_mask(positions, self.cache_len)

    def layout(self, positions: torch.Tensor, slots: torch.Tensor | None,
               mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Where rows write their K/V and what they see -> (slots [B, T], mask [B, 1, T, S]): by
        default slot = position and the causal cache mask; a tree's rows pass both (siblings share
        a position, not a slot)."""
        if slots is None:
            return positions, self.mask(positions)
        self.mask(positions)  # the call checked against the caches
        return slots, mask

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every cache: slot dst[b, t] takes slot src[b, t]'s K/V ([B, T]). Each layer copies its own
        buffers, read as its attributes: so Dynamo keeps them static (CUDA graphs do not copy them)."""
        for module in self.modules():
            if module is not self and hasattr(module, "setup_cache"):
                module.copy_slots(src, dst)


class Draft(CachedModel):
    """The draft interface: `forward_rows` (a subclass's), then `catch_up` and `draft_step` on it."""

    def forward_rows(self, tokens, positions, hidden, slots=None, mask=None):
        raise NotImplementedError

    def catch_up(self, tokens: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None,
                 live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """T rows per request, all K/V written; logits `[B, V]` and hidden_out `[B, H]` of row
        `live[b]` (the last valid row of request b; later rows are padding, written, never read).

        The live row is selected only here, at the very end: the graph a live-row pass rewrites.
        """
        logits, hidden_out = self.forward_rows(tokens, positions, hidden)
        return select_live(logits, live), select_live(hidden_out, live)

    def draft_step(self, tokens: torch.Tensor, positions: torch.Tensor,
                   hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per request: tokens `[B]`, positions `[B]`, hidden `[B, Hh]` -> `([B, V], [B, H])`."""
        logits, hidden_out = self.forward_rows(
            tokens[:, None], positions[:, None], None if hidden is None else hidden[:, None])
        return logits[:, 0], hidden_out[:, 0]

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids: the same vocabulary unless a subclass maps it."""
        return ids

    def get_input_embeddings(self) -> nn.Embedding:
        """The embedding the draft reads token ids with."""
        return self.embed_tokens

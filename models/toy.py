"""The smallest draft step: one pre-norm decoder layer with a static KV cache and an lm_head.

Small enough to read its whole captured graph; the backend and pipeline tests pin it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ToyDraft(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, batch: int = 2, cache_len: int = 16,
                 kv_heads: int | None = None):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.kv_heads = kv_heads or heads
        self.embed = nn.Embedding(vocab, hidden)
        self.attn_norm = nn.RMSNorm(hidden, eps=1e-6)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=1e-6)
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("k_cache", torch.zeros(batch, self.kv_heads, cache_len, self.head_dim))
        self.register_buffer("v_cache", torch.zeros(batch, self.kv_heads, cache_len, self.head_dim))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # tokens: [B, T]; positions: [T], the cache slots these tokens occupy in every request
        B, T = tokens.shape
        x = self.embed(tokens)  # [B, T, H]
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, self.heads, self.head_dim).transpose(1, 3).unbind(2)
        grouped = self.kv_heads < self.heads  # grouped-query: the first kv_heads heads' K/V serve all query heads
        if grouped:
            k, v = k[:, :self.kv_heads], v[:, :self.kv_heads]
        self.k_cache.index_copy_(2, positions, k)  # [B, kv heads, S, hd]
        self.v_cache.index_copy_(2, positions, v)
        slots = torch.arange(self.k_cache.shape[2], device=tokens.device)
        mask = slots[None, :] <= positions[:, None]  # [T, S]
        keys, values = self.k_cache, self.v_cache
        if grouped:  # repeated to every query head, as transformers' SDPA path does when given a mask
            keys, values = (c.repeat_interleave(self.heads // self.kv_heads, 1) for c in (keys, values))
        a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, nh, T, hd]
        x = x + self.o_proj(a.transpose(1, 2).reshape(B, T, -1))
        x = x + self.down(F.silu(self.up(self.mlp_norm(x))))
        logits = self.lm_head(self.norm(x))  # [B, T, V]
        return logits[:, -1]  # the live row of each request

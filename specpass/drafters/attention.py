"""Cached attention over static per-request K/V buffers, written as a plain model writes it.

Shapes: B requests, T rows per request (static), S cache slots per request. Positions are per
request (`positions [B, T]` int64): requests in a batch have different lengths. Each attention
layer owns cache buffers `[capacity, S, heads, d]`; a call of B <= capacity requests uses rows
0..B-1 (`live`), so one graph with B symbolic serves every batch size. Written in place by position
(`cache[b, positions[b, t]] = k[b, t]`, an `aten.index_put_`); nothing is copied or rolled back on
rejection: slots past a request's position are stale and the mask hides them,
`mask[b, 0, t, s] = s <= positions[b, t]`. Attention is one SDPA call over the whole cache; which
kernel runs it (GQA folded, split-KV) is the compiler's business: specpass's passes choose.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from specpass.drafters.rope import apply_rope


def attention_mask(positions: torch.Tensor, cache_len: int) -> torch.Tensor:
    """`[B, 1, T, S]` bool: row t of request b sees slots 0..positions[b, t] (stale slots hidden)."""
    slots = torch.arange(cache_len, device=positions.device)
    return slots[None, None, None, :] <= positions[:, None, :, None]


def live(cache: torch.Tensor, batch: int) -> torch.Tensor:
    """The cache rows of a call of `batch` requests: `cache[:batch]`, a view (the buffer keeps its
    static shape, so a compiled step with a symbolic batch reads the one buffer at every size)."""
    return cache[:batch]


def write_cache(cache: torch.Tensor, positions: torch.Tensor, value: torch.Tensor) -> None:
    """`cache[b, positions[b, t]] = value[b, t]` in place. cache `[capacity, S, ...]`, value `[B, T, ...]`, B <= capacity."""
    batch = torch.arange(positions.shape[0], device=positions.device)
    cache[batch[:, None], positions] = value


def copy_cache(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """`cache[b, dst[b, t]] = cache[b, src[b, t]]` in place, every source read before any write.
    cache `[capacity, S, ...]`, src, dst `[B, T]`, B <= capacity."""
    batch = torch.arange(src.shape[0], device=src.device)[:, None]
    cache[batch, dst] = cache[batch, src]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA over the whole cache. q `[B, T, hq, d]`, k `[B, S, hk, d]`, v `[B, S, hk, dv]`,
    mask `[B, 1, T, S]` -> `[B, T, hq, dv]`. Fewer K/V heads than query heads (GQA/MQA) is SDPA's
    own `enable_gqa`, on `[B, heads, T, d]` views. Never `is_causal=True`: its mask is top-left
    aligned, wrong once the cache holds a prefix."""
    g = q.shape[2] // v.shape[2]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, scale=scale, enable_gqa=g != 1)
    return out.transpose(1, 2)


class Attention(nn.Module):
    """GQA self-attention with RoPE over a static per-request KV cache.

    Llama: the defaults. Qwen3-Next/Qwen3.5 full attention: `qk_norm` (RMSNorm per head on q and
    k before RoPE), `output_gate` (q_proj also emits a per-head gate; the attention output is
    multiplied by sigmoid(gate) before o_proj) and partial RoPE (the caller's cos/sin are
    narrower than head_dim). `in_features` is 2H in an EAGLE-3 midlayer.
    """

    def __init__(self, config, in_features: int | None = None, qk_norm: bool = False, output_gate: bool = False):
        super().__init__()
        in_features = in_features or config.hidden_size
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.output_gate = output_gate
        q_out = self.n_heads * self.head_dim * (2 if output_gate else 1)
        self.q_proj = nn.Linear(in_features, q_out, bias=False)
        self.k_proj = nn.Linear(in_features, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        if qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.register_buffer("k_cache", None, persistent=False)  # [capacity, S, n_kv, head_dim]
        self.register_buffer("v_cache", None, persistent=False)

    def setup_cache(self, max_batch: int, max_len: int, device, dtype) -> None:
        shape = (max_batch, max_len, self.n_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        copy_cache(self.k_cache, src, dst)
        copy_cache(self.v_cache, src, dst)

    def project(self, x: torch.Tensor,
                rope_cs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """x `[B, T, in]` -> q `[B, T, n_heads, d]`, k, v `[B, T, n_kv, d]` (q, k roped), gate
        `[B, T, n_heads * d]` or None. Shared by the cached path and training (examples/train.py)."""
        B, T, _ = x.shape
        q = self.q_proj(x)
        gate = None
        if self.output_gate:  # Qwen3-Next layout: per head [query | gate]
            q, gate = q.view(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(B, T, self.n_heads * self.head_dim)
        q = q.reshape(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, *rope_cs), apply_rope(k, *rope_cs), v, gate

    def output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The attention output `[B, T, n_heads, d]` (and the gate) -> `[B, T, H]`."""
        out = out.reshape(*out.shape[:2], self.n_heads * self.head_dim)
        if self.output_gate:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def forward(self, x: torch.Tensor, rope_cs: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        q, k, v, gate = self.project(x, rope_cs)
        write_cache(self.k_cache, positions, k)  # every row's K/V lands in the cache ...
        write_cache(self.v_cache, positions, v)
        B = x.shape[0]
        out = attend(q, live(self.k_cache, B), live(self.v_cache, B), mask, self.head_dim**-0.5)  # ... then all of it is read
        return self.output(out, gate)  # [B, T, H]

"""Building blocks every zoo model shares: RoPE, the cache mask, the cached attention write and
read, SwiGLU, the pre-norm decoder layer, the live-row select, and the draft-model interface.

Shapes: B requests, T rows per request (static), S cache slots per request, H hidden size.
Positions are per request (`positions: [B, T]` int64), because requests in a batch have
different lengths. Every attention layer owns static cache buffers `[B, S, ...]`, written in
place by position (`cache[b, positions[b, t]] = k[b, t]`, an `aten.index_put_`); nothing is
copied or rolled back on rejection — slots past a request's current position are stale and
the mask hides them: `mask[b, 0, t, s] = s <= positions[b, t]`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from specpass.kernels import attend_folded, attend_split_refusal


# --- RoPE (Hugging Face's "default" rope: rotate_half, cos/sin in fp32, cast to the activations)


def rope(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[B, T, dim]` for `positions [B, T]`, computed exactly as transformers does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.int64).float() / dim))
    freqs = positions[..., None].float() * inv_freq  # [B, T, dim/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [B, T, dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` features of every head of `x [B, T, heads, d]`.

    A rotary dim below d is partial RoPE (Qwen3-Next/Qwen3.5): the rest pass through unrotated.
    """
    rot = cos.shape[-1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # broadcast over heads
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
    rotated = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return rotated if rot == x.shape[-1] else torch.cat((rotated, x_pass), dim=-1)


# --- the static KV cache: write by position, read everything under a mask


def attention_mask(positions: torch.Tensor, cache_len: int) -> torch.Tensor:
    """`[B, 1, T, S]` bool: row t of request b sees slots 0..positions[b, t] (stale slots hidden)."""
    slots = torch.arange(cache_len, device=positions.device)
    return slots[None, None, None, :] <= positions[:, None, :, None]


def write_cache(cache: torch.Tensor, positions: torch.Tensor, value: torch.Tensor) -> None:
    """`cache[b, positions[b, t]] = value[b, t]` in place. cache `[B, S, ...]`, value `[B, T, ...]`."""
    batch = torch.arange(cache.shape[0], device=positions.device)
    cache[batch[:, None], positions] = value


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA over the whole cache. q `[B, Tq, hq, d]`, k `[B, S, hk, d]`, v `[B, S, hk, dv]`,
    mask `[B, 1, Tq, S]` -> `[B, Tq, hq, dv]`. Fewer K/V heads than query heads is GQA/MQA.

    Several tokens per request (a verify, a catch-up, a prefill): GQA is folded into the query axis,
    as the MLA layer folds its heads. The g = hq / hk query heads of a K/V head become g rows per
    token, `[B, hk, Tq * g, d]` (token-major, so a row gather on Tq still maps to whole blocks of
    rows), and each K/V head is read once; with an explicit mask, `enable_gqa` goes to kernels that
    read K/V once per query head. On CUDA, a few such rows (Tq * g <= 64, Tq static: a verify or a
    catch-up; a prefill's symbolic length keeps SDPA and one graph for every length) go to the
    library's split-KV op `torch.ops.specpass.attend_split` instead: SDPA runs one program per
    (request, K/V head) over every slot, 128 programs at bs 16 (cuDNN: 187 µs at 16 x 4K slots, H100, against 128 µs
    split; faster at every verify shape measured, benchmarks/verify_attention.py). One token per
    request (a decode or draft step) stays SDPA's own GQA, the call transformers makes: folded, its
    g rows go through other matmul paths than one row and round differently (CPU), which flips near
    ties of plain decoding against transformers'.
    Never `is_causal=True`: its mask is top-left aligned, wrong once the cache holds a prefix.
    """
    B, T, hq, d = q.shape
    g = hq // v.shape[2]
    if g == 1 or T == 1:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=scale, enable_gqa=g != 1)
        return out.transpose(1, 2)
    if attend_split_refusal(q, k, v, mask) is None:  # CUDA, T * g <= 64 (symbolic T: refused, no guard), ...
        return torch.ops.specpass.attend_split(q, k, v, mask, scale)
    return attend_folded(q, k, v, mask, scale)


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
        self.register_buffer("k_cache", None, persistent=False)  # [B, S, n_kv, head_dim]
        self.register_buffer("v_cache", None, persistent=False)

    def setup_cache(self, max_batch: int, max_len: int, device, dtype) -> None:
        shape = (max_batch, max_len, self.n_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)

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
        out = attend(q, self.k_cache, self.v_cache, mask, self.head_dim**-0.5)  # ... then all of it is read
        return self.output(out, gate)  # [B, T, H]


class SwiGLU(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x)), Hugging Face names."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). Attention and MLP are plugged in."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.mlp = mlp

    def forward(self, x, rope_cs, mask, positions):
        h = x + self.self_attn(self.input_layernorm(x), rope_cs, mask, positions)
        return h + self.mlp(self.post_attention_layernorm(h))


def select_live(x: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Row `live[b]` of request b: `[B, T, ...] -> [B, ...]`. The one row per request sampled."""
    return x[torch.arange(x.shape[0], device=x.device), live]


class CachedModel(nn.Module):
    """A model whose attention layers own static caches, allocated by `setup_caches`."""

    cache_len: int | None = None
    cache_batch: int | None = None

    def setup_caches(self, max_batch: int, max_len: int, device=None, dtype=None) -> None:
        """(Re)allocate every layer's cache `[max_batch, max_len, ...]`, zeroed.

        Calls must then pass exactly `max_batch` requests (static shapes: the engine pads the
        batch) and positions below `max_len`. Defaults: the parameters' device and dtype.
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
        if positions.shape[0] != self.cache_batch:
            raise ValueError(f"{positions.shape[0]} requests, but the caches hold {self.cache_batch}: "
                             "pad the batch or call setup_caches again")
        return attention_mask(positions, self.cache_len)


class Draft(CachedModel):
    """The draft interface. A subclass defines `forward_rows`; catch-up and draft steps reuse it.

    `forward_rows(tokens [B, T], positions [B, T], hidden) -> (logits [B, T, V], hidden_out [B, T, H])`
    runs every row (writing every row's K/V); `hidden_out` is the pre-final-norm hidden state.
    """

    def forward_rows(self, tokens, positions, hidden):
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

"""DeepSeek-V3 building blocks: Multi-head Latent Attention (absorbed, decode form) and the MoE.

Modelled on DeepSeek-V3 (arXiv 2412.19437) and Hugging Face's `DeepseekV3Attention` /
`DeepseekV3MoE` (transformers 5 names: fused 3-D expert weights `experts.gate_up_proj
[E, 2I, H]`, `experts.down_proj [E, H, I]`, router `gate.weight`, `gate.e_score_correction_bias`).
Differences, none of which changes the graph's structure: RoPE is the plain rotate-half form
(DeepSeek's checkpoints store the rope features interleaved and HF permutes them; YaRN scaling
and its softmax-scale correction are not modelled).

MLA, absorbed: the cache holds the compressed latent `c_kv [B, S, kv_lora_rank]` (after
`kv_a_layernorm`) and the shared rope key `k_rope [B, S, qk_rope_head_dim]` — not per-head K/V.
W_UK (the K half of `kv_b_proj`) is folded into the query, W_UV (the V half) applied after
attention, so attention runs over the latent directly: q = [q_nope·W_UK, q_rope], k = [c_kv,
k_rope], v = c_kv, one KV head for all query heads (MQA). The query heads are folded into the
query rows, `[B, T·heads, 1, r + d_rope]` token-major (FlashMLA's layout): no fused SDPA kernel
takes 128 heads of dim 576 against one KV head, and with the fold a memory-efficient kernel
runs it instead of the math kernel's 128-fold copy of the cache.

MoE routing, as DeepSeek-V3: sigmoid scores; `e_score_correction_bias` added to choose experts
only; experts in `n_group` groups, the best `topk_group` groups (by their top-2 sum) kept, top-k
experts among them; weights = chosen raw scores, renormalised (`norm_topk_prob`), times
`routed_scaling_factor`; plus a shared expert. Qwen3-Next/Qwen3.5 routing (softmax top-k,
renormalised, sigmoid-gated shared expert) is the same module with `scoring_func="softmax"`.

Two static-shape forms of the routed experts (`moe_impl`):
  "dense"    every token through every expert, weighted by its routing weight (zero where not
             chosen). Row-local in the tokens: each output row depends on its own input row
             only, so a live-row pass may move a row gather up through it (E/k times the FLOPs).
  "dispatch" what an engine runs: sort the (token, expert) assignments by expert, gather the
             token rows, one grouped GEMM per projection (per-expert offsets), scale,
             `index_add_` back to the token rows. The gather by a computed permutation and the
             scatter-add mix rows: a live-row pass must stop here (or prove the permutation
             row-preserving, which it is not in general). The grouped GEMM is an opaque custom
             op, `specpass_zoo::grouped_mm`, as engines' fused-MoE kernels are; it also has to
             be: `aten._grouped_mm`'s fake kernel accepts bf16 only, so an fp32 graph could not
             be traced through it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import library

from specpass.drafters.attention import attend, copy_cache, live, write_cache
from specpass.drafters.layers import SwiGLU
from specpass.drafters.rope import apply_rope

_aten_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm  # public from torch 2.10 on


@library.custom_op("specpass_zoo::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows a[offs[e-1]:offs[e]] times b[e]: a [M, K], b [E, K, N], offs [E] int32 -> [M, N]."""
    if a.is_cuda and a.dtype != torch.bfloat16:  # CUDA's grouped GEMM is bf16 only: loop instead
        out, start = a.new_empty(a.shape[0], b.shape[-1]), 0
        for e, end in enumerate(offs.tolist()):
            out[start:end] = a[start:end] @ b[e]
            start = end
        return out
    return _aten_grouped_mm(a, b, offs=offs)


@grouped_mm.register_fake
def _(a, b, offs):
    return a.new_empty(a.shape[0], b.shape[-1])


class MLAAttention(nn.Module):
    """DeepSeek-V3 MLA over a latent cache (see module docstring). `in_features` is 2H in EAGLE-3."""

    def __init__(self, config, in_features: int | None = None):
        super().__init__()
        in_features = in_features or config.hidden_size
        self.n_heads = config.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.q_a_proj = nn.Linear(in_features, self.q_lora_rank, bias=False)
        self.q_a_layernorm = nn.RMSNorm(self.q_lora_rank, eps=config.rms_norm_eps)
        self.q_b_proj = nn.Linear(self.q_lora_rank, self.n_heads * (self.nope + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(in_features, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, config.hidden_size, bias=False)
        self.scale = (self.nope + self.rope_dim) ** -0.5  # of the un-absorbed per-head dot product
        self.register_buffer("c_kv_cache", None, persistent=False)  # [capacity, S, kv_lora_rank]
        self.register_buffer("k_rope_cache", None, persistent=False)  # [capacity, S, qk_rope_head_dim]

    def setup_cache(self, max_batch: int, max_len: int, device, dtype) -> None:
        self.c_kv_cache = torch.zeros(max_batch, max_len, self.kv_lora_rank, device=device, dtype=dtype)
        self.k_rope_cache = torch.zeros(max_batch, max_len, self.rope_dim, device=device, dtype=dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        copy_cache(self.c_kv_cache, src, dst)
        copy_cache(self.k_rope_cache, src, dst)

    def project(self, x: torch.Tensor, rope_cs):
        """-> q_nope [B,T,h,nope], q_rope [B,T,h,dr], c_kv [B,T,r], k_rope [B,T,dr] (roped)."""
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, self.n_heads, self.nope + self.rope_dim)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_rope = apply_rope(q_rope, *rope_cs)
        k_rope = apply_rope(k_rope[:, :, None, :], *rope_cs)[:, :, 0, :]  # one rope key shared by all heads
        return q_nope, q_rope, self.kv_a_layernorm(c_kv), k_rope

    def kv_b_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [h, nope, r] and W_UV [h, v, r]: the two halves of kv_b_proj, per head."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope:]

    def forward(self, x: torch.Tensor, rope_cs, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h, r = self.n_heads, self.kv_lora_rank
        q_nope, q_rope, c_kv, k_rope = self.project(x, rope_cs)
        write_cache(self.c_kv_cache, positions, c_kv)  # the latent write: every row
        write_cache(self.k_rope_cache, positions, k_rope)
        w_uk, w_uv = self.kv_b_weights()
        q_latent = torch.einsum("bthn,hnr->bthr", q_nope, w_uk)  # absorb W_UK: [B, T, h, r]
        q = torch.cat([q_latent, q_rope], dim=-1).reshape(B, T * h, 1, r + self.rope_dim)  # heads -> rows
        c_kv_cache = live(self.c_kv_cache, B)
        k = torch.cat([c_kv_cache, live(self.k_rope_cache, B)], dim=-1)[:, :, None, :]  # [B, S, 1, r + dr]
        v = c_kv_cache[:, :, None, :]  # [B, S, 1, r]
        S = k.shape[1]
        row_mask = mask[:, :, :, None, :].expand(B, 1, T, h, S).reshape(B, 1, T * h, S)
        out = attend(q, k, v, row_mask, self.scale).view(B, T, h, r)  # attention over the latent
        out = torch.einsum("bthr,hvr->bthv", out, w_uv)  # W_UV: latent -> per-head values [B, T, h, v]
        return self.o_proj(out.reshape(B, T, h * self.v_dim))


class Router(nn.Module):
    """Top-k expert choice (DeepSeek-V3 grouped sigmoid, or softmax); HF's `gate` module names."""

    def __init__(self, config):
        super().__init__()
        self.n_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.scoring = config.scoring_func
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.n_experts, config.hidden_size))
        if self.scoring == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] -> (weights [..., k] in x's dtype, expert ids [..., k]); row-local."""
        logits = F.linear(x.float(), self.weight.float())  # [..., E], fp32 as DeepSeek-V3 does
        if self.scoring == "softmax":
            scores = logits.softmax(dim=-1)
            weights, ids = scores.topk(self.top_k, dim=-1)
        else:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias  # the bias steers the choice, not the weights
            if self.n_group > 1:
                grouped = choice.unflatten(-1, (self.n_group, self.n_experts // self.n_group))
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [..., G]
                best = group_scores.topk(self.topk_group, dim=-1).indices
                keep = torch.zeros_like(group_scores).scatter(-1, best, 1.0).bool()
                keep = keep[..., None].expand(grouped.shape).flatten(-2)  # [..., E]
                choice = choice.masked_fill(~keep, float("-inf"))
            ids = choice.topk(self.top_k, dim=-1).indices
            weights = scores.gather(-1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.scaling).to(x.dtype), ids


class Experts(nn.Module):
    """The routed experts' weights, stacked (transformers 5 layout), in either static form."""

    def __init__(self, config):
        super().__init__()
        E, H, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))
        self.impl = config.moe_impl

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.dense(x, weights, ids) if self.impl == "dense" else self.dispatch(x, weights, ids)

    def dense(self, x, weights, ids):
        """x [..., H]: every token through every expert; row-local (see module docstring)."""
        out = None
        for e in range(self.gate_up_proj.shape[0]):
            weight = (weights * (ids == e)).sum(dim=-1, keepdim=True)  # [..., 1], zero if e not chosen
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weight
            out = y if out is None else out + y
        return out

    def dispatch(self, x, weights, ids):
        """Engine form: sort by expert, gather, grouped GEMM, scatter-add. Mixes rows."""
        shape, H = x.shape, x.shape[-1]
        E, k = self.gate_up_proj.shape[0], ids.shape[-1]
        x = x.reshape(-1, H)  # [N, H]
        expert = ids.reshape(-1)  # [N*k], assignment j is token j // k
        order = expert.argsort(stable=True)  # assignments grouped by expert
        token = order // k  # [N*k] the token row of each sorted assignment
        ends = torch.searchsorted(expert[order], torch.arange(E, device=x.device), right=True)
        offs = ends.to(torch.int32)  # [E] end of each expert's group (static shape: no bincount)
        gate, up = grouped_mm(x[token], self.gate_up_proj.transpose(1, 2), offs).chunk(2, dim=-1)
        y = grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs)  # [N*k, H]
        y = y * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, y).view(shape)


class MoE(nn.Module):
    """Routed experts + shared expert (DeepSeek-V3), optionally sigmoid-gated (Qwen3-Next)."""

    def __init__(self, config):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_experts = SwiGLU(config.hidden_size, config.shared_expert_intermediate_size)
        if config.shared_expert_gate:
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.gated_shared = config.shared_expert_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        shared = self.shared_experts(x)
        if self.gated_shared:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return self.experts(x, weights, ids) + shared

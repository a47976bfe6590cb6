"""DFlash block drafting (arXiv 2602.06036; z-lab/dflash's `DFlashDraftModel`, vLLM's `method: dflash`,
SGLang's DFLASH): one forward of a small non-causal draft makes a whole block of drafts.

The draft is Qwen3-style decoder layers (q/k norms) with no embedding and no lm_head of its own: it
reads ids with the target's input embedding and scores its drafts with the target's lm_head, both
held by reference. Per round, with n the position of the last verified token x_n and a accepted:

    ctx   = hidden_norm(fc(cat(the target's layer outputs at target_layer_ids)))   [B, T, H]
            the verified rows' states (positions n..n+K; the prefill's: the prompt's)
    block = embed([the bonus token, mask_token_id x K]) * input_embedding_scale    [B, K+1, H]
            at positions n+a+1 .. n+a+K+1
    each layer: the context's K/V (k_proj, k_norm, RoPE; v_proj) written at its positions, then
                the block's, then the block's queries attend to every slot up to the block's end,
                with no causal mask inside the block
    drafts = lm_head(norm(h[:, 1:])) * output_multiplier, softcapped                [B, K, V]

The cache needs no rollback: a round writes the context at n..n+K (rows after the live one are
rejected drafts' states), then the block over n+a+1..n+a+K+1, which covers every rejected row; the
next round's context starts at n+a+1 and overwrites the block before anything reads it. Every slot a
block sees below its start holds an accepted position's context.

The round is the parallel one (specpass/loop/parallel.py): the drafter is a `ParallelDrafter` whose
`draft_parallel` is the block forward, and its `catch_up` the same forward at K 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from specpass.drafters.attention import Attention, attend, live, write_cache
from specpass.drafters.base import CachedModel
from specpass.drafters.config import ConfigBase, check_llama_block
from specpass.drafters.layers import DecoderLayer, SwiGLU
from specpass.drafters.rope import apply_rope, read_rope, rope

ARCHITECTURES = ("DFlashDraftModel",)
OPTIONS = ("target_layer_ids", "mask_token_id", "block_size", "input_embedding_scale", "output_multiplier",
           "final_logit_softcapping")
DFLASH2 = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # config fields
DFLASH2_MODULES = ("attention_conv", "mlp_conv", "candidate_selector")  # tensor name parts


@dataclasses.dataclass
class DFlashConfig(ConfigBase):
    hidden_size: int  # the target's: the draft reads its embedding and feeds its lm_head
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    target_layer_ids: list[int]  # the target's decoder layers (0-based) whose outputs the context reads
    mask_token_id: int
    block_size: int = 16  # the block it was trained on: the bonus token and K = block_size - 1 drafts
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: dict[str, float] | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None  # None or 0: none

    model_type = "qwen3"

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        ids = self.target_layer_ids
        if not (isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise ValueError(f"target_layer_ids must be a non-empty list of layer indices, got {ids!r}")
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"block_size must be an int >= 2 (the bonus token and at least one draft), "
                             f"got {self.block_size!r}")
        if not (isinstance(self.mask_token_id, int) and 0 <= self.mask_token_id < self.vocab_size):
            raise ValueError(f"mask_token_id must be a token id below vocab_size {self.vocab_size}, "
                             f"got {self.mask_token_id!r}")
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be at least 1, got {self.num_hidden_layers}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")

    def architectures(self) -> list[str]:
        return list(ARCHITECTURES)

    def to_dict(self) -> dict[str, Any]:
        """As z-lab's checkpoints write it: the options under `dflash_config`, block_size at the top."""
        d = super().to_dict()
        d["dflash_config"] = {key: d.pop(key) for key in OPTIONS if key != "block_size"}
        return {**d, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False}

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        """A config.json as z-lab's checkpoints write it: the options under `dflash_config` (DFlash2 also
        puts block_size there), `rope_theta` or `rope_parameters`. DFlash2's convolutions and
        candidate selector, causal or sliding-window layers are refused, named."""
        check_llama_block(d)
        options = d.get("dflash_config")
        if not isinstance(options, dict):
            raise ValueError(f"dflash_config must be an object holding {list(OPTIONS[:2])}, got {options!r}")
        dflash2 = [key for key in DFLASH2 if options.get(key) is not None or d.get(key) is not None]
        if dflash2:
            raise ValueError(f"DFlash2 fields {dflash2} (per-layer grouped convolutions, a candidate selector) "
                             f"are not modelled: only DFlash's layers are; use a DFlash (not DFlash2) checkpoint")
        if d.get("is_causal") or options.get("causal") or "sliding_attention" in (d.get("layer_types") or []):
            raise ValueError("causal or sliding-window draft layers (is_causal, layer_types 'sliding_attention') "
                             "are not modelled: DFlash's layers attend to the whole block and context")
        theta, scaling = read_rope(d)
        d = {**{k: v for k, v in d.items() if v is not None}, **{k: v for k, v in options.items() if k in OPTIONS and v is not None},
             "rope_scaling": scaling}
        if theta is not None:
            d["rope_theta"] = theta
        return super().from_dict(d)

    @property
    def hidden_kind(self) -> str:
        """The target states it reads (`Target.forward_with_hidden`'s kind)."""
        return "layers:" + ",".join(map(str, self.target_layer_ids))


class DFlashAttention(Attention):
    """Qwen3's attention (q/k norms) whose keys and values are the context's and the block's."""

    def context_kv(self, ctx: torch.Tensor, rope_ctx: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The context's keys and values, ctx [B, T, H] -> [B, T, n_kv, d] each: k_proj, k_norm and RoPE
        on the keys, v_proj alone on the values (the context does not go through the layer's norm)."""
        B, T, _ = ctx.shape
        k = self.k_norm(self.k_proj(ctx).view(B, T, self.n_kv_heads, self.head_dim))
        return apply_rope(k, *rope_ctx), self.v_proj(ctx).view(B, T, self.n_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, rope_x: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
                slots: torch.Tensor, ctx: torch.Tensor, rope_ctx: tuple[torch.Tensor, torch.Tensor],
                ctx_slots: torch.Tensor) -> torch.Tensor:
        """x [B, K+1, H] the block at `slots`, ctx [B, T, H] the context at `ctx_slots`, mask
        [B, 1, K+1, S] -> [B, K+1, H]. The context's K/V are written first: the block's overwrite the
        rejected rows' slots."""
        k_ctx, v_ctx = self.context_kv(ctx, rope_ctx)
        write_cache(self.k_cache, ctx_slots, k_ctx)
        write_cache(self.v_cache, ctx_slots, v_ctx)
        q, k, v, _ = self.project(x, rope_x)
        write_cache(self.k_cache, slots, k)
        write_cache(self.v_cache, slots, v)
        B = x.shape[0]
        out = attend(q, live(self.k_cache, B), live(self.v_cache, B), mask, self.head_dim**-0.5)
        return self.output(out, None)


class DFlashLayer(DecoderLayer):
    def forward(self, x, rope_x, mask, slots, ctx, rope_ctx, ctx_slots):
        h = x + self.self_attn(self.input_layernorm(x), rope_x, mask, slots, ctx, rope_ctx, ctx_slots)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(CachedModel):
    """A DFlash draft as a `specpass.ParallelDrafter`, over the target's input embedding and lm_head
    (held, not copied: `embed_tokens` and `lm_head` are the target's modules)."""

    drafts_nest = False  # the block attends both ways: each draft depends on the masks after it, so on K

    def __init__(self, config: DFlashConfig, embed_tokens: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.config = config
        self.hidden_kind = config.hidden_kind
        H = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([
            DFlashLayer(DFlashAttention(config, qk_norm=True), SwiGLU(H, config.intermediate_size), H,
                        config.rms_norm_eps) for _ in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head

    def draft_parallel(self, tokens: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                       live: torch.Tensor, k: int) -> torch.Tensor:
        """tokens, positions [B, T] (row t: the token at positions[b, t]), hidden [B, T, n·H] (row t: the
        target's states at positions[b, t] - 1), live [B] the last verified row -> logits [B, K, V]:
        row j predicts the token at positions[b, live[b]] + 1 + j."""
        config = self.config
        B = tokens.shape[0]
        rows = torch.arange(B, device=tokens.device)
        offsets = torch.arange(k + 1, device=tokens.device)  # [K+1]
        slots = positions[rows, live][:, None] + offsets  # [B, K+1] the block: the bonus token, then K masks
        block = torch.where(offsets == 0, tokens[rows, live][:, None], config.mask_token_id)  # [B, K+1]
        ctx_slots = positions - 1  # [B, T] the states' own positions
        ctx = self.hidden_norm(self.fc(hidden))  # [B, T, H]
        x = self.embed_tokens(block)  # [B, K+1, H]
        x = x * config.input_embedding_scale if config.input_embedding_scale != 1.0 else x
        mask = self.mask(slots[:, -1:].expand(B, k + 1))  # [B, 1, K+1, S]: up to the block's end, all of it
        head_dim, theta, scaling = config.head_dim, config.rope_theta, config.rope_scaling
        rope_x, rope_ctx = rope(slots, head_dim, theta, x.dtype, scaling), rope(ctx_slots, head_dim, theta, x.dtype, scaling)
        for layer in self.layers:
            x = layer(x, rope_x, mask, slots, ctx, rope_ctx, ctx_slots)
        logits = self.lm_head(self.norm(x[:, 1:]))  # [B, K, V]
        logits = logits * config.output_multiplier if config.output_multiplier != 1.0 else logits
        cap = config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def catch_up(self, tokens: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                 live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block forward at K 1 -> (logits [B, V] of the token after row live[b], an empty hidden [B, 0])."""
        logits = self.draft_parallel(tokens, positions, hidden, live, 1)[:, 0]
        return logits, logits[:, :0]

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids  # the target's vocabulary

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

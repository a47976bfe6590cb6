"""NextN / MTP draft layers: DeepSeek-V3's and Qwen3.5's (Qwen3-Next's) multi-token prediction.

Modelled on DeepSeek-V3's MTP module (arXiv 2412.19437 §2.2; the extra layer 61 of the
checkpoint, SGLang's `DeepseekV3ForCausalLMNextN`) and on Qwen3-Next/Qwen3.5's MTP layer
(SGLang/TokenSpeed `Qwen3_5ForConditionalGenerationNextN`). One class, two layer types:

    x = eh_proj(cat(enorm(embed(token)), hnorm(hidden)))      [B, T, 2H] -> [B, T, H]
    h = decoder(x)                                            one pre-norm decoder layer
    logits = shared_head.head(shared_head.norm(h)); hidden_out = h (pre-norm)

  attention="mla":   DeepSeek-V3 MLA (absorbed, latent cache; models/deepseek.py)
  attention="gated": Qwen3.5 full attention: GQA with q/k RMSNorm per head, a sigmoid output
                     gate from q_proj, partial RoPE (`partial_rotary_factor` of head_dim)
  mlp="moe":         DeepSeek-V3 MoE (or, with scoring_func="softmax" and shared_expert_gate,
                     Qwen3-Next's); mlp="dense": SwiGLU

Checkpoint names follow DeepSeek-V3's MTP layer without its `model.layers.61.` prefix
(`embed_tokens`, `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, `shared_head.head`), with the
decoder layer's tensors under `decoder.` (SGLang's name; DeepSeek stores them flat). Qwen3-Next's
names map one to one: `mtp.pre_fc_norm_embedding` = enorm, `mtp.pre_fc_norm_hidden` = hnorm,
`mtp.fc` = eh_proj, `mtp.layers.0` = decoder, `mtp.norm` = shared_head.norm, lm_head =
shared_head.head. Qwen's zero-centred RMSNorm (x·(1+w)) is stored here as a plain weight (1+w).
The embedding and head are the target's in practice; the checkpoint carries them, as DeepSeek's does.

How a caller drives it (row t pairs the token at position p+t with the target's last hidden
state, before its final norm, at position p+t-1):

    catch_up(tokens [B, T], positions [B, T], hidden [B, T, H], live [B])
        hidden[b, t] = target.forward_with_hidden(..., "last")[b] at position p_b + t - 1;
        tokens, positions, live as for EAGLE-3 (models/eagle3.py)
    draft_step(tokens [B], positions [B], hidden [B, H])
        hidden = the previous step's hidden_out (the layer's own state, as SGLang chains MTP).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from models.deepseek import MLAAttention, MoE
from specpass.drafters.attention import Attention
from specpass.drafters.base import Draft
from specpass.drafters.config import ConfigBase
from specpass.drafters.layers import DecoderLayer, SwiGLU
from specpass.drafters.rope import rope


@dataclasses.dataclass
class NextNConfig(ConfigBase):
    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    attention: str  # "mla" (DeepSeek-V3) or "gated" (Qwen3.5)
    mlp: str  # "moe" or "dense"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    # attention="gated"
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    partial_rotary_factor: float = 1.0
    # attention="mla"
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # mlp="dense"
    intermediate_size: int | None = None
    # mlp="moe"
    n_routed_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    scoring_func: str = "sigmoid"  # DeepSeek-V3; "softmax": Qwen3-Next
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    shared_expert_gate: bool = False  # Qwen3-Next gates the shared expert by sigmoid(Linear(H, 1))
    moe_impl: str = "dense"  # "dense" (row-local) or "dispatch" (engine-style); see models/deepseek.py

    def __post_init__(self):
        needed = {
            ("attention", "mla"): ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
            ("attention", "gated"): ("num_key_value_heads", "head_dim"),
            ("mlp", "dense"): ("intermediate_size",),
            ("mlp", "moe"): ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                             "shared_expert_intermediate_size"),
        }
        for field in ("attention", "mlp"):
            value = getattr(self, field)
            if (field, value) not in needed:
                raise ValueError(f"{field}={value!r} is not one of {[v for f, v in needed if f == field]}")
            unset = [n for n in needed[field, value] if getattr(self, n) is None]
            if unset:
                raise ValueError(f"{field}={value!r} needs {unset}")
        if self.moe_impl not in ("dense", "dispatch"):
            raise ValueError(f"moe_impl must be 'dense' or 'dispatch', got {self.moe_impl!r}")
        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(f"scoring_func must be 'sigmoid' or 'softmax', got {self.scoring_func!r}")

    @property
    def model_type(self) -> str:  # type: ignore[override]
        return "deepseek_v3" if self.attention == "mla" else "qwen3_5_text"

    def architectures(self) -> list[str]:
        if self.attention == "mla":
            return ["DeepseekV3ForCausalLMNextN"]
        return ["Qwen3_5MoeForConditionalGenerationNextN" if self.mlp == "moe" else "Qwen3_5ForConditionalGenerationNextN"]

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim if self.attention == "mla" else int(self.head_dim * self.partial_rotary_factor)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "num_nextn_predict_layers": 1, "hidden_act": "silu"}


class NextN(Draft):
    config_class = NextNConfig
    architectures = ["DeepseekV3ForCausalLMNextN", "Qwen3_5ForConditionalGenerationNextN",
                     "Qwen3_5MoeForConditionalGenerationNextN"]

    def __init__(self, config: NextNConfig):
        super().__init__()
        self.config = config
        H, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.enorm = nn.RMSNorm(H, eps=eps)
        self.hnorm = nn.RMSNorm(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        attn = (MLAAttention(config) if config.attention == "mla"
                else Attention(config, qk_norm=True, output_gate=True))
        mlp = MoE(config) if config.mlp == "moe" else SwiGLU(H, config.intermediate_size)
        self.decoder = DecoderLayer(attn, mlp, H, eps)
        self.shared_head = nn.ModuleDict(dict(norm=nn.RMSNorm(H, eps=eps), head=nn.Linear(H, config.vocab_size, bias=False)))

    def forward_rows(self, tokens, positions, hidden, slots=None, mask=None):
        embeds = self.embed_tokens(tokens)  # [B, T, H]
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))  # [B, T, H]
        rope_cs = rope(positions, self.config.rotary_dim, self.config.rope_theta, x.dtype)
        h = self.decoder(x, rope_cs, *reversed(self.layout(positions, slots, mask)))
        return self.shared_head.head(self.shared_head.norm(h)), h  # [B, T, V], [B, T, H]

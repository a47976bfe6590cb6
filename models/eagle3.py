"""EAGLE-3 draft heads: the Llama one (GQA) and the DeepSeek one (MLA).

Modelled on EAGLE-3 (arXiv 2503.01840; SafeAILab/EAGLE `cnets.py`), SGLang/TokenSpeed's
`LlamaForCausalLMEagle3` and, for `attention="mla"`, TokenSpeed's `Eagle3DeepseekV2ForCausalLM`
(the same midlayer with DeepSeek-V3 MLA attention and a dense MLP).

    fc: [3·Ht] -> H            the three fused target hidden states (catch-up only)
    midlayer:                  one decoder layer whose attention input is 2H:
        x = cat(input_layernorm(embed(token)), hidden_norm(hidden))     [B, T, 2H]
        h = hidden + self_attn(x)      (the residual is the hidden branch)
        h = h + mlp(post_attention_layernorm(h))
    layers.1 .. N-1:           with num_hidden_layers N > 1, standard pre-norm decoder layers on h
    logits = lm_head(norm(h))  over the draft vocabulary; hidden_out = h (pre-norm)

Checkpoint layout: the public EAGLE-3 one — `fc.weight`, `midlayer.*`, `norm.weight`,
`lm_head.weight`, `d2t` (int64 [V_draft]) and `t2d` (bool [V_target]). A deeper head (config
`num_hidden_layers` N > 1) names its layers as vLLM's `llama_eagle3.py` loads them: `layers.0.*` is
the midlayer (vLLM reads a one-layer `midlayer.*` as `layers.0.*`), `layers.1.*` .. `layers.{N-1}.*`
plain decoder layers (`input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`). A draft
id maps back to a target id as `target_id = draft_id + d2t[draft_id]` (`to_target`); `t2d` marks
the target ids the draft vocabulary covers. The embedding is the target's: it is not in the checkpoint (key
`embed_tokens.weight` is in `checkpoint_excludes`); pass the target's tensor at load time,
`load(Eagle3Head, dir, shared={"embed_tokens.weight": target.model.embed_tokens.weight})`, and the
head uses it by reference (no copy when device and dtype match).

How a caller drives it (row t pairs the token at position p+t with the target's hidden state
at position p+t-1 — the state that predicted that token):

    catch_up(tokens [B, T], positions [B, T], hidden [B, T, 3Ht], live [B])
        tokens[b, t]    = the token at position positions[b, t] = p_b + t (the accepted tokens
                          of the round, then any padding)
        hidden[b, t]    = target.forward_with_hidden(..., "eagle3") at position p_b + t - 1
        live[b]         = index of request b's last valid row (accepted tokens - 1); rows after
                          it are padding: their K/V are written, never attended, and overwritten
                          by the next round.
        -> logits [B, V_draft] predicting position p_b + live[b] + 1, hidden_out [B, H]
    draft_step(tokens [B], positions [B], hidden [B, H])
        tokens = the draft token just sampled (mapped to a target id with `to_target`; the
        embedding is over the target vocabulary), positions = its position, hidden = the
        `hidden_out` of the previous step (the head's own state, no fc).

`forward_rows` runs all rows and returns all of them; it applies `fc` when the hidden input is
3·Ht wide (catch-up) and not when it is H wide (drafting), as EAGLE-3 does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from models.checkpoint import ConfigBase
from models.deepseek import MLAAttention
from models.layers import Attention, DecoderLayer, Draft, SwiGLU, rope


@dataclasses.dataclass
class Eagle3Config(ConfigBase):
    vocab_size: int  # the target's
    draft_vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # GQA only
    head_dim: int | None = None  # GQA only
    target_hidden_size: int | None = None  # None: hidden_size
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_position_embeddings: int = 8192
    num_hidden_layers: int = 1  # the midlayer, then N-1 decoder layers
    attention: str = "gqa"  # "gqa" (Llama) or "mla" (DeepSeek)
    q_lora_rank: int | None = None  # MLA only, from here on
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self):
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        needed = {"gqa": ("num_key_value_heads", "head_dim"),
                  "mla": ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
        if self.attention not in needed:
            raise ValueError(f"attention must be 'gqa' or 'mla', got {self.attention!r}")
        unset = [n for n in needed[self.attention] if getattr(self, n) is None]
        if unset:
            raise ValueError(f"attention={self.attention!r} needs {unset}")
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be at least 1 (the midlayer), got {self.num_hidden_layers}")

    @property
    def model_type(self) -> str:  # type: ignore[override]
        return "llama" if self.attention == "gqa" else "deepseek_v3"

    def architectures(self) -> list[str]:
        return ["LlamaForCausalLMEagle3" if self.attention == "gqa" else "Eagle3DeepseekV2ForCausalLM"]

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "hidden_act": "silu", "tie_word_embeddings": False}


def attention(config: Eagle3Config, in_features: int) -> nn.Module:
    return (Attention(config, in_features=in_features) if config.attention == "gqa"
            else MLAAttention(config, in_features=in_features))


class Eagle3Layer(nn.Module):
    """EAGLE-3's midlayer: embedding and hidden norms concatenated into a 2H attention input."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        H = config.hidden_size
        self.input_layernorm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.self_attn = attention(config, 2 * H)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.mlp = SwiGLU(H, config.intermediate_size)

    def forward(self, embeds, hidden, rope_cs, mask, positions):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        h = hidden + self.self_attn(x, rope_cs, mask, positions)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(Draft):
    config_class = Eagle3Config
    architectures = ["LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM"]
    checkpoint_excludes = ("embed_tokens.weight",)  # the target's embedding

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.fc = nn.Linear(3 * config.target_hidden_size, H, bias=False)
        if config.num_hidden_layers == 1:
            self.midlayer = Eagle3Layer(config)  # the public one-layer layout
        else:  # vLLM's deeper layout: the midlayer is layers.0
            self.layers = nn.ModuleList([Eagle3Layer(config)] + [
                DecoderLayer(attention(config, H), SwiGLU(H, config.intermediate_size), H, config.rms_norm_eps)
                for _ in range(config.num_hidden_layers - 1)])
        self.norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rope_dim = config.head_dim if config.attention == "gqa" else config.qk_rope_head_dim

    def forward_rows(self, tokens, positions, hidden):
        if hidden.shape[-1] == self.fc.in_features:
            hidden = self.fc(hidden)  # catch-up: the target's fused states [B, T, 3Ht] -> [B, T, H]
        elif hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(f"hidden must be [.., {self.fc.in_features}] (target) or "
                             f"[.., {self.config.hidden_size}] (own), got {list(hidden.shape)}")
        embeds = self.embed_tokens(tokens)  # [B, T, H]
        rope_cs = rope(positions, self.rope_dim, self.config.rope_theta, embeds.dtype)
        mask = self.mask(positions)
        first, *rest = self.decoder_layers
        h = first(embeds, hidden, rope_cs, mask, positions)
        for layer in rest:
            h = layer(h, rope_cs, mask, positions)
        return self.lm_head(self.norm(h)), h  # [B, T, V_draft], [B, T, H]

    @property
    def decoder_layers(self) -> list[nn.Module]:
        """The midlayer, then the decoder layers after it (N > 1)."""
        return [self.midlayer] if self.config.num_hidden_layers == 1 else list(self.layers)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target-vocabulary ids (the public `d2t` offset convention)."""
        return draft_ids + self.d2t[draft_ids]

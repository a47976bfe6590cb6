"""The EAGLE-3 draft head for Llama-style targets (GQA attention).

Modelled on EAGLE-3 (arXiv 2503.01840; SafeAILab/EAGLE `cnets.py`), SGLang/TokenSpeed's and vLLM's
`LlamaForCausalLMEagle3`:

    fc: [3·Ht] -> H            the three fused target hidden states (catch-up only)
    midlayer:                  one decoder layer whose attention input is 2H:
        x = cat(input_layernorm(embed(token)), hidden_norm(hidden))     [B, T, 2H]
        h = hidden + self_attn(x)      (the residual is the hidden branch)
        h = h + mlp(post_attention_layernorm(h))
    layers.1 .. N-1:           with num_hidden_layers N > 1, standard pre-norm decoder layers on h
    logits = lm_head(norm(h))  over the draft vocabulary; hidden_out = h (pre-norm)

A draft id maps back to a target id as `target_id = draft_id + d2t[draft_id]` (`to_target`); `t2d`
marks the target ids the draft vocabulary covers. The embedding is the target's in public
checkpoints (the loader shares it by reference).

How a caller drives it (row t pairs the token at position p+t with the target's hidden state at
position p+t-1, the state that predicted that token):

    catch_up(tokens [B, T], positions [B, T], hidden [B, T, 3·Ht], live [B])
        tokens[b, t]   = the token at position p_b + t (accepted tokens, then padding)
        hidden[b, t]   = the target's fused states at position p_b + t - 1
        live[b]        = index of request b's last accepted row; rows after it are padding, their
                         K/V written to slots the next round overwrites
        -> logits [B, V_draft] predicting position p_b + live[b] + 1, hidden_out [B, H]
    draft_step(tokens [B], positions [B], hidden [B, H])
        tokens = the draft token just sampled (mapped to a target id with `to_target`; the
        embedding is over the target vocabulary), positions = its position, hidden = the
        `hidden_out` of the previous step (the head's own state, no fc).

`forward_rows` runs all rows and returns all of them; it applies `fc` when the hidden input is
3·Ht wide (catch-up) and not when it is H wide (drafting), as EAGLE-3 does. The loop's adapter
(drafters/adapter.py) shifts positions by one: the draft cache's slot s holds token s+1.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from specpass.drafters.attention import Attention
from specpass.drafters.base import Draft
from specpass.drafters.config import ConfigBase, check_llama_block
from specpass.drafters.layers import DecoderLayer, SwiGLU
from specpass.drafters.rope import LLAMA3_KEYS, read_rope, rope

# What a public config.json means by a key it leaves out: transformers' LlamaConfig defaults, which
# vLLM and SGLang read EAGLE-3 configs with.
PUBLIC_DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6}


@dataclasses.dataclass
class Eagle3Config(ConfigBase):
    vocab_size: int  # the target's
    draft_vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None: num_attention_heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    target_hidden_size: int | None = None  # None: hidden_size
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_position_embeddings: int = 8192
    num_hidden_layers: int = 1  # the midlayer, then N-1 decoder layers
    rope_scaling: dict[str, float] | None = None  # Llama-3.1's llama3 parameters (drafters/rope.py)

    model_type = "llama"

    def __post_init__(self):
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be at least 1 (the midlayer), got {self.num_hidden_layers}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.rope_scaling is not None and set(self.rope_scaling) != set(LLAMA3_KEYS):
            raise ValueError(f"rope_scaling holds the llama3 parameters {list(LLAMA3_KEYS)}, got {self.rope_scaling}")

    def architectures(self) -> list[str]:
        return ["LlamaForCausalLMEagle3"]

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "hidden_act": "silu", "tie_word_embeddings": False}

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        """A config.json as EAGLE-3 trainers write it: `rope_scaling` or `rope_parameters`, keys left
        out meaning transformers' LlamaConfig defaults (`PUBLIC_DEFAULTS`)."""
        check_llama_block(d)
        theta, scaling = read_rope(d)
        d = {**PUBLIC_DEFAULTS, **{k: v for k, v in d.items() if v is not None}, "rope_scaling": scaling}
        if theta is not None:
            d["rope_theta"] = theta
        return super().from_dict(d)


class Eagle3Layer(nn.Module):
    """EAGLE-3's midlayer: embedding and hidden norms concatenated into a 2H attention input."""

    def __init__(self, config: Eagle3Config, self_attn: nn.Module):
        super().__init__()
        H = config.hidden_size
        self.input_layernorm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.mlp = SwiGLU(H, config.intermediate_size)

    def forward(self, embeds, hidden, rope_cs, mask, positions):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        h = hidden + self.self_attn(x, rope_cs, mask, positions)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(Draft):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.fc = nn.Linear(3 * config.target_hidden_size, H, bias=False)
        if config.num_hidden_layers == 1:
            self.midlayer = Eagle3Layer(config, self.attention(2 * H))  # the public one-layer layout
        else:  # vLLM's deeper layout: the midlayer is layers.0
            self.layers = nn.ModuleList([Eagle3Layer(config, self.attention(2 * H))] + [
                DecoderLayer(self.attention(H), SwiGLU(H, config.intermediate_size), H, config.rms_norm_eps)
                for _ in range(config.num_hidden_layers - 1)])
        self.norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    def attention(self, in_features: int) -> nn.Module:
        """Every layer's attention: Llama's GQA (a subclass may plug in another, e.g. the zoo's MLA)."""
        return Attention(self.config, in_features=in_features)

    @property
    def rope_dim(self) -> int:
        return self.config.head_dim

    def forward_rows(self, tokens, positions, hidden, slots=None, mask=None):
        if hidden.shape[-1] == self.fc.in_features:
            hidden = self.fc(hidden)  # catch-up: the target's fused states [B, T, 3Ht] -> [B, T, H]
        elif hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(f"hidden must be [.., {self.fc.in_features}] (target) or "
                             f"[.., {self.config.hidden_size}] (own), got {list(hidden.shape)}")
        embeds = self.embed_tokens(tokens)  # [B, T, H]
        rope_cs = rope(positions, self.rope_dim, self.config.rope_theta, embeds.dtype, self.config.rope_scaling)
        slots, mask = self.layout(positions, slots, mask)
        first, *rest = self.decoder_layers
        h = first(embeds, hidden, rope_cs, mask, slots)
        for layer in rest:
            h = layer(h, rope_cs, mask, slots)
        return self.lm_head(self.norm(h)), h  # [B, T, V_draft], [B, T, H]

    @property
    def decoder_layers(self) -> list[nn.Module]:
        """The midlayer, then the decoder layers after it (N > 1)."""
        return [self.midlayer] if self.config.num_hidden_layers == 1 else list(self.layers)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target-vocabulary ids (the public `d2t` offset convention)."""
        return draft_ids + self.d2t[draft_ids]

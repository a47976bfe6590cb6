"""Llama (Llama-2/3 architecture): the target model, and, with a small config, the standalone draft.

Modelled on Hugging Face's `LlamaForCausalLM` and gpt-fast: GQA, RoPE (`rope_theta`, default
rope type), RMSNorm, SwiGLU, optional tied embeddings, explicit `head_dim`. Parameter names are
Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, ...), so one safetensors folder loads
into both this class and `transformers.LlamaForCausalLM`, with the same logits.

Target use (a static KV cache addressed by per-request position):

    model.setup_caches(max_batch=B, max_len=S)
    logits = model(tokens, positions)                                  # [B, T, V]
    logits, aux = model.forward_with_hidden(tokens, positions, "eagle3")  # aux: [B, T, 3H]
    logits, last = model.forward_with_hidden(tokens, positions, "last")   # last: [B, T, H]
    logits, ctx = model.forward_with_hidden(tokens, positions, "layers:1,3")  # ctx: [B, T, 2H]

"eagle3" is what an EAGLE-3 head consumes: the hidden states Hugging Face reports as
`output_hidden_states[i]` for i in (2, L//2, L-3) — the outputs of decoder layers 2, L/2 and
L-3 counting from 1, i.e. the inputs of 0-based layers 2, L//2, L-3, as EAGLE-3, SGLang and
vLLM capture them — concatenated in that order. "last" is what an MTP/NextN layer consumes: the
last layer's output before the final norm. "layers:i,j,.." is what a DFlash draft consumes: the
outputs of 0-based layers i, j, .. (`specpass.loop.protocols.hidden_indices`).

Draft use (the `Draft` interface, `hidden` unused): `catch_up(tokens, positions, None, live)`
and `draft_step(tokens, positions, None)` return (logits, pre-final-norm hidden) of the live row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from specpass.drafters.attention import Attention
from specpass.drafters.base import Draft
from specpass.drafters.config import ConfigBase, check_llama_block
from specpass.drafters.files import CheckpointError
from specpass.drafters.layers import DecoderLayer, SwiGLU
from specpass.drafters.rope import read_rope, rope
from specpass.loop.protocols import hidden_indices


@dataclasses.dataclass
class LlamaConfig(ConfigBase):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192

    model_type = "llama"

    def architectures(self) -> list[str]:
        return ["LlamaForCausalLM"]

    def to_dict(self) -> dict[str, Any]:
        # What transformers.LlamaConfig reads; no bos/eos so that generate() never stops early.
        return {**super().to_dict(), "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
                "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        d = dict(d)
        theta, scaling = read_rope(d)
        if scaling is not None:
            raise CheckpointError("rope type 'llama3' is not modelled by the zoo's Llama; only the default RoPE is "
                                  "(specpass.drafters' EAGLE-3 heads take it)")
        if theta is not None:
            d["rope_theta"] = theta
        if d.get("head_dim") is None and "hidden_size" in d and "num_attention_heads" in d:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]  # HF's default
        if d.get("num_key_value_heads") is None and "num_attention_heads" in d:
            d["num_key_value_heads"] = d["num_attention_heads"]
        check_llama_block(d)
        return super().from_dict(d)


class Llama(Draft):
    config_class = LlamaConfig
    architectures = ["LlamaForCausalLM"]

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(config.vocab_size, H),
            layers=nn.ModuleList(
                DecoderLayer(Attention(config), SwiGLU(H, config.intermediate_size), H, config.rms_norm_eps)
                for _ in range(config.num_hidden_layers)),
            norm=nn.RMSNorm(H, eps=config.rms_norm_eps),
        ))
        self.lm_head = nn.Linear(H, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def eagle3_layers(self) -> tuple[int, ...]:
        """Indices into HF's output_hidden_states (= inputs of these 0-based layers) EAGLE-3 fuses."""
        return hidden_indices("eagle3", self.config.num_hidden_layers)

    def _layers(self, tokens, positions, capture=(), slots=None, mask=None):
        """Run all layers; -> (last layer's output before the final norm, inputs of `capture` layers)."""
        x = self.model.embed_tokens(tokens)  # [B, T, H]
        rope_cs = rope(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        slots, mask = self.layout(positions, slots, mask)  # [B, T], [B, 1, T, S]
        captured = []
        for i, layer in enumerate(self.model.layers):
            if i in capture:
                captured.append(x)
            x = layer(x, rope_cs, mask, slots)
        return x, captured

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, _ = self._layers(tokens, positions)
        return self.lm_head(self.model.norm(x))  # [B, T, V]

    def forward_with_hidden(self, tokens: torch.Tensor, positions: torch.Tensor,
                            kind: str = "eagle3") -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, T, V], hidden): kind "eagle3" -> [B, T, 3H], "layers:i,j,.." -> [B, T, n·H],
        "last" -> [B, T, H] (see module doc)."""
        return self.forward_tree(tokens, positions, None, None, kind)  # a kind it does not know: named there

    def forward_tree(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor | None,
                     mask: torch.Tensor | None, kind: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`specpass.TreeTarget`'s verify: rows written at `slots`, seeing `mask` (None: by position)."""
        L = self.config.num_hidden_layers
        capture = () if kind in (None, "last") else hidden_indices(kind, L)
        x, captured = self._layers(tokens, positions, capture, slots, mask)
        normed = self.model.norm(x)
        logits = self.lm_head(normed)
        if kind is None:
            return logits, None
        if kind == "last":
            return logits, x
        by_layer = {**dict(zip(sorted(set(i for i in capture if i < L)), captured)), L: normed}  # L: HF's last
        return logits, torch.cat([by_layer[i] for i in capture], dim=-1)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def forward_rows(self, tokens, positions, hidden=None, slots=None, mask=None):
        x, _ = self._layers(tokens, positions, (), slots, mask)
        return self.lm_head(self.model.norm(x)), x

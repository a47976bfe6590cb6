"""The feed-forward block and the pre-norm decoder layer, with Hugging Face's parameter names."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SwiGLU(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x))."""

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

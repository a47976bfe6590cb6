"""The zoo's EAGLE-3 heads: the library's Llama head (GQA, `specpass.drafters.Eagle3Head`) and
its DeepSeek variant with MLA attention, one class picked by `attention`.

`attention="gqa"` is the library's head as it is (architecture `LlamaForCausalLMEagle3`);
`attention="mla"` is TokenSpeed's `Eagle3DeepseekV2ForCausalLM`: the same midlayer with
DeepSeek-V3 MLA attention (models/deepseek.py; q_a/kv_a take the 2H input) and a dense MLP, RoPE
over `qk_rope_head_dim`. Layout, catch-up and draft-step contract: specpass/drafters/eagle3.py.

Checkpoints (models/checkpoint.py): the public EAGLE-3 layout — `fc.weight`, `midlayer.*` (vLLM's
`layers.N.*` with num_hidden_layers > 1), `norm.weight`, `lm_head.weight`, `d2t`, `t2d`. The
embedding is the target's and is not saved (`checkpoint_excludes`): pass the target's tensor,
`load(Eagle3Head, dir, shared={"embed_tokens.weight": target.model.embed_tokens.weight})`, and the
head uses it by reference. `specpass.load_drafter(dir, target)` reads the GQA heads' folders too.
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from models.deepseek import MLAAttention
from specpass import drafters


@dataclasses.dataclass
class Eagle3Config(drafters.Eagle3Config):
    attention: str = "gqa"  # "gqa" (Llama) or "mla" (DeepSeek)
    q_lora_rank: int | None = None  # MLA only, from here on
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self):
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"attention must be 'gqa' or 'mla', got {self.attention!r}")
        mla = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        unset = [n for n in mla if getattr(self, n) is None]
        if self.attention == "mla" and unset:
            raise ValueError(f"attention='mla' needs {unset}")
        super().__post_init__()

    @property
    def model_type(self) -> str:  # type: ignore[override]
        return "llama" if self.attention == "gqa" else "deepseek_v3"

    def architectures(self) -> list[str]:
        return ["LlamaForCausalLMEagle3" if self.attention == "gqa" else "Eagle3DeepseekV2ForCausalLM"]


class Eagle3Head(drafters.Eagle3Head):
    config_class = Eagle3Config
    architectures = ["LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM"]
    checkpoint_excludes = ("embed_tokens.weight",)  # the target's embedding

    def attention(self, in_features: int) -> nn.Module:
        if self.config.attention == "mla":
            return MLAAttention(self.config, in_features=in_features)
        return super().attention(in_features)

    @property
    def rope_dim(self) -> int:
        return self.config.head_dim if self.config.attention == "gqa" else self.config.qk_rope_head_dim

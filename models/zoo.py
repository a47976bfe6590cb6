"""Named configs and deterministic random weights: `tiny-*` for CPU tests, the rest for GPU benchmarks.

    model = build("tiny-llama-eagle3")                                   # random, seed 0, CPU fp32
    model = build("llama3-8b-eagle3", device="cuda", dtype=torch.bfloat16)  # allocated on the GPU only
    draft = build("llama3-8b-dflash", target=target)                   # a DFlash draft over target's embedding and lm_head
    make_checkpoint("tiny-llama", "ckpt/")                               # config.json + model.safetensors

Configs are data: nothing is allocated until `build`, which constructs on the meta device and
materialises directly on `device` in `dtype`. The weights are random (no checkpoints can be
downloaded here) but scaled so activations stay O(1): linear weights ~ N(0, 1/fan_in),
embeddings ~ N(0, 1), norm weights ~ 1 + N(0, 0.1²) (not all ones, so a swapped norm shows),
routing bias ~ N(0, 0.1²), and for EAGLE-3 heads a random sorted draft vocabulary (`d2t`, `t2d`).
Deterministic for a given seed, device and dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from models.checkpoint import checkpoint_tensors, retie, save
from models.eagle3 import Eagle3Config, Eagle3Head
from models.llama import Llama, LlamaConfig
from models.nextn import NextN, NextNConfig
from models.peagle import ParallelEagle3Config, ParallelEagle3Head
from specpass.drafters import DFlashConfig, DFlashDraft

_TINY_MLA = dict(q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
_TINY_MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
_DSV3_MLA = dict(num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                 qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-6, rope_theta=10000.0)
_DSV3_MOE = dict(n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                 shared_expert_intermediate_size=2048, scoring_func="sigmoid", n_group=8, topk_group=4,
                 norm_topk_prob=True, routed_scaling_factor=2.5)
_QWEN_ATTN = dict(num_attention_heads=16, num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25,
                  rms_norm_eps=1e-6, rope_theta=10_000_000.0)

CONFIGS: dict[str, tuple[type[nn.Module], object]] = {
    # --- tiny: CPU tests (vocabulary 256 shared by the target and every draft)
    "tiny-llama": (Llama, LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_theta=10000.0)),
    "tiny-llama-draft": (Llama, LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True)),
    "tiny-llama-eagle3": (Eagle3Head, Eagle3Config(
        vocab_size=256, draft_vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_theta=10000.0)),
    "tiny-llama-peagle3": (ParallelEagle3Head, ParallelEagle3Config(
        vocab_size=256, draft_vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_theta=10000.0, mask_token_id=255)),
    "tiny-llama-dflash": (DFlashDraft, DFlashConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_theta=10000.0, target_layer_ids=[1, 4, 6], mask_token_id=255,
        block_size=8)),
    "tiny-deepseek-eagle3-mla": (Eagle3Head, Eagle3Config(
        vocab_size=256, draft_vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        attention="mla", rope_theta=10000.0, **_TINY_MLA)),
    "tiny-deepseek-nextn": (NextN, NextNConfig(
        vocab_size=256, hidden_size=64, num_attention_heads=4, attention="mla", mlp="moe", **_TINY_MLA,
        **_TINY_MOE, n_group=4, topk_group=2, routed_scaling_factor=2.5)),
    "tiny-qwen3.5-nextn": (NextN, NextNConfig(
        vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        partial_rotary_factor=0.25, attention="gated", mlp="dense", intermediate_size=128)),
    "tiny-qwen3.5-moe-nextn": (NextN, NextNConfig(
        vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        partial_rotary_factor=0.25, attention="gated", mlp="moe", **_TINY_MOE, scoring_func="softmax",
        shared_expert_gate=True)),
    # --- full size: GPU benchmarks (bf16 sizes in docs/models.md)
    "llama3-8b": (Llama, LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128)),
    "llama3-70b": (Llama, LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128)),
    "llama3.2-1b": (Llama, LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True)),
    "llama3-8b-eagle3": (Eagle3Head, Eagle3Config(
        vocab_size=128256, draft_vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128)),
    "llama3-70b-eagle3": (Eagle3Head, Eagle3Config(
        vocab_size=128256, draft_vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128)),
    "llama3-8b-peagle3": (ParallelEagle3Head, ParallelEagle3Config(
        vocab_size=128256, draft_vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, mask_token_id=128002)),
    # z-lab's Qwen3-8B-DFlash-b16 layers (5, intermediate 12288), its target layers spread over 32 as over 36
    "llama3-8b-dflash": (DFlashDraft, DFlashConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=12288, num_hidden_layers=5, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, target_layer_ids=[1, 8, 15, 22, 29], mask_token_id=128002,
        block_size=16)),
    "deepseek-v3-eagle3-mla": (Eagle3Head, Eagle3Config(
        vocab_size=129280, draft_vocab_size=32000, hidden_size=7168, intermediate_size=18432, attention="mla",
        **_DSV3_MLA)),
    "deepseek-v3-nextn": (NextN, NextNConfig(
        vocab_size=129280, hidden_size=7168, attention="mla", mlp="moe", **_DSV3_MLA, **_DSV3_MOE)),
    "deepseek-v3-nextn-dispatch": (NextN, NextNConfig(
        vocab_size=129280, hidden_size=7168, attention="mla", mlp="moe", **_DSV3_MLA, **_DSV3_MOE,
        moe_impl="dispatch")),
    "qwen3.5-nextn": (NextN, NextNConfig(
        vocab_size=248320, hidden_size=4096, attention="gated", mlp="dense", intermediate_size=12288,
        **{**_QWEN_ATTN, "num_key_value_heads": 4})),
    "qwen3-next-nextn": (NextN, NextNConfig(
        vocab_size=151936, hidden_size=2048, attention="gated", mlp="moe", **_QWEN_ATTN, n_routed_experts=512,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        scoring_func="softmax", shared_expert_gate=True)),
}


def config(name: str):
    """A copy of the named config (edit it freely, e.g. `dataclasses.replace(c, moe_impl="dispatch")`)."""
    if name not in CONFIGS:
        raise KeyError(f"unknown model {name!r}; known: {sorted(CONFIGS)}")
    return dataclasses.replace(CONFIGS[name][1])


def build(name_or_config, seed: int = 0, device=None, dtype: torch.dtype | None = None,
          shard: Callable[[nn.Module], nn.Module] | None = None, target: nn.Module | None = None) -> nn.Module:
    """A model with deterministic random weights: a zoo name, or a config of a zoo model class.

    shard: applied to the model while it is on the meta device, before any weight is allocated
    (`lambda m: models.tp.tensor_parallel(m, group)`: a 70B target's shard, never the whole model).
    Every rank then draws the same weights for its shard's shapes: replicated weights agree.
    target: a DFlash draft's (it holds the target's input embedding and lm_head, by reference)."""
    if isinstance(name_or_config, str):
        cls, cfg = CONFIGS[name_or_config][0], config(name_or_config)
    else:
        cfg = name_or_config
        cls = {LlamaConfig: Llama, Eagle3Config: Eagle3Head, ParallelEagle3Config: ParallelEagle3Head,
               NextNConfig: NextN, DFlashConfig: DFlashDraft}[type(cfg)]
    if (cls is DFlashDraft) != (target is not None):
        raise ValueError("target= is a DFlash draft's (whose embedding and lm_head are its target's), and it needs one")
    with torch.device("meta"):
        # the target's modules are set once this model's own weights are materialised (to_empty would wipe them)
        model = cls(cfg, nn.Identity(), nn.Identity()) if target is not None else cls(cfg)
    if shard is not None:
        model = shard(model)
    _, aliases = checkpoint_tensors(model)  # tied weights, which to_empty unties
    if dtype is not None:
        model = model.to(dtype)  # floating tensors only; free on the meta device
    model = model.to_empty(device=device or "cpu")
    retie(model, aliases)
    init_weights(model, seed)
    if target is not None:
        model.embed_tokens, model.lm_head = target.get_input_embeddings(), target.lm_head
    return model.eval()


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0) -> None:
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)

    def normal(t: torch.Tensor, mean: float, std: float) -> None:
        t.normal_(mean, std, generator=g)  # in place: no full-size temporaries on the GPU

    for name, p in model.named_parameters():
        if name == "mask_hidden":  # a stand-in for the target's fused states
            normal(p, 0.0, 1.0)
        elif p.dim() == 1:  # every other 1-D parameter in the zoo is a norm weight
            normal(p, 1.0, 0.1)
        elif isinstance(model.get_submodule(name.rpartition(".")[0]), nn.Embedding):
            normal(p, 0.0, 1.0)
        else:  # Linear [out, in] and stacked experts [E, out, in]
            normal(p, 0.0, p.shape[-1] ** -0.5)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            normal(b, 0.0, 0.1)
    if isinstance(model, Eagle3Head):  # a random draft vocabulary: sorted target ids
        V, Vd = model.config.vocab_size, model.config.draft_vocab_size
        ids = torch.randperm(V, generator=g, device=device)[:Vd].sort().values
        model.d2t.copy_(ids - torch.arange(Vd, device=device))
        model.t2d.zero_()
        model.t2d[ids] = True


def make_checkpoint(name: str, directory: str | Path, seed: int = 0, dtype: torch.dtype | None = None) -> Path:
    """Write a random-init checkpoint of a zoo model (see `build`) to `directory`."""
    model = build(name, seed=seed, dtype=dtype)
    return save(model, model.config, directory)

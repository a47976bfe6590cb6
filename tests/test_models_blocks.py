"""Building blocks against independent references: absorbed MLA against the textbook (naive)
formula, both MoE forms against transformers' DeepSeek-V3 / Qwen3.5 MoE blocks, Qwen3.5 gated
attention against transformers'; and the strict checkpoint loader's every failure mode."""

import json
import math

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

from models import checkpoint, zoo
from models.checkpoint import CheckpointError, load, save
from models.eagle3 import Eagle3Head
from models.llama import Llama
from models.nextn import NextN
from specpass.drafters import files
from specpass.drafters.rope import rope


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# --- MLA: absorbed (latent cache, W_UK/W_UV folded) == naive (per-head K/V from kv_b_proj)


def rotate(x, positions, theta):
    """Plain rotate-half RoPE, written out: x [B, T, heads, d], positions [B, T]."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = positions[..., None].float() * inv
    cos, sin = ang.cos().repeat(1, 1, 2)[:, :, None], ang.sin().repeat(1, 1, 2)[:, :, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def naive_mla(attn, x, positions, theta):
    """DeepSeek-V2/V3 MLA as the paper writes it, no cache: causal over the rows given."""
    B, T, _ = x.shape
    h, nope, dr, dv, r = attn.n_heads, attn.nope, attn.rope_dim, attn.v_dim, attn.kv_lora_rank
    q = F.linear(attn.q_a_layernorm(F.linear(x, attn.q_a_proj.weight)), attn.q_b_proj.weight).view(B, T, h, nope + dr)
    q_nope, q_pe = q[..., :nope], rotate(q[..., nope:], positions, theta)
    kv_a = F.linear(x, attn.kv_a_proj_with_mqa.weight)
    c_kv, k_pe = attn.kv_a_layernorm(kv_a[..., :r]), rotate(kv_a[..., None, r:], positions, theta)
    kv = F.linear(c_kv, attn.kv_b_proj.weight).view(B, T, h, nope + dv)
    k = torch.cat([kv[..., :nope], k_pe.expand(B, T, h, dr)], -1)
    qf = torch.cat([q_nope, q_pe], -1)
    scores = torch.einsum("bthd,bshd->bhts", qf, k) / math.sqrt(nope + dr)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), kv[..., nope:])
    return F.linear(out.reshape(B, T, h * dv), attn.o_proj.weight)


def test_absorbed_mla_equals_naive_mla():
    model = zoo.build("tiny-deepseek-nextn", seed=3)
    attn, theta = model.decoder.self_attn, model.config.rope_theta
    B, T = 2, 9
    x = torch.randn(B, T, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(T).expand(B, -1)
    with torch.no_grad():
        expected = naive_mla(attn, x, positions, theta)
        model.setup_caches(B, 16)
        all_rows = attn(x, rope(positions, attn.rope_dim, theta, x.dtype), model.mask(positions), positions)
        model.setup_caches(B, 16)
        steps = [attn(x[:, t:t + 1], rope(positions[:, t:t + 1], attn.rope_dim, theta, x.dtype),
                      model.mask(positions[:, t:t + 1]), positions[:, t:t + 1]) for t in range(T)]
    close(all_rows, expected)
    close(torch.cat(steps, 1), expected)
    # the cache holds the latent and the roped shared key, not per-head K/V
    assert attn.c_kv_cache.shape == (B, 16, attn.kv_lora_rank)
    assert attn.k_rope_cache.shape == (B, 16, attn.rope_dim)


# --- MoE: dense == dispatch == transformers


def moe_input(hidden, seed=0):
    return torch.randn(3, 5, hidden, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["tiny-deepseek-nextn", "tiny-qwen3.5-moe-nextn"])
def test_moe_dense_equals_dispatch(name):
    model = zoo.build(name, seed=4)
    moe = model.decoder.mlp
    x = moe_input(model.config.hidden_size)
    with torch.no_grad():
        moe.experts.impl = "dense"
        dense = moe(x)
        moe.experts.impl = "dispatch"
        dispatch = moe(x)
    close(dense, dispatch)


def test_deepseek_moe_matches_transformers():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    model = zoo.build("tiny-deepseek-nextn", seed=5)
    cfg = model.config
    assert cfg.n_group > 1 and cfg.topk_group < cfg.n_group  # group-limited routing is exercised
    hf_cfg = DeepseekV3Config(hidden_size=cfg.hidden_size, n_routed_experts=cfg.n_routed_experts,
                              num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.moe_intermediate_size,
                              n_shared_experts=1, n_group=cfg.n_group, topk_group=cfg.topk_group,
                              routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=True)
    hf = DeepseekV3MoE(hf_cfg).eval()
    hf.load_state_dict(model.decoder.mlp.state_dict(), strict=True)  # same names, same layout
    x = moe_input(cfg.hidden_size, seed=1)
    with torch.no_grad():
        expected = hf(x)
        for impl in ("dense", "dispatch"):
            model.decoder.mlp.experts.impl = impl
            close(model.decoder.mlp(x), expected)


def test_qwen_moe_matches_transformers():
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    model = zoo.build("tiny-qwen3.5-moe-nextn", seed=6)
    cfg = model.config
    hf_cfg = Qwen3_5MoeTextConfig(hidden_size=cfg.hidden_size, num_experts=cfg.n_routed_experts,
                                  num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.moe_intermediate_size,
                                  shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    hf = Qwen3_5MoeSparseMoeBlock(hf_cfg).eval()
    state = {k.replace("shared_experts.", "shared_expert."): v for k, v in model.decoder.mlp.state_dict().items()}
    hf.load_state_dict(state, strict=True)
    x = moe_input(cfg.hidden_size, seed=2)
    with torch.no_grad():
        expected = hf(x)
        for impl in ("dense", "dispatch"):
            model.decoder.mlp.experts.impl = impl
            close(model.decoder.mlp(x), expected)


# --- Qwen3.5 attention: q/k norm, sigmoid output gate, partial RoPE == transformers'


def test_qwen_gated_attention_matches_transformers():
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention, Qwen3_5TextRotaryEmbedding

    model = zoo.build("tiny-qwen3.5-nextn", seed=7)
    cfg = model.config
    attn = model.decoder.self_attn
    assert cfg.rotary_dim == 4 < cfg.head_dim  # partial
    hf_cfg = Qwen3_5TextConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                               num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                               rms_norm_eps=cfg.rms_norm_eps,
                               rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                                                "partial_rotary_factor": cfg.partial_rotary_factor})
    hf_cfg._attn_implementation = "eager"
    hf = Qwen3_5Attention(hf_cfg, layer_idx=3).eval()
    state = dict(attn.state_dict())
    for k in ("q_norm.weight", "k_norm.weight"):  # Qwen's norms are zero-centred: x·(1 + w)
        state[k] = state[k] - 1
    hf.load_state_dict(state, strict=True)
    B, T = 2, 7
    x = torch.randn(B, T, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(T).expand(B, -1)
    causal = torch.zeros(T, T).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    with torch.no_grad():
        expected, _ = hf(x, Qwen3_5TextRotaryEmbedding(hf_cfg)(x, positions), causal.expand(B, 1, T, T))
        model.setup_caches(B, 8)
        actual = attn(x, rope(positions, cfg.rotary_dim, cfg.rope_theta, x.dtype), model.mask(positions), positions)
    close(actual, expected)


# --- checkpoints: round trip, and every failure mode, all-or-nothing


@pytest.mark.parametrize("name", ["tiny-llama-draft", "tiny-deepseek-nextn", "tiny-qwen3.5-moe-nextn"])
def test_round_trip(name, tmp_path):
    model = zoo.build(name, seed=8)
    save(model, model.config, tmp_path)
    loaded = load(type(model), tmp_path)
    assert loaded.config == model.config
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    if model.config.__dict__.get("tie_word_embeddings"):
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        assert "lm_head.weight" not in safetensors.torch.load_file(tmp_path / "model.safetensors")


def test_sharded_round_trip_and_index(tmp_path):
    """Above max_shard_bytes: Hugging Face's shard names and index, shards within the limit, the same
    tensors back (the EAGLE-3 head with the target's embedding); saving again replaces the shards."""
    target, head = zoo.build("tiny-llama"), zoo.build("tiny-llama-eagle3", seed=3)
    limit = 40_000
    save(head, head.config, tmp_path, max_shard_bytes=limit)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (tmp_path / "model.safetensors").exists()
    stored = {}
    for file in files:
        shard = safetensors.torch.load_file(tmp_path / file)
        size = sum(t.numel() * t.element_size() for t in shard.values())
        assert size <= limit or len(shard) == 1  # a tensor above the limit has a shard of its own
        assert all(index["weight_map"][name] == file for name in shard)
        stored.update(shard)
    expected, _ = checkpoint.checkpoint_tensors(head)
    assert stored.keys() == expected.keys() == index["weight_map"].keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    loaded = load(Eagle3Head, tmp_path, shared={"embed_tokens.weight": target.model.embed_tokens.weight})
    for key, value in head.state_dict().items():
        if key != "embed_tokens.weight":
            assert torch.equal(loaded.state_dict()[key], value), key

    save(head, head.config, tmp_path)  # unsharded now: no shard or index may outlive it
    assert sorted(f.name for f in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_load_casts_dtype_and_keeps_integer_buffers(tmp_path):
    target = zoo.build("tiny-llama")
    head = zoo.build("tiny-llama-eagle3")
    save(head, head.config, tmp_path)
    loaded = load(Eagle3Head, tmp_path, dtype=torch.bfloat16, shared={"embed_tokens.weight": target.model.embed_tokens.weight})
    assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.d2t.dtype == torch.int64 and loaded.t2d.dtype == torch.bool
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)


def test_eagle3_checkpoint_has_public_layout_and_shares_the_target_embedding(tmp_path):
    target = zoo.build("tiny-llama")
    head = zoo.build("tiny-llama-eagle3")
    save(head, head.config, tmp_path)
    keys = set(safetensors.torch.load_file(tmp_path / "model.safetensors"))
    assert "embed_tokens.weight" not in keys
    assert {"fc.weight", "d2t", "t2d", "norm.weight", "lm_head.weight", "midlayer.hidden_norm.weight",
            "midlayer.input_layernorm.weight", "midlayer.self_attn.q_proj.weight"} <= keys
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 96
    embed = target.model.embed_tokens.weight
    loaded = load(Eagle3Head, tmp_path, shared={"embed_tokens.weight": embed})
    assert loaded.embed_tokens.weight.data_ptr() == embed.data_ptr()  # by reference
    assert loaded.midlayer.self_attn.q_proj.in_features == 2 * head.config.hidden_size
    # d2t maps draft ids to the target ids t2d marks
    target_ids = loaded.to_target(torch.arange(head.config.draft_vocab_size))
    assert loaded.t2d[target_ids].all() and int(loaded.t2d.sum()) == head.config.draft_vocab_size


@pytest.fixture
def folder(tmp_path):
    zoo.make_checkpoint("tiny-llama-draft", tmp_path)
    return tmp_path


def rewrite(folder, edit):
    path = folder / "model.safetensors"
    state = safetensors.torch.load_file(path)
    edit(state)
    safetensors.torch.save_file(state, path)


class CountReads:
    """Wraps safe_open to count the tensors the loader reads."""

    def __init__(self, monkeypatch):
        self.reads = 0
        real = files.safe_open
        outer = self

        class Counting:
            def __init__(self, *args, **kwargs):
                self.inner = real(*args, **kwargs)

            def __enter__(self):
                self.f = self.inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_slice(self, name):
                return self.f.get_slice(name)

            def get_tensor(self, name):
                outer.reads += 1
                return self.f.get_tensor(name)

        monkeypatch.setattr(files, "safe_open", Counting)


def failing_load(monkeypatch, cls, folder, **kw):
    counter = CountReads(monkeypatch)
    with pytest.raises(CheckpointError) as info:
        load(cls, folder, **kw)
    assert counter.reads == 0, "tensors were read before the checkpoint was checked"
    return str(info.value)


def test_missing_config_json(folder, monkeypatch):
    (folder / "config.json").unlink()
    msg = failing_load(monkeypatch, Llama, folder)
    assert str(folder / "config.json") in msg and "not found" in msg and "make_checkpoint" in msg


def test_missing_safetensors(folder, monkeypatch):
    (folder / "model.safetensors").unlink()
    msg = failing_load(monkeypatch, Llama, folder)
    assert str(folder / "model.safetensors") in msg and "not found" in msg and "checkpoint.save" in msg


def test_missing_key(folder, monkeypatch):
    rewrite(folder, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    msg = failing_load(monkeypatch, Llama, folder)
    assert "missing keys (1): ['model.layers.1.mlp.up_proj.weight']" in msg


def test_unexpected_key(folder, monkeypatch):
    rewrite(folder, lambda s: s.__setitem__("model.layers.7.mlp.up_proj.weight", torch.zeros(2)))
    msg = failing_load(monkeypatch, Llama, folder)
    assert "unexpected keys (1): ['model.layers.7.mlp.up_proj.weight']" in msg


def test_wrong_shape(folder, monkeypatch):
    rewrite(folder, lambda s: s.__setitem__("model.norm.weight", torch.ones(63)))
    msg = failing_load(monkeypatch, Llama, folder)
    assert "wrong shapes (1): model.norm.weight: expected [64], found [63]" in msg


def test_wrong_dtype(folder, monkeypatch):
    rewrite(folder, lambda s: s.__setitem__("model.norm.weight", s["model.norm.weight"].bfloat16()))
    msg = failing_load(monkeypatch, Llama, folder)
    assert "wrong dtypes (1): model.norm.weight: expected float32 (config.json declares float32), found bfloat16" in msg


def test_wrong_integer_buffer_dtype(tmp_path, monkeypatch):
    zoo.make_checkpoint("tiny-llama-eagle3", tmp_path)
    rewrite(tmp_path, lambda s: s.__setitem__("d2t", s["d2t"].int()))
    msg = failing_load(monkeypatch, Eagle3Head, tmp_path, shared={"embed_tokens.weight": torch.zeros(256, 64)})
    assert "d2t: expected int64, found int32" in msg


def test_every_problem_reported_at_once(folder, monkeypatch):
    def edit(s):
        s.pop("model.norm.weight")
        s["extra"] = torch.zeros(1)
        s["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    rewrite(folder, edit)
    msg = failing_load(monkeypatch, Llama, folder)
    assert "missing keys" in msg and "unexpected keys" in msg and "wrong shapes" in msg


def test_eagle3_without_the_target_embedding(tmp_path, monkeypatch):
    zoo.make_checkpoint("tiny-llama-eagle3", tmp_path)
    msg = failing_load(monkeypatch, Eagle3Head, tmp_path)
    assert "embed_tokens.weight" in msg and "shared=" in msg


def test_wrong_architecture(folder, monkeypatch):
    msg = failing_load(monkeypatch, NextN, folder)
    assert "LlamaForCausalLM" in msg and "NextN" in msg


@pytest.mark.parametrize("params, words", [
    ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, ["'llama3' is not modelled by the zoo's Llama"]),
    ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}, ["'llama3' needs", "'low_freq_factor'"]),
    ({"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0}, ["'yarn' is not modelled"]),
])
def test_unmodelled_rope_scaling_is_refused(folder, monkeypatch, params, words):
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = params
    (folder / "config.json").write_text(json.dumps(config))
    msg = failing_load(monkeypatch, Llama, folder)
    assert str(folder / "config.json") in msg and all(w in msg for w in words), msg

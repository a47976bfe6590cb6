"""The library's public draft formats (specpass/drafters/): RoPE against transformers', the loader on
public EAGLE-3 and P-EAGLE layouts (one-layer `midlayer.*`, vLLM's `layers.N.*`, shards, a
pytorch_model.bin, the target's embedding or the file's own) against the zoo's heads, every loader
error, and `specpass.generate` with the shipped head on a transformers target from a process where
the zoo cannot be imported."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import specpass
from models import zoo
from models.checkpoint import save
from models.text import encode, load_prompts
from specpass.drafters import (CheckpointError, DraftAdapter, Eagle3Head, ParallelDraftAdapter, ParallelEagle3Head,
                               load_drafter)
from specpass.drafters.rope import inverse_frequencies, read_rope, rope
from tests.test_models_blocks import CountReads

ROOT = Path(__file__).resolve().parents[1]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
B, T, S = 3, 4, 16


# --- RoPE


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])  # transformers 5's name, 4's
def test_llama3_rope_is_transformers(key):
    """Llama-3.1's scaled frequencies and the cos/sin made of them, bit for bit (head dim 128, where
    all three bands of the scaling are hit)."""
    params = {**LLAMA3, "rope_theta": 500000.0}
    hf_config = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=params)
    theta, scaling = read_rope({key: {k: v for k, v in params.items() if k != "rope_theta"}, "rope_theta": 500000.0})
    assert theta == 500000.0 and scaling == {k: v for k, v in LLAMA3.items() if k != "rope_type"}
    want, factor = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    got = inverse_frequencies(128, theta, torch.device("cpu"), scaling)
    default = inverse_frequencies(128, theta, torch.device("cpu"))
    assert factor == 1.0 and torch.equal(got, want)
    assert (got < default).any() and (got == default).any()  # scaled and kept bands both present
    positions = torch.tensor([[0, 5, 4000], [9000, 1, 2]])
    cos, sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.bfloat16), positions)
    ours = rope(positions, 128, theta, torch.bfloat16, scaling)
    assert torch.equal(ours[0], cos) and torch.equal(ours[1], sin)


@pytest.mark.parametrize("config, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not modelled"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic' is not modelled"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope type 'llama3' needs"),
    ({"rope_scaling": [1, 2]}, "must be an object"),
])
def test_rope_types_not_modelled_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        read_rope(config)


def test_default_rope_reads_theta_from_either_place():
    assert read_rope({"rope_theta": 7.0}) == (7.0, None)
    assert read_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 9.0}}) == (9.0, None)
    assert read_rope({}) == (None, None)


# --- the loader: public layouts


@pytest.fixture(scope="module")
def target():
    return zoo.build("tiny-llama", seed=0)


def head_folder(path: Path, name: str = "tiny-llama-eagle3", seed: int = 3, **changes) -> tuple[torch.nn.Module, Path]:
    """A zoo head (random weights) saved in the public layout, its config changed by `changes`."""
    config = dataclasses.replace(zoo.config(name), **changes)
    head = zoo.build(config, seed=seed)
    save(head, head.config, path)
    return head, path


def edit_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    state = safetensors.torch.load_file(path)
    edit(state)
    safetensors.torch.save_file(state, path)


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    (folder / "config.json").write_text(json.dumps(config))


def catch_up_inputs(head, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, head.config.vocab_size, (B, T), generator=g)
    positions = torch.arange(T) + torch.tensor([[2], [7], [1]])
    hidden = torch.randn(B, T, 3 * head.config.target_hidden_size, generator=g)
    return tokens, positions, hidden, torch.tensor([3, 0, 2])


def same_drafts(drafter, head, target):
    """The loaded drafter against the zoo head it was saved from (the target's embedding, the
    adapter's one-slot shift): catch-up and draft step, bit for bit."""
    head.embed_tokens.weight = target.model.embed_tokens.weight
    tokens, positions, hidden, live = catch_up_inputs(head)
    drafter.setup_caches(B, S)
    head.setup_caches(B, S)
    with torch.no_grad():
        got = drafter.catch_up(tokens, positions + 1, hidden, live)
        want = head.catch_up(tokens, positions, hidden, live)
        got_step = drafter.draft_step(tokens[:, 0], positions[:, -1] + 2, got[1])
        want_step = head.draft_step(tokens[:, 0], positions[:, -1] + 1, want[1])
    for g, w in zip((*got, *got_step), (*want, *want_step), strict=True):
        assert torch.equal(g, w)


def test_one_layer_head_shares_the_target_embedding(tmp_path, target):
    head, folder = head_folder(tmp_path)
    drafter = load_drafter(folder, target)
    assert type(drafter) is DraftAdapter and type(drafter.model) is Eagle3Head
    assert drafter.hidden_kind == "eagle3" and drafter.shift == 1
    assert drafter.get_input_embeddings().weight is target.model.embed_tokens.weight  # by reference
    assert torch.equal(drafter.model.d2t, head.d2t) and torch.equal(drafter.model.t2d, head.t2d)
    ids = torch.arange(head.config.draft_vocab_size)
    assert torch.equal(drafter.to_target(ids), head.to_target(ids))
    same_drafts(drafter, head, target)


def test_dtype_and_device_follow_the_target_unless_given(tmp_path, target):
    _, folder = head_folder(tmp_path)
    edit_weights(folder, lambda s: s.update({k: v.bfloat16() for k, v in s.items() if v.is_floating_point()}))
    assert load_drafter(folder, target).model.fc.weight.dtype == torch.float32  # the target's
    half = load_drafter(folder, target, dtype=torch.bfloat16, device="cpu").model
    assert half.fc.weight.dtype == half.embed_tokens.weight.dtype == torch.bfloat16
    assert half.embed_tokens.weight is not target.model.embed_tokens.weight  # a cast copy
    assert half.d2t.dtype == torch.int64 and half.t2d.dtype == torch.bool


def test_vllm_layer_names_for_one_layer(tmp_path, target):
    head, folder = head_folder(tmp_path)
    edit_weights(folder, lambda s: s.update({k.replace("midlayer.", "layers.0."): s.pop(k) for k in list(s)}))
    same_drafts(load_drafter(folder, target), head, target)


def test_deeper_parallel_head_in_vllm_names(tmp_path, target):
    """A saved P-EAGLE head of three layers: `layers.0.*` (the midlayer) .. `layers.2.*`, `mask_hidden`,
    config.json's `parallel_drafting` and `mask_token_id`; its drafts in one forward are the zoo head's."""
    head, folder = head_folder(tmp_path, "tiny-llama-peagle3", num_hidden_layers=3)
    with safetensors.safe_open(folder / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "mask_hidden" in names and {n.split(".")[1] for n in names if n.startswith("layers.")} == {"0", "1", "2"}
    drafter = load_drafter(folder, target)
    assert type(drafter) is ParallelDraftAdapter and type(drafter.model) is ParallelEagle3Head
    assert drafter.model.config.mask_token_id == head.config.mask_token_id and len(drafter.model.layers) == 3
    same_drafts(drafter, head, target)
    tokens, positions, hidden, live = catch_up_inputs(head, seed=1)
    head.setup_caches(B, S)
    drafter.setup_caches(B, S)
    with torch.no_grad():
        want = head.draft_parallel(tokens, positions, hidden, live, 3)
        assert torch.equal(drafter.draft_parallel(tokens, positions + 1, hidden, live, 3), want)


def test_midlayer_names_in_a_deeper_head(tmp_path, target):
    """vLLM reads `midlayer.*` as `layers.0.*` whatever the depth."""
    head, folder = head_folder(tmp_path, num_hidden_layers=2)
    edit_weights(folder, lambda s: s.update({k.replace("layers.0.", "midlayer."): s.pop(k) for k in list(s)
                                             if k.startswith("layers.0.")}))
    same_drafts(load_drafter(folder, target), head, target)


def test_sharded_and_pytorch_bin(tmp_path, target):
    head = zoo.build("tiny-llama-eagle3", seed=3)
    save(head, head.config, tmp_path / "sharded", max_shard_bytes=20_000)
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    same_drafts(load_drafter(tmp_path / "sharded", target), head, target)
    _, folder = head_folder(tmp_path / "bin")
    state = safetensors.torch.load_file(folder / "model.safetensors")
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    same_drafts(load_drafter(folder, target), head, target)


def test_own_embedding_and_left_out_vocabulary_maps(tmp_path, target):
    """An `embed_tokens.weight` in the file is the head's own (its width then need not be the
    target's); a draft vocabulary equal to the target's may leave out d2t and t2d."""
    _, folder = head_folder(tmp_path, draft_vocab_size=256, hidden_size=32, num_attention_heads=2, head_dim=16,
                            num_key_value_heads=1, target_hidden_size=64)
    embedding = torch.randn(256, 32)
    edit_weights(folder, lambda s: (s.pop("d2t"), s.pop("t2d"), s.update({"embed_tokens.weight": embedding})))
    head = load_drafter(folder, target).model
    assert torch.equal(head.embed_tokens.weight, embedding) and head.fc.in_features == 3 * 64
    assert torch.equal(head.to_target(torch.arange(256)), torch.arange(256)) and head.t2d.all()


def test_t2d_follows_from_d2t(tmp_path, target):
    head, folder = head_folder(tmp_path)
    edit_weights(folder, lambda s: s.pop("t2d"))
    assert torch.equal(load_drafter(folder, target).model.t2d, head.t2d)


def test_public_config_without_optional_keys(tmp_path, target):
    """head_dim and target_hidden_size left out mean hidden / heads and the head's hidden size;
    rope_theta and rms_norm_eps left out mean transformers' LlamaConfig defaults; llama3 scaling is read."""
    _, folder = head_folder(tmp_path, head_dim=16)
    edit_config(folder, head_dim=None, target_hidden_size=None, rope_theta=None, rms_norm_eps=None, attention=None,
                rope_scaling={**LLAMA3, "original_max_position_embeddings": 64})
    config = load_drafter(folder, target).model.config
    assert (config.head_dim, config.target_hidden_size, config.rope_theta, config.rms_norm_eps) == (16, 64, 10000.0, 1e-6)
    assert config.rope_scaling["original_max_position_embeddings"] == 64


def test_a_transformers_target(tmp_path):
    """A PreTrainedModel: its get_input_embeddings() and config sizes; the drafter runs in the loop's probe."""
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)).eval()
    _, folder = head_folder(tmp_path)
    drafter = load_drafter(folder, hf)
    assert drafter.get_input_embeddings().weight is hf.get_input_embeddings().weight
    out = specpass.generate(hf, torch.tensor([[5, 6, 7]]), assistant_model=drafter, max_new_tokens=6,
                            compile="eager", pad_token_id=0)
    assert torch.equal(out, hf.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False, pad_token_id=0))


# --- the loader: every error, before a tensor is read


def refused(monkeypatch, folder, target, *words):
    counter = CountReads(monkeypatch)
    with pytest.raises(CheckpointError) as info:
        load_drafter(folder, target)
    message = str(info.value)
    assert counter.reads == 0, "tensors were read before the checkpoint was checked"
    assert all(w in message for w in words), message
    return message


def test_missing_folder_config_and_weights(tmp_path, target, monkeypatch):
    refused(monkeypatch, tmp_path / "nowhere", target, "nowhere does not exist: check the path, or copy the head's "
            "folder (config.json and its weights) there")
    _, folder = head_folder(tmp_path / "head")
    (folder / "model.safetensors").unlink()
    refused(monkeypatch, folder, target, f"{folder / 'model.safetensors'} not found (nor a sharded "
            "model.safetensors.index.json, nor pytorch_model.bin)")
    (folder / "config.json").unlink()
    refused(monkeypatch, folder, target, f"{folder / 'config.json'} not found")


def test_unknown_architecture(tmp_path, target, monkeypatch):
    _, folder = head_folder(tmp_path)
    edit_config(folder, architectures=["LlamaForCausalLM"])
    refused(monkeypatch, folder, target, "config.json describes architectures ['LlamaForCausalLM'], not a Llama "
            "EAGLE-3 head (LlamaForCausalLMEagle3 or Eagle3LlamaForCausalLM)")
    zoo.make_checkpoint("tiny-deepseek-eagle3-mla", tmp_path / "mla")
    refused(monkeypatch, tmp_path / "mla", target, "['Eagle3DeepseekV2ForCausalLM'], not a Llama EAGLE-3 head")


def test_config_values_refused(tmp_path, target, monkeypatch):
    _, folder = head_folder(tmp_path)
    edit_config(folder, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    refused(monkeypatch, folder, target, "config.json: rope type 'yarn' is not modelled", "fix the file")
    edit_config(folder, rope_scaling=None, hidden_act="gelu")
    refused(monkeypatch, folder, target, "hidden_act 'gelu' is not modelled")
    edit_config(folder, hidden_act="silu", draft_vocab_size=None)
    refused(monkeypatch, folder, target, "config.json lacks ['draft_vocab_size']")
    _, folder = head_folder(tmp_path / "p", "tiny-llama-peagle3")
    edit_config(folder, mask_token_id=None)
    refused(monkeypatch, folder, target, "mask_token_id must be a token id below vocab_size 256, got None")


def test_missing_unexpected_and_misshapen_tensors(tmp_path, target, monkeypatch):
    _, folder = head_folder(tmp_path)

    def edit(s):
        s.pop("midlayer.mlp.up_proj.weight")
        s["layers.1.mlp.up_proj.weight"] = torch.zeros(2)
        s["fc.weight"] = torch.zeros(64, 100)
        s["d2t"] = s["d2t"].float()
    edit_weights(folder, edit)
    message = refused(monkeypatch, folder, target, "missing tensors (1): ['midlayer.mlp.up_proj.weight']",
                      "unexpected tensors (1): ['layers.1.mlp.up_proj.weight']",
                      "fc.weight: config.json gives [64, 192], the file holds [64, 100]",
                      "d2t is float32, not integer", "does not hold the head")
    assert "1 layer(s), hidden_size 64, draft_vocab_size 96" in message


def test_a_layer_named_twice(tmp_path, target, monkeypatch):
    _, folder = head_folder(tmp_path)
    edit_weights(folder, lambda s: s.update({"layers.0.hidden_norm.weight": s["midlayer.hidden_norm.weight"].clone()}))
    refused(monkeypatch, folder, target, "are the same tensor of layer 0: keep one of them")


def test_head_that_does_not_fit_the_target(tmp_path, target, monkeypatch):
    _, folder = head_folder(tmp_path, vocab_size=300, hidden_size=32, num_attention_heads=2, head_dim=16,
                            num_key_value_heads=1, target_hidden_size=48)
    refused(monkeypatch, folder, target, "vocabulary: the target has 256 tokens, the EAGLE-3 head 300",
            "EAGLE-3 target_hidden_size 48 != the target's hidden_size 64",
            "EAGLE-3 hidden_size 32 != the target's hidden_size 64 (the head uses the target's embedding")


def test_target_embedding_of_another_shape(tmp_path, monkeypatch):
    """A target whose input embedding has more rows than its config's vocabulary (resized, padded)."""
    target = zoo.build("tiny-llama", seed=0)
    target.model.embed_tokens = torch.nn.Embedding(300, 64)
    _, folder = head_folder(tmp_path)
    refused(monkeypatch, folder, target, "the target's input embedding is [300, 64], the head reads it as [256, 64]")


def test_d2t_outside_the_target_vocabulary(tmp_path, target):
    _, folder = head_folder(tmp_path)
    edit_weights(folder, lambda s: s["d2t"].__setitem__(-1, 1000))
    with pytest.raises(CheckpointError, match=r"model.safetensors: d2t maps 1 draft ids outside the target's 256 ids"):
        load_drafter(folder, target)


def test_target_that_is_not_a_model(tmp_path):
    _, folder = head_folder(tmp_path)
    with pytest.raises(TypeError, match="target must be a transformers PreTrainedModel or the zoo's Llama"):
        load_drafter(folder, torch.nn.Linear(2, 2))


# --- Done-when: a transformers user without the repository's models/


NO_ZOO = r'''
import importlib.abc, json, sys

class NoZoo(importlib.abc.MetaPathFinder):  # as after `pip install specpass`: models/ is not installed
    def find_spec(self, name, path=None, target=None):
        if name == "models" or name.startswith("models."):
            raise ImportError(f"No module named {name!r} (blocked)")
        return None

sys.meta_path.insert(0, NoZoo())
try:
    import models  # noqa: F401
    raise SystemExit("models/ is importable")
except ImportError:
    pass

import torch
from transformers import AutoModelForCausalLM

import specpass

checkpoints, prompts = sys.argv[1], json.loads(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(f"{checkpoints}/stdlib-llama", dtype=torch.float32,
                                             attn_implementation="sdpa").eval()
result = {"specpass": specpass.__file__, "zoo": [m for m in sys.modules if m == "models" or m.startswith("models.")]}
inputs = [torch.tensor([prompt]) for prompt in prompts]
result["want"] = [model.generate(ids, max_new_tokens=16, do_sample=False).tolist() for ids in inputs]
for folder in ("stdlib-llama-eagle3", "stdlib-llama-peagle3", "stdlib-llama-dflash"):
    drafter = specpass.load_drafter(f"{checkpoints}/{folder}", model)
    outs = [specpass.generate(model, ids, assistant_model=drafter, max_new_tokens=16, compile="eager",
                              return_dict_in_generate=True) for ids in inputs]
    result[folder] = {"drafter": type(drafter).__name__, "got": [out.sequences.tolist() for out in outs],
                      "accepted": [out.metrics.accept_length for out in outs]}
print(json.dumps(result))
'''


def test_generate_with_the_shipped_heads_without_the_zoo(tmp_path):
    """`pip install specpass` + transformers: the shipped target loaded by transformers, the shipped
    EAGLE-3, P-EAGLE and DFlash heads by `specpass.load_drafter`, from a process that cannot import `models`
    and runs outside the repository; greedy tokens equal `model.generate`'s, and drafts are accepted."""
    prompts = [encode(text) for text in load_prompts()[:2]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # specpass from this checkout; models/ beside it is blocked
    run = subprocess.run([sys.executable, "-c", NO_ZOO, str(ROOT / "checkpoints"), json.dumps(prompts)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["zoo"] == [] and Path(result["specpass"]).is_relative_to(ROOT / "specpass")
    for folder, drafter in (("stdlib-llama-eagle3", "DraftAdapter"), ("stdlib-llama-peagle3", "ParallelDraftAdapter"),
                            ("stdlib-llama-dflash", "DFlashDraft")):
        assert result[folder]["drafter"] == drafter
        assert result[folder]["got"] == result["want"]
        accepted = result[folder]["accepted"]
        assert sum(accepted) / len(accepted) > 1.5, accepted  # the heads draft, not only the target

"""The trained checkpoints shipped in checkpoints/: transformers reads the target as we do, the
pair is lossless on held-out prompts, and the drafts are accepted as often as the docs say."""

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from models.checkpoint import load
from models.drafters import load_drafter
from models.llama import Llama
from models.text import BOS, encode, load_prompts
from specpass.loop import Decoder, cache_slots

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
TARGET = CHECKPOINTS / "stdlib-llama"
NEW = 48


@pytest.fixture(scope="module")
def target():
    # fp32, as examples/generate.py runs it: in the shipped bf16, logits of two tokens round to the
    # same value often enough that which one wins depends on the kernel's shape (one row or K + 1)
    return load(Llama, TARGET, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts():
    return [encode(t) for t in load_prompts()[:3]]


def test_shipped_files_fit_the_budget():
    files = [f for f in CHECKPOINTS.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) <= 62e6  # 50e6 before the parallel head (7.9 MB), 55e6 before DFlash's (7.2 MB)
    assert all(f.stat().st_size < 16 * 2**20 for f in files)


def test_transformers_loads_the_target_and_decodes_the_same_tokens(target, prompts):
    hf = LlamaForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    ours = Decoder(target, None, max_batch=1, max_len=max(map(len, prompts)) + NEW + 1, compile="eager")
    for prompt in prompts:
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0, len(prompt):]
        assert ours.generate([prompt], NEW).tokens[0] == want.tolist()


@pytest.mark.parametrize("kind, folder, min_accept", [("eagle", "stdlib-llama-eagle3", 2.5),
                                                       ("draft", "stdlib-llama-draft", 1.5),
                                                       ("parallel", "stdlib-llama-peagle3", 2.3),
                                                       ("block", "stdlib-llama-dflash", 2.3)])
def test_shipped_drafters_are_lossless_and_accepted(target, prompts, kind, folder, min_accept):
    k = 4
    max_len = cache_slots(max(map(len, prompts)), NEW, k)
    shape = dict(max_batch=len(prompts), max_len=max_len, compile="eager")
    plain = Decoder(target, None, **shape).generate(prompts, NEW)
    out = Decoder(target, load_drafter(target, kind, CHECKPOINTS / folder), k=k, **shape).generate(prompts, NEW)
    assert out.tokens == plain.tokens
    assert out.metrics.accept_length >= min_accept, out.metrics


def test_parallel_head_config_carries_the_names_vllm_reads():
    config = json.loads((CHECKPOINTS / "stdlib-llama-peagle3" / "config.json").read_text())
    assert config["parallel_drafting"] is True and config["mask_token_id"] == BOS
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]


def test_dflash_config_carries_the_names_z_lab_writes():
    config = json.loads((CHECKPOINTS / "stdlib-llama-dflash" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 16
    assert config["dflash_config"]["target_layer_ids"] == [1, 5, 9] and config["dflash_config"]["mask_token_id"] == BOS


def test_the_block_draft_reads_the_target_s_states(target, prompts):
    """The context path is live: with `fc` zeroed (no context from the target's states), the shipped
    block draft still decodes losslessly but accepts measurably less."""
    drafter = load_drafter(target, "block", CHECKPOINTS / "stdlib-llama-dflash")
    shape = dict(max_batch=len(prompts), max_len=cache_slots(max(map(len, prompts)), NEW, 8), compile="eager")
    plain = Decoder(target, None, **shape).generate(prompts, NEW)
    seeing = Decoder(target, drafter, k=8, **shape).generate(prompts, NEW)
    with torch.no_grad():
        drafter.fc.weight.zero_()
    blind = Decoder(target, drafter, k=8, **shape).generate(prompts, NEW)
    assert seeing.tokens == blind.tokens == plain.tokens
    assert seeing.metrics.accept_length > blind.metrics.accept_length + 0.5, (seeing.metrics, blind.metrics)

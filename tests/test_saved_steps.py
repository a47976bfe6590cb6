"""Saved steps (specpass/loop/saved_steps.py, issue 46): a second process runs the loop's compiled
steps without Dynamo; a changed model config, option or dtype compiles again, and so does a corrupted
file (with a warning, never loaded). The tokens stay plain greedy decoding's. The steps are handed off
eagerly (Inductor's C++ builds take minutes on a CPU; the GPU runs in docs/results.md use Inductor).
fp32, CPU."""

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

import specpass
from specpass import compile_backend
from models.llama import Llama, LlamaConfig
from specpass.compile_backend import SpecpassWarning
from specpass.hf.generate import DecoderCache
from specpass.loop import Decoder

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[3, 14, 15], [9, 2, 6, 5, 35, 89, 79, 32, 38], [46]]
NEW = 10
CONFIG = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8)

# One process's decode: its tokens, the graphs Dynamo traced, the steps saved.
SCRIPT = """
import json, sys, torch
from torch._dynamo.utils import counters
import specpass
from models import zoo
from models.drafters import ZooDrafter
from models.llama import Llama, LlamaConfig
from specpass.loop import Decoder
torch.manual_seed(0)
target = Llama(LlamaConfig(**json.loads(sys.argv[1]))).eval()
dec = Decoder(target, ZooDrafter(zoo.build("tiny-llama-draft", seed=3)), k=3, max_batch=3, max_len=40,
              compile=specpass.backend(handoff="eager"), fused_round=True)
tokens = dec.generate(json.loads(sys.argv[2]), int(sys.argv[3])).tokens
print(json.dumps({"tokens": tokens, "graphs": counters["stats"]["unique_graphs"]}))
"""


@pytest.fixture
def steps_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPASS_CACHE", "1")  # conftest turns specpass's caches off for the rest of the suite
    monkeypatch.setenv("SPECPASS_CACHE_DIR", str(tmp_path))
    return tmp_path / "steps"


def plain_greedy(target):
    return Decoder(target, None, k=0, max_batch=3, max_len=40, compile="eager").generate(PROMPTS, NEW).tokens


def test_a_second_process_runs_the_saved_steps_without_dynamo(steps_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def process():
        done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CONFIG), json.dumps(PROMPTS), str(NEW)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "SpecpassWarning" not in done.stderr, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = process()
    saved = sorted(p.name.split("-")[0] for p in steps_dir.iterdir())
    second = process()
    torch.manual_seed(0)
    assert first["graphs"] == 2 and saved == ["decode_round", "prefill"]
    assert second["graphs"] == 0  # nothing traced: both steps loaded
    assert second["tokens"] == first["tokens"] == plain_greedy(Llama(LlamaConfig(**CONFIG)).eval())


def decode(target, **options):
    """Tokens and the graphs Dynamo traced for a new plain-decoding Decoder (its steps compiled or
    loaded: the staleness key is the same code for every round shape, and plain steps compile in a
    third of a drafter's time), with the warnings specpass gave."""
    counters.clear()
    options = {"compile": specpass.backend(handoff="eager"), "fused_round": True, **options}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = Decoder(target, None, k=0, max_batch=3, max_len=40, **options).generate(PROMPTS, NEW).tokens
    return tokens, counters["stats"]["unique_graphs"], [str(w.message) for w in caught if w.category is SpecpassWarning]


def tiny_llama(**overrides):
    torch.manual_seed(0)
    return Llama(LlamaConfig(**{**CONFIG, **overrides})).eval()


def static_marks_of_the_round(monkeypatch) -> dict:
    """Filled as the fused round compiles: its state's and carry's fields (Dynamo's inputs) -> their
    static-address marks."""
    marks = {}
    adopt = compile_backend.adopt_dynamo_inputs

    def spy(dynamo_gm, aten_gm):
        if compile_backend.step_name(dynamo_gm) == "decode_round":
            for node in dynamo_gm.graph.find_nodes(op="placeholder"):
                source = getattr(node, "_dynamo_source", None)
                name = "" if source is None else source.name() if callable(source.name) else source.name
                tensor = isinstance(node.meta.get("example_value"), torch.Tensor)  # not one of its sizes
                if tensor and re.match(r"L\['args'\]\[[01]\]\.", name):  # a field of the state or the carry
                    marks[name] = node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
        return adopt(dynamo_gm, aten_gm)

    monkeypatch.setattr(compile_backend, "adopt_dynamo_inputs", spy)
    return marks


def test_a_stale_or_corrupted_step_is_never_loaded(steps_dir, monkeypatch):
    """One base compile, then each change: a corrupted file (a warning, compiled again, replaced), a
    model config, an option and a dtype the guards cannot see or need not (misses: compiled, no warning).
    The base compile runs on clones of the round's arguments: they keep the state buffers' static
    marks, without which CUDA graphs skip a round that writes its state in place ("mutated inputs")."""
    target = tiny_llama()
    marks = static_marks_of_the_round(monkeypatch)
    tokens, graphs, warned = decode(target)
    assert graphs == 2 and not warned and tokens == plain_greedy(target)
    assert len(marks) >= 4 and set(marks.values()) == {"unguarded"}, marks
    assert decode(target) == (tokens, 0, [])  # the same models, options and dtype: loaded

    round_file, = steps_dir.glob("decode_round-*.bin")
    data = bytearray(round_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    round_file.write_bytes(bytes(data))
    got, graphs, warned = decode(target)
    assert got == tokens and graphs == 1  # the round compiled again, the prefill loaded
    assert len(warned) == 1 and "fails its digest" in warned[0] and round_file.name in warned[0], warned
    assert decode(target) == (tokens, 0, [])  # the file written again loads

    assert target.config.rms_norm_eps != 1e-6
    changes = {"config": (tiny_llama(rms_norm_eps=1e-6), {}),  # same shapes and weights: only the key tells
               "option": (target, {"compile": specpass.backend(handoff="eager", max_probs="ones")}),
               "dtype": (tiny_llama().double(), {})}
    for change, (changed, options) in changes.items():
        got, graphs, warned = decode(changed, **options)
        assert graphs == 2 and not warned, (change, warned)  # a miss, not a stale file loaded
        assert got == plain_greedy(changed), change
    assert len(list(steps_dir.iterdir())) == 2 * (1 + len(changes))


def test_generate_reports_the_rewrites_of_loaded_steps(steps_dir):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=1,
                                      eos_token_id=2, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval()
    draft = transformers.LlamaForCausalLM(config).eval()
    ids = torch.tensor([[0, 5, 17, 33], [8, 41, 9, 60]])

    def generate():
        counters.clear()
        out = specpass.generate(model, ids, attention_mask=(ids != 0).long(), assistant_model=draft,
                                max_new_tokens=6, compile=specpass.backend(handoff="eager"), fused_round=True,
                                return_dict_in_generate=True, decoder_cache=DecoderCache(keep=1))
        return out, counters["stats"]["unique_graphs"]

    compiled, traced = generate()
    loaded, traced_again = generate()
    assert traced > 0 and traced_again == 0
    assert torch.equal(loaded.sequences, compiled.sequences)
    assert any("[argmax] rewrote" in line for lines in compiled.rewrites.values() for line in lines)
    assert loaded.rewrites == compiled.rewrites

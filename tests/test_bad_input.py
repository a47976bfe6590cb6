"""Bad input at every public entry point gets an error that says what is wrong and what to do:
capture/explain, the backend's options, the decoding loop, checkpoint folders, the example CLI.
A failed save leaves an existing checkpoint as it was and nothing half-written beside it."""

import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

import specpass
from models import checkpoint, zoo
from models.checkpoint import CheckpointError, load, save
from models.drafters import ZooDrafter
from models.eagle3 import Eagle3Head
from models.llama import Llama
from specpass.loop import Decoder, round_spec, shapes
from specpass.loop.chain import CHAIN

ROOT = Path(__file__).resolve().parents[1]

# --- capture, explain


@pytest.mark.parametrize("entry", [specpass.capture, specpass.explain])
@pytest.mark.parametrize("thing", [42, torch.randn(3)])
def test_capture_needs_a_module_or_a_function(entry, thing):
    with pytest.raises(TypeError, match=r"expected an nn.Module or a function to trace .* got a (int|Tensor): "
                                        r"pass the model or its step function first"):
        entry(thing, torch.randn(3))


def printing_step(x):
    print("step")
    return x + 1


def branching_step(x):
    if x.sum() > 0:
        return x + 1
    return x - 1


@pytest.mark.parametrize("entry", [specpass.capture, specpass.explain])
@pytest.mark.parametrize("step, reason", [
    (printing_step, r"at .*test_bad_input.py:\d+ \(print\(\"step\"\)\): Failed to trace builtin operator"),
    (branching_step, r"at .*test_bad_input.py:\d+ \(if x.sum\(\) > 0:\): Data-dependent branching"),
])
def test_graph_break_is_a_capture_error(entry, step, reason):
    with pytest.raises(specpass.CaptureError, match=f"{step.__name__} must compile to one graph, but Dynamo breaks it "
                                                    f"{reason}.*Make the step one graph.*torch.where") as info:
        entry(step, torch.randn(3))
    assert isinstance(info.value.__cause__, torch._dynamo.exc.Unsupported)  # Dynamo's full report, chained
    assert "\n" not in str(info.value)  # one line


def test_inputs_the_step_cannot_take_are_a_capture_error():
    def step(x):
        return x @ torch.ones(5, 5)

    with pytest.raises(specpass.CaptureError, match=r"step fails on these inputs at .*\(return x @ torch.ones.*"
                                                    r"same reduction dim.*Check that it runs on them without torch.compile"):
        specpass.capture(step, torch.randn(3))


# --- options: specpass.backend, Options.make, rewrite (validated in specpass/options.py)


@pytest.mark.parametrize("make", [specpass.backend, specpass.Options.make,
                                  lambda **kw: specpass.rewrite(torch.fx.symbolic_trace(torch.nn.Identity()), **kw)])
def test_misspelled_option_lists_the_valid_ones(make):
    assert {"q_slice", "live_rows", "argmax", "handoff"} <= set(specpass.Options.names())
    valid = re.escape(str(specpass.Options.names()))
    with pytest.raises(TypeError, match=rf"unknown specpass option\(s\) \['qslice'\]; valid options are {valid}"):
        make(qslice=False)


@pytest.mark.parametrize("name, value, allowed", [
    ("argmax", "yes", "True or False"), ("live_rows", 1, "True or False"), ("q_slice", None, "True or False"),
    ("split_projections", "False", "True or False"),
    ("split_min_rows", -1, "an int >= 0"), ("split_min_rows", 1.5, "an int >= 0"), ("split_min_rows", True, "an int >= 0"),
    ("max_probs", "one", r"one of \['exact', 'ones'\]"), ("handoff", "aot_eager", r"one of \['inductor', 'eager'\]"),
])
def test_wrong_option_value_says_what_it_takes(name, value, allowed):
    with pytest.raises(ValueError, match=rf"specpass option {name}= must be {allowed}, got {value!r}"):
        specpass.backend(**{name: value})


def test_option_given_through_torch_compile_options_is_validated():
    backend = specpass.backend(handoff="eager")
    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    with pytest.raises(ValueError, match=r"specpass option q_slice= must be True or False, got 'no'"):
        backend(gm, [torch.randn(2)], options={"q_slice": "no"})


# --- the decoding loop


@pytest.fixture(scope="module")
def target():
    return zoo.build("tiny-llama", seed=0)


def zoo_drafter(name, **changes):
    return ZooDrafter(zoo.build(dataclasses.replace(zoo.config(name), **changes), seed=3))


def decoder(target, drafter=None, **kw):
    return Decoder(target, drafter, **{"k": 4, "max_batch": 2, "max_len": 64, "compile": "eager", **kw})


@pytest.mark.parametrize("k", [-1, 2.0, (4, 5, 16)])
def test_k_must_be_an_int_or_a_tree_shape(target, k):
    with pytest.raises(ValueError, match=rf"k must be an int >= 0 \(draft tokens per round; 0: the drafter off, plain "
                                         rf"decoding\) or a specpass.TreeShape\(topk, steps, tokens\) \(tree rounds\), "
                                         rf"got {re.escape(repr(k))}"):
        decoder(target, zoo_drafter("tiny-llama-draft"), k=k)


def test_one_check_of_k_whatever_the_entry_point(target, monkeypatch):
    """Decoder(k=), use_k and tune_k's trees say the same of a bad K; a RoundSpec is checked where
    `round_spec` made it, and a Decoder given one checks nothing again."""
    message = r"must be an int >= 0 \(draft tokens per round; 0: the drafter off, plain decoding\)"
    drafter = zoo_drafter("tiny-llama-eagle3")
    dec = decoder(target, drafter, k=2)
    for call in (lambda: decoder(target, drafter, k=-1), lambda: dec.use_k(-1),
                 lambda: round_spec(drafter, -1, "num_assistant_tokens")):
        with pytest.raises(ValueError, match=message):
            call()
    spec = round_spec(drafter, 3)
    assert (spec.shape, spec.k, spec.cache_slots(5, 10)) == (CHAIN, 3, CHAIN.cache_slots(5, 10, 3))
    checked = []
    monkeypatch.setattr(shapes, "round_shape", lambda *a: checked.append(a))
    dec.use_k(spec)
    assert dec.k == 3 and checked == []


@pytest.mark.parametrize("name", ["max_batch", "max_len"])
def test_cache_sizes_must_be_positive(target, name):
    with pytest.raises(ValueError, match=rf"{name} must be an int >= 1 \(a static cache size\), got 0"):
        decoder(target, **{name: 0})


def test_unknown_compiler(target):
    with pytest.raises(ValueError, match=r"compile must be one of \['specpass', 'inductor', 'eager'\] or a backend "
                                         r"callable, got 'inductr'"):
        decoder(target, compile="inductr")
    with pytest.raises(ValueError, match="or a backend callable, got 3"):
        decoder(target, compile=3)


def test_models_without_the_protocols_members(target):
    with pytest.raises(TypeError, match=r"the drafter \(Llama\) lacks \['hidden_kind'\]: a drafter needs "
                                        r"the members of specpass.Drafter"):
        decoder(target, zoo.build("tiny-llama-draft"))  # the model, not its ZooDrafter
    with pytest.raises(TypeError, match=r"the target \(Linear\) lacks \['setup_caches'\]: a target needs the "
                                        r"members of specpass.Target"):
        decoder(torch.nn.Linear(2, 2))

    class NoHidden(torch.nn.Module):  # enough for plain decoding, not for an EAGLE-3 drafter
        def __init__(self, model):
            super().__init__()
            self.model = model

        def setup_caches(self, max_batch, max_len):
            self.model.setup_caches(max_batch, max_len)

        def forward(self, tokens, positions):
            return self.model(tokens, positions)

    assert decoder(NoHidden(target)).generate([[1, 2]], 4).tokens == decoder(target).generate([[1, 2]], 4).tokens
    with pytest.raises(TypeError, match=r"the target \(NoHidden\) lacks \['forward_with_hidden'\]"):
        decoder(NoHidden(target), zoo_drafter("tiny-llama-eagle3"))


@pytest.mark.parametrize("name, changes, reads, why", [
    ("tiny-llama-eagle3", dict(target_hidden_size=32), r"the target's 'eagle3' hidden states \[2, 1, 192\]",
     r"ValueError: hidden must be \[.., 96\]"),
    ("tiny-qwen3.5-nextn", dict(hidden_size=32), r"the target's 'last' hidden states \[2, 1, 64\]",
     r"RuntimeError: Given normalized_shape=\[32\]"),
    ("tiny-deepseek-eagle3-mla", dict(target_hidden_size=48), r"the target's 'eagle3' hidden states \[2, 1, 192\]",
     r"ValueError: hidden must be \[.., 144\]"),
])
def test_drafter_hidden_size_must_fit_the_target(target, name, changes, reads, why):
    with pytest.raises(ValueError, match=rf"the drafter does not fit the target: its catch_up fails on {reads} "
                                         rf"\({why}.*Use a drafter made for this target .*target_hidden_size"):
        decoder(target, zoo_drafter(name, **changes))


@pytest.mark.parametrize("name, changes", [("tiny-llama-eagle3", dict(vocab_size=512)),  # d2t maps up to 511
                                           ("tiny-llama-draft", dict(vocab_size=300))])
def test_drafter_ids_must_map_into_the_target_vocabulary(target, name, changes):
    with pytest.raises(ValueError, match=r"the drafter's vocabulary does not fit the target's: to_target maps \d+ of "
                                         r"its \d+ ids outside the target's 256 \(e.g. \[2[5-9]\d.*use a drafter made"):
        decoder(target, zoo_drafter(name, **changes))


@pytest.mark.parametrize("name, changes", [("tiny-llama-eagle3", dict(vocab_size=128)),
                                           ("tiny-llama-draft", dict(vocab_size=200))])
def test_drafter_must_embed_every_target_id(target, name, changes):
    rows = changes["vocab_size"]
    with pytest.raises(ValueError, match=rf"the drafter embeds {rows} token ids but the target's vocabulary has 256"):
        decoder(target, zoo_drafter(name, **changes))


@pytest.mark.parametrize("prompts, max_new_tokens, error, message", [
    ([], 8, ValueError, r"no prompts: pass a list of prompts, each a list of token ids"),
    ([[1], []], 8, ValueError, r"prompt 1 is empty: every prompt needs at least one token"),
    (["def f(x):"], 8, TypeError, r"prompt 0 is a str: encode the text to token ids first"),
    ([[1], [3, 256]], 8, ValueError, r"prompt 1 holds 256 at index 1, not a token id of the target's vocabulary "
                                     r"\(ints 0..255\): encode it with the target's tokenizer"),
    ([[-1]], 8, ValueError, r"prompt 0 holds -1 at index 0"),
    ([[1.0]], 8, ValueError, r"prompt 0 holds 1.0 at index 0"),
    ([[1, 2, True]], 8, ValueError, r"prompt 0 holds True at index 2"),
    ([[1], [2] * 70], 8, ValueError, r"prompt 1 has 70 tokens but max_len is 64: raise max_len \(to 87 for "
                                     r"max_new_tokens 8\) or shorten the prompt"),
    ([[1], [2] * 40], 20, ValueError, r"prompt 1 \(40 tokens\) \+ max_new_tokens 20 needs 69 cache slots at K 4 "
                                      r"\(`cache_slots`\), but max_len is 64: raise max_len to 69, or lower max_new_tokens"),
    ([[1]], 0, ValueError, r"max_new_tokens must be an int >= 1, got 0"),
    ([[1], [2]], [8, -3], ValueError, r"max_new_tokens\[1\] must be an int >= 1, got -3"),
    ([[1], [2]], [8], ValueError, r"max_new_tokens has 1 values for 2 prompts: pass one per prompt, or one int"),
    ([[1]], 8.5, ValueError, r"max_new_tokens must be an int >= 1, got 8.5"),
])
def test_bad_requests(target, prompts, max_new_tokens, error, message):
    dec = decoder(target, zoo_drafter("tiny-llama-eagle3"))
    with pytest.raises(error, match=message):
        dec.generate(prompts, max_new_tokens)


def test_prompts_of_other_integer_types_decode_as_ints(target):
    import numpy as np

    dec = decoder(target, zoo_drafter("tiny-llama-eagle3"))
    prompts = [[5, 17, 33], [8, 41]]
    want = dec.generate(prompts, 8).tokens
    assert dec.generate([np.array(p) for p in prompts], 8).tokens == want


def test_bad_eos_and_a_decoder_that_refused_a_request_still_decodes(target):
    dec = decoder(target, zoo_drafter("tiny-llama-eagle3"))
    with pytest.raises(ValueError, match=r"eos_id\[0\] must be an int >= -1 or a sequence of them, got None"):
        dec.generate([[1], [5, 6]], 8, eos_id=[None, 3])
    with pytest.raises(ValueError, match=r"eos_id\[1\] must be .* got \[3, 'a'\]"):
        dec.generate([[1], [5, 6]], 8, eos_id=[2, [3, "a"]])
    with pytest.raises(ValueError, match="eos_id has 3 values for 2 prompts"):
        dec.generate([[1], [5, 6]], 8, eos_id=[2, 3, 4])
    with pytest.raises(ValueError, match="prompt 1 has 70 tokens"):
        dec.generate([[1], [5] * 70], 8)
    fresh = decoder(target, zoo_drafter("tiny-llama-eagle3")).generate([[1, 9], [5, 6, 7]], 12)
    assert dec.generate([[1, 9], [5, 6, 7]], 12).tokens == fresh.tokens
    assert fresh.tokens == decoder(target).generate([[1, 9], [5, 6, 7]], 12).tokens


# --- checkpoints: load


@pytest.fixture
def folder(tmp_path):
    return zoo.make_checkpoint("tiny-llama-draft", tmp_path / "ckpt")


def test_load_from_a_folder_that_does_not_exist(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint folder .*nowhere does not exist: check the path, or write "
                                              r"one with models.checkpoint.save"):
        load(Llama, tmp_path / "nowhere")


def test_load_from_a_file(folder):
    with pytest.raises(CheckpointError, match=r"model.safetensors is a file, not a checkpoint folder: pass the folder"):
        load(Llama, folder / "model.safetensors")


def test_config_json_that_is_not_json(folder):
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=r"ckpt/config.json is not valid JSON \(.*\); it may be truncated: "
                                              r"copy or write it again"):
        load(Llama, folder)


def test_config_value_the_model_refuses(tmp_path):
    zoo.make_checkpoint("tiny-llama-eagle3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "attention": "flash"}))
    with pytest.raises(CheckpointError, match=r"config.json: attention must be 'gqa' or 'mla', got 'flash'; fix the "
                                              r"file or write it again"):
        load(Eagle3Head, tmp_path, shared={"embed_tokens.weight": torch.zeros(256, 64)})


@pytest.mark.parametrize("cut", [4, 100, 0.5])
def test_truncated_safetensors(folder, cut):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(cut * len(data)) if isinstance(cut, float) else cut])
    with pytest.raises(CheckpointError, match=r"ckpt/model.safetensors is not a readable safetensors file \(.*\); "
                                              r"it may be truncated .*: copy or write it again"):
        load(Llama, folder)


@pytest.fixture
def sharded(tmp_path):
    model = zoo.build("tiny-llama-draft")
    save(model, model.config, tmp_path / "ckpt", max_shard_bytes=20_000)
    shards = sorted((tmp_path / "ckpt").glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    return tmp_path / "ckpt", shards


def test_shard_missing_from_a_sharded_folder(sharded):
    folder, shards = sharded
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=rf"model.safetensors.index.json names shard files that are not in "
                                              rf".*ckpt: \['{shards[1].name}'\]; copy them there .* or write the "
                                              r"checkpoint again"):
        load(Llama, folder)


def test_truncated_shard(sharded):
    folder, shards = sharded
    shards[-1].write_bytes(shards[-1].read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=rf"{shards[-1].name} is not a readable safetensors file"):
        load(Llama, folder)


def test_index_without_a_weight_map(sharded):
    folder, _ = sharded
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match=r"index.json has no weight_map \(tensor name -> shard file\)"):
        load(Llama, folder)


@pytest.mark.parametrize("field, value, problem", [
    ("intermediate_size", 80, r"wrong shapes \(6\): model.layers.0.mlp.gate_proj.weight: expected \[80, 64\], "
                              r"found \[96, 64\]"),
    ("num_hidden_layers", 3, r"missing keys \(9\): \['model.layers.2.input_layernorm.weight'"),
    ("num_hidden_layers", 1, r"unexpected keys \(9\): \['model.layers.1.input_layernorm.weight'"),
])
def test_config_that_disagrees_with_the_weights(folder, field, value, problem):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(CheckpointError, match=rf"(?s)cannot load .*ckpt into Llama:\n  {problem}.*\n  .*ckpt/"
                                              r"model.safetensors does not hold the weights .*ckpt/config.json "
                                              r"describes: load the folder with the class and config that wrote "
                                              r"it, or save the model into it again"):
        load(Llama, folder)


# --- checkpoints: save, all or nothing


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def fail_midway(monkeypatch, after: int = 0):
    """safetensors' writer writes `after` files, then half of the next one and raises."""
    written = []
    real = checkpoint.save_file

    def save_file(tensors, path, metadata=None):
        if len(written) == after:
            Path(path).write_bytes(b"\x00" * 1000)  # what an interrupted write leaves
            raise OSError(28, "No space left on device")
        written.append(path)
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(checkpoint, "save_file", save_file)


@pytest.mark.parametrize("shard, after", [(None, 0), (20_000, 0), (20_000, 2)])
@pytest.mark.parametrize("old_shard", [None, 20_000])
def test_failed_save_leaves_the_old_checkpoint_intact(tmp_path, monkeypatch, shard, after, old_shard):
    old = zoo.build("tiny-llama-draft", seed=1)
    save(old, old.config, tmp_path / "ckpt", max_shard_bytes=old_shard)
    (tmp_path / "ckpt" / "README.md").write_text("mine")
    before, around = snapshot(tmp_path / "ckpt"), list(tmp_path.iterdir())
    new = zoo.build("tiny-llama-draft", seed=2)
    fail_midway(monkeypatch, after)
    with pytest.raises(OSError, match="No space left on device"):
        save(new, new.config, tmp_path / "ckpt", max_shard_bytes=shard)
    assert snapshot(tmp_path / "ckpt") == before
    assert list(tmp_path.iterdir()) == around  # no staging folder left beside it
    monkeypatch.undo()
    assert torch.equal(load(Llama, tmp_path / "ckpt").lm_head.weight, old.lm_head.weight)


def test_failed_save_to_a_new_folder_leaves_nothing(tmp_path, monkeypatch):
    fail_midway(monkeypatch)
    with pytest.raises(OSError):
        zoo.make_checkpoint("tiny-llama-draft", tmp_path / "new" / "ckpt")
    assert list((tmp_path / "new").iterdir()) == []


def test_save_replaces_the_weights_and_keeps_other_files(tmp_path):
    old = zoo.build("tiny-llama-draft", seed=1)
    save(old, old.config, tmp_path, max_shard_bytes=20_000)
    (tmp_path / "README.md").write_text("mine")
    new = zoo.build("tiny-llama-draft", seed=2)
    save(new, new.config, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert torch.equal(load(Llama, tmp_path).lm_head.weight, new.lm_head.weight)


def test_save_refuses_bad_arguments(tmp_path):
    model = zoo.build("tiny-llama-draft")
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match=r"file is a file, not a folder: pass the folder to save"):
        save(model, model.config, tmp_path / "file")
    with pytest.raises(TypeError, match=r"config must be the model's config .*, got dict"):
        save(model, model.config.to_dict(), tmp_path / "c")
    with pytest.raises(ValueError, match=r"max_shard_bytes must be a positive int \(or None: one file\), got 0"):
        save(model, model.config, tmp_path / "c", max_shard_bytes=0)
    state = {"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.bfloat16)}
    with pytest.raises(CheckpointError, match=r"mixed floating dtypes .*; cast the model to one dtype first"):
        save(state, model.config, tmp_path / "c")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing written


# --- examples/generate.py (it writes no file)

_spec = importlib.util.spec_from_file_location("generate", ROOT / "examples" / "generate.py")
generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate)


@pytest.mark.parametrize("args, message", [
    (["--k", "0"], "argument --k: must be at least 1, got 0"),
    (["--max-new-tokens", "-5"], "argument --max-new-tokens: must be at least 1, got -5"),
    (["--num-prompts", "0"], "argument --num-prompts: must be at least 1, got 0"),
    (["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
    (["--k", "two"], "argument --k: invalid positive_int value: 'two'"),
    (["--device", "gpu0"], "error: --device gpu0: "),  # then torch's reason
    (["--eagle", "a", "--draft", "b"], "argument --draft: not allowed with argument --eagle"),
])
def test_example_arguments(capsys, args, message):
    with pytest.raises(SystemExit) as info:
        generate.parse_args(args)
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_example_cuda_without_a_gpu(capsys):
    with pytest.raises(SystemExit):
        generate.parse_args(["--device", "cuda"])
    assert "--device cuda, but this torch sees no CUDA GPU: use --device cpu" in capsys.readouterr().err

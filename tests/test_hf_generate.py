"""`specpass.generate` on transformers causal LMs equals `model.generate(do_sample=False)` token for
token: six families as target, each with a standalone draft of its family that disagrees with it
sometimes, and the zoo's EAGLE-3 head over a Llama and a Qwen3 target; at batch size 1 and on a
ragged left-padded batch; EOS per request; the live-row rewrite on the draft's catch-up; tree
rounds (the adapters' `forward_tree`, `copy_slots`, `draft_tree_step`); the refusals. Tiny random
configs, fp32, CPU, the steps run eagerly except in the compile tests; the tree rounds' EAGLE-3
test runs the shipped target and head (a random head never drafts what the target emits)."""

import copy
import gc
import inspect
import pydoc
import subprocess
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch
import transformers

import specpass
from models import zoo
from models.drafters import ZooDrafter
from models.eagle3 import Eagle3Config
from models.text import encode
from specpass import compile_backend, pipeline
from specpass.hf.adapters import HFDrafter, HFTarget

V, NEW, K = 96, 12, 4
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2)  # decisive logits
ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
SIZES = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4, **SPECIAL)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(SIZES, **ATTN)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(SIZES, **ATTN)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(SIZES, **ATTN)),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(SIZES, num_attention_heads=4,
                                                                         num_key_value_heads=2)),
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, dict(SIZES, **ATTN)),
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel, dict(
        vocab_size=V, n_embd=64, n_layer=4, n_head=4, n_positions=64, **SPECIAL)),  # absolute positions
}
# Left-padded, lengths 3, 7, 1 (pad id 0 never appears in a prompt).
IDS = torch.tensor([[0, 0, 0, 0, 5, 17, 33], [8, 41, 9, 60, 12, 3, 77], [0, 0, 0, 0, 0, 0, 50]])
MASK = (IDS != 0).long()


def build(family, seed=0, noise=0.0, **overrides):
    config_class, model_class, sizes = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**sizes, **overrides})).eval()
    return perturbed(model, noise) if noise else model


@torch.no_grad()
def perturbed(model, noise, seed=1):
    """A copy with every weight moved by `noise` of its spread: a draft that agrees often, not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    for p in draft.parameters():
        p.add_(noise * p.std() * torch.randn(p.shape, generator=g))
    return draft


def reference(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **kw)


def ours(model, ids, mask, **kw):
    return specpass.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, compile="eager",
                             return_dict_in_generate=True, **kw)


def eagle3_head(target, seed=3):
    """The zoo's EAGLE-3 head (random) sized for this transformers target."""
    c = target.config
    config = Eagle3Config(vocab_size=c.vocab_size, draft_vocab_size=64, hidden_size=c.hidden_size,
                          intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          rope_theta=10000.0)
    return ZooDrafter(zoo.build(config, seed=seed))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("rows", [[1], [0, 1, 2]], ids=["bs1", "ragged3"])
def test_standalone_draft_equals_generate(family, rows):
    model, draft = build(family), build(family, noise=0.1)
    ids, mask = IDS[rows], MASK[rows]
    out = ours(model, ids, mask, assistant_model=draft, num_assistant_tokens=K)
    assert torch.equal(out.sequences, reference(model, ids, mask))
    assert 1 < out.metrics.accept_length < K + 1  # some drafts rejected, some accepted


def test_eager_attention_gets_the_additive_mask():
    """SDPA models get a bool mask (what the split-KV kernel reads), eager attention the additive one
    it adds to its scores: a bool mask there would add 1 where a slot is seen and hide nothing."""
    model = build("llama", attn_implementation="eager")
    draft = build("llama", noise=0.1, attn_implementation="eager")
    out = ours(model, IDS, MASK, assistant_model=draft)
    assert torch.equal(out.sequences, reference(model, IDS, MASK))
    assert HFTarget(build("llama")).mask_dtype == torch.bool and HFTarget(model).mask_dtype == torch.float32


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_eagle3_head_equals_generate(family):
    model = build(family)
    head = eagle3_head(model)
    out = ours(model, IDS, MASK, assistant_model=head, num_assistant_tokens=K)
    assert torch.equal(out.sequences, reference(model, IDS, MASK))
    assert out.metrics.rounds >= NEW // (K + 1)


def test_eagle3_reads_transformers_hidden_states_2_mid_and_l_minus_3():
    model = build("llama", num_hidden_layers=6)
    target = HFTarget(model)
    target.setup_caches(2, 16)
    tokens = IDS[:2, :5]
    with torch.no_grad():
        logits, hidden = target.forward_with_hidden(tokens, torch.arange(5).expand(2, -1), "eagle3")
        expected = model(tokens, output_hidden_states=True)
    close = dict(rtol=1e-4, atol=1e-4)  # a 16-slot cache against 5 positions: other summation orders
    torch.testing.assert_close(hidden, torch.cat([expected.hidden_states[i] for i in (2, 3, 3)], -1), **close)
    torch.testing.assert_close(logits, expected.logits, **close)


def test_plain_decoding_equals_generate():
    model = build("qwen3")
    out = ours(model, IDS, MASK)
    assert torch.equal(out.sequences, reference(model, IDS, MASK))
    assert out.metrics.accept_length == 1


def test_eos_per_request_pads_like_generate():
    model, draft = build("llama"), build("llama", noise=0.1)
    free = reference(model, IDS, MASK, eos_token_id=None)
    eos = int(free[0, IDS.shape[1] + 2])  # request 0 stops at its third new token
    assert (free[1:, IDS.shape[1]:IDS.shape[1] + 6] != eos).any(), "the other requests go on past it"
    expected = reference(model, IDS, MASK, eos_token_id=eos, pad_token_id=90)
    out = ours(model, IDS, MASK, assistant_model=draft, eos_token_id=eos, pad_token_id=90)
    assert torch.equal(out.sequences, expected)
    assert (out.sequences[0, IDS.shape[1] + 3:] == 90).all() and out.sequences.shape[1] > IDS.shape[1] + 3


@pytest.mark.parametrize("compile", ["eager", "specpass"])
def test_several_eos_ids_stop_each_request_on_any_of_them(compile):
    """A list of EOS ids (a Llama-3 Instruct generation_config's), as `model.generate` takes it: request 0
    stops on one id, request 2 on another, each where plain decoding first emits it; compiled, the ids
    are compared inside the round."""
    model, draft = build("llama"), build("llama", noise=0.1)
    free = reference(model, IDS, MASK, eos_token_id=None)
    n = IDS.shape[1]
    first, second = int(free[0, n + 2]), int(free[2, n + 4])
    assert first != second and second not in free[0, n:n + 3].tolist() and first not in free[2, n:n + 5].tolist()
    expected = reference(model, IDS, MASK, eos_token_id=[first, second], pad_token_id=90)
    compile_with = specpass.backend(handoff="eager") if compile == "specpass" else "eager"
    out = specpass.generate(model, IDS, attention_mask=MASK, max_new_tokens=NEW, assistant_model=draft,
                            eos_token_id=[first, second], pad_token_id=90, compile=compile_with)
    assert torch.equal(out, expected)
    assert (out[0, n + 3:] == 90).all() and (out[2, n + 5:] == 90).all()
    model.generation_config.eos_token_id = [second, first]  # read from the config as generate reads it
    assert torch.equal(ours(model, IDS, MASK, assistant_model=draft, pad_token_id=90).sequences, expected)


class RecordingStreamer:
    """transformers' streamer protocol, each call recorded in order."""

    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(("put", value.tolist()))

    def end(self):
        self.calls.append(("end",))


def test_a_streamer_gets_the_prompt_then_each_round_s_tokens_then_end():
    model, draft = build("llama"), build("llama", noise=0.1)
    ids, mask = IDS[[1]], MASK[[1]]
    streamer = RecordingStreamer()
    out = ours(model, ids, mask, assistant_model=draft, num_assistant_tokens=K, streamer=streamer)
    assert torch.equal(out.sequences, reference(model, ids, mask))
    calls = streamer.calls
    assert calls[0] == ("put", ids.tolist()) and calls[-1] == ("end",)
    pieces = [c[1] for c in calls[1:-1]]
    assert all(c[0] == "put" and len(p) == 1 for c, p in zip(calls[1:-1], pieces))  # [1, n]: one request
    assert sum((p[0] for p in pieces), []) == out.sequences[0, ids.shape[1]:].tolist()
    assert pieces[0] == [[out.sequences[0, ids.shape[1]].tolist()]]  # the prefill's token, on its own
    assert len(pieces) == out.metrics.rounds + 1 and any(len(p[0]) > 1 for p in pieces)  # a round at a time


def test_a_streamer_takes_one_request_and_the_protocol():
    _refusal("streamer= takes one request", streamer=RecordingStreamer())
    _refusal("lacks put", error=TypeError, streamer=object())


def test_generation_config_is_read_as_generate_reads_it():
    """`generation_config=` stands in for the model's: its EOS list, pad id and do_sample."""
    model, draft = build("llama"), build("llama", noise=0.1)
    free = reference(model, IDS, MASK, eos_token_id=None)
    n = IDS.shape[1]
    config = transformers.GenerationConfig(eos_token_id=[int(free[0, n + 2]), int(free[2, n + 4])], pad_token_id=90)
    want = model.generate(IDS, attention_mask=MASK, max_new_tokens=NEW, generation_config=config)
    out = ours(model, IDS, MASK, assistant_model=draft, generation_config=config)
    assert torch.equal(out.sequences, want) and not torch.equal(want, free)
    sampled = transformers.GenerationConfig(do_sample=True, temperature=0.7, top_k=0)
    got = ours(model, IDS, MASK, assistant_model=draft, generation_config=sampled, seed=5).sequences
    assert torch.equal(got, ours(model, IDS, MASK, assistant_model=draft, do_sample=True, temperature=0.7,
                                 top_k=0, seed=5).sequences)
    assert not torch.equal(got, reference(model, IDS, MASK))  # sampled, not greedy


def test_options_specpass_does_not_apply_are_refused_by_name():
    """Never ignored: a generation config's field that changes tokens, model.generate's own keywords."""
    model = build("llama")
    model.generation_config.suppress_tokens = [5]
    _refusal(r"the model's generation_config sets suppress_tokens=\[5\], which specpass.generate does not apply",
             model=model)
    config = transformers.GenerationConfig(suppress_tokens=[5], min_new_tokens=3, bad_words_ids=[[5]])
    _refusal(r"generation_config sets bad_words_ids=\[\[5\]\], suppress_tokens=\[5\], which", generation_config=config)
    for name, value in (("suppress_tokens", [5]), ("stopping_criteria", transformers.StoppingCriteriaList()),
                        ("prefix_allowed_tokens_fn", lambda batch_id, ids: [1])):
        _refusal(f"specpass.generate does not apply {name} ", **{name: value})
    _refusal(r"unexpected keyword arguments \['nonsense'\]", error=TypeError, nonsense=1)
    _refusal("stop_strings needs the model's tokenizer", stop_strings=["ab"])


def letters_tokenizer(vocab_size):
    """A tokenizer of the tiny vocabulary, built here (nothing downloaded): ids 0-25 are the letters a-z,
    the others two letters each ("aa", "ab", ...); text splits into letters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    names = [chr(97 + i) if i < 26 else chr(96 + i // 26) + chr(97 + i % 26) for i in range(vocab_size)]
    tokenizer = Tokenizer(models.WordLevel({name: i for i, name in enumerate(names)}, unk_token="a"))
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Split("", "isolated"), decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer), names


@pytest.mark.parametrize("k", [0, K, specpass.TreeShape(2, 3, 6)])
def test_stop_strings_stop_where_model_generate_stops(k):
    """A stop string that spans two new tokens, another that is one token: each request stops after the
    token that completes one, as `model.generate(stop_strings=..., tokenizer=...)` does, at bs 1 and
    ragged, and a streamer sees no token past it. With an EOS id a stopped request is padded; with
    eos_token_id=None transformers pads nothing and every request runs to the last one's stop."""
    model, draft = build("llama"), build("llama", noise=0.1)
    tokenizer, names = letters_tokenizer(V)
    free, n = reference(model, IDS, MASK, eos_token_id=None), IDS.shape[1]
    stops = [names[int(free[1, n + 3])][-1] + names[int(free[1, n + 4])], names[int(free[0, n + 6])]]
    for eos in ({}, {"eos_token_id": None}):
        for rows in ([1], [0, 1, 2]):
            want = reference(model, IDS[rows], MASK[rows], stop_strings=stops, tokenizer=tokenizer, pad_token_id=90,
                             **eos)
            assert want.shape[1] < n + NEW and (len(rows) == 1 or (90 in want) == (not eos))  # padded with an EOS
            streamer = RecordingStreamer() if len(rows) == 1 else None
            got = specpass.generate(model, IDS[rows], attention_mask=MASK[rows], max_new_tokens=NEW, compile="eager",
                                    assistant_model=draft if k else None, num_assistant_tokens=k, stop_strings=stops,
                                    tokenizer=tokenizer, pad_token_id=90, streamer=streamer, **eos)
            assert torch.equal(got, want), (eos, rows, got.tolist(), want.tolist())
            if streamer is not None:
                streamed = sum((c[1][0] for c in streamer.calls[1:-1]), [])
                assert streamed == want[0, n:][want[0, n:] != 90].tolist()


def test_compiled_catch_up_gets_the_live_row_rewrite():
    model, draft = build("llama"), build("llama", noise=0.1)
    out = specpass.generate(model, IDS, attention_mask=MASK, assistant_model=draft, max_new_tokens=NEW,
                            num_assistant_tokens=K, compile=specpass.backend(handoff="eager"),
                            return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference(model, IDS, MASK))
    assert any(line.startswith("[live_rows] rewrote") for line in out.rewrites["catch_up"]), out.rewrites
    assert any(line.startswith("[argmax] rewrote") for line in out.rewrites["draft"]), out.rewrites
    # the prefill, compiled with the prompt length symbolic: lm_heads on each request's live row
    assert any(line.startswith("[live_rows] rewrote") for line in out.rewrites["prefill"]), out.rewrites
    assert set(out.rewrites) == {"prefill", "draft", "verify", "accept", "catch_up"}


def test_steps_compiled_without_rewrites_say_why_in_rewrites(monkeypatch):
    """Capture fails on every graph: each step runs unrewritten, and its `rewrites` say so and why
    instead of listing nothing (or what the passes did to a graph that does not run)."""
    def to_aten_ir(gm, example_inputs):
        raise RuntimeError("injected capture failure")

    monkeypatch.setattr(compile_backend, "to_aten_ir", to_aten_ir)
    model, draft = build("llama"), build("llama", noise=0.1)
    with pytest.warns(specpass.SpecpassWarning, match="injected capture failure"):
        out = specpass.generate(model, IDS, attention_mask=MASK, assistant_model=draft, max_new_tokens=NEW,
                                compile=specpass.backend(handoff="eager"), return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference(model, IDS, MASK))
    assert set(out.rewrites) == {"prefill", "draft", "verify", "accept", "catch_up"}, out.rewrites
    assert all(lines == ["[fallback] specpass could not capture this graph (RuntimeError: injected capture failure); "
                         "compiling it without rewrites"] for lines in out.rewrites.values()), out.rewrites


def test_a_model_dynamo_cannot_trace_as_one_graph_runs_uncompiled_and_says_why():
    model, draft = build("llama"), build("llama", noise=0.1)
    norm = model.model.norm.forward

    def breaking(hidden):
        torch._dynamo.graph_break()  # what a forward Dynamo cannot trace whole does to fullgraph=True
        return norm(hidden)

    model.model.norm.forward = breaking
    with pytest.warns(specpass.SpecpassWarning, match="Dynamo cannot trace prefill as one graph"):
        out = specpass.generate(model, IDS, attention_mask=MASK, assistant_model=draft, max_new_tokens=NEW,
                                compile=specpass.backend(handoff="eager"), return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference(model, IDS, MASK))
    assert out.rewrites["prefill"] == ["[fallback] Dynamo cannot trace prefill as one graph (Unsupported: "
                                       "Call to `torch._dynamo.graph_break()`); it runs uncompiled"], out.rewrites
    assert any(line.startswith("[argmax] rewrote") for line in out.rewrites["draft"]), out.rewrites  # the draft's own
    with pytest.raises(specpass.ExactModeError, match="exact mode refuses prefill: Dynamo cannot trace"):
        specpass.generate(model, IDS, attention_mask=MASK, max_new_tokens=2, exact=True,
                          compile=specpass.backend(handoff="eager"))


def test_a_pass_dropped_says_why_in_rewrites_beside_the_others(monkeypatch):
    def raising(gm, options):
        raise RuntimeError("injected pass failure")

    monkeypatch.setattr(pipeline, "PASSES", [(n, raising if n == "live_rows" else run) for n, run in pipeline.PASSES])
    model, draft = build("llama"), build("llama", noise=0.1)
    with pytest.warns(specpass.SpecpassWarning, match="injected pass failure"):
        out = specpass.generate(model, IDS, attention_mask=MASK, assistant_model=draft, max_new_tokens=NEW,
                                compile=specpass.backend(handoff="eager"), return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference(model, IDS, MASK))
    dropped = "[error] pass live_rows failed (RuntimeError: injected pass failure)"
    assert all(any(line.startswith(dropped) for line in lines) for lines in out.rewrites.values()), out.rewrites
    assert not any(line.startswith("[live_rows]") for lines in out.rewrites.values() for line in lines)
    assert any(line.startswith("[argmax] rewrote") for line in out.rewrites["draft"]), out.rewrites


def test_rewrites_are_reported_after_other_specpass_compiles():
    """specpass compiling elsewhere first (its logger then caches "INFO is off") must not hide the
    rewrites of the next step compiled here (it hid the prefill's: the first step compiled)."""
    other = torch.compile(lambda x: torch.softmax(x, -1).max(-1).indices, backend=specpass.backend(handoff="eager"),
                          fullgraph=True)
    other(torch.randn(3, 8))
    model, draft = build("llama"), build("llama", noise=0.1)
    out = specpass.generate(model, IDS, attention_mask=MASK, assistant_model=draft, max_new_tokens=4,
                            compile=specpass.backend(handoff="eager"), return_dict_in_generate=True)
    assert any(line.startswith("[live_rows] rewrote") for line in out.rewrites["prefill"]), out.rewrites


def test_import_specpass_does_not_import_transformers():
    code = "import sys, specpass; assert 'transformers' not in sys.modules; print(specpass.generate.__name__)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "generate"


def test_generate_shows_its_signature():
    """`specpass.generate` is the function itself, imported on first access: its signature and help
    are the real ones, and `dir(specpass)` lists it before transformers is imported."""
    parameters = inspect.signature(specpass.generate).parameters
    assert list(parameters)[:3] == ["model", "input_ids", "max_new_tokens"] and "decoder_cache" in parameters
    assert "max_new_tokens" in pydoc.render_doc(specpass.generate)
    exported = {"generate", "DecoderCache", "Decoder", "Drafter", "ParallelDrafter", "Target"}
    assert exported <= set(specpass.__all__) and exported <= set(dir(specpass))
    code = ("import sys, specpass; assert {'generate', 'DecoderCache'} <= set(dir(specpass)); "
            "assert 'transformers' not in sys.modules; import inspect; print(inspect.signature(specpass.generate))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and "max_new_tokens: 'int'" in result.stdout, result.stderr


def test_generate_keeps_one_decoder_per_configuration():
    cache = specpass.DecoderCache(keep=2)
    model = build("llama")
    first = ours(model, IDS, MASK, decoder_cache=cache)
    (decoder,) = cache
    again = ours(model, IDS, MASK, decoder_cache=cache)
    assert list(cache) == [decoder] and torch.equal(first.sequences, again.sequences)  # reused
    for rows in (slice(1, 2), slice(0, 2)):  # other batch sizes: the same Decoder
        ours(model, IDS[rows], MASK[rows], decoder_cache=cache)
    # plain decoding (K 0) needs the longest prompt + NEW + 1 slots: 20 here; a new Decoder rounds up to
    # 5/8, 6/8, 7/8 or 8/8 of the next power of two, a multiple of 16
    assert decoder.max_len == 32
    shorter = ours(model, IDS[2:, -1:], MASK[2:, -1:], decoder_cache=cache)  # 14 slots: the same Decoder
    assert list(cache) == [decoder]
    assert torch.equal(shorter.sequences, reference(model, IDS[2:, -1:], MASK[2:, -1:]))
    longer = torch.arange(3, 15)[None]  # 12 tokens, 25 slots: this one still
    ours(model, longer, torch.ones_like(longer), decoder_cache=cache)
    assert list(cache) == [decoder]
    longest = torch.arange(3, 24)[None]  # 21 tokens, 34 slots: a new Decoder, 48 of them (6/8 of 64)
    ours(model, longest, torch.ones_like(longest), decoder_cache=cache)
    assert len(cache) == 2 and list(cache)[0] is decoder and list(cache)[1].max_len == 48
    ours(model, IDS, MASK, decoder_cache=cache)  # the shortest that is long enough: the first one again
    assert list(cache)[1] is decoder
    for slots in (64, 80):  # a given cache length: exactly that; keep=2 drops the least recently used
        ours(model, IDS, MASK, decoder_cache=cache, cache_len=slots)
    assert len(cache) == 2 and [d.max_len for d in cache] == [64, 80] and decoder not in list(cache)
    with pytest.raises(ValueError, match="keep .* must be an int >= 0, got -1"):
        specpass.DecoderCache(keep=-1)


def test_clear_frees_the_models():
    """A cached Decoder holds its models (an id in a key can never name another model); `clear`
    lets them go. The default cache is `specpass.generate.cache`."""
    for cache in (specpass.DecoderCache(), None):
        held = cache if cache is not None else specpass.generate.cache
        held.clear()
        model, draft = build("llama"), build("llama", noise=0.1)
        ours(model, IDS, MASK, assistant_model=draft, decoder_cache=cache)
        assert len(held) == 1
        refs = [weakref.ref(model), weakref.ref(draft)]
        del model, draft
        gc.collect()
        assert all(ref() is not None for ref in refs)  # the cache holds them
        held.clear()
        gc.collect()
        assert all(ref() is None for ref in refs) and len(held) == 0


def _refusal(match, error=ValueError, model=None, **kw):
    with pytest.raises(error, match=match):
        ours(model if model is not None else build("llama"), IDS, MASK, **kw)


def test_refuses_a_draft_with_another_vocabulary():
    _refusal("vocab_size: the model has 96, the assistant 80", assistant_model=build("llama", vocab_size=80))


def test_refuses_a_draft_with_another_tokenizer():
    _refusal("eos_token_id: the model has 2, the assistant 3", assistant_model=build("llama", eos_token_id=3))
    tokenizers = [types.SimpleNamespace(get_vocab=lambda v=v: {"a": 0, "b": v}) for v in (1, 2)]
    _refusal("different ids", assistant_model=build("llama", noise=0.1), tokenizer=tokenizers[0],
             assistant_tokenizer=tokenizers[1])


def test_refuses_encoder_decoder_models():
    config = transformers.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    _refusal("encoder-decoder", model=transformers.T5ForConditionalGeneration(config))


def test_refuses_an_encoder_not_loaded_as_a_decoder():
    """Bidirectional attention: served, it gave other tokens than `model.generate`; as a decoder it is served."""
    config = dict(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    _refusal("is_decoder=False", model=transformers.BertLMHeadModel(transformers.BertConfig(**config)))
    model = transformers.BertLMHeadModel(transformers.BertConfig(**config, is_decoder=True)).eval()
    assert torch.equal(ours(model, IDS, MASK).sequences, reference(model, IDS, MASK))


def test_refuses_a_model_whose_logits_read_later_tokens():
    """Whatever its config says: here every position's embedding gains the mean over the sequence."""
    model = build("llama")
    model.model.embed_tokens.register_forward_hook(lambda module, args, out: out + out.mean(1, keepdim=True))
    _refusal("is not causal: changing the last of three tokens", model=model)
    _refusal("assistant_model .* is not causal", assistant_model=model, model=build("llama"))


def test_refuses_stateful_models():
    config = transformers.MambaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, state_size=4)
    _refusal("roll", model=transformers.MambaForCausalLM(config))


def test_refuses_attention_without_a_4d_mask():
    model = build("llama")
    model.config._attn_implementation = "flash_attention_2"
    _refusal("attn_implementation='sdpa'", model=model)


def test_refuses_right_padding_a_bad_eos_id_and_too_many_positions():
    with pytest.raises(ValueError, match="left padding"):
        ours(build("llama"), IDS, MASK.flip(1))
    _refusal(r"eos_token_id must be a token id \(an int >= 0\) or a list of them, got \[2, -3\]", eos_token_id=[2, -3])
    with pytest.raises(ValueError, match="64 positions"):
        specpass.generate(build("gpt2"), IDS, attention_mask=MASK, max_new_tokens=60, compile="eager")


def test_refuses_a_drafter_that_is_neither():
    _refusal("lacks", error=TypeError, assistant_model=object())


def test_sliding_window_in_the_mask_equals_generate():
    model, draft = build("mistral", sliding_window=4), build("mistral", noise=0.1, sliding_window=4)
    out = ours(model, IDS, MASK, assistant_model=draft, num_assistant_tokens=K)
    assert torch.equal(out.sequences, reference(model, IDS, MASK))
    assert not torch.equal(out.sequences, reference(build("mistral"), IDS, MASK))  # the window matters


def test_refuses_mixed_sliding_and_full_layers_and_the_last_hidden_state():
    _refusal("one mask", model=build("qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=2))
    target = HFTarget(build("llama"))
    target.setup_caches(1, 8)
    with pytest.raises(ValueError, match="'eagle3'"):
        target.forward_with_hidden(IDS[:1, :2], torch.arange(2)[None], "last")


def test_sampling_has_transformers_distribution():
    """do_sample=True through the speculative loop against transformers' own sampler (temperature,
    top-k, top-p applied as its warpers apply them): a two-sample chi-square test on the first two
    tokens, N = 20,000 each, α = 1e-3 (tests/test_sampling.py states the loop's own tests)."""
    from tests.test_sampling import two_sample

    model = build("llama", vocab_size=16, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    draft = perturbed(model, 0.5)
    n, kw = 20_000, dict(temperature=0.7, top_k=8, top_p=0.9)
    ids = torch.tensor([[5, 3, 9]]).expand(n, -1)
    torch.manual_seed(0)
    theirs = model.generate(ids, max_new_tokens=2, do_sample=True, **kw)[:, 3:]
    out = specpass.generate(model, ids, assistant_model=draft, max_new_tokens=2, do_sample=True, seed=0,
                            compile="eager", return_dict_in_generate=True, **kw)
    assert 1 < out.metrics.accept_length < K + 1
    stat, df, p = two_sample(out.sequences[:, 3:], theirs, vocab=16)
    assert p > 1e-3, f"chi-square {stat:.1f} on {df} df, p = {p:.2e}"
    again = specpass.generate(model, ids[:4], assistant_model=draft, max_new_tokens=2, do_sample=True, seed=0,
                              compile="eager", **kw)
    assert torch.equal(again, specpass.generate(model, ids[:4], assistant_model=draft, max_new_tokens=2,
                                                do_sample=True, seed=0, compile="eager", **kw))


def test_sampling_keywords_need_do_sample():
    with pytest.raises(ValueError, match="take effect with do_sample=True"):
        specpass.generate(build("llama"), IDS[:1], max_new_tokens=2, temperature=0.5, compile="eager")


# --- tree rounds: num_assistant_tokens=specpass.TreeShape(topk, steps, tokens)

TREES = [specpass.TreeShape(3, 3, 8), specpass.TreeShape(2, 4, 6)]  # topk > 1, fewer nodes than the full tree
SHIPPED = Path(__file__).resolve().parent.parent / "checkpoints"


@pytest.mark.parametrize("shape", TREES, ids=str)
@pytest.mark.parametrize("rows", [[1], [0, 1, 2]], ids=["bs1", "ragged3"])
def test_tree_rounds_with_a_standalone_draft_equal_generate(shape, rows):
    model, draft = build("llama"), build("llama", noise=0.1)
    ids, mask = IDS[rows], MASK[rows]
    out = ours(model, ids, mask, assistant_model=draft, num_assistant_tokens=shape)
    assert torch.equal(out.sequences, reference(model, ids, mask))
    assert 1 < out.metrics.accept_length < shape.steps + 1  # some drafts rejected, some accepted
    assert len(out.metrics.acceptance) == shape.steps


@pytest.fixture(scope="module")
def shipped():
    """The shipped target loaded by transformers and its EAGLE-3 head, and prompts it was not
    trained on (so that it drafts right often, not always), left-padded with 0."""
    model = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED / "stdlib-llama", dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    prompts = [encode(text) for text in ("zq9 ~~ {", "Hello, wor", "£€")]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return model, specpass.load_drafter(SHIPPED / "stdlib-llama-eagle3", model), ids, mask


@pytest.mark.parametrize("shape", TREES, ids=str)
@pytest.mark.parametrize("rows", [[1], [0, 1, 2]], ids=["bs1", "ragged3"])
def test_tree_rounds_with_an_eagle3_head_equal_generate(shipped, shape, rows):
    model, head, ids, mask = shipped
    ids, mask = ids[rows], mask[rows]
    out = ours(model, ids, mask, assistant_model=head, num_assistant_tokens=shape)
    assert torch.equal(out.sequences, reference(model, ids, mask, pad_token_id=0))
    assert 2 < out.metrics.accept_length < shape.steps + 1, out.metrics.acceptance  # deep paths, not every time


@pytest.mark.parametrize("family,options", [("gpt2", {}), ("llama", dict(attn_implementation="eager")),
                                            ("mistral", dict(sliding_window=4))],
                         ids=["absolute_positions", "eager_attention", "sliding_window"])
def test_tree_rounds_read_positions_masks_and_windows_as_the_model_does(family, options):
    """Siblings share a learned position (GPT-2); eager attention adds the tree mask to its scores;
    a sliding window (4 > steps 3) cuts the tree's mask as it cuts the model's own."""
    model, draft = build(family, **options), build(family, noise=0.1, **options)
    out = ours(model, IDS, MASK, assistant_model=draft, num_assistant_tokens=TREES[0])
    assert torch.equal(out.sequences, reference(model, IDS, MASK))
    assert out.metrics.accept_length > 1


PROMPT, SLOTS = IDS[1:, 3:], 16  # two requests' 4-token prompts [2, 4], at positions 0..3
X, A, B, C, D = 10, 20, 30, 40, 50  # a tree x -> (a, b), b -> c after the prompt; d after x, b, c
CLOSE = dict(rtol=1e-4, atol=1e-4)  # a 16-slot cache against the branch alone: other summation orders


def own_logits(model, branch):
    """transformers' own last-row logits for each request's prompt + branch: [2, V]."""
    return model(torch.cat([PROMPT, torch.tensor([branch]).expand(2, -1)], 1)).logits[:, -1]


def tree_call(tokens, positions, slots, ancestors, prefix):
    """The rows' [2, T] tokens, positions and slots, and the [2, 1, T, SLOTS] mask: slots < prefix
    and the rows' ancestors (ancestors [T, T], among the rows' own slots)."""
    mask = torch.zeros(2, 1, len(tokens), SLOTS, dtype=torch.bool)
    mask[..., :prefix] = True
    mask[..., slots[0]:slots[0] + len(slots)] = torch.tensor(ancestors, dtype=torch.bool)
    return [torch.tensor([row]).expand(2, -1) for row in (tokens, positions, slots)] + [mask]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_forward_tree_is_transformers_forward_along_each_branch(attention):
    """After the prompt, the tree x -> (a, b), b -> c at slots 4..7: each node's logits are those
    transformers' own forward gives its branch; a chain-shaped tree (slots = positions, the causal
    mask) gives the plain forward's; copy_slots moves b's and c's K/V into slots 5 and 6, where
    the next token (at position 7) reads them as the chain x, b, c."""
    model = build("llama", attn_implementation=attention)
    target = HFTarget(model)
    target.setup_caches(2, SLOTS)
    with torch.no_grad():
        target(PROMPT, torch.arange(4).expand(2, -1))
        chain = tree_call([X, B, C], [4, 5, 6], [4, 5, 6], [[1, 0, 0], [1, 1, 0], [1, 1, 1]], 4)
        torch.testing.assert_close(target.forward_tree(*chain, None)[0], target(*chain[:2]), rtol=0, atol=0)

        ancestors = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
        tree = tree_call([X, A, B, C], [4, 5, 5, 6], [4, 5, 6, 7], ancestors, 4)
        logits, hidden = target.forward_tree(*tree, None)
        assert hidden is None
        for row, branch in enumerate([[X], [X, A], [X, B], [X, B, C]]):
            torch.testing.assert_close(logits[:, row], own_logits(model, branch), **CLOSE)

        before = [(layer.keys.clone(), layer.values.clone()) for layer in target.cache.layers]
        # accept b, c: slot 6 is read, then written
        target.copy_slots(torch.tensor([[6, 7]]).expand(2, -1), torch.tensor([[5, 6]]).expand(2, -1))
        for layer, (keys, values) in zip(target.cache.layers, before):
            for now, was in ((layer.keys, keys), (layer.values, values)):
                assert torch.equal(now[:, :, 5:7], was[:, :, 6:8]) and torch.equal(now[:, :, :5], was[:, :, :5])
        torch.testing.assert_close(target(torch.tensor([[D]]).expand(2, -1), torch.full((2, 1), 7))[:, -1],
                                   own_logits(model, [X, B, C, D]), **CLOSE)


def test_draft_tree_step_is_the_drafts_forward_along_each_branch():
    """A standalone draft's tree step on a and b (position 5) and c under b (position 6), written at
    slots 10..12 (past the catch-up's, as the loop lays out a draft's tree) after a catch-up on the
    prompt and x: each row's logits are the draft's own forward on its branch; the empty hidden it
    is given comes back."""
    draft = build("llama", noise=0.1)
    drafter = HFDrafter(draft)
    drafter.setup_caches(2, SLOTS)
    with torch.no_grad():
        drafter.catch_up(torch.cat([PROMPT, torch.full((2, 1), X)], 1), torch.arange(5).expand(2, -1), None,
                         torch.full((2,), 4))
        tokens, positions, slots, mask = tree_call([A, B, C], [5, 5, 6], [10, 11, 12],
                                                   [[1, 0, 0], [0, 1, 0], [0, 1, 1]], 5)
        empty = torch.zeros(2, 3, 0)
        logits, hidden = drafter.draft_tree_step(tokens, positions, slots, empty, mask)
        assert hidden is empty
        for row, branch in enumerate([[X, A], [X, B], [X, B, C]]):
            torch.testing.assert_close(logits[:, row], own_logits(draft, branch), **CLOSE)


def test_the_tree_shape_is_part_of_the_decoder_key():
    cache = specpass.DecoderCache()
    model, draft = build("llama"), build("llama", noise=0.1)
    for k in (TREES[0], 3, TREES[1], TREES[0]):
        ours(model, IDS[:1], MASK[:1], assistant_model=draft, num_assistant_tokens=k, decoder_cache=cache)
    assert [decoder.k for decoder in cache] == [3, TREES[1], TREES[0]]


def test_compiled_tree_round_is_one_graph():
    """The whole tree round (draft steps, verify, path copy, accept, catch-up) of a transformers
    target and draft compiles as one graph through specpass's passes (fullgraph: a break would raise)."""
    model, draft = build("llama", num_hidden_layers=1), build("llama", noise=0.1, num_hidden_layers=1)
    out = specpass.generate(model, IDS, attention_mask=MASK, assistant_model=draft, max_new_tokens=NEW,
                            num_assistant_tokens=TREES[0], compile=specpass.backend(handoff="eager"),
                            fused_round=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference(model, IDS, MASK))
    assert set(out.rewrites) == {"prefill", "decode_round"}, out.rewrites
    assert any(line.startswith("[live_rows] rewrote") for line in out.rewrites["decode_round"]), out.rewrites


def test_tree_rounds_refusals():
    chain_only = types.SimpleNamespace(hidden_kind=None, setup_caches=None, catch_up=None, draft_step=None,
                                       to_target=None)  # a Drafter without draft_tree_step
    _refusal(r"drafter of tree rounds \(SimpleNamespace\) lacks \['draft_tree_step'\]", error=TypeError,
             assistant_model=chain_only, num_assistant_tokens=TREES[0])
    draft = build("llama", noise=0.1)
    _refusal(r"or a specpass.TreeShape.* got \(3, 3, 8\): pass specpass.TreeShape\(3, 3, 8\)",
             assistant_model=draft, num_assistant_tokens=(3, 3, 8))
    _refusal(r"num_assistant_tokens=specpass.TreeShape\(topk, steps, tokens\), not draft_tree=", error=TypeError,
             assistant_model=draft, draft_tree=(3, 3, 8))
    windowed = dict(model=build("mistral", sliding_window=4), num_assistant_tokens=specpass.TreeShape(2, 4, 6))
    _refusal(r"model \(MistralForCausalLM\) attends through a 4-token sliding window.* steps < 4",
             assistant_model=build("mistral", noise=0.1, sliding_window=4), **windowed)

"""One compile for every batch size (issue 35): a `Decoder`'s steps are compiled once with the batch
symbolic, and calls at batch sizes 2, 3, 5 and 1 (run as two rows) reuse them, with the tokens of
plain greedy decoding at each size; more prompts than the caches hold grow them; `specpass.generate`
keeps one Decoder for every batch size. Graphs are counted with a backend that counts its calls.
fp32, CPU, tiny zoo and transformers models."""

import pytest
import torch
import transformers

import specpass
from models import zoo
from models.drafters import ZooDrafter
from specpass.loop import Decoder

PROMPTS = [[3, 14, 15], [9, 2, 6, 5, 35, 89, 79, 32, 38], [46], [7, 8], [1, 2, 3, 4, 5]]
NEW, MAX_LEN = 12, 48
SIZES = (2, 3, 5, 1)


class Counting:
    """A backend counting the graphs it compiles and whether their batch axis is symbolic (dim 0 of
    an input); then `inner` (default: the graph as traced)."""

    def __init__(self, inner=None):
        self.inner, self.graphs, self.symbolic = inner, 0, []

    def __call__(self, gm, example_inputs, **kwargs):
        self.graphs += 1
        values = [node.meta.get("example_value") for node in gm.graph.find_nodes(op="placeholder")]
        self.symbolic.append(any(isinstance(v, torch.Tensor) and v.dim() and isinstance(v.shape[0], torch.SymInt)
                                 for v in values))
        return gm if self.inner is None else self.inner(gm, example_inputs, **kwargs)


@pytest.fixture(scope="module")
def target():
    return zoo.build("tiny-llama", seed=0)


@pytest.fixture(scope="module")
def greedy():
    """Plain greedy decoding on a copy of the target: a Decoder sets up its target's caches, and the
    Decoder under test keeps its own."""
    reference = zoo.build("tiny-llama", seed=0)
    return lambda prompts: Decoder(reference, None, max_batch=len(prompts), max_len=MAX_LEN,
                                   compile="eager").generate(prompts, NEW).tokens


@pytest.mark.parametrize("fused, graphs", [(False, 5), (True, 2)], ids=["apart", "fused"])
@pytest.mark.parametrize("name", ["tiny-llama-eagle3", "tiny-llama-draft"])  # a head; a standalone draft
def test_one_compile_serves_every_batch_size(target, greedy, name, fused, graphs):
    backend = Counting()
    dec = Decoder(target, ZooDrafter(zoo.build(name, seed=3)), k=3, max_batch=8, max_len=MAX_LEN, compile=backend,
                  fused_round=fused)
    for bs in SIZES:
        out = dec.generate(PROMPTS[:bs], NEW)
        assert out.tokens == greedy(PROMPTS[:bs]), bs
        assert backend.graphs == graphs, bs  # prefill + 4 steps apart, or prefill + the fused round: once
    assert all(backend.symbolic), backend.symbolic
    assert dec.max_batch == 8  # nothing grew


def test_a_first_batch_as_large_as_the_caches_serves_smaller_ones(target, greedy):
    """A first call whose batch equals the capacity compiles a graph that serves smaller batches:
    the two sizes stay apart, though equal when it compiled."""
    backend = Counting()
    dec = Decoder(target, ZooDrafter(zoo.build("tiny-llama-eagle3", seed=3)), k=3, max_batch=4, max_len=MAX_LEN,
                  compile=backend, fused_round=True)
    for bs in (4, 2, 3):
        assert dec.generate(PROMPTS[:bs], NEW).tokens == greedy(PROMPTS[:bs]), bs
        assert backend.graphs == 2, bs


def test_sampling_at_another_batch_size_draws_the_same_tokens(target):
    """Sampled, per-request seeds: a request's tokens do not depend on the batch it runs in, and the
    sampled graphs (other inputs than greedy's) are compiled once for both sizes."""
    backend = Counting()
    dec = Decoder(target, ZooDrafter(zoo.build("tiny-llama-eagle3", seed=3)), k=3, max_batch=4, max_len=MAX_LEN,
                  compile=backend)
    seeds = [11, 12, 13]
    three = dec.generate(PROMPTS[:3], NEW, temperature=0.8, top_k=20, seed=seeds)
    compiled = backend.graphs
    two = dec.generate(PROMPTS[:2], NEW, temperature=0.8, top_k=20, seed=seeds[:2])
    assert two.tokens == three.tokens[:2]
    assert backend.graphs == compiled == 5


def test_a_capacity_of_one_compiles_for_one_and_grows(target, greedy):
    """max_batch=1: batch 1 runs in one row (its graph specialized to 1); more prompts grow the caches
    (to twice the rows at least), which compiles again, once for every size above 1."""
    backend = Counting()
    dec = Decoder(target, ZooDrafter(zoo.build("tiny-llama-eagle3", seed=3)), k=3, max_batch=1, max_len=MAX_LEN,
                  compile=backend, fused_round=True)
    assert dec.generate(PROMPTS[:1], NEW).tokens == greedy(PROMPTS[:1])
    assert backend.graphs == 2 and backend.symbolic == [False, False]
    for bs in (3, 2, 5):
        assert dec.generate(PROMPTS[:bs], NEW).tokens == greedy(PROMPTS[:bs]), bs
    assert dec.max_batch == 6  # 3 grew it to 3; 5 to twice 3
    assert backend.graphs == 6 and backend.symbolic[2:] == [True] * 4  # at 3 and at 6 rows of cache


def test_reserved_caches_serve_larger_batches_with_one_compile(target, greedy):
    """`reserve` before the first call sizes the caches for the largest batch: every batch up to it
    reuses the steps compiled once; a reserve of fewer rows shrinks nothing."""
    backend = Counting()
    dec = Decoder(target, ZooDrafter(zoo.build("tiny-llama-eagle3", seed=3)), k=3, max_batch=2, max_len=MAX_LEN,
                  compile=backend, fused_round=True)
    dec.reserve(11)
    dec.reserve(3)
    assert dec.max_batch == 11
    for bs in (2, 11, 5):
        prompts = (PROMPTS * 3)[:bs]
        assert dec.generate(prompts, NEW).tokens == greedy(prompts), bs
    assert backend.graphs == 2 and dec.max_batch == 11
    with pytest.raises(ValueError, match=r"requests must be an int >= 1 \(a static cache size\), got 0"):
        dec.reserve(0)


def test_live_rows_rewrite_fires_on_the_symbolic_batch(target, greedy):
    backend = Counting(specpass.backend(handoff="eager"))
    dec = Decoder(target, ZooDrafter(zoo.build("tiny-llama-eagle3", seed=3)), k=3, max_batch=4, max_len=MAX_LEN,
                  compile=backend)
    y = torch.randint(0, 256, (3, 4))
    hidden = torch.randn(3, 4, 3 * target.config.hidden_size)
    pos, a = torch.tensor([4, 11, 2]), torch.tensor([0, 3, 2])
    for x in (y, pos, hidden, a):  # the catch-up's inputs as the loop marks them
        torch._dynamo.mark_dynamic(x, 0)
    gm = specpass.capture(dec.steps.catch_up, y, pos, hidden, a, None)
    assert isinstance(next(iter(gm.graph.find_nodes(op="placeholder"))).meta["val"], torch.SymInt)  # the batch
    report = specpass.rewrite(gm).report
    live = [f for f in report.of("live_rows") if f.fired]
    assert live and "3" not in str(live[0].rows), str(report)  # rows of a symbolic batch
    for bs in (2, 3):
        assert dec.generate(PROMPTS[:bs], NEW).tokens == greedy(PROMPTS[:bs])
    assert backend.graphs == 5 and all(backend.symbolic)


@pytest.fixture(scope="module")
def hf_pair():
    torch.manual_seed(0)
    config = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  initializer_range=0.2)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    torch.manual_seed(1)
    return model, transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()


def test_generate_reuses_one_decoder_for_every_batch_size(hf_pair):
    model, draft = hf_pair
    ids = torch.tensor([[0, 0, 0, 0, 5, 17, 33], [8, 41, 9, 60, 12, 3, 77], [0, 0, 0, 0, 0, 0, 50],
                        [0, 0, 11, 12, 13, 14, 15], [0, 0, 0, 21, 22, 23, 24]])
    mask = (ids != 0).long()
    cache, backend = specpass.DecoderCache(), Counting(specpass.backend(handoff="eager"))
    for bs in SIZES:
        out = specpass.generate(model, ids[:bs], attention_mask=mask[:bs], assistant_model=draft, max_new_tokens=NEW,
                                cache_len=64, compile=backend, decoder_cache=cache, return_dict_in_generate=True)
        want = model.generate(ids[:bs], attention_mask=mask[:bs], max_new_tokens=NEW, do_sample=False)
        assert torch.equal(out.sequences, want), bs
        assert len(cache) == 1 and backend.graphs == 5, bs
    assert all(backend.symbolic)
    assert any(line.startswith("[live_rows] rewrote") for line in out.rewrites["catch_up"]), out.rewrites


def test_generate_max_batch_sizes_the_caches_at_the_first_call(hf_pair):
    """max_batch= at the first call: a later call of that many requests compiles nothing; a kept
    Decoder asked for more grows (and compiles again); a bad value is a clear error."""
    model, draft = hf_pair
    ids = torch.randint(3, 96, (12, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    cache, backend = specpass.DecoderCache(), Counting(specpass.backend(handoff="eager"))

    def call(bs, **kwargs):
        out = specpass.generate(model, ids[:bs], attention_mask=mask[:bs], assistant_model=draft, max_new_tokens=NEW,
                                cache_len=64, compile=backend, decoder_cache=cache, **kwargs)
        assert torch.equal(out, model.generate(ids[:bs], attention_mask=mask[:bs], max_new_tokens=NEW,
                                               do_sample=False)), bs

    call(2, max_batch=12)
    call(12)
    assert len(cache) == 1 and backend.graphs == 5 and next(iter(cache)).max_batch == 12
    call(3, max_batch=13)
    assert len(cache) == 1 and backend.graphs > 5 and next(iter(cache)).max_batch == 13
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="max_batch must be an int >= 1"):
            specpass.generate(model, ids[:2], max_new_tokens=NEW, max_batch=bad, decoder_cache=cache)

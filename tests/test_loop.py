"""The loop package's surface: a drafter's Protocol decides its round shape, `use_k` switches K and
keeps what it compiled, and `start` / `rounds` / `clock` run the rounds `generate` runs (the parts a
benchmark times). fp32, CPU, tiny zoo models."""

import re

import pytest
import torch

from models import zoo
from models.drafters import ZooDrafter, adapt
from specpass.loop import Decoder, ParallelDrafter, cache_slots, round_shape, steps
from specpass.loop.chain import CHAIN
from specpass.loop.parallel import PARALLEL
from specpass.loop.plain import PLAIN
from tests.test_speculative import GraphCounter

PROMPTS = [[3, 14, 15], [9, 2, 6, 5, 35, 89, 79, 32, 38], [46]]  # mixed lengths: 3, 9, 1
NEW = 24
MAX_LEN = cache_slots(9, NEW, 5)


@pytest.fixture(scope="module")
def target():
    return zoo.build("tiny-llama", seed=0)


@pytest.fixture(scope="module")
def greedy(target):
    return Decoder(target, None, max_batch=3, max_len=MAX_LEN, compile="eager").generate(PROMPTS, NEW, eos_id=7).tokens


def eagle():
    return ZooDrafter(zoo.build("tiny-llama-eagle3", seed=3))


class Duck:
    """A drafter by its members alone (no zoo class, no specpass base): the chain's, plus
    `draft_parallel` when parallel; it runs the zoo head it wraps."""

    def __init__(self, parallel: bool):
        self.inner = adapt(zoo.build("tiny-llama-peagle3", seed=3))
        self.hidden_kind = self.inner.hidden_kind
        for name in ("setup_caches", "catch_up", "draft_step", "to_target", "get_input_embeddings"):
            setattr(self, name, getattr(self.inner, name))
        if parallel:
            self.draft_parallel = self.inner.draft_parallel


def test_the_protocol_decides_the_round_shape(target, greedy):
    assert round_shape(None) is PLAIN and round_shape(eagle()) is CHAIN
    assert round_shape(adapt(zoo.build("tiny-llama-peagle3", seed=3))) is PARALLEL
    parallel, chain = Duck(parallel=True), Duck(parallel=False)
    assert isinstance(parallel, ParallelDrafter) and not isinstance(chain, ParallelDrafter)
    assert round_shape(parallel) is PARALLEL and round_shape(chain) is CHAIN
    for drafter, draft_step in ((parallel, steps.carried), (chain, None)):
        dec = Decoder(target, drafter, k=3, max_batch=3, max_len=MAX_LEN, compile="eager")
        assert (dec.steps.draft is steps.carried) == (draft_step is steps.carried)
        assert dec.generate(PROMPTS, NEW, eos_id=7).tokens == greedy  # each shape decodes losslessly


def test_a_non_drafter_is_refused_naming_what_it_lacks(target):
    class CatchUpOnly:
        def catch_up(self, tokens, positions, hidden, live): ...

    class NoRound(CatchUpOnly):  # every drafter's members, none of a round shape's
        hidden_kind = None

        def setup_caches(self, max_batch, max_len): ...

        def to_target(self, ids): ...

    for thing, lacks in ((object(), "['hidden_kind', 'setup_caches', 'catch_up', 'to_target']"),
                         (CatchUpOnly(), "['hidden_kind', 'setup_caches', 'to_target']")):
        message = re.escape(f"the drafter ({type(thing).__name__}) lacks {lacks}: a drafter needs the members of "
                            "specpass.Drafter")
        with pytest.raises(TypeError, match=message):
            round_shape(thing)
        with pytest.raises(TypeError, match=message):
            Decoder(target, thing, k=2, max_batch=3, max_len=MAX_LEN, compile="eager")
    message = re.escape("the drafter (NoRound) drafts in no round shape: it lacks ['draft_parallel'] "
                        "(specpass.ParallelDrafter) or ['draft_step'] (specpass.ChainDrafter)")
    with pytest.raises(TypeError, match=message):
        Decoder(target, NoRound(), k=2, max_batch=3, max_len=MAX_LEN, compile="eager")


def test_cache_slots_per_shape_and_for_any_drafter():
    assert [shape.cache_slots(9, 24, 4) for shape in (PLAIN, CHAIN, PARALLEL)] == [34, 42, 45]
    # the most of any shape (K 1: the chain's 2K+1 = the parallel 3K), rounded up to a multiple of 16
    assert cache_slots(9, 24, 4) == 48 and cache_slots(9, 24, 1) == 48 and cache_slots(9, 24, 8) == 64


def test_use_k_switches_and_reuses_what_it_compiled(target, greedy):
    backend = GraphCounter()
    dec = Decoder(target, eagle(), k=2, max_batch=3, max_len=MAX_LEN, compile=backend, fused_round=True)
    assert dec.generate(PROMPTS, NEW, eos_id=7).tokens == greedy and backend.graphs == 2  # prefill, round
    dec.use_k(4)
    out = dec.generate(PROMPTS, NEW, eos_id=7)
    assert dec.k == 4 and len(out.metrics.acceptance) == 4 and out.tokens == greedy
    assert backend.graphs == 3  # K 4's round; the chain's prefill does not read K: shared
    dec.use_k(2)
    assert dec.generate(PROMPTS, NEW, eos_id=7).tokens == greedy and backend.graphs == 3  # nothing recompiled
    for k in (-1, 2.5, (4, 5, 16)):
        with pytest.raises(ValueError, match=r"k must be an int >= 0 .* or a specpass.TreeShape"):
            dec.use_k(k)
    assert dec.k == 2
    dec.use_k(0)  # the drafter off: plain decoding's rounds and prefill (no drafter half), compiled once
    out = dec.generate(PROMPTS, NEW, eos_id=7)
    assert out.tokens == greedy and out.metrics.acceptance == [] and out.metrics.rounds == NEW - 1
    assert backend.graphs == 5
    with pytest.raises(ValueError, match="plain decoding .* drafts nothing: K is 0, got 3"):
        Decoder(target, None, max_batch=3, max_len=MAX_LEN, compile="eager").use_k(3)


@pytest.mark.parametrize("drafter, compile", [(eagle, "eager"), (eagle, "counting"),
                                              (lambda: adapt(zoo.build("tiny-llama-peagle3", seed=3)), "eager")])
def test_start_and_rounds_give_generate_s_tokens(target, drafter, compile):
    """Rounds run by hand (fused and compiled: rounds 3 on without guards, and CUDA graphs' clones,
    as generate) emit what generate emits; a run goes on where it stopped, greedy or sampled."""
    compiled = compile == "counting"
    dec = Decoder(target, drafter(), k=3, max_batch=4, max_len=MAX_LEN, compile=GraphCounter() if compiled else
                  "eager", fused_round=compiled, mode="reduce-overhead" if compiled else None)
    assert dec.cudagraphs == compiled  # the replay's bookkeeping runs on a CPU too (no graphs recorded)
    for sampling in ({}, dict(temperature=1.0, top_k=20, seed=4)):
        out = dec.generate(PROMPTS, NEW, eos_id=7, **sampling)
        run = dec.start(PROMPTS, NEW, eos_id=7, **sampling)
        # the prefill emitted each request's first token; 3 rows of the 4 the caches hold, none idle
        assert run.state.count.tolist() == [1, 1, 1]
        run = dec.rounds(dec.rounds(run, 2), out.metrics.rounds - 2)
        state = run.state
        assert state.done.all() and state.count.tolist()[:3] == [len(t) for t in out.tokens]
        assert [row[:n] for row, n in zip(state.out.tolist(), state.count.tolist())][:3] == out.tokens
        assert dec.rounds(run, 0) == run


def test_a_fused_round_keeps_the_state_in_its_own_static_buffers(target):
    """What lets a CUDA graph replay without copying the state in or cloning it out: the fused
    round's state and carry are the same tensors from round to round, marked static, updated in
    place, and the tokens are those of steps apart (which return new tensors)."""
    fused = Decoder(target, eagle(), k=3, max_batch=4, max_len=MAX_LEN, compile="eager", fused_round=True)
    first = fused.start(PROMPTS, NEW)
    one = fused.rounds(first, 1)
    counts = one.state.count.tolist()
    two = fused.rounds(one, 2)
    buffers = [t for t in [*one.state, *one.carry] if isinstance(t, torch.Tensor)]
    assert all(a is b for a, b in zip(buffers, [t for t in [*two.state, *two.carry] if isinstance(t, torch.Tensor)]))
    assert not any(a is b for a, b in zip(first.state, one.state) if a is not None)  # the prefill's state copied in
    assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for t in buffers)
    assert one.state.count.tolist() != counts  # two more rounds wrote over the first one's state
    apart = Decoder(target, eagle(), k=3, max_batch=4, max_len=MAX_LEN, compile="eager", fused_round=False)
    assert fused.generate(PROMPTS, NEW).tokens == apart.generate(PROMPTS, NEW).tokens


def test_rounds_refuses_a_run_started_at_another_k(target):
    dec = Decoder(target, eagle(), k=3, max_batch=3, max_len=MAX_LEN, compile="eager")
    run = dec.start(PROMPTS, 4)
    dec.use_k(2)
    with pytest.raises(ValueError, match=r"started at K 3 and the decoder is at K 2: call use_k\(3\) first"):
        dec.rounds(run, 1)
    with pytest.raises(ValueError, match="n .* must be an int >= 0, got -1"):
        dec.rounds(dec.start(PROMPTS, 4), -1)


def test_clock_waits_and_counts_seconds(target):
    dec = Decoder(target, eagle(), k=3, max_batch=3, max_len=MAX_LEN, compile="eager")
    run = dec.start(PROMPTS, NEW)
    before = dec.clock()
    dec.rounds(run, 2)
    assert dec.clock() > before


def test_prompts_right_padded_with_zeros_in_int64_rows():
    from specpass.loop.host import right_padded

    rows = right_padded([[5, 2**40, 7], [1], [3, 0, 9, 4]], 5)
    assert rows.dtype == torch.long and rows.tolist() == [[5, 2**40, 7, 0, 0], [1, 0, 0, 0, 0], [3, 0, 9, 4, 0]]


def test_start_moves_every_request_to_a_position(target):
    """A long context without its prefill: one-token prompts, then position 30 for every request;
    the rounds decode from there (the slots below hold what the prefill left)."""
    k, prompts = 3, [[5], [6], [7]]
    dec = Decoder(target, eagle(), k=k, max_batch=3, max_len=64, compile="eager")
    run = dec.start(prompts, 8, position=30)
    assert run.state.pos.tolist() == [30, 30, 30] and run.state.count.tolist() == [1, 1, 1]
    state = dec.rounds(run, 8).state
    assert state.done.all() and state.count.tolist() == [8, 8, 8]
    assert (state.pos >= 30 + 7).all()  # 7 more tokens each, at 31 on
    need = CHAIN.cache_slots(60, 8, k)
    with pytest.raises(ValueError, match=rf"position 60 \+ max_new_tokens 8 \(request 0\) needs {need} cache slots at "
                                         rf"K 3 \(`cache_slots`\), but max_len is 64: raise max_len to {need}"):
        dec.start(prompts, 8, position=60)
    with pytest.raises(ValueError, match=r"position 2 is inside prompt 1 \(4 tokens\).* pass 4 or more"):
        dec.start([[5], [1, 2, 3, 4]], 8, position=2)
    for bad in (0, 2.0, "30"):
        with pytest.raises(ValueError, match="position must be an int >= 1"):
            dec.start(prompts, 8, position=bad)


def test_round_ms_and_tune_k_s_callback(target):
    dec = Decoder(target, eagle(), k=2, max_batch=3, max_len=MAX_LEN, compile="eager")
    ms, metrics = dec.round_ms(PROMPTS, 2, 6, repeats=1)
    assert ms > 0 and len(metrics.acceptance) == 2 and metrics.new_tokens > 0
    timed = []
    choice = dec.tune_k(PROMPTS, (1, 3), acceptance=[0.9, 0.8, 0.7], new_tokens=(2, 6), repeats=1, max_timings=0,
                        on_timed=lambda k, ms: timed.append((k, ms)))
    assert [k for k, _ in timed] == [1, 3] and dict(timed) == choice.round_ms
    with pytest.raises(ValueError, match="1 <= short < long"):
        dec.round_ms(PROMPTS, 6, 6)

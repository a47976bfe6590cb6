"""The tree round through `Decoder` (specpass/loop/tree.py): greedy tree rounds decode exactly as
plain greedy decoding for every drafter kind, at bs 1 and on a ragged batch, apart and fused;
the accepted path's K/V is where later rounds read it (the shipped pair accepts long paths);
sampled tree rounds keep the seed's tokens; `tune_k` chooses among plain, chain and tree rounds."""


import pytest
import torch

from models import zoo
from models.checkpoint import load
from models.drafters import load_drafter
from models.llama import Llama
from models.text import encode, load_prompts
from specpass.loop import Decoder, Metrics, TreeShape, cache_slots, round_shape
from specpass.loop.tree import TREE
from tests.test_shipped import CHECKPOINTS
from tests.test_speculative import PROMPTS, CountingBackend, drafter

NEW = 24
SHAPE = TreeShape(3, 4, 10)  # topk 3, 4 levels, 10 of the 40 drafted nodes verified
MAX_LEN = cache_slots(9, NEW, SHAPE)
DRAFTS = ["tiny-llama-eagle3", "tiny-deepseek-eagle3-mla", "tiny-deepseek-nextn", "tiny-llama-draft", "copy"]


@pytest.fixture(scope="module")
def target():
    return zoo.build("tiny-llama", seed=0)


def plain(target, prompts, new=NEW, **kw):
    return Decoder(target, None, max_batch=len(prompts), max_len=MAX_LEN, compile="eager").generate(prompts, new, **kw)


@pytest.mark.parametrize("name", DRAFTS)
def test_greedy_tree_rounds_are_plain_greedy_decoding(target, name):
    d = drafter(name, target)
    assert round_shape(d, SHAPE) is TREE
    for prompts in (PROMPTS[1:2], PROMPTS):  # bs 1, then a ragged batch
        dec = Decoder(target, d, k=SHAPE, max_batch=len(prompts), max_len=MAX_LEN, compile="eager")
        out = dec.generate(prompts, NEW, eos_id=7)
        assert out.tokens == plain(target, prompts, eos_id=7).tokens
        assert len(out.metrics.acceptance) == SHAPE.steps
    if name == "copy":  # the target drafting for itself: every level of every round is accepted
        assert out.metrics.acceptance[:2] == [1.0, 1.0]


@pytest.mark.parametrize("fused", [False, True])
def test_tree_rounds_compile_whole_and_through_the_passes(target, fused):
    counter = CountingBackend()  # specpass, handed off eagerly
    dec = Decoder(target, drafter("noisy-copy", target), k=SHAPE, max_batch=3, max_len=MAX_LEN, compile=counter,
                  fused_round=fused)
    assert dec.generate(PROMPTS, NEW, eos_id=7).tokens == plain(target, PROMPTS, eos_id=7).tokens
    assert counter.graphs == (2 if fused else 5)  # the prefill and the round, or prefill + the four steps


@pytest.fixture(scope="module")
def shipped():
    target = load(Llama, CHECKPOINTS / "stdlib-llama", dtype=torch.float32)  # fp32: see test_shipped
    return target, load_drafter(target, "eagle", CHECKPOINTS / "stdlib-llama-eagle3")


def test_the_accepted_path_is_where_later_rounds_read_it(shipped):
    # A trained pair accepts several levels per round, from siblings other than node 1: if the
    # path's K/V were not moved to its positions, the next rounds would read other nodes' K/V.
    target, eagle = shipped
    prompts = [encode(t) for t in load_prompts()[:2]]
    shape = TreeShape(4, 5, 16)
    max_len = cache_slots(max(map(len, prompts)), 48, shape)
    want = Decoder(target, None, max_batch=2, max_len=max_len, compile="eager").generate(prompts, 48).tokens
    out = Decoder(target, eagle, k=shape, max_batch=2, max_len=max_len, compile="eager").generate(prompts, 48)
    assert out.tokens == want
    assert out.metrics.accept_length > 3.5, out.metrics


def test_sampled_tree_rounds_keep_the_seed_and_greedy_rows(target):
    d = drafter("noisy-copy", target)
    dec = Decoder(target, d, k=SHAPE, max_batch=3, max_len=MAX_LEN, compile="eager")
    temperature = [0.8, 0.0, 1.0]  # the middle request greedy
    first, again = (dec.generate(PROMPTS, NEW, temperature=temperature, seed=[1, 2, 3]).tokens for _ in range(2))
    assert first == again
    assert first[1] == plain(target, PROMPTS).tokens[1]
    other = dec.generate(PROMPTS, NEW, temperature=temperature, seed=[4, 5, 6]).tokens
    assert other[0] != first[0] and other[1] == first[1]


def test_tree_shapes_and_drafters_are_checked(target):
    with pytest.raises(ValueError, match=r"tokens .* must be <= 13, got 14"):
        TreeShape(3, 2, 14)
    with pytest.raises(ValueError, match="TreeShape.topk must be an int >= 1, got 0"):
        TreeShape(0, 2, 2)
    eagle = drafter("tiny-llama-eagle3", target)

    class ChainOnly:  # the chain's members alone
        def __init__(self, inner):
            self.inner, self.hidden_kind = inner, inner.hidden_kind
            for name in ("setup_caches", "catch_up", "draft_step", "to_target"):
                setattr(self, name, getattr(inner, name))

    with pytest.raises(TypeError, match=r"drafter of tree rounds .* lacks \['draft_tree_step'\]"):
        Decoder(target, ChainOnly(eagle), k=SHAPE, max_batch=3, max_len=MAX_LEN, compile="eager")
    with pytest.raises(ValueError, match=r"needs \d+ cache slots"):
        Decoder(target, eagle, k=SHAPE, max_batch=3, max_len=TREE.cache_slots(9, NEW, SHAPE) - 1,
                compile="eager").generate(PROMPTS, NEW)


def test_tune_k_chooses_plain_chain_or_tree_by_tokens_per_ms(target, monkeypatch):
    tree = TreeShape(2, 3, 6)
    max_len = max(cache_slots(9, 40, 4), cache_slots(9, 40, tree))
    dec = Decoder(target, drafter("tiny-llama-eagle3", target), k=2, max_batch=3, max_len=max_len, compile="eager")
    # ms per round: the chain 1 + 0.1 K (each draft accepted half the time: K 4 gives 3 tokens in 1.4 ms)
    costs = {1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4}
    per_depth = {tree: [0.9, 0.8, 0.7]}  # 3.4 tokens per round

    def round_ms(self, prompts, short, long, repeats=3, sampling=None):  # every request busy in every round
        return costs[self.k], Metrics(new_tokens=0, rounds=1, seconds=0.0, prefill_seconds=0.0, accept_length=0.0,
                                      acceptance=per_depth.get(self.k, []), phase_ms={}, request_rounds=len(prompts))

    monkeypatch.setattr(Decoder, "round_ms", round_ms)
    tune = lambda: dec.tune_k(PROMPTS, (2, 4), acceptance=[0.5] * 4, off=True, trees=[tree])  # noqa: E731
    for plain_ms, tree_ms, want in ((1.0, 1.3, tree),  # 2.6 tokens/ms against the chain's 2.14
                                    (0.3, 1.3, 0),  # plain decoding: 3.3 tokens/ms
                                    (1.0, 3.0, 4)):  # the chain's K 4
        costs[0], costs[tree] = plain_ms, tree_ms
        choice = tune()
        assert choice.k == want and dec.k == want, choice
        assert choice.why[0] == "the drafter off: plain decoding" and choice.why[tree] == "a tree shape"
        assert choice.own_acceptance == {tree: [0.9, 0.8, 0.7]}
        assert choice.tokens_per_ms[0] == pytest.approx(1 / plain_ms)

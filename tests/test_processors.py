"""Logits processors that read the prefix (min_new_tokens, min_length, repetition_penalty,
no_repeat_ngram_size, and any other through logits_processor: a toy grammar here) under
speculation: every verified position processed with the prefix plain decoding had there.

Greedy tokens against references the loop does not compute: `model.generate` with the same options
(transformers models, bs 1 and a ragged left-padded batch, plain, chain and tree rounds, eager and
compiled), and a token-by-token recompute of a zoo target through transformers' own processor
classes (chain, tree and block rounds). Sampled: the two-sample chi-square test of
tests/test_sampling.py against plain sampling with the penalty, which itself fits transformers'
processed distribution; a rule that forgets the drafts on the way to a row is rejected."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessor, LogitsProcessorList,
                                                    MinNewTokensLengthLogitsProcessor, NoRepeatNGramLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor)

import specpass
from benchmarks.generate_sweep import IDS, build_pair
from models import zoo
from models.drafters import ZooDrafter
from specpass.loop import Decoder, TreeShape, cache_slots, steps
from tests.test_sampling import ALPHA, TARGET, _drafter, goodness_of_fit, two_sample

MASK = (IDS != 0).long()
NEW = 12
TREE = TreeShape(2, 3, 6)


@pytest.fixture(scope="module")
def pair():
    return build_pair("llama", "LlamaForCausalLM", torch.device("cpu"))


def _early_token(model) -> int:
    """A token the model emits among its first greedy tokens: an EOS that min_new_tokens must hold."""
    plain = model.generate(IDS[1:2], attention_mask=MASK[1:2], max_new_tokens=NEW, do_sample=False)
    return int(plain[0, IDS.shape[1] + 2])


OPTIONS = {
    "penalty": lambda eos: dict(repetition_penalty=1.3),
    "penalty<1": lambda eos: dict(repetition_penalty=0.7),
    "min_new_tokens": lambda eos: dict(min_new_tokens=8, eos_token_id=eos),
    "min_length": lambda eos: dict(min_length=IDS.shape[1] + 9, eos_token_id=eos),
    "no_repeat_ngram": lambda eos: dict(no_repeat_ngram_size=2),
    "no_repeat_unigram": lambda eos: dict(no_repeat_ngram_size=1),
    "all": lambda eos: dict(repetition_penalty=1.5, min_new_tokens=5, eos_token_id=[eos, 3], no_repeat_ngram_size=3),
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_greedy_tokens_equal_model_generate_s(pair, option):
    model, draft = pair
    kw = OPTIONS[option](_early_token(model))
    for rows in ([1], [0, 1, 2]):
        want = model.generate(IDS[rows], attention_mask=MASK[rows], max_new_tokens=NEW, do_sample=False, **kw)
        unprocessed = model.generate(IDS[rows], attention_mask=MASK[rows], max_new_tokens=NEW, do_sample=False,
                                     eos_token_id=kw.get("eos_token_id"))
        assert not torch.equal(want, unprocessed), "the option must change the tokens"
        for k in (0, 3, TREE):
            got = specpass.generate(model, IDS[rows], attention_mask=MASK[rows], assistant_model=draft if k else None,
                                    num_assistant_tokens=k, max_new_tokens=NEW, compile="eager", **kw)
            assert torch.equal(got, want), (option, rows, k, got.tolist(), want.tolist())


def test_compiled_steps_process_as_eager_ones(pair):
    """The steps apart, compiled (the fused round compiled: the zoo test below)."""
    model, draft = pair
    kw = OPTIONS["all"](_early_token(model))
    want = model.generate(IDS, attention_mask=MASK, max_new_tokens=NEW, do_sample=False, **kw)
    got = specpass.generate(model, IDS, attention_mask=MASK, assistant_model=draft, num_assistant_tokens=3,
                            max_new_tokens=NEW, compile=specpass.backend(handoff="eager"), fused_round=False,
                            decoder_cache=specpass.DecoderCache(keep=0), **kw)
    assert torch.equal(got, want), (got.tolist(), want.tolist())


def test_generation_config_s_processors_are_read(pair):
    model, draft = pair
    config = model.generation_config.__class__(repetition_penalty=1.3, min_new_tokens=4, eos_token_id=5)
    want = model.generate(IDS, attention_mask=MASK, max_new_tokens=NEW, generation_config=config)
    assert not torch.equal(want, model.generate(IDS, attention_mask=MASK, max_new_tokens=NEW, do_sample=False,
                                                eos_token_id=5))  # the config's processors change the tokens
    got = specpass.generate(model, IDS, attention_mask=MASK, assistant_model=draft, max_new_tokens=NEW,
                            generation_config=config, compile="eager")
    assert torch.equal(got, want)


class Grammar(LogitsProcessor):
    """A toy grammar, a function of input_ids: after token t, at prefix length L, a token u may follow
    only if (u + t + L) % 3 != 0. It reads the last token and the length, so a row processed with
    another position's prefix picks other tokens."""

    def __call__(self, input_ids, scores):
        u = torch.arange(scores.shape[-1], device=scores.device)
        banned = (u + input_ids[:, -1:] + input_ids.shape[1]) % 3 == 0
        return scores.masked_fill(banned, float("-inf"))


@pytest.mark.parametrize("k", [0, 3, TREE], ids=["plain", "chain", "tree"])
def test_a_custom_processor_gives_model_generate_s_tokens(pair, k):
    model, draft = pair
    for rows in ([1], [0, 1, 2]):
        with_grammar = dict(logits_processor=LogitsProcessorList([Grammar()]), repetition_penalty=1.2)
        want = model.generate(IDS[rows], attention_mask=MASK[rows], max_new_tokens=NEW, do_sample=False,
                              **with_grammar)
        unprocessed = model.generate(IDS[rows], attention_mask=MASK[rows], max_new_tokens=NEW, do_sample=False,
                                     repetition_penalty=1.2)
        assert not torch.equal(want, unprocessed), "the grammar must change the tokens"
        with pytest.warns(specpass.SpecpassWarning, match="logits_processor runs on the host"):
            got = specpass.generate(model, IDS[rows], attention_mask=MASK[rows], assistant_model=draft if k else None,
                                    num_assistant_tokens=k, max_new_tokens=NEW, **with_grammar)
        assert torch.equal(got, want), (rows, k, got.tolist(), want.tolist())


# --- zoo targets: chain, tree and block rounds against a recompute through transformers' processors

PROMPTS = [[3, 14, 15, 3], [9, 2, 6, 5, 35, 89, 79, 32, 38], [46]]
ZOO_NEW = 16


@torch.no_grad()
def recompute(target, prompt, new, penalty, min_new, eos, ngram, extra=()):
    """Greedy decoding by recomputing the whole sequence each token, its logits through transformers'
    RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor and MinNewTokensLengthLogitsProcessor;
    stops at an EOS."""
    processors = [RepetitionPenaltyLogitsProcessor(penalty)]
    if ngram:
        processors.append(NoRepeatNGramLogitsProcessor(ngram))
    if min_new:
        processors.append(MinNewTokensLengthLogitsProcessor(len(prompt), min_new, torch.tensor(eos)))
    processors = LogitsProcessorList([*processors, *extra])
    seq = list(prompt)
    for _ in range(new):
        target.setup_caches(1, len(seq))
        logits = target(torch.tensor([seq]), torch.arange(len(seq))[None])[:, -1].float()
        seq.append(int(processors(torch.tensor([seq]), logits)[0].argmax()))
        if seq[-1] in eos:
            break
    return seq[len(prompt):]


@pytest.mark.parametrize("round_", ["chain", "tree", "block"])
def test_zoo_rounds_equal_a_recompute_through_transformers_processors(round_):
    target = zoo.build("tiny-llama", seed=0)
    plain = Decoder(target, None, max_batch=3, max_len=64, compile="eager").generate(PROMPTS, ZOO_NEW).tokens
    eos = [plain[0][2], plain[1][3]]  # early tokens: held back by min_new_tokens, then allowed
    want = [recompute(target, p, ZOO_NEW, 1.4, 6, eos, 2) for p in PROMPTS]
    assert want != plain
    if round_ == "block":
        drafter, k = zoo.build("tiny-llama-dflash", seed=4, target=target), 3
    else:
        drafter, k = ZooDrafter(zoo.build("tiny-llama-eagle3", seed=3)), (3 if round_ == "chain" else TREE)
    max_len = cache_slots(9, ZOO_NEW, k) + 16
    dec = Decoder(target, drafter, k=k, max_batch=3, max_len=max_len, compile=specpass.backend(handoff="eager"),
                  fused_round=True)  # the fused round compiled (eager rounds: the transformers tests above)
    out = dec.generate(PROMPTS, ZOO_NEW, eos_id=[eos] * 3, repetition_penalty=1.4, min_new_tokens=6,
                       no_repeat_ngram_size=2)
    assert out.tokens == want, round_


@pytest.mark.parametrize("round_", ["chain", "tree", "block"])
def test_zoo_rounds_with_a_custom_processor_equal_a_recompute(round_):
    target = zoo.build("tiny-llama", seed=0)
    eos = [5]
    want = [recompute(target, p, ZOO_NEW, 1.1, 0, eos, 0, extra=[Grammar()]) for p in PROMPTS]
    assert want != [recompute(target, p, ZOO_NEW, 1.1, 0, eos, 0) for p in PROMPTS]
    if round_ == "block":
        drafter, k = zoo.build("tiny-llama-dflash", seed=4, target=target), 3
    else:  # the target's copy, unprocessed: its drafts are accepted where the grammar allows them
        drafter, k = ZooDrafter(copy.deepcopy(target)), (3 if round_ == "chain" else TREE)
    dec = Decoder(target, drafter, k=k, max_batch=3, max_len=cache_slots(9, ZOO_NEW, k) + 16, compile="eager")
    out = dec.generate(PROMPTS, ZOO_NEW, eos_id=[eos] * 3, repetition_penalty=1.1,
                       logits_processor=LogitsProcessorList([Grammar()]))
    assert out.tokens == want, round_
    assert round_ == "block" or out.metrics.accept_length > 1.5, out.metrics  # rows after drafts decide tokens


# --- sampled: the processed distribution kept


N = 20_000
PROMPT = [3, 3, 3]
SAMPLED_NEW = 3
PENALTY = 3.0


def _run(target, drafter, k, seed, n=N):
    max_len = cache_slots(len(PROMPT), SAMPLED_NEW, k) + 1
    dec = Decoder(target, drafter, k=k, max_batch=n, max_len=max_len, compile="eager")
    out = dec.generate([PROMPT] * n, SAMPLED_NEW, seed=seed, temperature=1.0, repetition_penalty=PENALTY)
    return torch.tensor(out.tokens), out.metrics


@pytest.fixture(scope="module")
def sampling_target():
    return zoo.build(TARGET, seed=0)


@pytest.fixture(scope="module")
def plain_sampled(sampling_target):
    return _run(sampling_target, None, 0, seed=7)[0]


def test_plain_sampling_draws_transformers_processed_distribution(sampling_target, plain_sampled):
    logits = sampling_target(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None])[:, -1].float()
    p = RepetitionPenaltyLogitsProcessor(PENALTY)(torch.tensor([PROMPT]), logits).softmax(-1)[0]
    assert goodness_of_fit(plain_sampled[:, 0], p) > ALPHA
    assert goodness_of_fit(plain_sampled[:, 0], logits.softmax(-1)[0]) < ALPHA  # the penalty is seen


@pytest.mark.parametrize("kind,k", [("eagle", 2), ("dflash", 3)])
def test_speculative_sampling_keeps_the_penalized_distribution(sampling_target, plain_sampled, kind, k):
    tokens, metrics = _run(sampling_target, _drafter(kind), k, seed=11)
    assert 0.05 < metrics.acceptance[0] < 0.95, metrics
    for sample, plain in ((tokens, plain_sampled), (repeats(tokens), repeats(plain_sampled))):
        stat, df, p = two_sample(sample, plain, vocab=int(max(sample.max(), plain.max())) + 1)
        assert p > ALPHA, f"{kind}: chi-square {stat:.1f} on {df} df, p = {p:.2e}"


def repeats(tokens: torch.Tensor) -> torch.Tensor:
    """[N, 3] tokens -> [N, 3] which of them repeat an earlier one (the second the first; the third the
    second, the first): the events the penalty governs, in 8 cells instead of the 4096 of the tokens."""
    return torch.stack([tokens[:, 1] == tokens[:, 0], tokens[:, 2] == tokens[:, 1], tokens[:, 2] == tokens[:, 0]],
                       1).long()


def _rows_without_the_drafts(processing, logits, count, tokens, depth, reads):
    return _PROCESSED(processing, logits, count, tokens, depth, torch.zeros_like(reads))


_PROCESSED = steps.processed


def test_a_penalty_that_forgets_the_drafts_is_rejected(sampling_target, plain_sampled, monkeypatch):
    monkeypatch.setattr(steps, "processed", _rows_without_the_drafts)
    tokens = _run(sampling_target, _drafter("eagle"), 2, seed=11)[0]
    stat, df, p = two_sample(repeats(tokens), repeats(plain_sampled), vocab=2)
    assert p < ALPHA, f"not rejected: chi-square {stat:.1f} on {df} df, p = {p:.2e}"


def test_bad_processor_options_are_named(sampling_target):
    dec = Decoder(sampling_target, None, max_batch=2, max_len=16, compile="eager")
    with pytest.raises(ValueError, match=r"repetition_penalty must be a number > 0 and finite"):
        dec.generate([PROMPT], 2, repetition_penalty=0.0)
    with pytest.raises(ValueError, match=r"min_new_tokens must be an int >= 0"):
        dec.generate([PROMPT], 2, min_new_tokens=-1)
    with pytest.raises(ValueError, match=r"penalty_context must hold one sequence of token ids in \[0, 16\) per prompt"):
        dec.generate([PROMPT], 2, repetition_penalty=1.2, penalty_context=[[99]])
    with pytest.raises(ValueError, match=r"no_repeat_ngram_size must be an int >= 0 \(0: off\), got 1.5"):
        dec.generate([PROMPT], 2, no_repeat_ngram_size=1.5)
    with pytest.raises(ValueError, match=r"prefix_context holds 16 ids, as many as the caches' 16 slots"):
        dec.generate([PROMPT], 2, no_repeat_ngram_size=2, prefix_context=[[1] * 16])
    with pytest.raises(ValueError, match=r"logits_processor must be callable as \(input_ids, scores\) -> scores"):
        dec.generate([PROMPT], 2, logits_processor=3)
    with pytest.raises(ValueError, match=r"prefix_context holds an empty row: logits_processor reads"):
        dec.generate([PROMPT], 2, logits_processor=Grammar(), prefix_context=[[]])
    compiled = Decoder(sampling_target, None, max_batch=2, max_len=16, compile=specpass.backend(handoff="eager"))
    with pytest.raises(ValueError, match=r"logits_processor runs on the host at every verified position, which a "
                                         r"compiled step cannot call out to: use Decoder\(compile='eager'\)"):
        compiled.generate([PROMPT], 2, logits_processor=Grammar())

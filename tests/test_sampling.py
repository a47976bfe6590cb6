"""Speculative sampling keeps the target's distribution: hypothesis tests with a stated α.

Each equality test draws N = 20,000 requests through the speculative loop and N through plain
sampling from the target (the same loop with no drafter, another seed), and compares the joint
distribution of the first three generated tokens with a two-sample Pearson chi-square test (equal
sizes: sum (a - b)^2 / (a + b) over cells, cells with a + b < 10 pooled into one, df = cells - 1).
Tiny random models, vocabulary 16, fixed seeds: each test is deterministic. α = 0.01 for the
family of equality tests, Bonferroni-corrected: ALPHA = 0.01 / len(CASES) per test.

Power: the same tests must reject three wrong samplers (each a one-line change of the loop), on a
chain case and on the block (DFlash) case: accepting a draft whenever p >= q, drawing the residual
from p instead of max(0, p - q), and drafting from the top-k/top-p cut q while judging with the
uncut q (the cut applied to p only).
`--long` multiplies N by 5.

The accept/residual step alone is tested on hand-set p and q (goodness of fit against p), and
greedy requests inside a sampled batch still give greedy decoding's tokens exactly.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import specpass
from models import zoo
from models.drafters import ZooDrafter
from models.eagle3 import Eagle3Config
from models.llama import LlamaConfig
from specpass.drafters import DFlashConfig, DFlashDraft
from specpass.kernels.counter import key, uniform
from specpass.sampling import DRAFT, Params, floor_of, logprobs
from specpass.loop import Decoder, Proposal, round_shape, steps
from specpass.loop.steps import judge

V = 16
PROMPT = [3, 1, 4, 1, 5]
NEW = 3  # tokens compared, jointly
TARGET = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, rope_theta=10000.0)
EAGLE = Eagle3Config(vocab_size=V, draft_vocab_size=12, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, rope_theta=10000.0)
DFLASH = DFlashConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, rope_theta=10000.0, target_layer_ids=[0, 2], mask_token_id=V - 1)

# (drafter, k, temperature, top_k, top_p, greedy drafts, compile, fused round)
CASES = {
    "eagle-t1": ("eagle", 2, 1.0, None, None, False, "eager", False),
    "eagle-t0.6-topk": ("eagle", 3, 0.6, 4, None, False, "eager", False),
    "draft-t0.6-topp": ("draft", 1, 0.6, None, 0.8, False, "eager", False),
    "draft-t1-greedy-drafts": ("draft", 2, 1.0, None, None, True, "eager", False),
    "draft-t0.6-topk-topp-greedy-drafts": ("draft", 2, 0.6, 5, 0.9, True, "eager", False),
    "eagle-t1-specpass-apart": ("eagle", 2, 1.0, None, None, False, "specpass", False),
    "draft-t0.6-topp-specpass-fused": ("draft", 3, 0.6, None, 0.9, False, "specpass", True),
    "dflash-t0.8-topk": ("dflash", 3, 0.8, 8, None, False, "eager", False),  # one block forward a round
    "eagle-t0.8-exact": ("eagle", 2, 0.8, None, None, False, "exact", False),  # exact mode (test_exact.py)
}
ALPHA = 0.01 / len(CASES)


@pytest.fixture(scope="module")
def n(request):
    return 20_000 * (5 if request.config.getoption("--long") else 1)


@pytest.fixture(scope="module")
def target():
    return zoo.build(TARGET, seed=0)


@functools.cache
def _drafter(kind: str) -> ZooDrafter | DFlashDraft:
    if kind == "eagle":
        return ZooDrafter(zoo.build(EAGLE, seed=3))
    if kind == "dflash":  # over the target's embedding and lm_head (an identical copy of the target's)
        twin = zoo.build(TARGET, seed=0)
        torch.manual_seed(3)
        return DFlashDraft(DFLASH, twin.get_input_embeddings(), twin.lm_head).eval()
    model = zoo.build(TARGET, seed=0)  # a noisy copy of the target: agrees often, not always
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g))
    return ZooDrafter(model)


def run(target, n, drafter=None, k=2, greedy_drafts=False, compile="eager", fused=False, seed=0, **params):
    backend = specpass.backend(handoff="eager") if compile in ("specpass", "exact") else compile
    max_len = round_shape(drafter).cache_slots(len(PROMPT), NEW, k) + 1
    dec = Decoder(target, drafter, k=k, max_batch=n, max_len=max_len, compile=backend,
                  fused_round=fused, greedy_drafts=greedy_drafts, exact=compile == "exact")
    out = dec.generate([PROMPT] * n, NEW, seed=seed, **params)
    assert all(len(t) == NEW for t in out.tokens)
    return torch.tensor(out.tokens), out.metrics


def two_sample(a: torch.Tensor, b: torch.Tensor, vocab: int = V) -> tuple[float, int, float]:
    """Pearson's chi-square for two samples of equal size of token tuples [N, m] -> (stat, df, p)."""
    cells = vocab ** a.shape[1]
    code = vocab ** torch.arange(a.shape[1])
    ca, cb = (torch.bincount((t * code).sum(1), minlength=cells).double() for t in (a, b))
    small = ca + cb < 10
    ca = torch.cat([ca[~small], ca[small].sum()[None]])
    cb = torch.cat([cb[~small], cb[small].sum()[None]])
    keep = ca + cb > 0
    ca, cb = ca[keep], cb[keep]
    stat = float(((ca - cb) ** 2 / (ca + cb)).sum())
    df = len(ca) - 1
    return stat, df, chi2_sf(stat, df)


def goodness_of_fit(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's chi-square of tokens [N] against the distribution p [V] -> p-value."""
    expected = p.double() * len(tokens)
    observed = torch.bincount(tokens, minlength=len(p)).double()
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum()[None]])
    o = torch.cat([observed[big], observed[~big].sum()[None]])
    keep = e > 0
    assert o[~keep].sum() == 0, "a token of probability 0 was drawn"
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    return chi2_sf(stat, int(keep.sum()) - 1)


def chi2_sf(stat: float, df: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _params(case):
    _, _, temperature, top_k, top_p, *_ = CASES[case]
    return dict(temperature=temperature, top_k=top_k, top_p=top_p)


@functools.cache
def _reference(target_id, n, temperature, top_k, top_p):
    return run(_TARGETS[target_id], n, seed=7, temperature=temperature, top_k=top_k, top_p=top_p)[0]


_TARGETS: dict[int, torch.nn.Module] = {}


def reference(target, n, case):
    _TARGETS[id(target)] = target
    return _reference(id(target), n, **_params(case))


def speculate(target, n, case):
    kind, k, _, _, _, greedy_drafts, compile, fused = CASES[case]
    return run(target, n, _drafter(kind), k, greedy_drafts, compile, fused, seed=11, **_params(case))


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_keeps_the_distribution(target, n, case):
    tokens, metrics = speculate(target, n, case)
    k = CASES[case][1]
    assert 0.05 < metrics.acceptance[0] < 0.95, metrics  # both accept and reject paths are taken
    stat, df, p = two_sample(tokens, reference(target, n, case))
    assert p > ALPHA, f"{case}: chi-square {stat:.1f} on {df} df, p = {p:.2e} <= α = {ALPHA:.1e} (k = {k})"


def _accepts_when_p_at_least_q(u, p, q):
    return p >= q


def _residual_from_p(p, q):
    return torch.log(p)


def _propose_judged_with_uncut_q(drafter, sampled, logits, params, pos):
    """Drafts drawn from the cut q, but q reported without the cut: top-k/top-p applied to p only."""
    ids, proposal = _PROPOSE(drafter, sampled, logits, params, pos)
    if proposal is None:
        return ids, None
    draft_ids = torch.searchsorted(drafter.to_target(torch.arange(logits.shape[-1])), ids)
    q = logprobs(logits, params, None).exp()
    return ids, Proposal(q, q.gather(1, draft_ids[:, None])[:, 0])


_PROPOSE = steps.propose
WRONG = {  # each on a chain case and on the block case
    f"{wrong}/{case}": (name, replacement, case)
    for wrong, name, replacement, chain_case in (
        ("accept-when-p>=q", "accepts", _accepts_when_p_at_least_q, "eagle-t1"),
        ("residual-from-p", "residual", _residual_from_p, "eagle-t1"),
        ("cut-applied-to-p-only", "propose", _propose_judged_with_uncut_q, "eagle-t0.6-topk"))
    for case in (chain_case, "dflash-t0.8-topk")}


@pytest.mark.parametrize("wrong", list(WRONG))
def test_a_wrong_sampler_is_rejected(target, n, wrong, monkeypatch):
    name, replacement, case = WRONG[wrong]
    monkeypatch.setattr(steps, name, replacement)
    stat, df, p = two_sample(speculate(target, n, case)[0], reference(target, n, case))
    assert p < ALPHA, f"{wrong} not rejected on {case}: chi-square {stat:.1f} on {df} df, p = {p:.2e}"


@pytest.mark.parametrize("greedy_drafts", [False, True])
def test_accept_and_residual_give_p_on_hand_set_distributions(greedy_drafts):
    """One draft d ~ q judged against p (judge with K = 1): the emitted token is distributed as p,
    whatever q; p and q differ in both directions and q puts mass where p has none."""
    N = 200_000
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10, 0.0])
    q = torch.tensor([0.05, 0.40, 0.05, 0.20, 0.10, 0.20])
    params = Params(torch.ones(N), torch.arange(N), None, None)
    pos = torch.full((N,), 5)
    if greedy_drafts:
        d, proposal = torch.full((N, 1), 1), None  # q one-hot at token 1
    else:
        u = uniform(key(params.seed, pos + 1, DRAFT), torch.arange(6))  # inverse CDF of q, per request
        d = (u[:, :1] > q.cumsum(0)).sum(1, keepdim=True)
        proposal = Proposal(q.expand(N, 1, 6), q[d])
    logits = torch.log(p).expand(N, 2, 6)  # row 0 judges d; row 1 (the bonus) is not emitted first
    y, a = judge(logits, d, proposal, params, pos, lambda ids: ids)
    assert 0.1 < (a == 1).float().mean() < 0.9
    assert goodness_of_fit(y[:, 0], p) > 1e-3
    drawn_from_p = torch.multinomial(p, N, replacement=True, generator=torch.Generator().manual_seed(0))
    wrong = torch.where(a == 1, d[:, 0], drawn_from_p)  # the residual drawn from p
    assert goodness_of_fit(wrong, p) < 1e-3


def test_greedy_requests_in_a_sampled_batch_decode_greedily(target):
    prompts = [[3, 14, 15], [9, 2, 6, 5], [1]]
    dec = Decoder(target, _drafter("eagle"), k=3, max_batch=3, max_len=40, compile="eager")
    greedy = Decoder(target, None, max_batch=3, max_len=40, compile="eager").generate(prompts, 16).tokens
    mixed = dec.generate(prompts, 16, temperature=[0.0, 1.0, 0.0], top_k=[0, 3, 5], seed=2).tokens
    assert mixed[0] == greedy[0] and mixed[2] == greedy[2]
    assert mixed[1] != greedy[1]


def test_the_same_seed_gives_the_same_tokens(target):
    prompts = [[3, 14, 15], [9, 2, 6, 5]]
    dec = Decoder(target, _drafter("draft"), k=2, max_batch=2, max_len=40, compile="eager")
    one, two, other = (dec.generate(prompts, 16, temperature=1.0, top_p=0.9, seed=s).tokens for s in (4, 4, 5))
    assert one == two and one != other
    per_request = dec.generate(prompts[::-1], 16, temperature=1.0, top_p=0.9, seed=[4 * 2**20 + 1, 4 * 2**20]).tokens
    assert per_request == one[::-1]  # a request's tokens depend on its own seed, not on its place in the batch


def test_floor_keeps_top_k_and_the_smallest_set_reaching_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, 2.0]]).log_softmax(-1) * 1.0
    p = logits.softmax(-1)[0].tolist()  # 0.56, 0.21, 0.08, 0.03, 0.01, 0.08 (ties at 2.0)
    cases = [(dict(top_k=1), {0}), (dict(top_k=3), {0, 1, 2, 5}), (dict(top_p=0.5), {0}),
             (dict(top_p=p[0] + 0.01), {0, 1}), (dict(top_k=2, top_p=0.99), {0, 1})]
    for kw, kept in cases:
        params = Params.make(1, 1, torch.device("cpu"), temperature=1.0, seed=0, **kw)
        log_p = logprobs(logits, params, floor_of(logits, params))[0]
        assert {i for i in range(6) if log_p[i] > float("-inf")} == kept, kw
        assert math.isclose(float(log_p.exp().sum()), 1.0, rel_tol=1e-6)


def test_bad_sampling_parameters_are_named(target):
    dec = Decoder(target, None, max_batch=2, max_len=40, compile="eager")
    for kw, message in [(dict(temperature=-0.5), "temperature must be a number >= 0"),
                        (dict(temperature=[1.0]), "temperature has 1 values for 2 prompts"),
                        (dict(temperature=1.0, top_p=0.0), r"top_p must be a number in \(0, 1\]"),
                        (dict(temperature=1.0, top_k=1.5), "top_k must be an int >= 0"),
                        (dict(temperature=1.0, seed=-1), "seed must be an int >= 0")]:
        with pytest.raises(ValueError, match=message):
            dec.generate([[1], [2]], 4, **kw)


def test_uniforms_stay_inside_the_open_interval():
    """The extreme hashes give uniforms strictly inside (0, 1), so the Gumbel noise is finite."""
    u = uniform(torch.tensor([0, 1, 2**32 - 2, 2**32 - 1]))
    assert (u > 0).all() and (u < 1).all(), u
    assert torch.isfinite(-torch.log(-torch.log(u))).all()

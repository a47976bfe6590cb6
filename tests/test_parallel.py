"""Parallel drafting (P-EAGLE): the head's one draft forward against the mask-slot layout built by
hand, the loop's round of verify + one draft forward (lossless, steps apart and fused, greedy and
sampled), and the live-row rewrite of that forward (K live rows per request). fp32, CPU, tiny models."""

import copy
import dataclasses
import json

import pytest
import torch

import specpass
from models import zoo
from models.drafters import ParallelZooDrafter, ZooDrafter, adapt
from models.peagle import ParallelEagle3Config, ParallelEagle3Head
from specpass.loop import Decoder, Proposal, cache_slots, parallel
from tests import test_sampling
from tests.test_speculative import CountingBackend

PROMPTS = [[3, 14, 15], [9, 2, 6, 5, 35, 89, 79, 32, 38], [46]]  # mixed lengths: 3, 9, 1
NEW = 24
MAX_LEN = cache_slots(9, NEW, 5)  # K up to 5, any drafter


@pytest.fixture(scope="module")
def target():
    return zoo.build("tiny-llama", seed=0)


class NoisyParallelCopy(ZooDrafter):
    """A parallel drafter that agrees with the target often, not always: a noisy copy of it drafts
    K tokens greedily in one `draft_parallel` call (its own cache, standalone: no hidden states)."""

    def __init__(self, target):
        model = copy.deepcopy(target)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * p.std() * torch.randn(p.shape, generator=g))
        super().__init__(model)

    def draft_parallel(self, tokens, positions, hidden, live, k):
        rows = torch.arange(tokens.shape[0])
        logits = [self.model(tokens, positions)[rows, live]]  # [B, V]; rows after live: overwritten below
        pos = positions[rows, live]
        for j in range(1, k):
            token = logits[-1].argmax(-1)
            logits.append(self.model(token[:, None], (pos + j)[:, None])[:, 0])
        return torch.stack(logits, 1)  # [B, K, V]


def peagle(seed=3, layers=1):
    """A random parallel head; `layers` > 1: the midlayer, then decoder layers (vLLM's deeper layout)."""
    return adapt(zoo.build(dataclasses.replace(zoo.config("tiny-llama-peagle3"), num_hidden_layers=layers), seed=seed))


def decode(target, drafter, k, compile="eager", fused_round=False, **kw):
    dec = Decoder(target, drafter, k=k, max_batch=len(PROMPTS), max_len=MAX_LEN, compile=compile,
                  fused_round=fused_round)
    return dec.generate(PROMPTS, NEW, **kw)


def greedy(target, **kw):
    return Decoder(target, None, max_batch=len(PROMPTS), max_len=MAX_LEN, compile="eager").generate(PROMPTS, NEW, **kw)


@pytest.mark.parametrize("layers", [1, 2])
def test_draft_forward_is_the_mask_slot_layout(layers):
    """Rows 0..live are verified, then K-1 mask slots (mask token, mask_hidden, the next positions);
    the K drafts are rows live..live+K-1. Checked against a forward on exactly those rows."""
    head = peagle(layers=layers).model
    assert isinstance(adapt(head), ParallelZooDrafter)
    B, T, k, H3 = 3, 5, 4, 3 * head.config.target_hidden_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (B, T), generator=g)
    hidden = torch.randn(B, T, H3, generator=g)
    start, live = torch.tensor([4, 11, 2]), torch.tensor([0, 4, 2])
    head.setup_caches(B, 32)
    got = head.draft_parallel(tokens, start[:, None] + torch.arange(T), hidden, live, k)  # [B, K, Vd]
    assert got.shape == (B, k, head.config.draft_vocab_size)
    for b in range(B):
        n = int(live[b]) + 1  # verified rows
        toks = torch.cat([tokens[b, :n], torch.full((k - 1,), head.config.mask_token_id)])
        hid = torch.cat([hidden[b, :n], head.mask_hidden.expand(k - 1, H3)])
        head.setup_caches(1, 32)  # a fresh cache: the padding rows above must not have been seen
        want, _ = head.forward_rows(toks[None], start[b] + torch.arange(n + k - 1)[None], hid[None])
        torch.testing.assert_close(got[b], want[0, n - 1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [1, 2, 4, 5])
@pytest.mark.parametrize("kind", ["peagle", "peagle-2-layers", "noisy"])
def test_lossless(target, kind, k):
    ref = greedy(target)
    drafter = {"peagle": peagle, "peagle-2-layers": lambda: peagle(layers=2)}.get(kind, lambda: NoisyParallelCopy(target))()
    out = decode(target, drafter, k)
    assert out.tokens == ref.tokens
    m = out.metrics
    assert m.new_tokens == NEW * len(PROMPTS) and len(m.acceptance) == k
    assert all(a >= b for a, b in zip(m.acceptance, m.acceptance[1:]))
    if kind == "noisy" and k > 1:  # partial acceptance, different per request: every path ran
        assert 1 < m.accept_length < k + 1


@pytest.mark.parametrize("layers", [1, 2])
def test_compiled_apart_and_fused_match_eager(target, layers):
    ref, k = greedy(target, eos_id=7), 3
    want = decode(target, peagle(layers=layers), k, eos_id=7)
    assert want.tokens == ref.tokens
    for fused, graphs in ((False, 4), (True, 2)):  # prefill; verify, accept, draft forward or the whole round
        backend = CountingBackend()
        out = decode(target, peagle(layers=layers), k, compile=backend, fused_round=fused, eos_id=7)
        assert out.tokens == ref.tokens
        assert (out.metrics.accept_length, out.metrics.acceptance) == (want.metrics.accept_length,
                                                                        want.metrics.acceptance)
        assert backend.graphs == graphs


@pytest.mark.parametrize("layers", [1, 2])
def test_live_rows_on_the_draft_forward(target, layers):
    """The draft forward computes 2K rows per request and keeps K: after the last layer's KV write,
    its attention's queries, o_proj, the MLP, the norms and lm_head run on K rows per request (the
    layers before it on every row: the last layer's K/V reads them); same outputs and caches."""
    k, B = 4, 3
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 256, (B, k + 1), generator=g)
    hidden = torch.randn(B, k + 1, 3 * target.config.hidden_size, generator=g)
    args = (y, torch.tensor([4, 11, 2]), hidden, torch.tensor([0, 4, 2]), None)  # a = 0, K, 2; greedy
    runs = []
    for compile in ("eager", CountingBackend()):
        dec = Decoder(target, peagle(layers=layers), k=k, max_batch=B, max_len=MAX_LEN, compile="eager")
        step = dec.steps.catch_up if compile == "eager" else torch.compile(dec.steps.catch_up, backend=compile,
                                                                            fullgraph=True)
        d, _, _ = step(*args)
        caches = [b.clone() for n, b in dec.drafter.model.named_buffers() if n.endswith("_cache")]
        runs.append((d, caches))
    assert torch.equal(runs[0][0], runs[1][0])
    for want, got in zip(runs[0][1], runs[1][1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    report = specpass.explain(dec.steps.catch_up, *args)
    (live,) = [f for f in report.of("live_rows") if f.fired and f.rows == (B * 2 * k, B * k)]
    # One layer: the rows are selected after the K/V write. More: the last layer's K/V projections
    # read its input norm of every row, so the residual stream is selected where they branch off.
    assert ("used by the in-place index_put_" if layers == 1 else "needed in full by rms_norm") in live.message
    assert "does not trace" not in str(report)  # the positions' arange: a factory, named as one
    rewritten = specpass.rewrite(specpass.capture(dec.steps.catch_up, *args)).graph_module
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    rows = [n.meta["val"].shape[-2] for n in rewritten.graph.find_nodes(op="call_function", target=sdpa)]
    assert rows == [2 * k] * (layers - 1) + [k]  # [B, heads, rows, d] (SDPA's enable_gqa): K in the last
    lm_head = [n for n in rewritten.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)
               if n.meta["val"].shape[-1] == zoo.config("tiny-llama-peagle3").draft_vocab_size]
    assert [tuple(n.meta["val"].shape) for n in lm_head] == [(B, k, 96)]


@pytest.fixture(scope="module")
def n():
    return 20_000


@pytest.fixture(scope="module")
def sampling_target():
    return zoo.build(test_sampling.TARGET, seed=0)


def sample_parallel(target, n, k=3):
    """n requests of test_sampling's prompt, drafts sampled from a random parallel head, 3 tokens each."""
    cfg = ParallelEagle3Config(**dataclasses.asdict(test_sampling.EAGLE), mask_token_id=test_sampling.V - 1)
    return test_sampling.run(target, n, adapt(zoo.build(cfg, seed=3)), k, seed=11, temperature=1.0)


def test_speculative_sampling_keeps_the_distribution(sampling_target, n):
    """test_sampling's two-sample chi-square (alpha 0.01) on the joint law of the first three tokens:
    K = 3 drafts per round from one forward, each drawn from its own distribution."""
    tokens, metrics = sample_parallel(sampling_target, n)
    assert 0.05 < metrics.acceptance[0] < 0.95 and metrics.acceptance[1] > 0.01, metrics  # mask rows accepted too
    reference, _ = test_sampling.run(sampling_target, n, seed=7, temperature=1.0)
    stat, df, p = test_sampling.two_sample(tokens, reference)
    assert p > 0.01, f"chi-square {stat:.1f} on {df} df, p = {p:.2e}"


def test_judging_a_draft_against_another_draft_s_proposal_is_rejected(sampling_target, n, monkeypatch):
    """Power: the same test rejects a loop that judges the drafts with their proposals in reverse order."""
    propose_rows = parallel.propose_rows

    def swapped(*args):
        ids, q = propose_rows(*args)
        return ids, None if q is None else Proposal(q.probs.flip(1), q.at.flip(1))

    monkeypatch.setattr(parallel, "propose_rows", swapped)
    tokens, _ = sample_parallel(sampling_target, n)
    monkeypatch.undo()
    reference, _ = test_sampling.run(sampling_target, n, seed=7, temperature=1.0)
    assert test_sampling.two_sample(tokens, reference)[2] < 1e-6


class ExactParallelCopy(NoisyParallelCopy):
    """NoisyParallelCopy without the noise: every draft is the target's, every round accepts K."""

    def __init__(self, target):
        ZooDrafter.__init__(self, copy.deepcopy(target))


def test_a_finished_request_s_draft_forward_fits_the_cache(target):
    """A request that finishes first, its last round accepting all K drafts past its budget, runs on
    frozen while another decodes: its draft forward writes 2K slots past its position, K-1 more
    than a chain round. The cache `cache_slots` sizes holds them, and Decoder refuses one slot less."""
    k, prompts, limits = 4, [PROMPTS[1], PROMPTS[0]], [12, 17]  # 9 + 12: 1, 6, 11, then 1 of 5 emitted
    max_len = max(parallel.PARALLEL.cache_slots(len(p), n, k) for p, n in zip(prompts, limits))  # the shape's own count
    assert max_len == 9 + 12 + 3 * k > 3 + 17 + 3 * k  # the request that finishes first needs the most
    want = Decoder(target, None, max_batch=2, max_len=max_len, compile="eager").generate(prompts, limits)
    out = Decoder(target, ExactParallelCopy(target), k=k, max_batch=2, max_len=max_len,
                  compile="eager").generate(prompts, limits)
    assert out.tokens == want.tokens and out.metrics.accept_length == k + 1
    with pytest.raises(ValueError, match=f"raise max_len to {max_len}"):
        Decoder(target, ExactParallelCopy(target), k=k, max_batch=2, max_len=max_len - 1,
                compile="eager").generate(prompts, limits)


def test_a_two_layer_head_loads_from_vllm_s_names(tmp_path):
    """A deeper EAGLE-3 head's checkpoint names its layers as vLLM's llama_eagle3.py loads them:
    layers.0 the midlayer (with hidden_norm, 2H attention input), layers.1 a plain decoder layer;
    config.json's num_hidden_layers says how many. One-layer checkpoints keep `midlayer.*`."""
    from safetensors import safe_open

    from models.checkpoint import CheckpointError, load, save
    from models.drafters import load_drafter

    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight",
                 *(f"self_attn.{p}_proj.weight" for p in "qkvo"), *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))]
    vllm_names = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "mask_hidden", "layers.0.hidden_norm.weight",
                  *(f"layers.{i}.{n}" for i in (0, 1) for n in per_layer)}
    for layers, names in ((2, vllm_names), (1, {n.replace("layers.0.", "midlayer.") for n in vllm_names - {
            n for n in vllm_names if n.startswith("layers.1.")}})):
        head = peagle(seed=4, layers=layers).model
        save(head, head.config, tmp_path / str(layers))
        with safe_open(str(tmp_path / str(layers) / "model.safetensors"), "pt") as f:
            assert set(f.keys()) == names
        config = json.loads((tmp_path / str(layers) / "config.json").read_text())
        assert config["num_hidden_layers"] == layers and config["parallel_drafting"]

    target = zoo.build("tiny-llama", seed=0)
    loaded = load_drafter(target, "parallel", tmp_path / "2")
    assert loaded.model.config.num_hidden_layers == 2 and len(loaded.model.layers) == 2
    saved = peagle(seed=4, layers=2).model
    saved.embed_tokens.weight = target.model.embed_tokens.weight
    g = torch.Generator().manual_seed(0)
    args = (torch.randint(0, 256, (2, 5), generator=g), torch.arange(5).expand(2, -1),
            torch.randn(2, 5, 3 * saved.config.target_hidden_size, generator=g), torch.tensor([1, 4]), 3)
    for model in (saved, loaded.model):
        model.setup_caches(2, 16)
    torch.testing.assert_close(loaded.model.draft_parallel(*args), saved.draft_parallel(*args), rtol=0, atol=0)

    config["num_hidden_layers"] = 3  # a config that promises a layer the weights lack
    (tmp_path / "2" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="layers.2"):
        load(ParallelEagle3Head, tmp_path / "2", shared={"embed_tokens.weight": target.model.embed_tokens.weight})

"""The speculative loop is lossless: for every drafter, K and batch of mixed prompt lengths, the
tokens equal the target's own greedy decoding; EOS, budgets, one host sync per round, the compiled
forms (fused round included), the live-row rewrite on the catch-up step, and the example CLI.
fp32, CPU, tiny zoo models."""

import copy
import dataclasses
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import specpass
from models import zoo
from specpass.capture import to_aten_ir
from models.checkpoint import save
from models.drafters import ZooDrafter
from specpass.loop import Decoder, Metrics, choose_k, expected_accept_length, next_k_to_time, price
from specpass.loop.host import DoneFlags
from specpass.loop.cost import batch_busy
from specpass.loop.steps import decode_round as steps_decode_round
from specpass.loop.steps import first_true

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[3, 14, 15], [9, 2, 6, 5, 35, 89, 79, 32, 38], [46]]  # mixed lengths: 3, 9, 1
NEW = 24
aten = torch.ops.aten
MAX_LEN = 9 + NEW + 2 * 5 + 1
DRAFTS = ["tiny-llama-eagle3", "tiny-deepseek-eagle3-mla", "tiny-deepseek-nextn", "tiny-qwen3.5-nextn",
          "tiny-qwen3.5-moe-nextn", "tiny-llama-draft", "noisy-copy"]


@pytest.fixture(scope="module")
def target():
    return zoo.build("tiny-llama", seed=0)


def drafter(name, target):
    if name == "noisy-copy":  # a standalone draft that agrees with the target often, not always
        model = copy.deepcopy(target)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * p.std() * torch.randn(p.shape, generator=g))
        return ZooDrafter(model)
    if name == "copy":
        return ZooDrafter(copy.deepcopy(target))
    return ZooDrafter(zoo.build(name, seed=3))


def greedy(target, prompts=PROMPTS, new=NEW, **kw):
    return Decoder(target, None, max_batch=len(prompts), max_len=MAX_LEN, compile="eager").generate(prompts, new, **kw)


def speculate(target, name, k, prompts=PROMPTS, new=NEW, max_batch=None, **kw):
    options = {key: kw.pop(key) for key in ("compile", "fused_round") if key in kw}
    dec = Decoder(target, drafter(name, target), k=k, max_batch=max_batch or len(prompts), max_len=MAX_LEN,
                  **{"compile": "eager", **options})
    return dec.generate(prompts, new, **kw)


@torch.no_grad()
def full_recompute(target, prompt, new):
    """Greedy decoding by recomputing the whole sequence each token, one request, fresh caches."""
    seq = list(prompt)
    for _ in range(new):
        target.setup_caches(1, len(seq))
        logits = target(torch.tensor([seq]), torch.arange(len(seq))[None])
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_plain_decoding_is_greedy(target):
    ref = [full_recompute(target, p, NEW) for p in PROMPTS]
    out = greedy(target)
    assert out.tokens == ref
    assert out.metrics.accept_length == 1 and out.metrics.acceptance == []


@pytest.mark.parametrize("k", [1, 2, 4, 5])
@pytest.mark.parametrize("name", DRAFTS)
def test_lossless(target, name, k):
    ref = greedy(target)
    out = speculate(target, name, k)
    assert out.tokens == ref.tokens
    m = out.metrics
    assert m.new_tokens == NEW * len(PROMPTS) and len(m.acceptance) == k
    assert 1 <= m.accept_length <= k + 1
    assert all(a >= b for a, b in zip(m.acceptance, m.acceptance[1:]))  # accepting d_i needs d_1..d_{i-1}
    if name == "noisy-copy":  # partial acceptance, different per request: the rollback paths ran
        assert 1 < m.accept_length < k + 1


@pytest.mark.parametrize("k", [1, 2, 4, 5])
def test_copy_of_target_accepts_every_draft(target, k):
    out = speculate(target, "copy", k, timing=True)
    assert out.tokens == greedy(target).tokens
    m = out.metrics
    assert m.accept_length == k + 1 and m.acceptance == [1.0] * k
    assert m.rounds == -(-(NEW - 1) // (k + 1))  # the prefill emits one token, each round k+1
    assert set(m.phase_ms) == {"round", "draft", "verify", "accept", "catch_up", "between"}


def truncate_after(tokens, eos):
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("name", ["noisy-copy", "tiny-llama-eagle3"])
def test_eos_mid_batch(target, name):
    ref = greedy(target).tokens
    eos = ref[1][5]  # the middle request stops at its 6th token (or earlier, if eos came before)
    want = [truncate_after(r, eos) for r in ref]
    assert len(want[1]) <= 6 and any(len(w) == NEW for w in want), "pick an EOS that stops one request only"
    assert greedy(target, eos_id=eos).tokens == want
    for k in (2, 5):
        assert speculate(target, name, k, eos_id=eos).tokens == want
    # per-request EOS: only the middle request has one
    assert speculate(target, name, 3, eos_id=[-1, eos, -1]).tokens == [ref[0], want[1], ref[2]]


@pytest.mark.parametrize("k", [3, "tree"])
def test_several_eos_ids_per_request(target, k):
    """Any of a request's ids stops it, each request its own set, in chain and tree rounds, compiled
    (the passes, eagerly run) as the loop runs them."""
    from specpass.loop import TreeShape

    ref = greedy(target).tokens
    a, b, c = ref[0][4], ref[1][6], ref[2][3]
    sets = [[b, a], [b], [c, a]]
    want = [r[: min([r.index(e) for e in ids if e in r] + [len(r) - 1]) + 1] for r, ids in zip(ref, sets)]
    assert [len(w) for w in want] != [NEW] * 3 and want[0] != ref[0], "pick ids that stop some requests early"
    shape = TreeShape(2, 3, 6) if k == "tree" else k
    out = speculate(target, "tiny-llama-eagle3", shape, eos_id=sets, compile=specpass.backend(handoff="eager"))
    assert out.tokens == want
    assert greedy(target, eos_id=sets).tokens == want


def test_max_new_tokens_per_request_and_idle_rows(target):
    ref = greedy(target).tokens
    budgets = [3, 11, 1]
    out = speculate(target, "noisy-copy", 4, max_batch=5, new=budgets)  # 2 idle rows in the batch
    assert out.tokens == [r[:n] for r, n in zip(ref, budgets)]
    assert out.metrics.new_tokens == sum(budgets)


def test_first_true_is_the_count_of_leading_falses():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(64, 6, generator=g) < 0.3
    mask[0] = False  # no True: the row's length
    mask[1] = True
    leading = [next((i for i, m in enumerate(row) if m), len(row)) for row in mask.tolist()]
    assert first_true(mask).tolist() == leading
    assert first_true(mask)[0] == 6 and first_true(mask)[1] == 0


def test_one_host_sync_per_round(target, monkeypatch):
    syncs = []
    for method in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _name=method, **kwargs):
            syncs.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    for name in ("tiny-llama-eagle3", "tiny-deepseek-nextn", "noisy-copy"):
        syncs.clear()
        out = speculate(target, name, 4, eos_id=7)
        # one read per round (none after the round that spends the largest budget: NEW - 1 rounds
        # after the prefill's token), then the final read of tokens, counts and statistics
        reads = out.metrics.rounds - (out.metrics.rounds == NEW - 1)
        assert syncs == ["item"] * reads + ["tolist"] * 3, (name, syncs)


@pytest.mark.parametrize("eos_id", [None, 206])
def test_no_round_past_the_budgets(target, monkeypatch, eos_id):
    """With the done flag read a round late (`lag` 1, as on a GPU), a batch that ends on its budgets
    runs the rounds they need and no more (the prefill's token, then one a round or more); one that
    an EOS ends first (206: the first token of the first request, the eleventh of the third) runs
    one round past it, which the count leaves out. Tokens as greedy decoding's."""
    from specpass.loop import driver

    class Lagged(DoneFlags):  # a GPU's DoneFlags on the CPU: each push reads the round before
        def __init__(self, device):
            super().__init__(device)
            self.lag = 1

        def push(self, finished):
            self.pending.append(bool(finished))
            return len(self.pending) > 1 and self.pending.pop(0)

    monkeypatch.setattr(driver, "DoneFlags", Lagged)
    ran = []
    monkeypatch.setattr(driver, "decode_round", lambda *args: ran.append(1) or steps_decode_round(*args))
    budgets = [NEW, 5, NEW - 2] if eos_id is None else [NEW, 5, NEW]
    want = greedy(target, new=budgets, eos_id=eos_id).tokens
    for k, name in ((0, None), (3, "tiny-llama-eagle3")):
        dec = Decoder(target, name and drafter(name, target), k=k, max_batch=3, max_len=MAX_LEN, compile="eager")
        ran.clear()
        out = dec.generate(PROMPTS, budgets, eos_id=eos_id)
        assert out.tokens == want
        if eos_id is None:
            assert len(ran) == out.metrics.rounds <= NEW - 1, (k, len(ran))
            assert k or len(ran) == NEW - 1  # plain decoding: one token a round
        else:
            assert [len(t) for t in want] == [1, 5, 11]
            assert len(ran) == out.metrics.rounds + 1 and (k or out.metrics.rounds == 10), (k, len(ran))


def test_explain_catch_up_shows_the_live_row_gather(target):
    k = 4
    dec = Decoder(target, drafter("tiny-llama-eagle3", target), k=k, max_batch=3, max_len=MAX_LEN, compile="eager")
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 256, (3, k + 1), generator=g)
    hidden = torch.randn(3, k + 1, 3 * target.config.hidden_size, generator=g)
    args = (y, torch.tensor([4, 11, 2]), hidden, torch.tensor([0, 4, 2]), None)  # params None: greedy
    report = specpass.explain(dec.steps.catch_up, *args)
    live = [f for f in report.of("live_rows") if f.fired]
    assert live and live[0].rows == (3 * (k + 1), 3), str(report)
    # The gather lands before attention (one query row per request and head), even though the
    # sampled id then indexes d2t: an index computed from the rows, which must not be hoisted above them.
    rewritten = specpass.rewrite(specpass.capture(dec.steps.catch_up, *args)).graph_module
    (attention,) = rewritten.graph.find_nodes(op="call_function", target=torch.ops.aten.scaled_dot_product_attention.default)
    attn = dec.drafter.model.midlayer.self_attn
    assert list(attention.meta["val"].shape[1:3]) == [attn.n_heads, 1]  # [B, heads, one token, d]
    assert "only known after" not in str(report)  # the query projection runs on live rows too
    assert any(f.fired for f in report.of("argmax")), str(report)  # the greedy softmax -> max


class CountingBackend:
    """specpass without Inductor (fast on CPU), counting the graphs it compiles."""

    def __init__(self):
        self.graphs = 0
        self.inner = specpass.backend(handoff="eager")

    def __call__(self, gm, example_inputs, **kwargs):
        self.graphs += 1
        return self.inner(gm, example_inputs, **kwargs)


class GraphCounter:
    """Dynamo's graphs run as traced (no passes, no Inductor), counted: for what the loop asks of
    Dynamo itself (code objects, guards, recompiles), which does not depend on the backend."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs, **kwargs):
        self.graphs += 1
        return gm


@pytest.mark.parametrize("name", ["tiny-llama-eagle3", "tiny-llama-draft"])
def test_compiled_and_fused_round_match_eager(target, name):
    ref = greedy(target, eos_id=7)
    k = 3
    want = speculate(target, name, k, eos_id=7)
    assert want.tokens == ref.tokens
    for fused, graphs in ((False, 5), (True, 2)):
        backend = CountingBackend()
        out = speculate(target, name, k, compile=backend, fused_round=fused, eos_id=7)
        assert out.tokens == ref.tokens
        assert (out.metrics.accept_length, out.metrics.acceptance) == (want.metrics.accept_length,
                                                                        want.metrics.acceptance)
        assert backend.graphs == graphs  # prefill; draft, verify, accept, catch-up or the whole round


@pytest.mark.parametrize("name", ["tiny-llama-eagle3", "tiny-llama-draft"])  # a head; a standalone draft
def test_prefill_compiles_once_for_every_prompt_length(target, name):
    backend = CountingBackend()
    dec = Decoder(target, drafter(name, target), k=3, max_batch=3, max_len=MAX_LEN, compile=backend)
    lengths = [(1, 1, 1), (4, 2, 1), (9, 3, 7), (13, 13, 2)]  # the longest prompt sets the padded length
    for n in lengths:
        prompts = [list(range(3 + j, 3 + j + i)) for j, i in enumerate(n)]
        want = greedy(target, prompts, new=12)
        assert dec.generate(prompts, 12).tokens == want.tokens, n
        assert backend.graphs == 5, n  # the first generate compiled the prefill and 4 steps; no length recompiles


def test_decoders_over_one_pair_keep_their_own_compile_caches(target):
    """Five Decoders over one target and drafter (K 1..5), ten graphs (each Decoder's prefill and
    fused round), all guarding on the same two models, where Dynamo allows 8 per code object: each
    Decoder compiles its steps under code objects of its own."""
    backend, head = GraphCounter(), drafter("tiny-llama-eagle3", target)
    want = [t[:6] for t in greedy(target).tokens]
    for k in range(1, 6):
        dec = Decoder(target, head, k=k, max_batch=3, max_len=MAX_LEN, compile=backend, fused_round=True)
        assert dec.generate(PROMPTS, 6).tokens == want, k
    assert backend.graphs == 10


def stance_per_round(monkeypatch):
    """-> a list that gets, at each round's host sync, whether Dynamo skips guard evaluation."""
    seen = []
    push = DoneFlags.push

    def recording(self, finished):
        seen.append(torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe)
        return push(self, finished)

    monkeypatch.setattr(DoneFlags, "push", recording)
    return seen


def test_rounds_after_the_second_skip_guard_evaluation(target, monkeypatch):
    seen = stance_per_round(monkeypatch)
    backend = GraphCounter()
    dec = Decoder(target, drafter("tiny-llama-eagle3", target), k=3, max_batch=3, max_len=MAX_LEN, compile=backend,
                  fused_round=True)
    want = greedy(target, eos_id=7).tokens
    seen.clear()
    out = dec.generate(PROMPTS, NEW, eos_id=7)
    assert out.tokens == want
    reads = out.metrics.rounds - (out.metrics.rounds == NEW - 1)  # none after the largest budget's last round
    assert out.metrics.rounds > 3 and seen == [False, False] + [True] * (reads - 2), seen
    assert not torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe  # restored after the loop
    seen.clear()
    with pytest.raises(RuntimeError, match="stop"):  # restored when the loop raises, too
        monkeypatch.setattr(DoneFlags, "push", lambda self, finished: (_ for _ in ()).throw(
            RuntimeError("stop")) if len(seen) > 4 else seen.append(1))
        dec.generate(PROMPTS, NEW)
    assert not torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe
    assert backend.graphs == 2


def test_a_call_after_unguarded_rounds_still_recompiles_what_changed(target):
    """Greedy, then sampled (other inputs to every step: a new graph each), then greedy again on one
    Decoder: each call's first rounds run under full guards, so each runs its own graphs; tokens
    equal a fresh Decoder's, and the sampled ones differ from the greedy ones."""
    head = drafter("tiny-llama-eagle3", target)
    backend = GraphCounter()
    dec = Decoder(target, head, k=3, max_batch=3, max_len=MAX_LEN, compile=backend, fused_round=True)
    want = greedy(target).tokens
    assert dec.generate(PROMPTS, NEW).tokens == want
    assert backend.graphs == 2  # the prefill, the round
    sampled = dec.generate(PROMPTS, NEW, temperature=1.0, seed=5).tokens
    assert backend.graphs == 4 and sampled != want
    fresh = Decoder(target, head, k=3, max_batch=3, max_len=MAX_LEN, compile=GraphCounter(), fused_round=True)
    assert fresh.generate(PROMPTS, NEW, temperature=1.0, seed=5).tokens == sampled
    assert dec.generate(PROMPTS, NEW).tokens == want and backend.graphs == 4


def test_the_callers_compiler_stance_holds_in_every_round(target, monkeypatch):
    seen = stance_per_round(monkeypatch)
    backend = GraphCounter()
    dec = Decoder(target, drafter("tiny-llama-eagle3", target), k=3, max_batch=3, max_len=MAX_LEN, compile=backend,
                  fused_round=True)
    want = greedy(target).tokens
    seen.clear()
    with torch.compiler.set_stance("force_eager"):
        assert dec.generate(PROMPTS, NEW).tokens == want
        assert torch._dynamo.eval_frame._stance.stance == "force_eager"
    assert backend.graphs == 0 and seen[2:] and all(seen[2:])  # nothing compiled, rounds 3 on unguarded


class RewriteRecorder:
    """specpass's passes on every graph Dynamo compiles, as its backend runs them, recorded; the graph
    then runs as traced."""

    def __init__(self):
        self.results = []

    def __call__(self, gm, example_inputs, **kwargs):
        self.results.append(specpass.rewrite(to_aten_ir(gm, example_inputs)))
        return gm


def test_prefill_lm_heads_run_on_the_live_rows_only(target):
    """The target's logits are read at each request's last prompt row, the EAGLE-3 drafter's at its
    live row: in the compiled prefill (the prompt length symbolic) both lm_heads run on B rows."""
    head = drafter("tiny-llama-eagle3", target)
    recorder = RewriteRecorder()
    dec = Decoder(target, head, k=3, max_batch=3, max_len=MAX_LEN, compile=recorder)
    assert dec.generate(PROMPTS, 4).tokens == [t[:4] for t in greedy(target).tokens]
    result = recorder.results[0]  # the prefill's graph, compiled first
    vocabularies = [target.config.vocab_size, head.model.config.draft_vocab_size]
    lm_heads = [n.meta["val"].shape for n in result.graph_module.graph.find_nodes(
        op="call_function", target=aten.linear.default) if n.meta["val"].shape[-1] in vocabularies]
    assert [(shape.numel() // shape[-1], shape[-1]) for shape in lm_heads] == [(3, V) for V in vocabularies], \
        str(result.report)
    live = [f for f in result.report.of("live_rows") if f.fired]
    assert len(live) == 2, str(result.report)
    for finding in live:  # B * P rows (symbolic: every prompt length) -> B
        assert not isinstance(finding.rows[0], int) and finding.rows[1] == 3, str(result.report)


def run_example(*args):
    return subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_example_runs_with_no_arguments():
    result = run_example()
    assert result.returncode == 0, result.stderr
    assert "mean accepted length:" in result.stdout
    assert "acceptance per draft position:" in result.stdout
    assert "tokens/s: speculative" in result.stdout and "plain target decoding" in result.stdout


def test_example_check_with_a_standalone_draft(tmp_path):
    for name, directory in (("tiny-llama", "t"), ("tiny-llama-draft", "d")):
        model = zoo.build(dataclasses.replace(zoo.config(name), vocab_size=258), seed=0)
        save(model, model.config, tmp_path / directory)
    result = run_example("--target", tmp_path / "t", "--draft", tmp_path / "d", "--check", "--k", 2,
                         "--max-new-tokens", 12, "--prompt", "ab", "--prompt", "hello",
                         "--compile", "eager")  # compiled: test_example_runs_with_no_arguments
    assert result.returncode == 0, result.stderr
    assert "check: every token equals plain greedy decoding: yes" in result.stdout


def test_example_samples_reproducibly_and_refuses_check_when_sampling():
    args = ("--temperature", 0.8, "--top-k", 40, "--top-p", 0.9, "--seed", 3, "--max-new-tokens", 24,
            "--num-prompts", 1, "--repeats", 1, "--compile", "eager")  # compiled sampling: tests/test_sampling.py
    first, second = run_example(*args), run_example(*args)
    assert first.returncode == 0, first.stderr
    assert "sampling: temperature 0.8, top-k 40, top-p 0.9, seed 3" in first.stdout
    completion = first.stdout.split("completion")[1].split("=" * 68)[0]
    assert completion == second.stdout.split("completion")[1].split("=" * 68)[0]
    refused = run_example("--temperature", 0.5, "--check")
    assert refused.returncode == 2 and "--check compares with plain greedy decoding" in refused.stderr
    bad = run_example("--top-p", 0)
    assert bad.returncode == 2 and "--top-p: must be in (0, 1], got 0.0" in bad.stderr


def test_example_missing_and_mismatched_checkpoints(tmp_path):
    result = run_example("--target", tmp_path / "nowhere", "--eagle", tmp_path / "nothing")
    assert result.returncode == 2 and "nowhere does not exist: check the path" in result.stderr
    zoo.make_checkpoint("tiny-llama", tmp_path / "t")
    model = zoo.build(dataclasses.replace(zoo.config("tiny-qwen3.5-nextn"), vocab_size=300, hidden_size=32))
    save(model, model.config, tmp_path / "n")
    result = run_example("--target", tmp_path / "t", "--nextn", tmp_path / "n")
    assert result.returncode == 2
    assert "vocabulary: the target has 256 tokens, the NextN draft 300" in result.stderr
    assert "NextN hidden_size 32 != the target's hidden_size 64" in result.stderr


def test_choose_k_takes_the_most_tokens_per_ms():
    acceptance = [0.8, 0.7, 0.6, 0.5, 0.1]
    assert expected_accept_length(acceptance[:3]) == pytest.approx(3.1)
    assert choose_k({2: 10.0, 4: 10.0}, acceptance) == 5  # drafts cost nothing: every one pays
    # round ms = 10 + 2K: tokens per ms 0.150 0.179 0.194 0.200 0.185 for K = 1..5
    assert choose_k({1: 12.0, 5: 20.0}, acceptance) == 4
    assert choose_k({1: 12.0, 3: 30.0, 5: 20.0}, acceptance) == 5  # measured K keep their cost; K 2, 4 between
    with pytest.raises(ValueError, match="two K"):
        choose_k({4: 10.0}, acceptance)


def test_price_between_and_beyond_the_measured_k():
    assert price({2: 10.0, 4: 20.0, 6: 22.0}, 8) == pytest.approx(
        {1: 5.0, 2: 10.0, 3: 15.0, 4: 20.0, 5: 21.0, 6: 22.0, 7: 23.0, 8: 24.0})  # each gap on its own line
    assert price({3: 9.0, 5: 8.0}, 6)[6] == 8.0  # a falling line is cut at the largest measured round
    assert price({3: 3.0, 5: 9.0}, 2) == pytest.approx({1: 1.0, 2: 2.0})  # not below the line from the origin


# The shipped pair's acceptance (docs/e2e.json) and the round's ms at bs 128 x 64 on the H100
# (docs/results.md, runs 5, 6: K 2-5 measured; K 1 and 6-8 set above the K-2 and K-5 rounds).
SHIPPED = [0.77, 0.68, 0.60, 0.55, 0.50, 0.44, 0.387, 0.341]
BS128 = {1: 12.0, 2: 14.49, 3: 15.97, 4: 19.93, 5: 23.72, 6: 27.6, 7: 31.5, 8: 35.4}


def search(table, acceptance, timed, max_timings=8):
    """`Decoder.tune_k`'s search on a cost table: -> (chosen K, the K timed in order)."""
    round_ms = {k: table[k] for k in timed}
    while (k := next_k_to_time(round_ms, acceptance)) is not None and len(round_ms) < len(timed) + max_timings:
        round_ms[k] = table[k]
    return choose_k(round_ms, acceptance), list(round_ms)


def rate(table, acceptance, k):
    return expected_accept_length(acceptance[:k]) / table[k]


def test_the_search_finds_the_best_k_where_the_round_is_not_linear():
    best = max(range(1, 9), key=lambda k: rate(BS128, SHIPPED, k))
    assert best == 3 and choose_k({2: BS128[2], 4: BS128[4]}, SHIPPED) == 5  # the two timed K alone miss it
    chosen, timed = search(BS128, SHIPPED, [2, 4])
    assert chosen == best and timed == [2, 4, 5, 3]  # K 5 priced best, measured slower; then K 4's neighbour 3
    assert search(BS128, SHIPPED, [2, 4], max_timings=1) == (4, [2, 4, 5])  # the bound holds; K 4 priced best


@pytest.mark.parametrize("fixed, per_k", [(10.0, 2.0), (10.0, 0.5), (5.0, 6.0)])
def test_the_search_on_a_linear_round_keeps_the_lines_choice(fixed, per_k):
    acceptance = [0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]
    table = {k: fixed + per_k * k for k in range(1, 9)}
    best = max(table, key=lambda k: rate(table, acceptance, k))
    chosen, timed = search(table, acceptance, [2, 6])
    assert chosen == best == choose_k({2: table[2], 6: table[6]}, acceptance)
    assert set(timed) - {2, 6} <= {best - 1, best, best + 1}  # only the chosen K and its neighbours
    around = [k for k in (best - 1, best, best + 1) if 1 <= k <= 8]
    assert search(table, acceptance, around) == (best, around)  # timed already: nothing more


class Slow(ZooDrafter):
    """A drafter whose catch-up and draft steps each move a virtual clock by a known time."""

    def __init__(self, model, clock, catch_up_s: float, draft_s: float):
        super().__init__(model)
        self.clock, self.catch_up_s, self.draft_s = clock, catch_up_s, draft_s

    def catch_up(self, *args):
        self.clock.now += self.catch_up_s
        return super().catch_up(*args)

    def draft_step(self, *args):
        self.clock.now += self.draft_s
        return super().draft_step(*args)


@pytest.mark.parametrize("catch_up_s, draft_s", [(0.03, 0.0), (0.01, 0.03)])
def test_tune_k_picks_the_fastest_k_and_decodes_with_it(target, monkeypatch, catch_up_s, draft_s):
    clock = types.SimpleNamespace(now=0.0)  # the loop's clock: only the drafter's known costs move it
    monkeypatch.setattr(time, "perf_counter", lambda: clock.now)
    acceptance = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]
    rate = {k: (1 + sum(acceptance[:k])) / (catch_up_s + (k - 1) * draft_s) for k in range(1, 7)}
    want = max(rate, key=rate.get)  # free drafts: 6; costly drafts: 1
    dec = Decoder(target, Slow(zoo.build("tiny-llama-eagle3", seed=3), clock, catch_up_s, draft_s), k=4,
                  max_batch=len(PROMPTS), max_len=MAX_LEN + 2, compile="eager")
    choice = dec.tune_k(PROMPTS, (2, 6), acceptance=acceptance, new_tokens=(2, 6), repeats=1)
    assert choice.round_ms == pytest.approx({k: 1e3 * (catch_up_s + (k - 1) * draft_s) for k in choice.round_ms})
    assert choice.k == want == dec.k and choice.verified, choice
    assert {2, 6, want} <= set(choice.round_ms) <= {2, 6, want - 1, want, want + 1}
    out = dec.generate(PROMPTS, NEW)
    assert out.tokens == greedy(target).tokens and len(out.metrics.acceptance) == want


class Stepped(ZooDrafter):
    """A drafter whose catch-up moves a virtual clock by table[K] (its K+1 rows a round), any shape."""

    def __init__(self, model, clock, table):
        super().__init__(model)
        self.clock, self.table = clock, table

    def catch_up(self, tokens, *args):
        self.clock.now += self.table.get(tokens.shape[1] - 1, 0.0)  # the prefill's catch-up: not in the table
        return super().catch_up(tokens, *args)


def test_tune_k_searches_until_its_k_and_neighbours_are_timed(target, monkeypatch):
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(time, "perf_counter", lambda: clock.now)
    table = {k: ms / 1e3 for k, ms in BS128.items() if k <= 6}

    def tune(**kw):
        dec = Decoder(target, Stepped(zoo.build("tiny-llama-eagle3", seed=3), clock, table), k=4,
                      max_batch=len(PROMPTS), max_len=MAX_LEN + 2, compile="eager")
        return dec, dec.tune_k(PROMPTS, (2, 4), acceptance=SHIPPED[:6], new_tokens=(2, 6), repeats=1, **kw)

    dec, choice = tune()
    assert choice.k == dec.k == 3 and choice.verified
    assert choice.why == {2: "given", 4: "given", 5: "priced best", 3: "neighbour of K 4, priced best"}
    assert choice.round_ms == pytest.approx({k: BS128[k] for k in (2, 4, 5, 3)})
    dec, choice = tune(max_timings=1)
    assert list(choice.round_ms) == [2, 4, 5] and choice.k == dec.k == 4 and not choice.verified
    dec, choice = tune(max_timings=0)
    assert list(choice.round_ms) == [2, 4] and choice.k == 5 and not choice.verified  # the cost model's K, untimed


def test_tune_k_counts_the_rounds_done_requests_idle(target, monkeypatch):
    # A chain whose requests finish 10 rounds apart idles 30% of the batch's request-rounds; a tree
    # whose requests finish together idles none. Per active request the chain is faster (3.7 tokens
    # in 1.3 ms against 3.7 in 1.5), for the batch the tree is: 2.85 x 0.7 < 2.47.
    tree = specpass.TreeShape(2, 3, 6)

    def timed(self, prompts, short, long, repeats=3, sampling=None):
        busy, ms = (1.0, 1.5) if self.k == tree else (0.7, 1.0 + 0.1 * self.k)
        rounds = 10
        return ms, Metrics(new_tokens=0, rounds=rounds, seconds=1.0, prefill_seconds=0.0, accept_length=0.0,
                           acceptance=[0.9] * 3, phase_ms={}, request_rounds=round(busy * rounds * len(prompts)))

    monkeypatch.setattr(Decoder, "round_ms", timed)
    dec = Decoder(target, ZooDrafter(zoo.build("tiny-llama-eagle3", seed=3)), k=1, max_batch=len(PROMPTS),
                  max_len=MAX_LEN + 6, compile="eager")
    choice = dec.tune_k(PROMPTS, (1, 3), acceptance=[0.9] * 3, new_tokens=(2, 6), repeats=1, trees=[tree])
    assert choice.k == dec.k == tree
    assert choice.tokens_per_ms[3] == pytest.approx(3.7 * 0.7 / 1.3) and choice.tokens_per_ms[tree] == pytest.approx(3.7 / 1.5)
    assert batch_busy([Metrics(0, 10, 1.0, 0.0, 0.0, [], {}, request_rounds=21)], [3]) == pytest.approx(0.7)


def test_tune_k_measures_acceptance_at_the_largest_k(target):
    dec = Decoder(target, drafter("copy", target), max_batch=len(PROMPTS), max_len=MAX_LEN, compile="eager")
    choice = dec.tune_k(PROMPTS, (1, 3), new_tokens=(2, 8), repeats=1)
    assert choice.acceptance == [1.0, 1.0, 1.0]  # the target's copy drafts its tokens: every draft accepted
    assert set(choice.tokens_per_ms) == {1, 2, 3} and choice.k == dec.k


def test_tune_k_pools_acceptance_over_more_prompts_than_max_batch(target):
    """At max_batch 1 tune_k takes three prompts: the rounds are timed on the first, the acceptance
    is every prompt's run at the largest K, weighted by its request-rounds (one prompt's acceptance
    is where its one trajectory goes)."""
    runs = [speculate(target, "noisy-copy", 3, [p], new=8).metrics for p in PROMPTS]
    assert len({tuple(m.acceptance) for m in runs}) > 1, "the prompts' acceptances must differ to tell them apart"
    total = sum(m.request_rounds for m in runs)
    want = [sum(m.acceptance[i] * m.request_rounds for m in runs) / total for i in range(3)]
    dec = Decoder(target, drafter("noisy-copy", target), max_batch=1, max_len=MAX_LEN, compile="eager")
    choice = dec.tune_k(PROMPTS, (1, 3), new_tokens=(2, 8), repeats=1, max_timings=0)
    assert choice.acceptance == pytest.approx(want, abs=1e-12) and choice.acceptance != runs[0].acceptance
    assert [m.request_rounds for m in runs] == [m.rounds for m in runs]  # one request each: every round active


def test_tune_k_times_and_measures_with_the_traffic_s_sampling(target):
    """sampling= reaches every generate tune_k runs: its acceptance is the sampled one (the
    largest K's run at that temperature and seed), not the greedy one."""
    sampling = dict(temperature=1.5, seed=7)
    want = speculate(target, "noisy-copy", 3, new=8, **sampling).metrics.acceptance
    assert want != speculate(target, "noisy-copy", 3, new=8).metrics.acceptance, "must differ from greedy"
    dec = Decoder(target, drafter("noisy-copy", target), max_batch=len(PROMPTS), max_len=MAX_LEN, compile="eager")
    choice = dec.tune_k(PROMPTS, (1, 3), new_tokens=(2, 8), repeats=1, max_timings=0, sampling=sampling)
    assert choice.acceptance == pytest.approx(want, abs=1e-12)
    with pytest.raises(ValueError, match="sampling must be None or a mapping of generate's temperature"):
        dec.tune_k(PROMPTS, (1, 3), sampling={"temp": 1.0})


def test_tune_k_compiles_one_prefill_for_every_k(target):
    """A chain drafter's prefill does not read K: the K that tune_k times share one compiled
    prefill; compile_prefill=False compiles none (a benchmark of the rounds alone)."""
    want = [t[:6] for t in greedy(target).tokens]
    for compile_prefill, graphs in ((True, 3), (False, 2)):
        backend = GraphCounter()
        dec = Decoder(target, drafter("tiny-llama-eagle3", target), k=2, max_batch=3, max_len=MAX_LEN,
                      compile=backend, fused_round=True, compile_prefill=compile_prefill)
        dec.tune_k(PROMPTS, (1, 3), new_tokens=(2, 6), repeats=1, max_timings=0)
        dec.use_k(3)  # timed, compiled: the K it chose may be the priced, untimed K 2 (host timing decides)
        assert dec.generate(PROMPTS, 6).tokens == want
        assert backend.graphs == graphs, compile_prefill  # the round at K 1 and at K 3, the prefill once or not
    with pytest.raises(ValueError, match="compile_prefill must be True or False"):
        Decoder(target, None, max_batch=3, max_len=MAX_LEN, compile_prefill="no")


def test_tune_k_bad_input(target):
    with pytest.raises(ValueError, match="no K to tune"):
        Decoder(target, None, max_batch=3, max_len=MAX_LEN, compile="eager").tune_k(PROMPTS)
    dec = Decoder(target, drafter("copy", target), k=2, max_batch=3, max_len=MAX_LEN, compile="eager")
    for ks in [(4,), (3, 3), (0, 2), (2.0, 4)]:
        with pytest.raises(ValueError, match="two or more different K >= 1"):
            dec.tune_k(PROMPTS, ks)
    with pytest.raises(ValueError, match=r"acceptance must list.*\[0, 1\]"):
        dec.tune_k(PROMPTS, acceptance=[0.5, 1.5])
    with pytest.raises(ValueError, match="short < long"):
        dec.tune_k(PROMPTS, new_tokens=(8, 8))
    with pytest.raises(ValueError, match="max_timings .* int >= 0"):
        dec.tune_k(PROMPTS, max_timings=-1)
    with pytest.raises(ValueError, match="tuning at K = 8: prompt 1 .* raise max_len"):
        dec.tune_k(PROMPTS, (2, 8), new_tokens=(2, NEW))
    assert dec.k == 2  # a refused tuning leaves K as it was

"""Steps compiled in the background (specpass/loop/background.py, `Decoder(background_compile=True)`):
the call decodes with the steps uncompiled until their compile lands, then switches between rounds.
Greedy tokens equal plain greedy decoding's through a switch forced mid-generation (chain apart and
fused, tree, parallel and block rounds); the sampled distribution across the switch passes the
chi-square test of tests/test_sampling.py; the worker's order, context and shutdown; a step
waiting out torch.fx's process-wide patch; bad options."""

from __future__ import annotations

import contextvars
import threading

import pytest
import torch

import specpass
from models import zoo
from models.drafters import ZooDrafter, adapt
from specpass.loop import Decoder, TreeShape, background, checks, round_shape
from tests.test_sampling import ALPHA, NEW as SAMPLED_NEW, PROMPT as SAMPLED_PROMPT, TARGET as SAMPLED_TARGET
from tests.test_sampling import _drafter, reference, two_sample

PROMPTS = [[3, 14, 15], [9, 2, 6, 5, 35, 89, 79, 32, 38], [46]]
NEW = 24
BACKEND = specpass.backend(handoff="eager")  # Dynamo and the passes, not Inductor: the switch is what is tested


@pytest.fixture(scope="module")
def target():
    return zoo.build("tiny-llama", seed=0)


@pytest.fixture(scope="module")
def plain(target):
    return Decoder(target, None, max_batch=3, max_len=96, compile="eager").generate(PROMPTS, NEW).tokens


def drafter(shape, target):
    if shape == "block":
        return zoo.build("tiny-llama-dflash", seed=4, target=target), 3
    if shape == "parallel":
        return adapt(zoo.build("tiny-llama-peagle3", seed=3)), 3
    return ZooDrafter(zoo.build("tiny-llama-eagle3", seed=3)), (TreeShape(2, 3, 6) if shape == "tree" else 3)


def round_step(dec):
    """The step that runs the round's target forward: the fused round, or the verify apart."""
    bound = dec._bound[dec.k]
    return bound.apart.verify if bound.apart is not None else bound.round.run_round


def switching_at(dec, switch):
    """-> (on_round, compiled): on_round waits for the compile after round `switch`; compiled[i]: whether
    the round step's last call (the prefill's for i = 0, round i's after) ran compiled."""
    compiled = []

    def on_round(state):
        compiled.append(round_step(dec).last is not None)
        if len(compiled) == switch + 1:
            dec.wait_compiled()

    return on_round, compiled


@pytest.mark.parametrize("shape,fused", [("chain", False), ("chain", True), ("tree", True), ("parallel", True),
                                         ("block", True)], ids=["chain-apart", "chain", "tree", "parallel", "block"])
def test_greedy_tokens_equal_plain_greedy_through_the_switch(target, plain, shape, fused):
    model, k = drafter(shape, target)
    dec = Decoder(target, model, k=k, max_batch=3, max_len=96, compile=BACKEND, fused_round=fused,
                  background_compile=True)
    on_round, compiled = switching_at(dec, switch=2)
    assert dec.generate(PROMPTS, NEW, on_round=on_round).tokens == plain
    assert compiled[:3] == [False] * 3 and len(compiled) > 4 and all(compiled[3:]), compiled
    assert dec._bound[k].prefill.last is None  # ran uncompiled; its compile landed with the round's

    again = dec.generate(PROMPTS, NEW)  # every step compiled, the prefill too
    assert again.tokens == plain
    assert dec._bound[k].prefill.last is not None and round_step(dec).last is not None


def test_sampled_distribution_across_the_switch():
    n, case = 20_000, "eagle-t1"
    sampling_target = zoo.build(SAMPLED_TARGET, seed=0)
    max_len = round_shape(_drafter("eagle")).cache_slots(len(SAMPLED_PROMPT), SAMPLED_NEW, 2) + 1
    dec = Decoder(sampling_target, _drafter("eagle"), k=2, max_batch=n, max_len=max_len, compile=BACKEND,
                  background_compile=True)
    on_round, compiled = switching_at(dec, switch=1)
    out = dec.generate([SAMPLED_PROMPT] * n, SAMPLED_NEW, seed=11, temperature=1.0, on_round=on_round)
    assert compiled == [False, False, True], compiled  # round 1 uncompiled, round 2 compiled
    assert 0.05 < out.metrics.acceptance[0] < 0.95, out.metrics  # requests that need round 2, and some that do not
    stat, df, p = two_sample(torch.tensor(out.tokens), reference(sampling_target, n, case))
    assert p > ALPHA, f"chi-square {stat:.1f} on {df} df, p = {p:.2e} <= α = {ALPHA:.1e}"


def test_the_worker_runs_the_rounds_first_under_the_caller_s_state():
    worker, ran = background.Worker(), []
    flag = contextvars.ContextVar("flag", default="unset")
    flag.set("caller's")
    with worker.holding():
        with torch.no_grad():
            jobs = [worker.submit(lambda name=name: ran.append((name, torch.is_grad_enabled(), flag.get())), priority)
                    for name, priority in (("prefill", 1), ("round", 0), ("draft", 0))]
        assert ran == []  # held: nothing starts
    for job in jobs:
        job.result(timeout=60)
    assert ran == [("round", False, "caller's"), ("draft", False, "caller's"), ("prefill", False, "caller's")]


def test_wait_inside_a_hold_runs_the_held_jobs_and_errors_reach_the_caller():
    worker = background.Worker()
    with worker.holding():
        failing = worker.submit(lambda: 1 / 0, 0)
        worker.wait()  # the hold does not keep a waiter waiting
    with pytest.raises(ZeroDivisionError):
        failing.result()


def test_stop_drops_the_queued_jobs_and_waits_for_the_running_one():
    worker, started, release = background.Worker(), threading.Event(), threading.Event()
    running = worker.submit(lambda: (started.set(), release.wait(60)), 0)
    queued = worker.submit(lambda: "ran", 0)
    started.wait(60)
    threading.Timer(0.2, release.set).start()
    worker.stop()
    assert running.done() and queued.cancelled()


def test_an_uncompiled_step_waits_out_a_tracer_on_another_thread():
    """torch.fx patches nn.Module.__call__ for the whole process while it traces: a module called
    meanwhile on another thread is refused; `background.uncompiled` runs the step once the worker's
    trace is done."""
    inside, release = threading.Event(), threading.Event()

    class Blocking(torch.nn.Module):  # traced on the worker, as a compile traces a step
        def forward(self, x):
            inside.set()
            release.wait(60)
            return x + 1

    tracing = background.worker.submit(lambda: torch.fx.symbolic_trace(Blocking()), 0)
    inside.wait(60)
    layer = torch.nn.Linear(3, 3)
    x = torch.ones(1, 3)
    with torch.no_grad():
        want = torch.nn.functional.linear(x, layer.weight, layer.bias) * 2
        with pytest.raises(NameError, match="not installed as a submodule"):
            layer(x)  # what an uncompiled step meets while the tracer is patched in
        threading.Timer(0.2, release.set).start()
        got = background.uncompiled(lambda x: layer(x) * 2, (x,))
    tracing.result(60)
    torch.testing.assert_close(got, want)


def test_bad_background_options_are_named(target):
    with pytest.raises(ValueError, match="background_compile must be True or False"):
        Decoder(target, None, max_batch=2, max_len=16, background_compile="yes")
    with pytest.raises(ValueError, match="background_compile=True with exact=True is not supported"):
        Decoder(target, None, max_batch=2, max_len=16, background_compile=True, exact=True)
    with pytest.raises(ValueError, match=r"background_compile=True with group= \(tensor parallel\)"):
        checks.check_background(True, False, object())

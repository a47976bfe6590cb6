"""The backend: its three spellings, option handling, logging, and every fallback path."""

import logging
import pathlib
import re
import subprocess
import sys
import warnings

import pytest
import torch

import specpass
from models.toy import ToyDraft
from specpass import pipeline
from specpass.graph import emit
from specpass.loop.compiling import SymbolicBatch, compiler
from specpass.report import Finding, collecting_reports

aten = torch.ops.aten


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # CI has no GPU; the GPU machine runs both


def _toy(batch=2, T=4, device="cpu"):
    torch.manual_seed(0)
    model = ToyDraft(batch=batch).eval().to(device)
    return model, torch.randint(0, 64, (batch, T), device=device), torch.arange(T, device=device)


def _run(model, backend, tokens, positions, **compile_kwargs):
    """Output and KV cache contents after one call, starting from an empty cache."""
    model.k_cache.zero_()
    model.v_cache.zero_()
    fn = model if backend is None else torch.compile(model, backend=backend, **compile_kwargs)
    with torch.no_grad():
        out = fn(tokens, positions)
    return out, model.k_cache.clone(), model.v_cache.clone()


def _assert_same(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def silu_to_sigmoid(gm, options):
    """A tiny real rewrite for plumbing tests: silu(x) -> x * sigmoid(x)."""
    findings = []
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.silu.default)):
        with gm.graph.inserting_before(node):
            sig = emit(gm.graph, aten.sigmoid.default, (node.args[0],))
            mul = emit(gm.graph, aten.mul.Tensor, (node.args[0], sig))
        node.replace_all_uses_with(mul)
        findings.append(Finding("silu", node.name, True, "silu -> x * sigmoid(x)"))
    return findings


def broken_pass(gm, options):
    raise RuntimeError("injected failure")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("handoff", ["eager", "inductor"])
@pytest.mark.parametrize("form", ["module", "entry_point", "factory"])
def test_backend_forms_match_eager(form, handoff, device):
    model, tokens, positions = _toy(device=device)
    backend = {"module": specpass, "entry_point": "specpass", "factory": specpass.backend(handoff=handoff)}[form]
    options = {"handoff": handoff} if form != "factory" else None
    expected = _run(model, None, tokens, positions)
    _assert_same(_run(model, backend, tokens, positions, options=options), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("given, handed", [
    (dict(mode="reduce-overhead"), ("reduce-overhead", None)),
    (dict(options={"epilogue_fusion": False, "q_slice": False}), (None, {"epilogue_fusion": False})),
], ids=["mode", "options"])
@pytest.mark.parametrize("form", ["module", "entry_point", "factory"])
def test_mode_and_options_are_handed_to_inductor(form, given, handed, device, monkeypatch):
    """torch.compile's mode= and options= reach Inductor's own wrapper (which makes
    mode="reduce-overhead" CUDA graphs); a specpass option among options= (q_slice) configures
    the passes and is not handed on."""
    from specpass import compile_backend

    wrappers, ran_with = [], []

    class InductorSpy(torch._TorchCompileInductorWrapper):
        def __init__(self, mode, options, dynamic):
            wrappers.append((mode, options))
            super().__init__(mode, options, dynamic)

    def run_passes(gm, options):
        ran_with.append(options.q_slice)
        return pipeline.run_passes(gm, options)

    monkeypatch.setattr(torch, "_TorchCompileInductorWrapper", InductorSpy)
    monkeypatch.setattr(compile_backend, "run_passes", run_passes)
    model, tokens, positions = _toy(device=device)
    backend = {"module": specpass, "entry_point": "specpass", "factory": specpass.backend()}[form]
    expected = _run(model, None, tokens, positions)
    torch._dynamo.reset()
    for _ in range(3):  # CUDA graphs: recorded, then replayed
        got = _run(model, backend, tokens, positions, **given)
        _assert_same(got, expected)
    assert wrappers == [handed], wrappers  # one graph, compiled once
    assert ran_with == [given.get("options", {}).get("q_slice", True)], ran_with


def test_exact_in_compile_options_turns_off_what_it_forbids(monkeypatch):
    """options={"exact": True} on a default backend: exact mode, with split_kv, gemv and gemv_group
    off (their defaults are no choice of the user's to clash with)."""
    from specpass import compile_backend

    ran_with = []

    def run_passes(gm, options):
        ran_with.append((options.exact, options.split_kv, options.gemv, options.gemv_group))
        return pipeline.run_passes(gm, options)

    monkeypatch.setattr(compile_backend, "run_passes", run_passes)
    fn = torch.compile(lambda x: (x * 2).sum(-1), backend=specpass.backend(handoff="eager"), options={"exact": True})
    torch.testing.assert_close(fn(torch.ones(3, 4)), torch.full((3,), 8.0))
    assert ran_with == [(True, False, False, False)], ran_with


@pytest.mark.parametrize("compile_kwargs,replayed", [
    ({}, False), ({"mode": "max-autotune-no-cudagraphs"}, False),
    ({"mode": "reduce-overhead"}, True), ({"options": {"triton.cudagraphs": True}}, True)])
def test_gemv_runs_only_where_cuda_graphs_replay_the_step(monkeypatch, compile_kwargs, replayed):
    """gemv and gemv_group launch their kernels through a library op, whose host time a call outweighs
    the kernel's saving unless a CUDA graph replays the step: torch.compile's mode and options decide,
    and the report of a CUDA step (here the inputs taken for CUDA ones) says why they were off."""
    from specpass import compile_backend

    monkeypatch.setattr(compile_backend, "_has_cuda_inputs", lambda example_inputs: True)
    ran_with = []

    def run_passes(gm, options):
        ran_with.append((options.gemv, options.gemv_group))
        return pipeline.run_passes(gm, options)

    monkeypatch.setattr(compile_backend, "run_passes", run_passes)
    fn = torch.compile(lambda x: (x * 2).sum(-1), backend=specpass.backend(handoff="eager"), **compile_kwargs)
    with collecting_reports() as reports:
        torch.testing.assert_close(fn(torch.ones(3, 4)), torch.full((3,), 8.0))
    assert ran_with == [(replayed, replayed)], ran_with
    [(_, report)] = reports
    notes = [n for n in report.notes if n.startswith("gemv and gemv_group off: no CUDA graph replays this step")]
    assert len(notes) == (not replayed), report.notes


def test_a_cpu_step_notes_nothing_of_gemv():
    """The GEMV pass runs on CUDA only: a CPU step's report has no note of it being off."""
    fn = torch.compile(lambda x: (x * 2).sum(-1), backend=specpass.backend(handoff="eager"))
    with collecting_reports() as reports:
        fn(torch.ones(3, 4))
    [(_, report)] = reports
    assert not any("gemv" in n for n in report.notes), report.notes


@pytest.mark.parametrize("switch,key", [("pdl", "triton.enable_pdl"), ("coordinate_descent", "coordinate_descent_tuning")])
def test_switches_turn_on_inductor_options(monkeypatch, switch, key):
    """pdl=True hands Inductor `triton.enable_pdl` (which it emits on sm90 and newer), and
    coordinate_descent=True its `coordinate_descent_tuning`, unless the user's own options= set
    it; off by default."""
    handed = []

    class InductorSpy(torch._TorchCompileInductorWrapper):
        def __init__(self, mode, options, dynamic):
            handed.append(options)
            super().__init__(mode, options, dynamic)

    monkeypatch.setattr(torch, "_TorchCompileInductorWrapper", InductorSpy)
    model, tokens, positions = _toy()
    for backend, options in [(specpass.backend(**{switch: True}), None), (specpass.backend(), None),
                             (specpass.backend(**{switch: True}), {key: False})]:
        torch._dynamo.reset()
        _run(model, backend, tokens, positions, options=options)
    assert handed == [{key: True}, None, {key: False}], handed


def test_inductor_options_are_forwarded_and_validated():
    model, tokens, positions = _toy()
    with pytest.raises(Exception, match="not_an_inductor_option"):
        _run(model, specpass, tokens, positions, options={"not_an_inductor_option": 1})


def test_unknown_option_lists_valid_ones():
    with pytest.raises(TypeError, match=r"unknown specpass option\(s\) \['qslice'\].*q_slice"):
        specpass.backend(qslice=False)
    with pytest.raises(TypeError, match="live_rows"):
        specpass.rewrite(specpass.capture(*_toy()), livE_rows=False)


def test_bad_option_values():
    with pytest.raises(ValueError, match="handoff= must be one of"):
        specpass.backend(handoff="tvm")
    with pytest.raises(ValueError, match="max_probs= must be one of"):
        specpass.backend(max_probs="approx")
    with pytest.raises(ValueError, match="q_slice= must be True or False"):
        specpass.backend(q_slice="no")


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="torch_dynamo_backends") if ep.name == "specpass"]
    assert ep.load() is specpass.default_backend


def test_pass_failure_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(pipeline, "PASSES", [("live_rows", broken_pass)])
    model, tokens, positions = _toy()
    expected = _run(model, None, tokens, positions)
    with pytest.warns(specpass.SpecpassWarning, match="pass live_rows failed .*injected failure") as record:
        got = _run(model, specpass.backend(handoff="eager"), tokens, positions)
    assert len([w for w in record if issubclass(w.category, specpass.SpecpassWarning)]) == 1
    _assert_same(got, expected)


def test_pipeline_failure_before_any_pass_falls_back(monkeypatch):
    """The pipeline's own preparation of the graph (clean-up, fake propagation) failing must not
    break the model either."""
    def failing(gm, kept):
        raise RuntimeError("injected propagation failure")

    monkeypatch.setattr(pipeline, "propagate_fake_tensors", failing)
    model, tokens, positions = _toy()
    expected = _run(model, None, tokens, positions)
    with pytest.warns(specpass.SpecpassWarning, match="could not prepare this graph .*injected propagation failure"):
        got = _run(model, specpass.backend(handoff="eager"), tokens, positions)
    _assert_same(got, expected)


def test_pass_switched_off_by_name(monkeypatch):
    monkeypatch.setattr(pipeline, "PASSES", [("live_rows", broken_pass)])
    model, tokens, positions = _toy()
    with warnings.catch_warnings():
        warnings.simplefilter("error", specpass.SpecpassWarning)
        _run(model, specpass.backend(handoff="eager", live_rows=False), tokens, positions)


def _stub_inductor(monkeypatch, fails_on=None) -> list:
    """Replace Inductor by a stub that records each graph handed to it (and runs it as is),
    raising on graphs that contain the op `fails_on`."""
    compiled = []

    class StubInductor:
        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, gm, example_inputs):
            compiled.append(gm)
            if any(n.target is fails_on for n in gm.graph.nodes):
                raise RuntimeError("codegen failed")
            return gm

    monkeypatch.setattr(torch, "_TorchCompileInductorWrapper", StubInductor)
    return compiled


def test_inductor_failure_on_rewritten_graph_falls_back(monkeypatch):
    monkeypatch.setattr(pipeline, "PASSES", [("live_rows", silu_to_sigmoid)])
    compiled = _stub_inductor(monkeypatch, fails_on=aten.sigmoid.default)
    model, tokens, positions = _toy()
    expected = _run(model, None, tokens, positions)
    with pytest.warns(specpass.SpecpassWarning, match="compiling the rewritten graph failed"):
        got = _run(model, specpass, tokens, positions)
    _assert_same(got, expected)
    assert len(compiled) == 2 and any(n.target is aten.silu.default for n in compiled[1].graph.nodes)


def test_report_is_logged(monkeypatch, caplog):
    monkeypatch.setattr(pipeline, "PASSES", [("live_rows", silu_to_sigmoid)])
    model, tokens, positions = _toy()
    with caplog.at_level(logging.INFO, logger="specpass"):
        _run(model, specpass.backend(handoff="eager"), tokens, positions)
    assert "[silu] rewrote silu: silu -> x * sigmoid(x)" in caplog.text
    (record,) = [r for r in caplog.records if hasattr(r, "report")]
    assert record.report.rewrites[0].where == "silu"
    assert list(record.report.seconds)[0] == "capture" and "live_rows/rewrite" in record.report.seconds
    assert "\n  specpass seconds: capture " in record.getMessage()


def test_compiling_a_step_logs_its_name_and_seconds(caplog):
    wrap = compiler(specpass.backend(handoff="eager"), mode=None, batch=SymbolicBatch())
    step = wrap(lambda x: torch.softmax(x @ x.T, -1).max(-1).indices, "decode_round")
    with caplog.at_level(logging.INFO, logger="specpass"):
        step(torch.randn(3, 4))
    messages = [r.getMessage() for r in caplog.records]
    assert re.fullmatch(r"specpass: compiling decode_round \(\d+ nodes\)", messages[0]), messages
    assert re.fullmatch(r"specpass: compiled decode_round in \d+\.\d s", messages[-1]), messages


def test_specpass_log_prints_report_to_stderr():
    code = (
        "import torch, specpass\n"
        "from models.toy import ToyDraft\n"
        "m = ToyDraft().eval()\n"
        "with torch.no_grad():\n"
        "    torch.compile(m, backend=specpass.backend(handoff='eager'))(torch.zeros(2, 3, dtype=torch.long), torch.arange(3))\n"
    )
    env = {"SPECPASS_LOG": "1", "PATH": ""}
    repo = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=repo, check=True)
    assert "specpass:" in done.stderr and "graph matmul FLOPs" in done.stderr


def test_compiled_graph_keeps_dynamo_input_metadata(monkeypatch):
    """AOTAutograd reads Dynamo's input sources to keep buffers (the KV cache) static under CUDA
    graphs; the graph specpass hands to Inductor must carry them like Dynamo's own graph."""
    seen = _stub_inductor(monkeypatch)
    model, tokens, positions = _toy()
    _run(model, specpass, tokens, positions)
    (gm,) = seen
    assert "dynamo_compile_id" in gm.meta
    inputs = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
    assert all(getattr(n, "_dynamo_source", None) is not None for n in inputs.values())
    assert inputs["k_cache"].meta["tensor_dict"]["_dynamo_static_input_type"]
    assert not inputs["tokens"].meta.get("tensor_dict", {}).get("_dynamo_static_input_type")


def test_inductor_receives_what_plain_inductor_receives(monkeypatch):
    """AOTAutograd must hand Inductor the same inputs for specpass's graph as for Dynamo's own:
    static inputs (parameters, KV cache: no copy per CUDA-graph replay), mutated inputs (all of
    them static, or cudagraph trees skip the graph) and output aliasing (runtime wrappers)."""
    import torch._inductor.compile_fx as compile_fx

    seen = []
    inner = compile_fx._compile_fx_inner

    def spy(gm, example_inputs, *args, **kwargs):
        meta = torch._guards.TracingContext.get().fw_metadata
        seen.append(dict(inputs=len(example_inputs), static=list(kwargs.get("static_input_idxs", ())),
                         mutated=[i for i, m in enumerate(meta.input_info) if m.mutates_data or m.mutates_metadata],
                         outputs=[o.output_type for o in meta.output_info]))
        return inner(gm, example_inputs, *args, **kwargs)

    monkeypatch.setattr(compile_fx, "_compile_fx_inner", spy)
    model, tokens, positions = _toy()
    # Cache hits would skip the compile this test watches.
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        for backend in ("inductor", specpass):
            torch._dynamo.reset()
            _run(model, backend, tokens, positions)
    plain, ours = seen
    assert ours == plain
    assert plain["mutated"] and set(plain["mutated"]) <= set(plain["static"])

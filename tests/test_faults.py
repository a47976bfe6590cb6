"""Fault injection: each pass, a row rule, capture, the pipeline's preparation, the report and the
handoff to Inductor are made to fail in turn. Each time the user's step still runs and equals
eager, with exactly one warning that names what failed and why."""

import importlib
import logging
import warnings

import pytest
import torch

import specpass
from models.toy import ToyDraft
from specpass import pipeline, report
from specpass.graph import emit
from specpass.passes.row_rules import engine as rule_engine
from specpass.report import Finding

aten = torch.ops.aten
backend_module = importlib.import_module("specpass.compile_backend")


def _step():
    """The toy draft, grouped-query, with a greedy tail: every pass fires on it but split_kv (CUDA only)."""
    torch.manual_seed(0)
    model = ToyDraft(kv_heads=2).eval()

    def step(tokens, positions):
        return torch.softmax(model(tokens, positions), -1).max(-1)

    return model, step, torch.randint(0, 64, (2, 4)), torch.arange(4)


def _run_with_warnings(backend, **compile_kwargs):
    """(eager result, compiled result, caches of each, the SpecpassWarnings raised)."""
    model, step, tokens, positions = _step()
    with torch.no_grad():
        want = step(tokens, positions)
        want_caches = [model.k_cache.clone(), model.v_cache.clone()]
        model.k_cache.zero_(), model.v_cache.zero_()
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = torch.compile(step, backend=backend, **compile_kwargs)(tokens, positions)
    torch.testing.assert_close(tuple(got), tuple(want), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close([model.k_cache, model.v_cache], want_caches, rtol=1e-5, atol=1e-6)
    return [str(w.message) for w in caught if issubclass(w.category, specpass.SpecpassWarning)]


def raising(gm, options):
    raise RuntimeError("injected failure")


def shrinking(run):
    """The real pass, then an output narrowed: breaks the outputs invariant."""
    def bad(gm, options):
        findings = run(gm, options)
        out = gm.graph.output_node()
        first = out.args[0][0]
        with gm.graph.inserting_before(out):
            narrowed = emit(gm.graph, aten.slice.Tensor, (first, 0, 0, 1))
        out.args = ((narrowed, *out.args[0][1:]),)
        return findings
    return bad


def writing_elsewhere(run):
    """The real pass, then the V write sent to the K cache: breaks the written-buffers invariant."""
    def bad(gm, options):
        findings = run(gm, options)
        k_write, v_write = [n for n in gm.graph.nodes if n.target is aten.index_copy_.default]
        v_write.args = (k_write.args[0], *v_write.args[1:])
        return findings
    return bad


def reporting_twice(run):
    """The real pass, then two verdicts on one node (a pass may have reported none)."""
    def bad(gm, options):
        findings = run(gm, options)
        node = next(iter(gm.graph.nodes)).name
        return findings + [Finding("fault", node, False, "again")] * 2
    return bad


ON_BY_DEFAULT = [(passes, name) for passes in ("PASSES", "AFTER_BODIES") for name, _ in getattr(pipeline, passes)
                 if getattr(specpass.Options(), name)]  # exact: below


@pytest.mark.parametrize("passes,name", ON_BY_DEFAULT)
@pytest.mark.parametrize("fault,cause", [
    (lambda run: raising, "RuntimeError: injected failure"),
    (shrinking, "outputs changed"),
    (writing_elsewhere, "the in-place writes changed"),
    (reporting_twice, "twice"),
])
def test_a_failing_pass_is_dropped_and_the_others_still_apply(monkeypatch, passes, name, fault, cause):
    _, step, tokens, positions = _step()
    fired = {f.pass_name for f in specpass.rewrite(specpass.capture(step, tokens, positions)).report.rewrites}
    assert fired == {"argmax", "live_rows", "gqa"}  # split_kv rewrites CUDA graphs only; no region calls, one mask reader
    monkeypatch.setattr(pipeline, passes, [(n, fault(run) if n == name else run) for n, run in getattr(pipeline, passes)])
    # As CUDA graphs would replay it, so that every pass on by default runs (gemv's only run so).
    (message,) = _run_with_warnings(specpass.backend(handoff="eager"), mode="reduce-overhead")
    assert f"pass {name}" in message and cause in message, message
    _, step, tokens, positions = _step()
    result = specpass.rewrite(specpass.capture(step, tokens, positions)).report
    assert result.errors == [message]
    assert {f.pass_name for f in result.rewrites} == fired - {name}


@pytest.mark.parametrize("fault,cause", [(lambda run: raising, "RuntimeError: injected failure"),
                                         (shrinking, "outputs changed")])
def test_in_exact_mode_a_failing_exact_pass_refuses_the_step_instead(monkeypatch, fault, cause):
    """The exact pass dropped would leave sums in row-dependent orders: the step is refused, not run."""
    monkeypatch.setattr(pipeline, "PASSES", [(n, fault(run) if n == "exact" else run) for n, run in pipeline.PASSES])
    _, step, tokens, positions = _step()
    torch._dynamo.reset()
    with pytest.raises(Exception, match=f"exact mode cannot make .* row-invariant: pass exact failed .*{cause}") as exc:
        with torch.no_grad():
            torch.compile(step, backend=specpass.backend(exact=True, handoff="eager"))(tokens, positions)
    assert isinstance(exc.value.__cause__ or exc.value.inner_exception, specpass.ExactModeError)


def test_a_failing_rule_drops_the_live_row_pass(monkeypatch):
    def rule(node, spec, options):
        raise ValueError("injected rule failure")

    monkeypatch.setattr(rule_engine, "_RULES", dict(rule_engine._RULES) | {aten.linear.default: rule})
    (message,) = _run_with_warnings(specpass.backend(handoff="eager"))
    assert "pass live_rows failed (ValueError: injected rule failure)" in message, message


def test_a_capture_failure_compiles_the_step_unrewritten(monkeypatch):
    def to_aten_ir(gm, example_inputs):
        raise RuntimeError("injected capture failure")

    monkeypatch.setattr(backend_module, "to_aten_ir", to_aten_ir)
    (message,) = _run_with_warnings(specpass.backend(handoff="eager"))
    assert "could not capture this graph (RuntimeError: injected capture failure)" in message, message


def test_a_preparation_failure_compiles_the_step_unrewritten(monkeypatch):
    def adopt(dynamo_gm, aten_gm):
        raise RuntimeError("injected metadata failure")

    monkeypatch.setattr(backend_module, "adopt_dynamo_inputs", adopt)
    (message,) = _run_with_warnings(specpass.backend(handoff="eager"))
    assert "could not prepare this graph (RuntimeError: injected metadata failure)" in message, message


def test_a_report_that_cannot_be_printed_does_not_stop_the_rewrite(monkeypatch, caplog):
    def text(self):
        raise TypeError("injected formatting failure")

    monkeypatch.setattr(report.Report, "__str__", text)
    with caplog.at_level(logging.INFO, logger="specpass"):  # the report is formatted when logged
        (message,) = _run_with_warnings(specpass.backend(handoff="eager"))
    assert "could not log its report (TypeError: injected formatting failure)" in message, message


def test_an_inductor_failure_on_the_rewritten_graph_compiles_it_unrewritten(monkeypatch):
    compiled = []

    class Inductor:  # fails on any graph specpass rewrote (it has fewer matmul rows), runs others
        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, gm, example_inputs):
            compiled.append(gm)
            if len(compiled) == 1:
                raise RuntimeError("injected codegen failure")
            return gm

    monkeypatch.setattr(torch, "_TorchCompileInductorWrapper", Inductor)
    (message,) = _run_with_warnings(specpass)
    assert "compiling the rewritten graph failed (RuntimeError: injected codegen failure)" in message, message
    assert len(compiled) == 2


def test_an_inductor_failure_on_the_ir_compiles_dynamo_s_own_graph(monkeypatch):
    """Inductor fails on the IR, rewritten or not (a layout its trace of the IR sees otherwise), and
    takes Dynamo's graph, as torch.compile hands it: the step compiles, without rewrites, reported."""
    compiled = []

    class Inductor:  # fails on the IR (ATen ops), runs Dynamo's graph (torch functions)
        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, gm, example_inputs):
            ir = any(isinstance(n.target, torch._ops.OpOverload) for n in gm.graph.nodes)
            compiled.append("IR" if ir else "Dynamo's")
            if ir:
                raise RuntimeError("injected failure on the IR")
            return gm

    monkeypatch.setattr(torch, "_TorchCompileInductorWrapper", Inductor)
    (message,) = _run_with_warnings(specpass)
    assert "compiling the rewritten graph failed (RuntimeError: injected failure on the IR)" in message, message
    assert compiled == ["IR", "IR", "Dynamo's"]


@pytest.mark.parametrize("where, cause", [("to_aten_ir", "could not capture this graph"),
                                          ("adopt_dynamo_inputs", "could not prepare this graph"),
                                          ("_TorchCompileInductorWrapper", "compiling the rewritten graph failed")])
def test_a_step_compiled_unrewritten_is_reported_once_with_why(monkeypatch, where, cause):
    """What `collecting_reports` gets (specpass.generate's `rewrites`): one report for the step, whose
    `fallback` says why; the rewrites it lists, if any, are of a graph that does not run."""
    def failing(*args, **kwargs):
        raise RuntimeError("injected failure")

    if where == "_TorchCompileInductorWrapper":  # Inductor fails on the rewritten graph, compiles the one after it
        calls = []

        def failing(*args, **kwargs):  # noqa: F811
            calls.append(args)
            if len(calls) == 1:
                raise RuntimeError("injected failure")
            return args[0]

        monkeypatch.setattr(torch, where, lambda *args, **kwargs: failing)
    else:
        monkeypatch.setattr(backend_module, where, failing)
    with report.collecting_reports() as reports:
        (message,) = _run_with_warnings(specpass if where == "_TorchCompileInductorWrapper" else
                                        specpass.backend(handoff="eager"))
    assert [(step, r.fallback) for step, r in reports] == [("step", message)], reports
    assert cause in message and "injected failure" in message, message
    assert f"compiled without rewrites: {message}" in str(reports[0][1])


def test_dynamos_restart_signal_goes_back_to_dynamo(monkeypatch):
    """TensorifyScalarRestartAnalysis, raised inside a compile, asks Dynamo to trace the frame again
    with a float specialized: not a failure to compile unrewritten and warn about."""
    calls = []

    def to_aten_ir(gm, example_inputs):
        calls.append(gm)
        if len(calls) == 1:
            raise torch._dynamo.exc.TensorifyScalarRestartAnalysis()
        return capture(gm, example_inputs)

    capture = backend_module.to_aten_ir
    monkeypatch.setattr(backend_module, "to_aten_ir", to_aten_ir)
    with report.collecting_reports() as reports:
        assert _run_with_warnings(specpass.backend(handoff="eager")) == []
    assert len(calls) == 2 and [r.fallback for _, r in reports] == [None] and reports[0][1].rewrites


def test_a_step_cuda_graphs_cannot_capture_runs_again_without_them():
    """An op that reads a tensor to the host inside an opaque custom op fails a CUDA graph's capture,
    before any kernel of the step ran: the step runs again compiled without CUDA graphs (made only
    then), once warned and reported. Any other error is the step's own and propagates."""
    from specpass.loop.compiling import CaptureChecked

    calls = []

    def captured(x):
        calls.append("captured")
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU "
                           "tensor is pinned.")

    def without_graphs():
        calls.append("made")
        return lambda x: calls.append("without") or x + 1

    step = CaptureChecked(captured, without_graphs, "decode_round")
    assert calls == []
    with warnings.catch_warnings(record=True) as caught, report.collecting_reports() as reports:
        warnings.simplefilter("always")
        assert step(1) == 2 and step(2) == 3
    assert calls == ["captured", "made", "without", "without"]
    (warning,) = [w for w in caught if isinstance(w.message, specpass.SpecpassWarning)]
    assert "CUDA graphs cannot capture decode_round (Cannot copy between CPU and CUDA" in str(warning.message)
    assert [(name, r.notes) for name, r in reports] == [("decode_round", [str(warning.message)])]

    def broken(x):
        raise RuntimeError("The size of tensor a (3) must match the size of tensor b (4)")

    with pytest.raises(RuntimeError, match="size of tensor a"):
        CaptureChecked(broken, without_graphs, "verify")(1)

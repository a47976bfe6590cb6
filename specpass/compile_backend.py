"""The torch.compile backend: Dynamo graph -> IR -> passes -> Inductor (or eager).

Nothing here may break the user's model: a graph the IR cannot capture, a pass that fails, or
an Inductor failure on the rewritten graph all fall back to the unrewritten graph, with a
warning that says which and why, and a report that says so (`Report.fallback`). Dynamo's own
signals to trace again (`RestartAnalysis`: a float it must specialize) are Dynamo's, not failures.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
import re
import time
import warnings
from typing import Any, Callable

import torch
import torch._inductor.config as inductor_config
import torch.fx as fx

from specpass import compile_cache
from specpass.capture import adopt_dynamo_inputs, to_aten_ir
from specpass.graph import device_reads_to_host
from specpass.options import Options
from specpass.pipeline import RewriteResult, run_passes
from specpass.report import Report, log, log_report, log_to_stderr_if_asked



class SpecpassWarning(UserWarning):
    """specpass compiled a graph without (some of) its rewrites."""


class ExactModeError(RuntimeError):
    """Exact mode (`exact=True`) could not make a graph row-invariant: it is refused, never run inexactly."""


def backend(**options: Any) -> Callable[..., Callable]:
    """A torch.compile backend with these specpass options (see `specpass.Options`).

    torch.compile's `mode=` and `options=` are forwarded to Inductor; keys of `options=` that
    name specpass options configure specpass instead.
    """
    base = Options.make(**options)

    def specpass_backend(gm: fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                         options: dict[str, Any] | None = None) -> Callable:
        # A first compile takes a minute or more: say which step, and how long it took.
        log_to_stderr_if_asked()
        name, start = step_name(gm), time.perf_counter()
        log.info("specpass: compiling %s (%d nodes)", name, len(gm.graph.nodes))
        compiled = rewrite_and_hand_off(gm, example_inputs, mode, options, name)
        log.info("specpass: compiled %s in %.1f s", name, time.perf_counter() - start)
        return compiled

    def rewrite_and_hand_off(gm: fx.GraphModule, example_inputs: list[Any], mode: str | None,
                             options: dict[str, Any] | None, name: str) -> Callable:
        inductor_options = dict(options or {})
        ours = {k: inductor_options.pop(k) for k in list(inductor_options) if k in Options.names()}
        opts = Options.make(**{**base.chosen(), **ours}) if ours else base
        unreplayed = [] if _replayed(mode, inductor_options) else [s for s in _REPLAYED_ONLY if getattr(opts, s)]
        if unreplayed:
            opts = dataclasses.replace(opts, **dict.fromkeys(unreplayed, False))
        if opts.exact:  # each op's result rounded as eager rounds it, no fused multiply-add: fusions change no bits
            inductor_options.setdefault("emulate_precision_casts", True)
        for switch, key in _INDUCTOR_SWITCHES.items():
            if getattr(opts, switch) and _has_config(key):
                inductor_options.setdefault(key, True)
        as_asked = _handoff(opts.handoff, mode, inductor_options)
        replayed = _replayed(mode, inductor_options)

        def handoff(graph: fx.GraphModule, inputs: list[Any], report: Report | None = None) -> Callable:
            """To Inductor, with CUDA graphs where mode asks for them and the graph can be captured."""
            reads = device_reads_to_host(graph) if replayed and isinstance(graph, fx.GraphModule) else []
            if not reads:
                return as_asked(graph, inputs)
            if report is not None:
                report.notes.append(f"CUDA graphs off: {reads[0].name} reads a CUDA tensor to the host, which "
                                    "a CUDA graph cannot capture")
            without_graphs = {**torch._inductor.list_mode_options(mode or "default"), **inductor_options,
                              "triton.cudagraphs": False}
            return _handoff(opts.handoff, None, without_graphs)(graph, inputs)

        refuse = _refuse_inexact(name) if opts.exact else warn

        def fall_back(message: str, report: Report | None = None) -> None:
            """Warn (exact mode: refuse) and report the step compiled without rewrites."""
            refuse(message)
            log_report(dataclasses.replace(report or Report(), fallback=message), name)

        timer = Report()
        with timer.timed("cache/key"):
            cache_key = _cache_key(gm, example_inputs, opts)
        with timer.timed("cache/load"):
            result = _cached(cache_key)
        aten_gm = None  # the unrewritten IR: captured here, or on a cache hit only if Inductor needs it
        if result is None:
            start = time.perf_counter()
            try:
                aten_gm = to_aten_ir(gm, example_inputs)
            except Exception as exc:
                _reraise_restart(exc)
                fall_back(f"specpass could not capture this graph ({type(exc).__name__}: {exc}); "
                          "compiling it without rewrites")
                return handoff(gm, example_inputs)

            try:
                capture_seconds = time.perf_counter() - start
                result = run_passes(aten_gm, opts)
                if unreplayed and _has_cuda_inputs(example_inputs):  # elsewhere the pass has nothing to do anyway
                    result.report.notes.append(f"{' and '.join(unreplayed)} off: no CUDA graph replays this step "
                                               f"(mode={mode!r}); {_REPLAYED_ONLY_WHY}")
                result.report.seconds = {"capture": capture_seconds, **result.report.seconds}
                for compiled in (result.graph_module, aten_gm):
                    adopt_dynamo_inputs(gm, compiled)
            except Exception as exc:  # the pipeline's own checks failed on the unrewritten graph
                _reraise_restart(exc)
                fall_back(f"specpass could not prepare this graph ({type(exc).__name__}: {exc}); "
                          "compiling it without rewrites")
                return handoff(gm, example_inputs)
            with timer.timed("cache/store"):
                _store(cache_key, result)
        else:
            adopt_dynamo_inputs(gm, result.graph_module)
        if cache_key is not None:
            result.report.seconds.update(timer.seconds)
        if opts.exact:
            _check_exact(result.report, name)
        for error in result.report.errors:
            warn(error)
        try:
            compiled = handoff(result.graph_module, example_inputs, result.report)
        except Exception as exc:
            _reraise_restart(exc)
            if not result.report.rewrites:  # the IR as captured: Dynamo's own graph is all that is left to try
                return _handed_off_from_dynamo(handoff, gm, example_inputs, exc)
            fall_back(f"compiling the rewritten graph failed ({type(exc).__name__}: {exc}); "
                      "compiling it without rewrites", result.report)
            unrewritten = aten_gm if aten_gm is not None else _unrewritten(gm, example_inputs)
            try:
                return handoff(unrewritten, example_inputs)
            except Exception as again:
                _reraise_restart(again)
                if unrewritten is gm:
                    raise
                return _handed_off_from_dynamo(handoff, gm, example_inputs, again)
        try:
            log_report(result.report, name)
        except Exception as exc:  # a report that cannot be printed is a bug, not the model's problem
            warn(f"specpass could not log its report ({type(exc).__name__}: {exc}); the graph is compiled as rewritten")
        return compiled

    specpass_backend.options = base  # type: ignore[attr-defined]
    return specpass_backend


default_backend = backend()


def _reraise_restart(exc: Exception) -> None:
    """Dynamo's signal to trace the frame again (a float to specialize, say) goes back to Dynamo."""
    if isinstance(exc, torch._dynamo.exc.RestartAnalysis):
        raise exc


def _refuse_inexact(step: str) -> Callable[[str], None]:
    def refuse(message: str) -> None:
        raise ExactModeError(f"exact mode refuses {step}: {message.partition('; ')[0]}")
    return refuse


def _check_exact(report: Report, step: str) -> None:
    """Every candidate of the exact pass rewritten, and the pass kept: else the step is refused."""
    left = Counter(f.message for f in report.findings if f.pass_name == "exact" and not f.fired)
    left = [f"{message} ({n} node{'s' if n > 1 else ''})" for message, n in left.items()]
    dropped = [e for e in report.errors if "pass exact " in e]
    if left or dropped:
        raise ExactModeError(
            f"exact mode cannot make {step} row-invariant: " + "; ".join(left + dropped)
            + ". Run without exact=True, or write the model with ops exact mode routes (docs/loop.md, exact mode)")


def _cache_key(gm: fx.GraphModule, example_inputs: list[Any], options: Options) -> str | None:
    try:
        return compile_cache.key(gm, example_inputs, options)
    except Exception as exc:  # the cache is an optimization: never the reason a model does not compile
        warn(f"specpass could not key its compile cache ({type(exc).__name__}: {exc}); rewriting without it")
        return None


def _cached(cache_key: str | None) -> RewriteResult | None:
    if cache_key is None:
        return None
    try:
        result = compile_cache.load(cache_key)
    except compile_cache.UnusableEntry as exc:
        warn(f"specpass ignored a compile cache entry: {exc}; rewriting the graph again")
        return None
    except Exception as exc:
        warn(f"specpass could not read its compile cache ({type(exc).__name__}: {exc}); rewriting the graph again")
        return None
    if result is not None:
        log.info("specpass: rewrite loaded from the compile cache (key %s)", cache_key)
    return result


def _store(cache_key: str | None, result: RewriteResult) -> None:
    if cache_key is None:
        return
    try:
        if compile_cache.store(cache_key, result):
            log.info("specpass: rewrite stored in the compile cache (key %s)", cache_key)
    except Exception as exc:
        warn(f"specpass could not write its compile cache ({type(exc).__name__}: {exc}); the graph is compiled "
             "as rewritten")


def _handed_off_from_dynamo(handoff: Callable, gm: fx.GraphModule, example_inputs: list[Any],
                            failure: Exception) -> Callable:
    """Dynamo's graph handed off as torch.compile hands it to Inductor, where Inductor failed on the
    IR of it: a layout the IR's trace fixed (a `.contiguous()` it saw as a no-op) can differ in
    AOTAutograd's trace of the IR. If Dynamo's graph fails too, the IR's failure is raised."""
    try:
        compiled = handoff(gm, example_inputs)
    except Exception as exc:
        _reraise_restart(exc)
        raise failure from exc
    log.info("specpass: Inductor failed on the IR (%s: %s); compiled Dynamo's graph instead",
             type(failure).__name__, failure)
    return compiled


def _unrewritten(gm: fx.GraphModule, example_inputs: list[Any]) -> fx.GraphModule:
    """The IR of a graph whose rewrite came from the cache; the Dynamo graph if it cannot be captured."""
    try:
        aten_gm = to_aten_ir(gm, example_inputs)
        adopt_dynamo_inputs(gm, aten_gm)
        return aten_gm
    except Exception:
        return gm


# specpass switches that turn an Inductor option on (where this torch has it), unless options= set it.
_INDUCTOR_SWITCHES = {"pdl": "triton.enable_pdl", "coordinate_descent": "coordinate_descent_tuning"}
# Passes whose kernels save little a call, launched through a library op from Python: the op's host
# time a call is many times what the kernel saves, which only a CUDA graph's replay hides
# (docs/results.md, the prefill's host time).
_REPLAYED_ONLY = ("gemv", "gemv_group")
_REPLAYED_ONLY_WHY = "their op's host time a call outweighs what their kernel saves where Python launches it"


def _replayed(mode: str | None, inductor_options: dict[str, Any]) -> bool:
    """Whether Inductor will run the step as a CUDA graph, from torch.compile's mode and options."""
    chosen = {**torch._inductor.list_mode_options(mode or "default"), **inductor_options}
    return bool(chosen.get("triton.cudagraphs", inductor_config.triton.cudagraphs))


def _has_cuda_inputs(example_inputs: list[Any]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in example_inputs)


def _has_config(key: str) -> bool:
    """Whether this torch's Inductor has the (dotted) option `key`."""
    where = inductor_config
    for part in key.split("."):
        if not hasattr(where, part):
            return False
        where = getattr(where, part)
    return True


def _handoff(kind: str, mode: str | None, inductor_options: dict[str, Any]) -> Callable:
    if kind == "eager":
        return lambda gm, example_inputs: gm
    # The same wrapper torch.compile(backend="inductor") uses: it validates mode/options and
    # turns mode="reduce-overhead" into CUDA graphs.
    return torch._TorchCompileInductorWrapper(mode, inductor_options or None, dynamic=False)


def step_name(gm: fx.GraphModule) -> str:
    """The compiled function's name (a loop's step: "decode_round", "prefill"): the outermost frame
    of any node's stack trace."""
    for node in gm.graph.nodes:
        frames = re.findall(r", in (\w+)", node.meta.get("stack_trace") or "")
        if frames:
            return frames[0]
    return f"graph {len(gm.graph.nodes)} nodes"


def warn(message: str) -> None:
    """A `SpecpassWarning` pointing at the code that called the backend (or a loop step)."""
    warnings.warn(message, SpecpassWarning, stacklevel=3)

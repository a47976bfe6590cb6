"""Compiling the loop's steps: each under a code object of its own, as one graph, with the batch
symbolic (`SymbolicBatch`) and every other size static; saved once compiled (`saved_steps`) or
compiled in the background (`background`); again without CUDA graphs where they cannot capture it,
or uncompiled (warned) where Dynamo cannot trace it whole; and the later rounds' stance without
guard evaluation (`skip_guards`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from specpass.compile_backend import ExactModeError, backend, default_backend, warn
from specpass.loop import saved_steps
from specpass.loop.steps import State
from specpass.options import Options
from specpass.report import Report, log_report

COMPILERS = ("specpass", "inductor", "eager")


def compiler(compile: str | Callable, mode: str | None, batch: SymbolicBatch, saved: bool = True,
             background: bool = False, priority: int = 0) -> Callable[[Callable, str], Callable]:
    """-> wrap(fn, name): fn compiled as one graph, under a code object of its own named `name`,
    with the batch symbolic (`batch` marks it on the inputs) and every other size and float static
    (`SymbolicBatch.marking`).

    saved: a step of specpass's backend or Inductor is saved once compiled and loaded by later
    processes without Dynamo (`saved_steps`), while specpass's compile cache is on.
    background: such a step compiles on the compile worker (`background`, at `priority`: lower
    first) and runs uncompiled until it lands."""
    if compile == "eager":
        return lambda fn, name: fn
    backend = default_backend if compile == "specpass" else compile  # "inductor"; a callable
    where = saved_steps.directory() if saved and savable(backend) else None
    background = background and savable(backend)

    exact = getattr(getattr(backend, "options", None), "exact", False)

    def compiled(fn: Callable, name: str, mode: str | None) -> Callable:
        step_code = torch.compile(own_code(name), backend=backend, mode=mode, fullgraph=True, dynamic=None)

        def step(*args: Any) -> Any:
            nonlocal step_code
            batch.mark(args)
            try:
                return step_code(fn, *args)
            except _NOT_ONE_GRAPH as exc:  # raised while tracing: nothing of the step ran
                step_code = uncompiled(name, exc, exact)
                return step_code(fn, *args)

        return step

    def wrap_with(fn: Callable, name: str, mode: str | None) -> Callable:
        if where is None and not background:
            return compiled(fn, name, mode)
        return saved_steps.SavedStep(fn, own_code(name), backend, mode, batch, where,
                                     lambda: compiled(fn, name, mode), background, priority)

    def wrap(fn: Callable, name: str) -> Callable:
        step = wrap_with(fn, name, mode)
        if mode != "reduce-overhead":
            return step
        return CaptureChecked(step, lambda: wrap_with(fn, name, None), name)

    return wrap


class CaptureChecked:
    """A step under CUDA graphs that drops them if its graph cannot be captured: an op that reads a
    tensor to the host (an opaque custom op's `.tolist()`, which Inductor cannot see into) fails the
    capture, before any kernel of the step ran (captured kernels do not execute), so the step runs
    again compiled without CUDA graphs, warned and reported. Only then does it compile again."""

    def __init__(self, step: Callable, without_graphs: Callable[[], Callable], name: str):
        self.step, self.without_graphs, self.name = step, without_graphs, name
        self.captured = True

    def __call__(self, *args: Any) -> Any:
        try:
            return self.step(*args)
        except RuntimeError as exc:
            if not self.captured or not capture_refused(exc):
                raise
            message = (f"CUDA graphs cannot capture {self.name} ({(str(exc).splitlines() or [''])[0]}); it runs "
                       "compiled without them")
            warn(message)
            log_report(Report(notes=[message]), self.name)
            self.step, self.captured = self.without_graphs(), False
            return self.step(*args)


def capture_refused(exc: RuntimeError) -> bool:
    """Whether exc is CUDA's or torch's refusal of an operation during a CUDA-graph capture."""
    text = str(exc)
    return "graph capture" in text or "stream is capturing" in text


# What Dynamo raises under fullgraph=True for code it cannot trace whole: a graph break, or one
# inside a region body (a repeated layer) that its higher-order op cannot take.
_NOT_ONE_GRAPH = (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UncapturedHigherOrderOpError)


def uncompiled(name: str, exc: Exception, exact: bool) -> Callable:
    """The step run as it is, for a model Dynamo cannot trace as one graph: warned, and reported as
    the step's fallback. Exact mode refuses it (its sums would not be in a fixed order)."""
    why = f"Dynamo cannot trace {name} as one graph ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]})"
    if exact:
        raise ExactModeError(f"exact mode refuses {name}: {why}") from exc
    message = f"{why}; it runs uncompiled"
    warn(message)
    log_report(Report(fallback=message), name)
    return lambda fn, *args: fn(*args)


def exact_backend(compile: str | Callable) -> Callable:
    """compile ("specpass", or a specpass backend: `checks.check_exact`) with the exact pass on."""
    options = compile.options.chosen() if compile != "specpass" else {}
    return backend(**{**options, "exact": True})


def savable(backend: str | Callable) -> bool:
    """Inductor, or a backend of specpass's (`specpass.backend(...)`): what torch can save compiled."""
    return backend == "inductor" or isinstance(getattr(backend, "options", None), Options)


class SymbolicBatch:
    """The batch axis made symbolic in every compiled step, so that one graph (one compile) serves
    every batch size >= 2 up to the caches' capacity. While `rows` is set (the calls that may compile:
    the prefill and rounds 1 and 2 of a call, which run under every guard), a step marks dim 0 of
    each tensor input of that many rows `maybe_mark_dynamic`: the batch axis of every loop tensor
    but the `State.stats`, the one without. Only a compile reads the marks, so later rounds skip
    this (a tensor unmarked at a call passes the guards of a graph compiled on marked ones). `more`
    names other axes to mark: the prefill's prompt length.

    While marking, Dynamo's automatic dynamic shapes are off: nothing but the marks is symbolic.
    Dynamo keeps what earlier compiles saw (a size or float that changed between them becomes
    symbolic) per (file, first line, name) of the code, and every Decoder's step of one name has
    the same (`own_code`): one model's prefill would make the next model's sizes and float
    attributes (a layer's scaling, a residual multiplier) symbolic, and which graphs Inductor could
    lower would depend on the models compiled before in the process.

    Size 1 is not marked: Dynamo specializes sizes 0 and 1, so `Decoder` runs a batch of one in two
    rows (one idle) when its caches hold two or more, and only a capacity of 1 compiles for 1. Caches of
    two rows (`capacity` 2) mark nothing either: the graph reads `cache[:B]`, so B can only be 2, and
    Dynamo would pin the symbol to 2 mid-trace (torch 2.13 then fails to reuse a repeated layer's
    body whose inputs it had bound to the symbol)."""

    def __init__(self) -> None:
        self.rows: int | None = None
        self.more: list[tuple[Tensor, int]] = []

    @contextlib.contextmanager
    def marking(self, rows: int, capacity: int, more: list[tuple[Tensor, int]] = ()) -> Iterator[None]:
        self.rows = rows if rows >= 2 and capacity > 2 else None
        self.more = list(more)
        try:
            with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
                yield
        finally:
            self.rows, self.more = None, []

    def marked(self, args: Any) -> Iterator[tuple[Tensor, int]]:
        """(tensor, axis) of args to mark symbolic."""
        if self.rows is None and not self.more:  # the rounds after the first two: nothing to walk
            return
        # Not the stats [K+1]: a tensor marked at a call but not when its graph was compiled fails a
        # guard (Dynamo's "_has_dynamo_dim_marking"), so a mark must not depend on K+1 == rows.
        args = [arg._replace(stats=None) if isinstance(arg, State) else arg for arg in args]
        for leaf in pytree.tree_leaves(args):
            if isinstance(leaf, Tensor):
                if self.rows is not None and leaf.dim() and leaf.shape[0] == self.rows:
                    yield leaf, 0
                yield from ((leaf, axis) for tensor, axis in self.more if tensor is leaf)

    def mark(self, args: Any) -> None:
        for tensor, axis in self.marked(args):
            torch._dynamo.maybe_mark_dynamic(tensor, axis)


def own_code(name: str) -> Callable:
    """step(fn, *args) = fn(*args), under a code object of its own named `name`. torch.compile calls
    every functools.partial through one shared function (torch._dynamo.external_utils.wrap_inline's
    `inner`), and Dynamo keeps at most 8 graphs per code object that guard on the same models: the
    steps of all Decoders over one pair would share that room, and the rest run uncompiled. fn is an
    argument, not a closure's cell, so that a saved step holds no model (`saved_steps`)."""

    def step(fn: Callable, *args: Any) -> Any:
        return fn(*args)

    step.__code__ = step.__code__.replace(co_name=name)  # a new code object
    step.__name__ = step.__qualname__ = name
    return step


def skip_guards() -> contextlib.AbstractContextManager:
    """The caller's compiler stance, without guard evaluation (a call runs the one compiled graph
    its code object holds; with several, only the guards that tell them apart).

    `Decoder.generate` (and `Decoder.rounds`) enter it after round 2. Rounds 1 (on the prefill's
    tensors) and 2 (on round 1's outputs) run under every guard, so other models, K, options or
    sampling parameters still recompile, and a batch size picks its graph: one graph, the batch
    symbolic, serves every size >= 2 (`SymbolicBatch`; its sizes read from the inputs on each call,
    and with CUDA graphs Inductor replays the graph recorded for that size, chosen on each call
    outside Dynamo's guards), a capacity of 1 its own. Each later round runs the same compiled round on the
    outputs of the round before, which match round 2's inputs in everything a guard checks (dtype,
    shape, stride, device), and nothing that runs between rounds changes the models, the options
    or global state: its guards would pass. That saves their host time per round
    (tests/test_speculative.py; docs/loop.md). The stance is process-wide: while a loop runs, other
    threads' compiled code skips guards too.
    """
    stance = torch._dynamo.eval_frame._stance  # private: set_stance has no getter
    return torch.compiler.set_stance(stance.stance, skip_guard_eval_unsafe=True, force_backend=stance.backend)

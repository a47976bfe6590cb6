"""Compiling and running the loop's steps: each step compiled under a code object of its own with
its batch symbolic (again without CUDA graphs where they cannot capture it), the skip-guards stance of
the later rounds, the fused round's state kept in
place, CUDA-graph replays' outputs cloned (steps apart), the prompts as a tensor, the host's read of the
done flag, the phase timer."""

from __future__ import annotations

import array
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from specpass.compile_backend import ExactModeError, backend, default_backend, log_report, warn
from specpass.loop import saved_steps
from specpass.loop.steps import State
from specpass.options import Options
from specpass.report import Report

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


def clone(value: Any) -> Any:
    """A copy of a CUDA-graph replay's outputs (tensors in nested tuples), which the next replay overwrites."""
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, tuple):
        items = map(clone, value)
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def replayed(run_round: Callable) -> Callable:
    """run_round (state, carry, params) -> (state, carry, done) as CUDA graphs replay it: a new
    step of the graph trees begins, and the state and carry that cross rounds are cloned (the
    next replay overwrites its outputs). The done flag is read before that."""

    def run(state: Any, carry: Any, params: Any) -> tuple[Any, Any, Tensor]:
        torch.compiler.cudagraph_mark_step_begin()
        state, carry, finished = run_round(state, carry, params)
        return clone(state), clone(carry), finished

    return run


class InPlaceRound:
    """The fused round as the loop calls it, (state, carry, params) -> (state, carry, all done), from
    `run_round` (`steps.decode_round_in_place`), which writes the next state and carry over the
    ones it gets. They live in buffers of this round's own, one set per batch size, marked static:
    CUDA graphs take them at their addresses, so a replay neither copies them in nor needs its
    outputs cloned (`replayed` does both: 16 copies a step of plain decoding, docs/results.md). A
    state from elsewhere (the prefill, another K's round) is copied in first. So a `Run` this round
    returns holds these buffers: the next run at this K and batch size overwrites it."""

    def __init__(self, run_round: Callable, cudagraphs: bool):
        self.run_round, self.cudagraphs = run_round, cudagraphs
        self.buffers: dict[tuple, tuple[Any, Any]] = {}  # the leaves' shapes and dtypes -> (state, carry)

    def __call__(self, state: Any, carry: Any, params: Any) -> tuple[Any, Any, Tensor]:
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        if not any(state is own[0] and carry is own[1] for own in self.buffers.values()):  # rounds 2 on: in place
            state, carry = self._copied_in(state, carry)
        return state, carry, self.run_round(state, carry, params)

    def _copied_in(self, state: Any, carry: Any) -> tuple[Any, Any]:
        leaves, spec = pytree.tree_flatten((state, carry))  # tensors, and None where a field is unused
        key = (str(spec), tuple((t.shape, t.dtype) if isinstance(t, Tensor) else t for t in leaves))
        if key not in self.buffers:
            own = [torch.empty_like(t) if isinstance(t, Tensor) else t for t in leaves]
            for t in own:
                if isinstance(t, Tensor):
                    torch._dynamo.mark_static_address(t)
            self.buffers[key] = pytree.tree_unflatten(own, spec)
        own_state, own_carry = self.buffers[key]
        for mine, given in zip(pytree.tree_leaves((own_state, own_carry)), leaves):
            if mine is not given:
                mine.copy_(given)
        return own_state, own_carry


def right_padded(prompts: list[list[int]], width: int) -> Tensor:
    """The prompts as int64 rows [len(prompts), width] on the CPU, zeros after each: each prompt copied
    into one array whole, where torch.tensor of nested lists converts every token on its own, on the
    host's time inside the prefill."""
    rows = array.array("q", bytes(8 * len(prompts) * width))
    for i, prompt in enumerate(prompts):
        rows[i * width: i * width + len(prompt)] = array.array("q", prompt)
    return torch.frombuffer(rows, dtype=torch.long).view(len(prompts), width)


def clock(device: torch.device) -> float:
    """Seconds, after the device has finished what was queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class DoneFlags:
    """The host's view of "all done". On a GPU, `push` reads the previous round's flag (copied to
    pinned memory as that round ends) while this round runs, so the device never idles waiting
    for the host; where an EOS ends the batch, that costs one round after the last, which runs on
    finished requests and emits nothing (`lag` = 1; a batch that ends on its budgets stops at its
    last round, counted by the driver). On a CPU the flag is read at once."""

    def __init__(self, device: torch.device):
        self.lag = int(device.type == "cuda")
        self.pending: list[tuple[Tensor, Any]] = []
        self.waited = 0.0  # seconds the host sat waiting for a round to end: the rest of a loop is host work

    def push(self, finished: Tensor) -> bool:
        if not self.lag:
            return bool(finished.item())
        event = torch.cuda.Event()
        self.pending.append((finished.to("cpu", non_blocking=True), event))
        event.record()
        if len(self.pending) <= self.lag:
            return False
        flag, event = self.pending.pop(0)
        start = time.perf_counter()
        event.synchronize()
        self.waited += time.perf_counter() - start
        return bool(flag.item())


class PhaseTimer:
    """Time per phase of the round without host syncs: a CUDA event (on CPU the host clock) is
    recorded after each phase; the totals are read once, after the loop."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, Any]] = []  # (the phase that just ended, event or time)

    def mark(self, phase: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((phase, event))
        else:
            self.marks.append((phase, time.perf_counter()))

    def timed(self, phase: str, step: Callable | None) -> Callable | None:
        if step is None:
            return None

        def run(*args: Any) -> Any:
            out = step(*args)
            self.mark(phase)
            return out

        return run

    def totals(self) -> dict[str, float]:
        """Seconds per phase; "between" is the host loop between rounds (the sync, the copies)."""
        if self.cuda:
            torch.cuda.synchronize()
        totals: dict[str, float] = {}
        for (_, start), (phase, end) in zip(self.marks, self.marks[1:]):
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            totals[phase] = totals.get(phase, 0.0) + seconds
        return totals

"""Compiling and running the loop's steps: each step compiled under a code object of its own, the
skip-guards stance of the later rounds, CUDA-graph replays' outputs cloned, the host's read of
the done flag, the phase timer."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from specpass.compile_backend import default_backend

COMPILERS = ("specpass", "inductor", "eager")


def compiler(compile: str | Callable, mode: str | None,
             dynamic: bool | None = False) -> Callable[[Callable, str], Callable]:
    """-> wrap(fn, name): fn compiled as one graph, under a code object of its own named `name`."""
    if compile == "eager":
        return lambda fn, name: fn
    backend = default_backend if compile == "specpass" else compile  # "inductor"; a callable
    return lambda fn, name: torch.compile(own_code(fn, name), backend=backend, mode=mode, fullgraph=True,
                                          dynamic=dynamic)


def own_code(fn: Callable, name: str) -> Callable:
    """fn called from a function whose code object is its own. torch.compile calls every
    functools.partial through one shared function (torch._dynamo.external_utils.wrap_inline's
    `inner`), and Dynamo keeps at most 8 graphs per code object that guard on the same models: the
    steps of all Decoders over one pair would share that room, and the rest run uncompiled."""

    def step(*args: Any) -> Any:
        return fn(*args)

    step.__code__ = step.__code__.replace(co_name=name)  # a new code object
    step.__name__ = step.__qualname__ = name
    return step


def skip_guards() -> contextlib.AbstractContextManager:
    """The caller's compiler stance, without guard evaluation (a call runs the one compiled graph
    its code object holds; with several, only the guards that tell them apart).

    `Decoder.generate` (and `Decoder.rounds`) enter it after round 2. Rounds 1 (on the prefill's
    tensors) and 2 (on round 1's outputs) run under every guard, so other models, K, batch, options
    or sampling parameters still recompile. Each later round runs the same compiled round on the
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


def clock(device: torch.device) -> float:
    """Seconds, after the device has finished what was queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class DoneFlags:
    """The host's view of "all done". On a GPU, `push` reads the previous round's flag (copied to
    pinned memory as that round ends) while this round runs, so the device never idles waiting
    for the host; that costs one round after the last, which runs on finished requests and emits
    nothing (`lag` = 1). On a CPU the flag is read at once."""

    def __init__(self, device: torch.device):
        self.lag = int(device.type == "cuda")
        self.pending: list[tuple[Tensor, Any]] = []

    def push(self, finished: Tensor) -> bool:
        if not self.lag:
            return bool(finished.item())
        event = torch.cuda.Event()
        self.pending.append((finished.to("cpu", non_blocking=True), event))
        event.record()
        if len(self.pending) <= self.lag:
            return False
        flag, event = self.pending.pop(0)
        event.synchronize()
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

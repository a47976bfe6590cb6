"""Compiling the loop's steps off the calling thread, so that decoding starts at once: a step whose
compile is queued here runs uncompiled meanwhile (`saved_steps.SavedStep`), and the loop switches to
the compiled step at the first call after it lands, between rounds. Both run the same function on
the same state: greedy decoding gives plain greedy's tokens across the switch, and sampling draws
from the same distributions (in bf16 the uncompiled kernels round otherwise than the compiled ones,
as any two kernels may: exact mode, which fixes them, refuses a background compile).

One worker thread runs the jobs one at a time (Dynamo compiles one frame at a time anyway), the
rounds before the prefill (`priority`: an uncompiled prefill costs about what a compiled one does, an
uncompiled round several times more). Each job runs under the calling thread's grad mode, CUDA device
and context variables (torch's config patches), as the compile on the calling thread would.

torch's ops release the GIL and take it back, so while the worker traces, every op of the decoding
thread would wait for the worker's turn to end (CPython's switch interval, 5 ms): the interval is cut
while a job runs. torch.fx's tracers patch `torch.nn.Module.__call__` for the whole process while
they trace, and a module the decoding thread calls meanwhile goes through the tracer, which refuses
a module outside its root (a NameError): while a job runs, `uncompiled` runs a step once no tracer
is patched in, and again from the start if one was patched in during it. A step is a function of its inputs, and writes
the models' caches at positions they give (the in-place round writes its state last), so running it
again writes what the first run wrote. A process that exits drops the jobs not started and waits for
the one running.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import contextvars
import heapq
import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

SWITCH_INTERVAL_S = 2e-5  # while a job runs; CPython's default is 5e-3


class Worker:
    """One daemon thread running submitted jobs, lowest priority first, then in submission order.
    While `holding`, jobs queue and none starts, so that the rounds submitted after the prefill
    still compile first."""

    def __init__(self) -> None:
        self._queue: list[tuple[int, int, Callable[[], None], concurrent.futures.Future]] = []
        self._order = itertools.count()
        self._ready = threading.Condition()
        self._holds = 0
        self._waiting = 0  # threads in `wait`: a hold does not keep them waiting
        self._running = 0
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], Any], priority: int) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        run = _as_caller(job)

        def work() -> None:
            if future.set_running_or_notify_cancel():  # False: dropped by `stop`
                try:
                    future.set_result(run())
                except BaseException as exc:  # handed to the caller, who raises it
                    future.set_exception(exc)

        with self._ready:
            heapq.heappush(self._queue, (priority, next(self._order), work, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="specpass-compile", daemon=True)
                self._thread.start()
                atexit.register(self.stop)
            self._ready.notify_all()
        return future

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        with self._ready:
            self._holds += 1
        try:
            yield
        finally:
            with self._ready:
                self._holds -= 1
                self._ready.notify_all()

    def wait(self) -> None:
        """Until every queued job has run, held ones too."""
        with self._ready:
            self._waiting += 1
            self._ready.notify_all()
            try:
                self._ready.wait_for(lambda: not self._queue and not self._running)
            finally:
                self._waiting -= 1

    def stop(self) -> None:
        """Drop the queued jobs and wait for the one running (a process exits: a thread killed inside
        Inductor could take the process down with it). Their steps compile again in the next process."""
        with self._ready:
            dropped, self._queue = self._queue, []
            self._ready.notify_all()
        for *_, future in dropped:
            future.cancel()
        self.wait()

    def busy(self) -> bool:
        with self._ready:
            return bool(self._running)

    def _serve(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._queue and (not self._holds or self._waiting))
                _, _, work, _ = heapq.heappop(self._queue)
                self._running += 1
            interval = sys.getswitchinterval()
            sys.setswitchinterval(min(interval, SWITCH_INTERVAL_S))
            try:
                work()
            finally:
                sys.setswitchinterval(interval)
                with self._ready:
                    self._running -= 1
                    self._ready.notify_all()


def _as_caller(job: Callable[[], Any]) -> Callable[[], Any]:
    """job, to run on another thread under this thread's grad mode, CUDA device and context variables."""
    context = contextvars.copy_context()
    grad = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run() -> Any:
        on_device = torch.cuda.device(device) if device is not None else contextlib.nullcontext()
        with torch.set_grad_enabled(grad), on_device:
            return context.run(job)

    return run


worker = Worker()  # one per process: the compiles share Dynamo, and its compile lock

_MODULE_CALL = torch.nn.Module.__call__  # what torch.fx's tracers patch over while they trace
ATTEMPTS = 1000


def uncompiled(fn: Callable, args: tuple) -> Any:
    """fn(*args) on the decoding thread while the worker may trace (see the module's docstring). A
    patch that outlives the worker's jobs is not a trace of theirs: it is not waited for."""
    for attempt in range(ATTEMPTS):
        while torch.nn.Module.__call__ is not _MODULE_CALL and worker.busy():
            time.sleep(1e-4)
        try:
            return fn(*args)
        except NameError as exc:  # the tracer's refusal of a module outside its root
            if "not installed as a submodule" not in str(exc) or attempt == ATTEMPTS - 1:
                raise

"""The host's side of the loop: the prompts as one tensor, the clock, the done flag read a round
late on a GPU (`DoneFlags`), and the phase timer read once after the loop."""

from __future__ import annotations

import array
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

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

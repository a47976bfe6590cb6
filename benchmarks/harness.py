"""What every benchmark shares: timing, the environment record, Dynamo's limits, the GPU lock and
the output rows; and the only places that reach into the loop's internals or torch's private APIs.

    env = environment(device, dtype)          # device, torch / triton / transformers, dtype, date, commit
    dynamo_limits(1024)                       # before compiling many variants of the same step functions
    ms = graph_ms([fn] * 20)                  # ms per call: the calls captured as one CUDA graph, replayed
    ms = median_ms({"a": fa, "b": fb}, iters=100, warmup=5)   # CUDA events around each call, taking turns
    ms = op_ms(fn, device)                    # CUDA-graph replays on a GPU, the host clock elsewhere
    with exclusive(lock_file): ...            # the GPU to this process alone while it times
    save = saver(path); save(result)          # the JSON written as it goes: a run cut short keeps its rows

Timers: CUDA events read the GPU's own clock (`median_ms`, `event_ms`); a CUDA graph of many calls
times back-to-back kernels without launch gaps (`graph_ms`); `now` is the host clock after a device
sync, for whole generates; `host_ms` times host work (CPU runs, Dynamo's overhead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import gc
import importlib.metadata
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch


ROOT = Path(__file__).resolve().parents[1]  # the repository: checkpoints/, docs/
PAIRED = ("pdl", "coordinate_descent", "gemv", "gemv_group")  # specpass switches a loop variant also runs with flipped, beside itself (VARIANT+SUFFIX)


def flipped(option: str) -> tuple[str, dict[str, bool]]:
    """A switch of PAIRED against its default: the variant's suffix ("pdl", "no-gemv") and its options."""
    from specpass.options import Options

    on = not getattr(Options(), option)
    return (option if on else f"no-{option}"), {option: on}


def paired_suffixes() -> str:
    """The suffixes of PAIRED's variants, for a command line's help: "+pdl, +no-gemv, ..."."""
    return ", ".join(f"+{suffix}" for suffix, _ in map(flipped, PAIRED))


# --- what ran where


def environment(device: torch.device | str, dtype: torch.dtype | str, **extra: Any) -> dict[str, Any]:
    """The record every result carries: the device's name, the versions of torch, Triton and
    transformers (None where absent; read without importing them), the dtype, the UTC date and the
    repository's commit (None outside a git checkout; "-dirty" with uncommitted changes), then `extra`."""
    device = torch.device(device)
    return dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
                torch=torch.__version__, triton=_version("triton"), transformers=_version("transformers"),
                dtype=str(dtype).removeprefix("torch."),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                commit=_commit(), **extra)


def describe(env: dict[str, Any]) -> str:
    """One line for a log: `environment`'s record, the absent versions left out."""
    return "# " + ", ".join(f"{key} {value}" for key, value in env.items() if value is not None)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    try:
        found = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12", "--exclude=*"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if found.returncode != 0:
        return None
    return found.stdout.strip() or None


@dataclasses.dataclass(kw_only=True)
class Row:
    """One variant measured at one point. A benchmark subclasses it with what it measures; `asdict`
    is the flat JSON row the docs' tables and plots read: the environment's keys, then the fields."""

    env: dict[str, Any]
    variant: str

    def asdict(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "env"}
        return {**self.env, **fields}


def in_fresh_processes(module: str, argv: list[str], variant: str, runs: int = 1) -> list[dict]:
    """`python -m module *argv --child variant`, each run in a new process that prints its JSON row last;
    the first with empty Inductor, Triton and specpass caches (a user's first run), the next with the
    caches the ones before left (variant "<variant>, warm")."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="fresh_caches_") as cache:
        # specpass's compile cache follows torch's directory unless told otherwise
        env = {key: value for key, value in os.environ.items() if key != "SPECPASS_CACHE_DIR"}
        env |= {"TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
        for run in range(runs):
            done = subprocess.run([sys.executable, "-m", module, *argv, "--child", variant], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, text=True, check=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append({**row, "variant": variant if run == 0 else f"{variant}, warm"})
    return rows


def saver(path: Path | None, indent: int = 1) -> Callable[[Any], None]:
    """save(result): its JSON written to `path` (nothing without a path). Benchmarks save after every
    measurement, so that a run cut off by the device's time limit keeps what it measured (whole: the
    file is replaced, never half written)."""
    if path is None:
        return lambda result: None

    def save(result: Any) -> None:
        part = path.with_name(path.name + ".part")
        part.write_text(json.dumps(result, indent=indent))
        part.replace(path)

    return save


# --- Dynamo


def dynamo_limits(graphs: int) -> None:
    """Let Dynamo keep `graphs` compiled graphs per code object: a benchmark compiles the same
    step functions again for every variant, shape and copy of the models."""
    # No public setter; `cache_size_limit` is `recompile_limit`'s older name (an alias in newer torch).
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, graphs)


def release(device: torch.device) -> None:
    """Free the compiled graphs (and their CUDA-graph pools) and the cached blocks between variants."""
    torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]  # no public counter of compiled graphs


def compile_seconds() -> dict[str, float]:
    """Seconds per region torch times while compiling (its `dynamo_timed` names: "_compile.compile_inner",
    "GraphLowering.run", ...), summed over every graph compiled in this process so far. Regions nest."""
    # no public reader: compile_times(repr="csv") gives the same sums as formatted text
    return {name: sum(times) for name, times in torch._dynamo.utils.compilation_time_metrics.items()}


def inductor_code(fn: Callable, *args: Any) -> tuple[Any, list[str]]:
    """fn(*args) and the source of the code Inductor generated for it."""
    from torch._inductor.utils import run_and_get_code  # no public way to read Inductor's output code

    return run_and_get_code(fn, *args)


def leaves(tree: Any) -> list[Any]:
    """The leaves (tensors, fx nodes, ...) of nested tuples, lists and dicts, in order."""
    from torch.utils._pytree import tree_leaves  # torch has no public pytree module

    return tree_leaves(tree)


def efficient_attention_lse(q, k, v, bias, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's memory-efficient kernel with its log-sum-exp: (out, lse)."""
    # The public SDPA returns no log-sum-exp; the aten op behind its efficient backend does.
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, scale=scale)[:2]


def fake_process_group(world: int) -> None:
    """This process as rank 0 of `world` on torch's fake process group, whose collectives do nothing."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"; no public one

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


# --- timing


def now(device: torch.device) -> float:
    """The host clock (seconds) once the device has finished its work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def median_ms(calls: dict[str, Callable[[], Any]], iters: int, warmup: int) -> dict[str, float]:
    """Median ms of each call, CUDA events around it; the calls take turns (one of each per
    iteration), so that drift of the GPU's clocks hits them alike. `warmup` untimed rounds first."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(warmup + iters):
        for name, call in calls.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            if i >= warmup:
                times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def event_ms(fn: Callable[[], Any], iters: int = 20, warmup: int = 3) -> float:
    """Median ms of `fn`, CUDA events around each call."""
    return median_ms({"": fn}, iters, warmup)[""]


def capture(calls: Sequence[Callable[[], Any]]) -> torch.cuda.CUDAGraph:
    """One CUDA graph of `calls`, back to back, after three warm-up calls (the first ones, in turn)
    on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in itertools.islice(itertools.cycle(calls), 3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph


def graph_ms(calls: Sequence[Callable[[], Any]], iters: int = 20, warmup: int = 3) -> float:
    """ms per call of `calls` captured as one CUDA graph (`capture`): a replay's median / len(calls)."""
    return event_ms(capture(calls).replay, iters, warmup) / len(calls)


def host_ms(fn: Callable[[], Any], repeats: int, calls: int = 1, warmup: int = 1, best: bool = False) -> float:
    """ms per call on the host clock: `repeats` batches of `calls` calls after `warmup` calls; the
    median batch, or the fastest with `best`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append(1e3 * (time.perf_counter() - start) / calls)
    return min(times) if best else statistics.median(times)


def op_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """ms per call: on a GPU, two calls in a CUDA graph (`graph_ms`); elsewhere one call on the host
    clock after one warm-up (a CPU run only checks the script)."""
    return graph_ms([fn] * 2) if device.type == "cuda" else host_ms(fn, repeats=1)


def time_candidates(candidates: dict[str, Callable[[], torch.Tensor]], ref: torch.Tensor) -> dict[str, float | str]:
    """Per candidate, its largest error against `ref` (`NAME_err`) and µs per call (`NAME_us`,
    `graph_ms` of 20 calls); one that refuses the shapes gives why instead (`NAME_error`)."""
    out: dict[str, float | str] = {}
    for name, fn in candidates.items():
        try:
            out[f"{name}_err"] = (fn().float() - ref).abs().max().item()
            out[f"{name}_us"] = 1e3 * graph_ms([fn] * 20)
        except Exception as exc:  # a candidate that refuses these shapes says why
            out[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return out


def gaps_per_round(prof, rounds: int, long_us: float = 5.0) -> dict:
    """The GPU's idle time between consecutive device activities (kernels, copies), over the middle
    80% of them (the rounds, not the prefill's eager kernels nor the end), per round: all of it, the
    gaps of `long_us` or more (a launch from the host: a graph's, a copy's) and the longest one."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA")
    window = spans[len(spans) // 10: len(spans) * 9 // 10]
    if len(window) < 2:
        raise ValueError(f"{len(spans)} device activities profiled: too few to measure gaps (profile a GPU run)")
    gaps, busy_until = [], window[0][1]
    for start, end in window[1:]:  # idle: no activity running, whichever ran longest (streams overlap)
        gaps.append(max(0.0, start - busy_until))
        busy_until = max(busy_until, end)
    share = rounds * len(window) / max(len(spans), 1)  # rounds the window covers
    long = [g for g in gaps if g >= long_us]
    return dict(idle_us=round(sum(gaps) / share, 1), long=round(len(long) / share, 2),
                long_us=round(sum(long) / share, 1), longest_us=round(max(gaps, default=0.0), 1))


@contextlib.contextmanager
def exclusive(lock: Path | None):
    """The GPU to this process alone while it times: an exclusive lock on the `lock` file, which
    processes started side by side share (none: no lock)."""
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def k_or_tree(text: str):
    """K or TOPK,STEPS,TOKENS (a command line's --k) -> an int or a TreeShape."""
    return tree_shapes(text)[0] if "," in text else int(text)


def tree_shapes(text: str) -> list:
    """TOPK,STEPS,TOKENS;... (a command line's --trees) -> TreeShapes."""
    from specpass.loop import TreeShape

    return [TreeShape(*(int(x) for x in part.split(","))) for part in text.split(";") if part]

"""Time to first token and peak memory of the loop's prefill at Llama-3-8B shape: eager, plain
Inductor and specpass (issue 24).

The zoo's `llama3-8b` target and `llama3-8b-eagle3` head (random weights, bf16), the `Decoder`'s
prefill (`Decoder.prefill_step`, called as `generate` calls it):
the target on every prompt row, the first token from each request's last row, then the drafter's
catch-up over the prompt and its first draft. Eager computes the target's logits on every prompt
row ([B, P, 128256]); plain Inductor compiles the same graph as it is; specpass's live-row pass
leaves the target's and the head's lm_head (and the target's last layer after its K/V write) one
row per request. The compiled prefill has a symbolic prompt length: one graph for every length.

    python -m benchmarks.prefill --out prefill.json          # bs 1 and 16, 4K prompts, on a GPU
    python -m benchmarks.prefill --quick --device cpu        # a smoke test: tiny models

Per batch size, each variant is built, compiled (a first call), checked on a second prompt length
(graphs compiled by it: 0 when one graph serves every length) and timed:
  TTFT ms    the prefill from the host's token lists to the first tokens on the device
             (synchronised), median of --repeats calls after the compiling one
  peak GB    torch.cuda.max_memory_allocated over one prefill; "added": above what was allocated
             before it (weights, KV caches)
  same first tokens   the fraction of requests whose first token equals eager's (bf16: near ties may differ)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

import specpass
from benchmarks import harness
from models import zoo
from models.drafters import ZooDrafter
from specpass.loop import Decoder

GB = 1 << 30


@dataclasses.dataclass(kw_only=True)
class PrefillRow(harness.Row):
    """One variant's prefill at one batch size (None: not measured, e.g. after an OOM, or off CUDA)."""

    bs: int
    prompt: int
    first_call_ms: float | None = None  # compiles
    graphs_compiled: int | None = None
    other_length_ms: float | None = None
    other_length: int | None = None
    other_length_graphs: int | None = None  # graphs compiled for it: 0 when one graph serves every length
    ttft_ms: float | None = None  # median of --repeats calls
    peak_gb: float | None = None  # torch.cuda.max_memory_allocated over one prefill
    resident_gb: float | None = None  # allocated before it (weights, KV caches)
    added_gb: float | None = None
    first: list[int] | None = None  # each request's first token
    specpass_warnings: list[str] = dataclasses.field(default_factory=list)
    error: str | None = None
    seconds: float | None = None  # to build, compile and time it
    same_first: float | None = None  # the fraction of requests whose first token is eager's


class Reports(logging.Handler):
    """specpass's reports (one per graph it compiles), as its logger writes them."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Bench:
    def __init__(self, args):
        self.args, self.device = args, torch.device(args.device)
        dtype = torch.float32 if args.quick else torch.bfloat16
        names = ("tiny-llama", "tiny-llama-eagle3") if args.quick else ("llama3-8b", "llama3-8b-eagle3")
        self.target = zoo.build(names[0], device=self.device, dtype=dtype)
        self.head = zoo.build(names[1], device=self.device, dtype=dtype)
        self.head.embed_tokens = self.target.model.embed_tokens  # EAGLE-3 uses the target's, by reference
        self.cuda = self.device.type == "cuda"

    def prompts(self, bs: int, length: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(bs * 7919 + length)
        return torch.randint(0, self.target.config.vocab_size, (bs, length), generator=g).tolist()

    def compiler(self, variant: str):
        if self.args.quick:  # the rewritten graphs run eagerly: Inductor's C++ builds would take minutes
            return specpass.backend(handoff="eager") if variant == "specpass" else "eager"
        return variant

    def run(self, row: PrefillRow) -> None:
        """One variant at one batch size: compile, second length, timed calls; measured into `row`."""
        bs, prompt = row.bs, row.prompt
        other = prompt - prompt // 16
        dec = Decoder(self.target, ZooDrafter(self.head), k=self.args.k, max_batch=bs, max_len=prompt + 64,
                      compile=self.compiler(row.variant))

        def call(prompts) -> tuple[torch.Tensor, float]:
            start = harness.now(self.device)
            run = dec.start(prompts, 1)
            return run.state.last, 1e3 * (harness.now(self.device) - start)

        before = harness.graphs_compiled()
        _, row.first_call_ms = call(self.prompts(bs, prompt))  # compiles
        row.graphs_compiled = harness.graphs_compiled() - before
        before = harness.graphs_compiled()
        _, row.other_length_ms = call(self.prompts(bs, other))
        row.other_length, row.other_length_graphs = other, harness.graphs_compiled() - before
        prompts, samples, peaks = self.prompts(bs, prompt), [], []
        for _ in range(self.args.repeats):
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
                resident = torch.cuda.memory_allocated()
            first, ms = call(prompts)
            samples.append(ms)
            if self.cuda:
                peaks.append((torch.cuda.max_memory_allocated(), resident))
        row.ttft_ms = statistics.median(samples)
        if peaks:
            peak, resident = max(peaks)
            row.peak_gb, row.resident_gb, row.added_gb = peak / GB, resident / GB, (peak - resident) / GB
        row.first = first[:bs].tolist()


def sweep(args, save) -> dict:
    bench = Bench(args)
    env = harness.environment(bench.device, next(bench.target.parameters()).dtype)
    result = dict(env=env, rows=[], reports={})
    print(harness.describe(env), file=sys.stderr, flush=True)
    reports = Reports()
    log = logging.getLogger("specpass")
    log.addHandler(reports)
    log.setLevel(logging.INFO)
    for bs in args.bs:
        eager_first = None
        for variant in args.variants:
            reports.lines.clear()
            start = time.perf_counter()
            row = PrefillRow(env=env, variant=variant, bs=bs, prompt=args.prompt)
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", specpass.SpecpassWarning)
                    bench.run(row)
                row.specpass_warnings = [str(w.message)[:300] for w in caught
                                         if issubclass(w.category, specpass.SpecpassWarning)]
            except torch.OutOfMemoryError as exc:
                row = PrefillRow(env=env, variant=variant, bs=bs, prompt=args.prompt, error=f"OOM: {str(exc)[:200]}")
            row.seconds = time.perf_counter() - start
            if row.first is not None:
                eager_first = row.first if variant == "eager" else eager_first
                if eager_first is not None:
                    row.same_first = sum(a == b for a, b in zip(row.first, eager_first)) / bs
            if variant == "specpass":
                result["reports"][f"bs{bs}"] = [line for line in reports.lines if "live_rows] rewrote" in line
                                                or line.startswith("specpass:")][:12]
            result["rows"].append(row.asdict())
            save(result)
            print(f"  bs {bs} {variant}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                       for k, v in result["rows"][-1].items()
                                                       if k not in env and k != "first" and v is not None),
                  file=sys.stderr, flush=True)
            harness.release(bench.device)
    return result


def table(result: dict) -> str:
    lines = ["| bs | prompt | variant | TTFT ms | vs eager | peak GB | added GB | first call s (compiles) | "
             "graphs for a 2nd length | same first tokens as eager |", "|" + "---|" * 10]
    eager = {r["bs"]: r for r in result["rows"] if r["variant"] == "eager" and r.get("ttft_ms") is not None}
    for r in result["rows"]:
        if r.get("ttft_ms") is None:
            lines.append(f"| {r['bs']} | {r['prompt']} | {r['variant']} | {r.get('error', '-')} |" + " |" * 6)
            continue
        base = eager.get(r["bs"])
        ratio = f"{base['ttft_ms'] / r['ttft_ms']:.2f}x" if base else "-"
        mem = lambda k: f"{r[k]:.2f}" if r.get(k) is not None else "-"  # noqa: E731
        same = r.get("same_first")
        lines.append(f"| {r['bs']} | {r['prompt']} | {r['variant']} | {r['ttft_ms']:.1f} | {ratio} | "
                     f"{mem('peak_gb')} | {mem('added_gb')} | {r['first_call_ms'] / 1e3:.1f} | "
                     f"{r['other_length_graphs']} | {1.0 if same is None else same:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--bs", default="16,1", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--variants", default="eager,specpass,inductor", type=lambda s: s.split(","))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny models, short prompts: checks the script runs")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--table", type=Path, help="print the table of this JSON and exit")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    if args.quick:
        args.bs, args.prompt, args.repeats = [2], 32, 1
    torch.set_grad_enabled(False)
    print(table(sweep(args, harness.saver(args.out))))


if __name__ == "__main__":
    main()

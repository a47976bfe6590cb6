"""Time to first token and peak memory of the loop's prefill at Llama-3-8B shape: eager, plain
Inductor and specpass (issue 24).

The zoo's `llama3-8b` target and `llama3-8b-eagle3` head (random weights, bf16), the `Decoder`'s
prefill (`Decoder.prefill_step`, called through `specpass.speculative.prefill`, as `generate` does):
the target on every prompt row, the first token from each request's last row, then the drafter's
catch-up over the prompt and its first draft. Eager computes the target's logits on every prompt
row ([B, P, 128256]); plain Inductor compiles the same graph as it is; specpass's live-row pass
leaves the target's and the head's lm_head (and the target's last layer after its K/V write) one
row per request. The compiled prefill has a symbolic prompt length: one graph for every length.

    python benchmarks/prefill.py --out prefill.json          # bs 1 and 16, 4K prompts, on a GPU
    python benchmarks/prefill.py --quick --device cpu        # a smoke test: tiny models

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
import gc
import json
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import specpass  # noqa: E402
from models import zoo  # noqa: E402
from models.drafters import ZooDrafter  # noqa: E402
from specpass.speculative import Decoder, prefill  # noqa: E402

GB = 1 << 30


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

    def sync(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def run(self, variant: str, bs: int) -> dict:
        """One variant at one batch size: compile, second length, timed calls."""
        prompt, other = self.args.prompt, self.args.prompt - self.args.prompt // 16
        max_len = prompt + 64
        dec = Decoder(self.target, ZooDrafter(self.head), k=self.args.k, max_batch=bs, max_len=max_len,
                      compile=self.compiler(variant))

        def call(prompts):
            start = self.sync()
            state, _ = prefill(dec.prefill_step, prompts, [1] * bs, [-1] * bs, None, dec.k, bs, max_len, self.device)
            return state.last, 1e3 * (self.sync() - start)

        row = dict(variant=variant, bs=bs, prompt=prompt)
        graphs = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # noqa: E731
        before = graphs()
        _, row["first_call_ms"] = call(self.prompts(bs, prompt))  # compiles
        row["graphs_compiled"] = graphs() - before
        before = graphs()
        _, row["other_length_ms"] = call(self.prompts(bs, other))
        row["other_length"], row["other_length_graphs"] = other, graphs() - before
        prompts, samples, peaks = self.prompts(bs, prompt), [], []
        for _ in range(self.args.repeats):
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
                resident = torch.cuda.memory_allocated()
            first, ms = call(prompts)
            samples.append(ms)
            if self.cuda:
                peaks.append((torch.cuda.max_memory_allocated(), resident))
        row["ttft_ms"] = statistics.median(samples)
        if peaks:
            peak, resident = max(peaks)
            row.update(peak_gb=peak / GB, resident_gb=resident / GB, added_gb=(peak - resident) / GB)
        row["first"] = first[:bs].tolist()
        del dec
        return row

    def release(self):
        torch._dynamo.reset()
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def sweep(args, save) -> dict:
    bench = Bench(args)
    env = dict(device=torch.cuda.get_device_name() if bench.cuda else "cpu", torch=torch.__version__,
               dtype=str(next(bench.target.parameters()).dtype).removeprefix("torch."))
    result = dict(env=env, rows=[], reports={})
    print(f"# {env}", file=sys.stderr, flush=True)
    reports = Reports()
    log = logging.getLogger("specpass")
    log.addHandler(reports)
    log.setLevel(logging.INFO)
    for bs in args.bs:
        eager_first = None
        for variant in args.variants:
            reports.lines.clear()
            start = time.perf_counter()
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", specpass.SpecpassWarning)
                    row = bench.run(variant, bs)
                row["specpass_warnings"] = [str(w.message)[:300] for w in caught
                                            if issubclass(w.category, specpass.SpecpassWarning)]
            except torch.OutOfMemoryError as exc:
                row = dict(variant=variant, bs=bs, prompt=args.prompt, error=f"OOM: {str(exc)[:200]}")
            row.update(env, seconds=time.perf_counter() - start)
            if "first" in row:
                eager_first = row["first"] if variant == "eager" else eager_first
                if eager_first is not None:
                    row["same_first"] = sum(a == b for a, b in zip(row["first"], eager_first)) / bs
            if variant == "specpass":
                result["reports"][f"bs{bs}"] = [line for line in reports.lines if "live_rows] rewrote" in line
                                                or line.startswith("specpass:")][:12]
            result["rows"].append(row)
            save(result)
            print(f"  bs {bs} {variant}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                       for k, v in row.items() if k not in env and k != "first"),
                  file=sys.stderr, flush=True)
            bench.release()
    return result


def table(result: dict) -> str:
    lines = ["| bs | prompt | variant | TTFT ms | vs eager | peak GB | added GB | first call s (compiles) | "
             "graphs for a 2nd length | same first tokens as eager |", "|" + "---|" * 10]
    eager = {r["bs"]: r for r in result["rows"] if r["variant"] == "eager" and "ttft_ms" in r}
    for r in result["rows"]:
        if "ttft_ms" not in r:
            lines.append(f"| {r['bs']} | {r['prompt']} | {r['variant']} | {r.get('error', '-')} |" + " |" * 6)
            continue
        base = eager.get(r["bs"])
        ratio = f"{base['ttft_ms'] / r['ttft_ms']:.2f}x" if base else "-"
        mem = lambda k: f"{r[k]:.2f}" if k in r else "-"  # noqa: E731
        lines.append(f"| {r['bs']} | {r['prompt']} | {r['variant']} | {r['ttft_ms']:.1f} | {ratio} | "
                     f"{mem('peak_gb')} | {mem('added_gb')} | {r['first_call_ms'] / 1e3:.1f} | "
                     f"{r['other_length_graphs']} | {r.get('same_first', 1.0):.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    save = (lambda r: args.out.write_text(json.dumps(r, indent=1))) if args.out else (lambda r: None)
    torch.set_grad_enabled(False)
    print(table(sweep(args, save)))


if __name__ == "__main__":
    main()

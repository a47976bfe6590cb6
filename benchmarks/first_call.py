"""A user's first call, each variant in a fresh process with empty caches (GPU or CPU).

    python -m benchmarks.first_call --out first_call.json
    python -m benchmarks.first_call --variants specpass "specpass, background" --bs 4 --new-tokens 128

The shipped pair loaded by transformers with its EAGLE-3 head (benchmarks/hf_generate.py's Bench), held-out
prompts left-padded, greedy, K 4, generate's defaults for the device. Variants:
  transformers            the target's own `generate`, static cache, compiled (CUDA graphs on a GPU)
  specpass                `specpass.generate`: the first call compiles its steps, then decodes
  specpass, background    `specpass.generate(background_compile=True)`: decodes at once, the steps
                          compiling on a worker thread, switched to as they land

Per variant: the first call's wall seconds and its time to the first token (a streamer's first
`put` of a generated token); the second call (the same prompts); for the background variant the
seconds from the first call's start until every step has landed, and a call after that (compiled);
then the median of `--warm` calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks import harness

VARIANTS = ("transformers", "specpass", "specpass, background")


@dataclasses.dataclass(kw_only=True)
class FirstCallRow(harness.Row):
    first_s: float
    first_token_s: float | None  # bs 1 only (a streamer takes one request)
    second_s: float
    compiled_s: float | None  # background: from the first call's start until every step landed
    after_compiled_s: float | None  # background: a call once they have
    warm_s: float  # median of --warm calls
    tokens: str  # a digest of the first call's tokens


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--bs", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(args, args.child)))
        return 0
    argv = argv if argv is not None else sys.argv[1:]
    command = " ".join(["python -m benchmarks.first_call", *(f'"{a}"' if " " in a else a for a in argv)])
    rows, save = [], harness.saver(args.out)
    for variant in args.variants:
        [row] = harness.in_fresh_processes("benchmarks.first_call", argv, variant)
        rows.append({**row, "command": command})
        save(rows)
    print(table(rows))
    return 0


class FirstToken:
    """A streamer that notes when the first generated token arrives (the first `put` is the prompt)."""

    def __init__(self, start: float, device):
        self.start, self.device, self.puts, self.at = start, device, 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2 and self.at is None:
            self.at = harness.now(self.device) - self.start

    def end(self) -> None:
        pass


def measure(args: argparse.Namespace, variant: str) -> dict:
    import hashlib

    import torch
    from transformers import CompileConfig

    import specpass
    from benchmarks.hf_generate import Bench, left_padded

    class Settings:  # what Bench reads
        device, dtype, new_tokens, k, quick = args.device, args.dtype, args.new_tokens, args.k, False

    bench = Bench(Settings)
    device = bench.device
    ids, mask = left_padded(torch, bench.prompts(args.bs), device)
    static = CompileConfig(mode="reduce-overhead" if device.type == "cuda" else "default")
    static._compile_all_devices = True

    def call(streamer=None):
        start = harness.now(device)
        first = FirstToken(start, device)
        if variant == "transformers":
            with torch.no_grad():
                out = bench.model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                                           pad_token_id=0, cache_implementation="static", compile_config=static,
                                           streamer=first if args.bs == 1 else None)
        else:
            out = specpass.generate(bench.model, ids, attention_mask=mask, assistant_model=bench.eagle3,
                                    max_new_tokens=args.new_tokens, num_assistant_tokens=args.k,
                                    background_compile=variant.endswith("background"),
                                    streamer=first if args.bs == 1 else None)
        return harness.now(device) - start, first.at, out[:, ids.shape[1]:].tolist()

    start = harness.now(device)
    first_s, first_token_s, tokens = call()  # the first token's time at bs 1 only: a streamer takes one request
    second_s, _, _ = call()
    compiled_s = after_compiled_s = None
    if variant.endswith("background"):
        specpass.loop.background.worker.wait()
        compiled_s = time.perf_counter() - start
        after_compiled_s = call()[0]
    warm_s = statistics.median(call()[0] for _ in range(args.warm))
    env = harness.environment(device, bench.dtype, bs=args.bs, new_tokens=args.new_tokens, k=args.k)
    return FirstCallRow(env=env, variant=variant, first_s=first_s, first_token_s=first_token_s, second_s=second_s,
                        compiled_s=compiled_s, after_compiled_s=after_compiled_s, warm_s=warm_s,
                        tokens=hashlib.sha256(repr(tokens).encode()).hexdigest()[:12]).asdict()


def table(rows: list[dict]) -> str:
    def s(value):
        return "-" if value is None else f"{value:.2f}"

    lines = ["| variant | first call s | first token s | second call s | all compiled s | then s | warm s | tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {s(r['first_s'])} | {s(r['first_token_s'])} | {s(r['second_s'])} | "
                     f"{s(r['compiled_s'])} | {s(r['after_compiled_s'])} | {s(r['warm_s'])} | {r['tokens']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

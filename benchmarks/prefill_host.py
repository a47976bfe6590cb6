"""The shipped target's prefill against the lean baseline's, and where its host time goes.

A prefill is compiled without CUDA graphs (its prompt length symbolic), so each kernel is launched
from Python and a small model's prefill is the host's time. This times `Decoder`'s plain prefill
(`Metrics.prefill_seconds`: the host's token lists to the first tokens, synchronised) against
`LeanDecoder`'s, at bs 1 (8 held-out prompts, one at a time, 377-399 tokens) and bs 64 (one
batch), then profiles one more `generate` of 2 tokens (the prefill and one round): its kernels,
their GPU time, the launches, and the host ops of most self time.

    python -m benchmarks.prefill_host lean,specpass,specpass-inline,inductor lean,specpass   # on a GPU

Variants: `lean`; `specpass` (the Decoder's default: repeated layers compiled once); `specpass-inline`
(every layer inline); `inductor` (the Decoder with plain Inductor). The first list runs at bs 1, the
second (may be "") at bs 64. The last lines are a table of the prefill's median ms (5 passes).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import harness
from benchmarks.e2e import TARGET
from benchmarks.lean import LeanDecoder
from models.checkpoint import load
from models.llama import Llama
from models.text import encode, load_prompts
from specpass.loop import Decoder

DECODERS = {"specpass": ("specpass", True), "specpass-inline": ("specpass", False), "inductor": ("inductor", True)}


def make(target: torch.nn.Module, kind: str, bs: int):
    if kind == "lean":
        return LeanDecoder(copy.deepcopy(target), max_batch=bs, max_len=1024)
    compile, regional = DECODERS[kind]
    return Decoder(copy.deepcopy(target), None, k=0, max_batch=bs, max_len=1024, compile=compile,
                   mode="reduce-overhead", regional=regional)


def prefill_ms(decoder, batches: list[list[list[int]]], passes: int = 5) -> float:
    """The median over passes of the mean prefill of a batch."""
    return statistics.median(1e3 * sum(decoder.generate(b, 2).metrics.prefill_seconds for b in batches) / len(batches)
                             for _ in range(passes))


def profiled(decoder, batch: list[list[int]], device: torch.device) -> None:
    """One generate of 2 tokens under torch.profiler: kernels, GPU ms, launches, top host ops."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = harness.now(device)
        decoder.generate(batch, 2)
        wall = 1e3 * (harness.now(device) - start)
    events = prof.key_averages()
    gpu = [e for e in events if e.device_type.name == "CUDA" and e.count]
    host = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)
    launches = sum(e.count for e in events
                   if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"))
    print(f"   profiled generate(2 tokens) {wall:.2f} ms; kernels {sum(e.count for e in gpu)}, "
          f"GPU {sum(e.device_time_total for e in gpu) / 1e3:.2f} ms, launches {launches}")
    for e in host[:14]:
        print(f"     {e.key[:70]:70s} n {e.count:5d} self {e.self_cpu_time_total / 1e3:7.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefill_host", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bs1", type=lambda s: [v for v in s.split(",") if v], help="variants at bs 1")
    parser.add_argument("bs64", type=lambda s: [v for v in s.split(",") if v], nargs="?", default=[],
                        help="variants at bs 64")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    harness.dynamo_limits(1024)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load(Llama, TARGET, device=device, dtype=dtype)
    texts = load_prompts()
    alone = [[encode(t)] for t in texts[:8]]
    print(harness.describe(harness.environment(device, dtype)), "; lengths", [len(b[0]) for b in alone])
    rows = []
    batch64 = [encode(texts[i % len(texts)]) for i in range(64)]
    for bs, batches, kinds in ((1, alone, args.bs1), (64, [batch64], args.bs64)):
        for kind in kinds:
            start = time.perf_counter()
            decoder = make(target, kind, bs)
            for _ in range(2):
                for batch in batches:
                    decoder.generate(batch, 2)
            compile_s = time.perf_counter() - start
            ms = prefill_ms(decoder, batches)
            rows.append((bs, kind, ms))
            print(f"bs {bs} {kind}: prefill {ms:.2f} ms (compile {compile_s:.0f} s)", flush=True)
            profiled(decoder, batches[0], device)
            del decoder
    print("| bs | variant | prefill ms |")
    for bs, kind, ms in rows:
        print(f"| {bs} | {kind} | {ms:.2f} |")


if __name__ == "__main__":
    main()

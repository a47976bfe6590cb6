"""Sampling reads of the logits: eager, plain Inductor and specpass, against Inductor's bare arg-max.

    python benchmarks/sampling.py --out sampling.json                  # GPU sweep (H100: ~5 min)
    python benchmarks/sampling.py --dtype float32 --bs 16 256 1280 --vocab 151936
    python benchmarks/sampling.py --device cpu --quick                 # smoke test, small sizes

The forms (each what an engine writes):
  top1      softmax(x).topk(1): the drafted token and its probability (greedy EAGLE drafting)
  argmax    softmax(x).argmax(-1): the token alone
  logprob   log_softmax(x).argmax(-1) and the log-probability gathered at it (a sampled token's)
  verify    log_softmax(x).gather(-1, ids): the target's log-probability of K drafted tokens

Each is compiled for one static shape at a time (Dynamo is reset between shapes) and checked
against eager on tie-free logits (each row's maximum lifted 1.0 above the rest). Times are medians
in microseconds per call: on CUDA, triton.testing.do_bench (L2 flushed between calls) of a
CUDA-graph replay of one call (--no-graphs: plain calls); on CPU, perf_counter. "bw" is the
logits' bytes over specpass's time, as a fraction of the device's peak memory bandwidth; "/ argmax"
is specpass's time over Inductor's bare `argmax` of the same logits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import specpass  # noqa: E402

K = 4  # drafted tokens read by `verify`


def top1(x):
    return torch.softmax(x, -1).topk(1)


def argmax(x):
    return torch.softmax(x, -1).argmax(-1)


def logprob(x):
    logprobs = torch.log_softmax(x, -1)
    token = logprobs.argmax(-1)
    return token, logprobs.gather(-1, token[:, None])


def verify(x, ids):
    return torch.log_softmax(x, -1).gather(-1, ids)


def bare_argmax(x):
    return x.argmax(-1)


FORMS = {"top1": top1, "argmax": argmax, "logprob": logprob, "verify": verify}
VARIANTS = {"eager": None, "inductor": "inductor", "specpass": specpass}  # name: torch.compile backend


def logits_for(bs: int, vocab: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(bs * 1_000_003 + vocab)
    x = torch.randn(bs, vocab, generator=g)
    top = torch.randint(0, vocab, (bs,), generator=g)
    x[torch.arange(bs), top] = x.amax(dim=-1) + 1.0  # a unique maximum, clear of softmax rounding
    return x.to(device=device, dtype=dtype)


def peak_bandwidth(device: str) -> float | None:
    """Bytes/s the device's memory moves at most: 2 transfers per clock over the bus."""
    if not device.startswith("cuda"):
        return None
    props = torch.cuda.get_device_properties(device)
    clock, width = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)  # kHz, bits
    return 2 * clock * 1e3 * width / 8 if clock and width else None


def timer(device: str, quick: bool, graphs: bool):
    if not device.startswith("cuda"):
        return lambda fn: _wall(fn, 3 if quick else 50)
    from triton.testing import do_bench

    measure = lambda fn: 1e3 * do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100,  # noqa: E731
                                        return_mode="median")
    return (lambda fn: measure(_graphed(fn))) if graphs else measure


def _graphed(fn):
    """One call captured in a CUDA graph; returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _wall(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def run_shape(bs: int, vocab: int, dtype: torch.dtype, device: str, quick: bool, graphs: bool) -> dict:
    x = logits_for(bs, vocab, device, dtype)
    ids = torch.randint(0, vocab, (bs, K), device=device, generator=torch.Generator(device=device).manual_seed(0))
    bench = timer(device, quick, graphs)
    row: dict = {"bs": bs, "vocab": vocab, "dtype": str(dtype).removeprefix("torch."), "us": {}}
    torch._dynamo.reset()
    with torch.no_grad():
        bare = torch.compile(bare_argmax, dynamic=False, fullgraph=True)
        bare(x)
        row["us"]["inductor_argmax"] = bench(lambda: bare(x))
        for form, fn in FORMS.items():
            args = (x, ids) if form == "verify" else (x,)
            outputs = {}
            for name, backend in VARIANTS.items():
                call = fn if backend is None else torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)
                outputs[name] = call(*args)
                row["us"][f"{form}/{name}"] = bench(lambda: call(*args))
            for name in ("inductor", "specpass"):
                for got, want in zip(torch.utils._pytree.tree_leaves(outputs[name]),
                                     torch.utils._pytree.tree_leaves(outputs["eager"]), strict=True):
                    if want.is_floating_point():
                        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
                    else:
                        assert torch.equal(got, want), f"{form}/{name}: indices differ from eager at {bs} x {vocab}"
    return row


def table(rows: list[dict], peak: float | None) -> str:
    lines = ["| dtype | bs | vocab | Inductor argmax | form | eager | Inductor | specpass | specpass bw "
             "| specpass / argmax | Inductor / specpass |", "|---" * 11 + "|"]
    for r in rows:
        t, size = r["us"], r["bs"] * r["vocab"] * (2 if r["dtype"] in ("bfloat16", "float16") else 4)
        for form in FORMS:
            ours = t[f"{form}/specpass"]
            bw = f"{size / (ours * 1e-6) / peak:.2f}" if peak else "-"
            lines.append(f"| {r['dtype']} | {r['bs']} | {r['vocab']} | {t['inductor_argmax']:.1f} | {form} "
                         f"| {t[f'{form}/eager']:.1f} | {t[f'{form}/inductor']:.1f} | {ours:.1f} | {bw} "
                         f"| {ours / t['inductor_argmax']:.2f} | {t[f'{form}/inductor'] / ours:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes and few iterations (smoke test)")
    parser.add_argument("--bs", type=int, nargs="+", default=None, help="default: 1 16 64 256 1280")
    parser.add_argument("--vocab", type=int, nargs="+", default=None, help="default: 32000 128256 151936")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--no-graphs", action="store_true", help="CUDA: time plain calls, not graph replays")
    parser.add_argument("--out", type=Path, default=None, help="write all results as JSON here")
    args = parser.parse_args()

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("CUDA is not available; use --device cpu --quick for a smoke test")
    bss = args.bs or ([1, 16] if args.quick else [1, 16, 64, 256, 1280])
    vocabs = args.vocab or ([1000, 32000] if args.quick else [32000, 128256, 151936])
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    peak = peak_bandwidth(args.device)
    print(f"device: {name}; torch {torch.__version__}; peak bandwidth {f'{peak / 1e12:.2f} TB/s' if peak else '-'}",
          flush=True)

    t0 = time.perf_counter()
    rows = []
    for vocab in vocabs:
        for bs in bss:
            rows.append(run_shape(bs, vocab, dtype, args.device, args.quick, not args.no_graphs))
            print(f"{args.dtype} bs={bs} vocab={vocab}: " + ", ".join(f"{k} {v:.1f}" for k, v in rows[-1]["us"].items()),
                  flush=True)
    graphs = args.device.startswith("cuda") and not args.no_graphs
    meta = {"device": name, "torch": torch.__version__, "peak_bandwidth": peak, "cuda_graphs": graphs,
            "quick": args.quick, "seconds": round(time.perf_counter() - t0, 1), "command": " ".join(sys.argv)}
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        print(f"wrote {args.out}")
    how = "CUDA-graph replay" if graphs else "plain calls"
    print(f"\nmedian us per call, {how} ({name}, torch {torch.__version__}, {meta['seconds']} s):\n")
    print(table(rows, peak))


if __name__ == "__main__":
    main()

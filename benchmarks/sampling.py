"""softmax -> topk(1) on bf16 logits: eager, plain Inductor, specpass, and hand-written arg-max.

    python benchmarks/sampling.py --out sampling.json            # GPU sweep (H100: ~2-3 min)
    python benchmarks/sampling.py --device cpu --quick           # smoke test, small sizes

Every variant is compiled for one static shape at a time (dynamo is reset between shapes).
specpass's indices are checked against eager's on tie-free logits (each row's maximum is lifted
1.0 above the rest, so neither the input nor softmax rounding makes ties; docs/passes.md says
what happens with ties). Times are medians, in microseconds per call, measured side by side in
one process: on CUDA, triton.testing.do_bench (L2 flushed between calls) of a CUDA-graph replay
of one call, so the numbers are GPU time, not Python/launch overhead (--no-graphs times plain
calls); on CPU, perf_counter. The log line of each shape also gives each variant's kernel count.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import specpass  # noqa: E402


def sample(logits):
    """What a greedy draft step does (SGLang before PR 26235)."""
    probs = torch.softmax(logits, dim=-1)
    return probs.topk(1, dim=-1)


def hand_argmax(logits):
    """SGLang's hand fix, values aside: the arg-max alone."""
    return logits.argmax(dim=-1, keepdim=True)


def hand_exact_lse(logits):
    """Arg-max plus the exact probability, as one would write it: exp(max - logsumexp)."""
    x = logits.float()
    top, idx = x.max(dim=-1, keepdim=True)
    return torch.exp(top - torch.logsumexp(x, dim=-1, keepdim=True)).to(logits.dtype), idx


def hand_exact_fused(logits):
    """Arg-max plus the exact probability in the best form found for Inductor: 1 / sum(exp(x - max))."""
    x = logits.float()
    m = x.amax(dim=-1, keepdim=True)
    z = torch.exp(x - m).sum(dim=-1, keepdim=True)
    return z.reciprocal().to(logits.dtype), logits.argmax(dim=-1, keepdim=True)


VARIANTS = {
    # name: (function, torch.compile backend; None runs eagerly)
    "eager": (sample, None),
    "inductor": (sample, "inductor"),
    "specpass": (sample, specpass),
    "specpass_ones": (sample, specpass.backend(max_probs="ones")),
    "hand_argmax": (hand_argmax, "inductor"),
    "hand_exact_lse": (hand_exact_lse, "inductor"),
    "hand_exact_fused": (hand_exact_fused, "inductor"),
}


def logits_for(bs: int, vocab: int, device: str) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(bs * 1_000_003 + vocab)
    x = torch.randn(bs, vocab, generator=g)
    top = torch.randint(0, vocab, (bs,), generator=g)
    x[torch.arange(bs), top] = x.amax(dim=-1) + 1.0  # a unique maximum, clear of softmax rounding
    return x.to(device=device, dtype=torch.bfloat16)


def timer(device: str, quick: bool, graphs: bool):
    if not device.startswith("cuda"):
        return lambda fn: _wall(fn, 3 if quick else 50)
    try:
        from triton.testing import do_bench

        measure = lambda fn: 1e3 * do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100,  # noqa: E731
                                            return_mode="median")
    except ImportError:
        measure = lambda fn: _cuda_events(fn, 20 if quick else 200)  # noqa: E731
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


def _cuda_events(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _wall(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _kernels(code: str) -> int:
    return len(re.findall(r"(?:triton_\w+)\.run\(|^\s+cpp_fused_\w+\(", code, re.M)) + code.count("extern_kernels.") + \
        len(re.findall(r"torch\.ops\.aten\.\w+\.default\(", code))


def run_shape(bs: int, vocab: int, device: str, quick: bool, mode: str | None, graphs: bool) -> dict:
    torch._dynamo.reset()
    x = logits_for(bs, vocab, device)
    bench = timer(device, quick, graphs)
    row: dict = {"bs": bs, "vocab": vocab, "us": {}, "kernels": {}}
    outputs = {}
    for name, (fn, backend) in VARIANTS.items():
        with torch.no_grad():
            if backend is None:
                call = fn
                outputs[name] = call(x)
            else:
                call = torch.compile(fn, backend=backend, mode=mode, dynamic=False, fullgraph=True)
                outputs[name], codes = run_and_get_code(call, x)  # compiles
                row["kernels"][name] = _kernels("\n".join(codes))
            row["us"][name] = bench(lambda: call(x))
    ref_p, ref_i = outputs["eager"]
    for name in ("specpass", "specpass_ones", "inductor"):
        p, i = outputs[name]
        assert torch.equal(i, ref_i), f"{name} indices differ from eager at bs={bs} vocab={vocab}"
        assert p.shape == ref_p.shape and p.dtype == ref_p.dtype, name
    torch.testing.assert_close(outputs["specpass"][0].float(), ref_p.float(), rtol=1e-2, atol=0)
    assert torch.equal(outputs["hand_argmax"], ref_i)
    return row


def table(rows: list[dict]) -> str:
    head = ("| bs | vocab | eager softmax+topk | Inductor softmax+topk | specpass (exact) | specpass (ones) "
            "| hand argmax | hand argmax+exact (lse) | hand argmax+exact (fused) "
            "| specpass exact / best hand exact | specpass ones / hand argmax |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        t = r["us"]
        best = min(t["hand_exact_lse"], t["hand_exact_fused"])
        cells = [t[k] for k in ("eager", "inductor", "specpass", "specpass_ones", "hand_argmax",
                                "hand_exact_lse", "hand_exact_fused")]
        lines.append(f"| {r['bs']} | {r['vocab']} | " + " | ".join(f"{c:.1f}" for c in cells)
                     + f" | {t['specpass'] / best:.3f} | {t['specpass_ones'] / t['hand_argmax']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes and few iterations (smoke test)")
    parser.add_argument("--bs", type=int, nargs="+", default=None, help="default: 1 16 64 256")
    parser.add_argument("--vocab", type=int, nargs="+", default=None, help="default: 32000 128256 151936")
    parser.add_argument("--mode", default=None, help="torch.compile mode for every compiled variant")
    parser.add_argument("--no-graphs", action="store_true", help="CUDA: time plain calls, not graph replays")
    parser.add_argument("--out", type=Path, default=None, help="write all results as JSON here")
    args = parser.parse_args()

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("CUDA is not available; use --device cpu --quick for a smoke test")
    bss = args.bs or ([1, 16] if args.quick else [1, 16, 64, 256])
    vocabs = args.vocab or ([1000, 32000] if args.quick else [32000, 128256, 151936])
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device: {name}; torch {torch.__version__}", flush=True)

    t0 = time.perf_counter()
    rows = []
    for vocab in vocabs:
        for bs in bss:
            rows.append(run_shape(bs, vocab, args.device, args.quick, args.mode, not args.no_graphs))
            us, kernels = rows[-1]["us"], rows[-1]["kernels"]
            print(f"bs={bs} vocab={vocab}: " + ", ".join(
                f"{k} {v:.1f}" + (f" ({kernels[k]}k)" if k in kernels else "") for k, v in us.items()), flush=True)
    graphs = args.device.startswith("cuda") and not args.no_graphs
    meta = {"device": name, "torch": torch.__version__, "mode": args.mode, "quick": args.quick, "cuda_graphs": graphs,
            "seconds": round(time.perf_counter() - t0, 1), "command": " ".join(sys.argv)}
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        print(f"wrote {args.out}")
    how = "CUDA-graph replay" if graphs else "plain calls"
    print(f"\nmedian us per call, {how} ({name}, torch {torch.__version__}, {meta['seconds']} s):\n")
    print(table(rows))


if __name__ == "__main__":
    main()

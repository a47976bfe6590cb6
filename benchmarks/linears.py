"""A model's linears at a few rows, timed as a decode step or a verify runs them: cuBLAS
(`F.linear`), the library's GEMV kernel (what `torch.ops.specpass.gemv` runs at up to
`MAX_ROWS` rows, timed here at every row count: where that bound belongs), exact
mode's row-invariant linear (`torch.ops.specpass.exact_linear`: tiles of 16 to 64 rows through
tensor cores, K split to fill the GPU) and Inductor's own mul-sum reduction. The numbers behind the
gemv pass (docs/passes.md#gemv), and whether a tiled kernel would beat cuBLAS at a verify's rows.

Each figure is µs a call from one CUDA graph of 32 calls, each reading another copy of the weight
(the copies 400 MB or more together, past L2), as a step reads a new layer's weight each call: the
median of 20 replays after 3. The floor is the weight's bytes at the copy bandwidth measured in the
same run. The last row of each table adds a step's linears up (each layer's, times the layers,
and lm_head once).

    python -m benchmarks.linears                             # llama3-8b, 1 to 16 rows, on a GPU
    python -m benchmarks.linears --model tiny-llama --rows 1 --out linears.json
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F

import specpass.kernels  # noqa: F401  registers torch.ops.specpass.gemv and exact_linear
from benchmarks import harness
from benchmarks.scale.floors import ceilings
from models import zoo

CALLS = 32
COPIES_BYTES = 400e6
FORMS = ("cublas", "gemv", "exact_linear", "inductor")


def shapes(name: str) -> dict[str, tuple[int, int, int]]:
    """linear -> (N, K, calls a step) of the zoo model `name`, its q/k/v and gate/up fused."""
    c = zoo.config(name)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    layers = c.num_hidden_layers
    return {"qkv": (q + 2 * kv, c.hidden_size, layers), "o": (c.hidden_size, q, layers),
            "gate_up": (2 * c.intermediate_size, c.hidden_size, layers),
            "down": (c.hidden_size, c.intermediate_size, layers), "lm_head": (c.vocab_size, c.hidden_size, 1)}


def inductor_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The linear as a reduction Inductor generates itself: x's rows against w's, summed in fp32."""
    return (x.float()[:, None, :] * w.float()).sum(-1).to(x.dtype)


def time_linear(n: int, k: int, rows: int, dtype: torch.dtype, names: list[str]) -> dict[str, float]:
    from specpass.kernels import triton_gemv  # Triton: on a GPU only

    copies = max(2, math.ceil(COPIES_BYTES / (n * k * dtype.itemsize)))
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    compiled = torch.compile(inductor_linear, dynamic=False)
    forms = dict(cublas=lambda w: F.linear(x, w), gemv=lambda w: triton_gemv.gemv(x, [w], None),
                 exact_linear=lambda w: torch.ops.specpass.exact_linear(x, w), inductor=lambda w: compiled(x, w))
    want = F.linear(x.double(), weights[0].double())
    out = {}
    for name in names:
        form = forms[name]
        err = (form(weights[0]).double() - want).abs().max().item()
        assert err <= 2 ** -7 * want.abs().max().item(), (name, n, k, rows, err)
        calls = [(lambda w=weights[i % copies]: form(w)) for i in range(CALLS)]
        out[name] = 1e3 * harness.graph_ms(calls)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.linears", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b", choices=list(zoo.CONFIGS))
    parser.add_argument("--rows", default="1,2,4,5,9,16", type=lambda s: [int(r) for r in s.split(",")],
                        help="rows a call: a decode step's batch, or a verify's K + 1 (5 and 9: K 4 and K 8 at bs 1)")
    parser.add_argument("--forms", default="cublas,gemv,exact_linear", type=lambda s: s.split(","),
                        help=f"comma-separated, of {list(FORMS)} (inductor compiles once per shape and rows)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if set(args.forms) - set(FORMS):
        parser.error(f"unknown forms {sorted(set(args.forms) - set(FORMS))}; known: {list(FORMS)}")
    if not torch.cuda.is_available():
        raise SystemExit("CUDA is not available: this benchmark times CUDA kernels (run it on a GPU)")
    dtype = getattr(torch, args.dtype)
    harness.dynamo_limits(len(args.rows) * len(shapes(args.model)))  # inductor: one graph per shape and rows
    env = harness.environment("cuda", dtype, model=args.model)
    bandwidth = ceilings(torch.device("cuda"))["bandwidth"]
    print(harness.describe(env), f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    save, result = harness.saver(args.out), dict(env=env, bandwidth=bandwidth, rows=[])
    for rows in args.rows:
        print(f"\n{rows} row(s): µs a call (/ floor)\n")
        print("| linear (N x K) | floor | " + " | ".join(args.forms) + " |\n" + "|---" * (len(args.forms) + 2) + "|")
        step = dict.fromkeys(("floor", *args.forms), 0.0)
        for name, (n, k, calls) in shapes(args.model).items():
            floor = 1e6 * n * k * dtype.itemsize / bandwidth
            us = time_linear(n, k, rows, dtype, args.forms)
            result["rows"].append(dict(rows=rows, linear=name, n=n, k=k, floor_us=floor,
                                       **{f"{form}_us": t for form, t in us.items()}))
            save(result)
            for form, t in dict(floor=floor, **us).items():
                step[form] += calls * t
            cells = [f"{us[f]:.1f} ({us[f] / floor:.2f}x)" for f in args.forms]
            print(f"| {name} ({n} x {k}) | {floor:.1f} | " + " | ".join(cells) + " |")
        cells = [f"{step[f]:.0f} ({step[f] / step['floor']:.3f}x)" for f in args.forms]
        print(f"| a step's linears | {step['floor']:.0f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

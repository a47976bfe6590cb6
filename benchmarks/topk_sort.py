"""Top-k of short rows under Inductor: `topk` (handed to ATen's kernels) against a stable `sort` and
a slice (one Triton kernel), bare and after a log_softmax, as a tree round's draft steps and
re-ranks make them. µs per call, 20 calls in one CUDA graph; k 4, bf16 rows. The numbers behind
the topk_sort pass (docs/passes.md#topk-as-sort).

    python -m benchmarks.topk_sort        # on a GPU
"""

from __future__ import annotations

import torch

from benchmarks import harness


def topk(x, k):
    return torch.log_softmax(x.float(), -1).topk(k, -1)


def sort(x, k):
    s = torch.log_softmax(x.float(), -1).sort(dim=-1, descending=True, stable=True)
    return s.values[:, :k], s.indices[:, :k]


def bare_topk(x, k):
    return x.topk(k, -1)


def bare_sort(x, k):
    s = x.sort(dim=-1, descending=True, stable=True)
    return s.values[:, :k], s.indices[:, :k]


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("CUDA is not available: this benchmark times CUDA kernels (run it on a GPU)")
    torch._dynamo.config.cache_size_limit = 256  # one compile per function and size
    print(harness.describe(harness.environment("cuda", torch.bfloat16)))
    print("| rows x row | log_softmax -> topk | log_softmax -> sort, slice | bare topk | bare sort, slice |")
    print("|---|---|---|---|---|")
    for rows in (4, 32, 256):
        for n in (16, 64, 128, 258, 512):
            x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
            us = []
            for fn in (topk, sort, bare_topk, bare_sort):
                compiled = torch.compile(fn, dynamic=False)
                compiled(x, 4)
                us.append(1e3 * harness.graph_ms([lambda: compiled(x, 4)] * 20))
            print(f"| {rows} x {n} | " + " | ".join(f"{u:.1f}" for u in us) + " |", flush=True)


if __name__ == "__main__":
    main()

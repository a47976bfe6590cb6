"""Top-k of short rows under Inductor: `topk` (handed to ATen's kernels), a stable `sort` and a slice
(one Triton kernel), and what specpass's backend makes of `topk` (the topk_sort pass: k rounds of
selection for k <= 8 on rows longer than 256, else the sort), bare and after a log_softmax, as a
tree round's draft steps and re-ranks make them. µs per call, 20 calls in one CUDA graph; bf16
rows. The numbers behind the topk_sort pass (docs/passes.md#topk-as-sort).

    python -m benchmarks.topk_sort        # on a GPU
"""

from __future__ import annotations

import torch

import specpass
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


SPELLINGS = {  # column -> (function, backend)
    "log_softmax -> topk": (topk, "inductor"), "log_softmax -> sort, slice": (sort, "inductor"),
    "log_softmax -> topk, specpass": (topk, "specpass"),
    "bare topk": (bare_topk, "inductor"), "bare sort, slice": (bare_sort, "inductor"),
    "bare topk, specpass": (bare_topk, "specpass"),
}


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("CUDA is not available: this benchmark times CUDA kernels (run it on a GPU)")
    torch._dynamo.config.cache_size_limit = 256  # one compile per function and size
    print(harness.describe(harness.environment("cuda", torch.bfloat16)))
    print("| rows x row, k | " + " | ".join(SPELLINGS) + " |")
    print("|---" * (len(SPELLINGS) + 1) + "|")
    for rows in (4, 32):
        for n in (16, 258, 512):
            for k in (4, 8):
                x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
                us = []
                for fn, backend in SPELLINGS.values():
                    compiled = torch.compile(fn, dynamic=False,
                                             backend=specpass.backend() if backend == "specpass" else backend)
                    torch.testing.assert_close(compiled(x, k)[0], fn(x, k)[0])
                    us.append(1e3 * harness.graph_ms([lambda: compiled(x, k)] * 20))
                print(f"| {rows} x {n}, {k} | " + " | ".join(f"{u:.1f}" for u in us) + " |", flush=True)


if __name__ == "__main__":
    main()

"""specpass options: one validated record shared by `rewrite`, `explain` and the backend."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Options:
    # Pass switches, one per module in specpass/passes (names match PASSES in pipeline.py).
    argmax: bool = True
    live_rows: bool = True
    # Attention on a head-repeated K/V copy reads the un-repeated heads instead (enable_gqa).
    gqa: bool = True
    # A grouped-query attention of a few static tokens per request (a verify) runs as the split-KV
    # kernel (torch.ops.specpass.attend_split) instead of SDPA, on CUDA.
    split_kv: bool = True
    # A topk over a short static row (<= 512) runs as a stable sort and a slice, on CUDA: Inductor
    # lowers that to one Triton kernel instead of ATen's two top-k kernels.
    topk_sort: bool = True
    # A linear of one row (up to 4 of a small weight; symbolic rows settled per call) runs as the
    # library's one-pass GEMV kernel (torch.ops.specpass.gemv) instead of cuBLAS, on CUDA, where a
    # CUDA graph replays the step (the backend turns it and gemv_group off elsewhere).
    gemv: bool = True
    # gemv: the linears of one input (q, k and v; gate and up) in one launch, `gemv_group`: at most 4,
    # static rows. Measured in a step: docs/results.md, the linears of one input in one launch.
    gemv_group: bool = True
    # Repeated layers compiled once: the next layer's head (its norm) moves into each layer's body,
    # so that Inductor fuses it with the residual add that ends the layer (one kernel per seam).
    seams: bool = True
    # An attention's boolean mask converted to the additive mask its kernel reads once, where the
    # mask is made, instead of inside every attention call (in every layer's body).
    masks: bool = True
    # live_rows: also gather attention's query rows (exact with K/V read from the cache).
    # Off keeps the gather after attention, for kernels that need as many queries as K/V rows.
    q_slice: bool = True
    # live_rows: split a fused projection (QKV, gate_up) whose column blocks have different needs
    # (K/V on every row, Q on the live rows) into one matmul per block over the weight's rows.
    split_projections: bool = True
    # ... when it runs on at least this many rows. Below, the matmul is bound by reading its weight
    # (the same bytes whatever the rows), so a split saves no time and adds a launch
    # (benchmarks/catchup.py --fused-qkv; docs/results.md, the catch-up step's fused QKV split).
    split_min_rows: int = 512
    # argmax: "exact" keeps exp(top_x - logsumexp(x)); "ones" replaces used probability
    # values by 1 (only when the caller states the values do not matter).
    max_probs: str = "exact"
    # argmax: which index on ties among the probabilities. "input": the largest softmax input,
    # the first among equal inputs (eager's index wherever its maximum probability is unique).
    # "eager": eager's index, the first probability equal to the maximum after rounding.
    argmax_ties: str = "input"
    # Exact mode: every op that adds floats runs as a row-invariant kernel (passes/exact.py), and
    # a graph that cannot be made so is refused. Turns split_kv off (its kernel splits by rows),
    # gemv and gemv_group (exact mode's own linear is row-invariant).
    exact: bool = False
    # Backend only: "inductor" compiles the rewritten graph, "eager" runs it as is.
    handoff: str = "inductor"
    # Backend only: Inductor's programmatic dependent launch (`triton.enable_pdl`, where this torch
    # has it; Inductor emits it on sm90 and newer): a Triton kernel launches while the one before it
    # ends and waits for its results in the kernel, which hides part of each launch's latency.
    pdl: bool = False
    # Backend only: Inductor's coordinate-descent tuning (`coordinate_descent_tuning`): each Triton
    # kernel's block sizes and warps searched around its heuristic choice, timed at compile time.
    coordinate_descent: bool = False

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def make(cls, **options: Any) -> "Options":
        unknown = sorted(set(options) - set(cls.names()))
        if unknown:
            raise TypeError(
                f"unknown specpass option(s) {unknown}; valid options are {cls.names()}"
            )
        for name in (f.name for f in dataclasses.fields(cls) if f.type == "bool"):  # the switches
            if name in options and not isinstance(options[name], bool):
                raise ValueError(f"specpass option {name}= must be True or False, got {options[name]!r}")
        if "split_min_rows" in options and (not isinstance(options["split_min_rows"], int)
                                            or isinstance(options["split_min_rows"], bool)
                                            or options["split_min_rows"] < 0):
            raise ValueError(f"specpass option split_min_rows= must be an int >= 0, got {options['split_min_rows']!r}")
        choices = {"max_probs": ("exact", "ones"), "argmax_ties": ("input", "eager"), "handoff": ("inductor", "eager")}
        for name, allowed in choices.items():
            if name in options and options[name] not in allowed:
                raise ValueError(
                    f"specpass option {name}= must be one of {list(allowed)}, got {options[name]!r}"
                )
        if options.get("exact"):
            for name, why in _OFF_IN_EXACT.items():
                if options.get(name):
                    raise ValueError(f"specpass options exact=True and {name}=True: {why}; leave {name} out")
            options = {**options, **dict.fromkeys(_OFF_IN_EXACT, False)}
        return cls(**options)

    def chosen(self) -> dict[str, Any]:
        """The options off their defaults: what was asked for, to merge under other options (a default
        is no choice, so a later exact=True turns split_kv off instead of clashing with it)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}


# The switches exact mode turns off, and why each cannot run in it.
_OWN_LINEAR = "exact mode runs every linear as its row-invariant kernel"
_OFF_IN_EXACT = {"split_kv": "the split-KV kernel splits the slots by the rows' count, which exact mode forbids",
                 "gemv": _OWN_LINEAR, "gemv_group": _OWN_LINEAR}

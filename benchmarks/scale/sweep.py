"""The sweep: ceilings, the attention and GEMM microbenchmarks, then per point each variant built,
timed and dropped in turn, and tune_k's choice (see the package doc). -> the JSON `--plot` reads."""

from __future__ import annotations

import json
import sys
import time

from benchmarks import harness
from benchmarks.scale.attention import attention_bench, kernel_profile
from benchmarks.scale.floors import ceilings, floors, gemm_floor
from benchmarks.scale.rounds import Bench, RoundRow
from benchmarks.scale.tune import tune_point
from specpass.loop import cache_slots

SHIPPED = {  # --drafter -> its measured acceptance: a file and the rows of it that hold it
    "eagle3": (harness.ROOT / "docs" / "e2e.json", dict(variant="eagle3/specpass-fused", dtype="bfloat16")),
    "parallel": (harness.ROOT / "docs" / "acceptance_parallel3.json", dict(kind="parallel")),  # the two-layer head
    "block": (harness.ROOT / "docs" / "e2e_dflash.json", dict(variant="dflash/specpass-fused", dtype="bfloat16"))}
# variant -> (its compiler: "specpass", "inductor" or specpass options; one graph per round)
VARIANTS = {"decode": ("specpass", True), "lean": ("lean", True), "specpass": ("specpass", True),
            "inductor": ("inductor", True),
            "specpass-no-split-kv": (dict(split_kv=False), True), "apart": ("specpass", False),
            **{f"{step}+{suffix}": (options, True)  # at --paired-at points: a switch of --paired flipped
               for suffix, options in map(harness.flipped, harness.PAIRED) for step in ("decode", "specpass")}}
START = time.perf_counter()


def shipped_acceptance(drafter: str = "eagle3") -> list[float]:
    """Acceptance per draft position of the shipped head: the chain head's from its bf16 fused specpass
    run on the H100, the parallel head's from the 32 held-out prompts (fp32: bf16 rounds leave the
    greedy text early at bs 1); the run with the most positions, and beyond it each position keeps
    the last measured conditional rate. The block draft's: its bf16 run at the largest K (its drafts
    depend on K: each K's acceptance is its own, and the largest block's is what --k-sweep projects)."""
    path, match = SHIPPED[drafter]
    rows = [r for r in json.loads(path.read_text())
            if all(r.get(key) == value for key, value in match.items()) and r["acceptance"]]
    best = max(rows, key=lambda r: (len(r["acceptance"]), r.get("bs", 0)))
    acc = list(best["acceptance"])
    rate = acc[-1] / acc[-2]
    while len(acc) < 8:
        acc.append(acc[-1] * rate)
    return acc


def sweep(args, save) -> dict:
    bench = Bench(args)
    dev = bench.device
    env = harness.environment(dev, next(bench.target.parameters()).dtype, drafter=args.drafter,
                              head_layers=bench.head.config.num_hidden_layers)
    with harness.exclusive(args.gpu_lock):
        ceiling = ceilings(dev)
    bench.release()  # the 4 GB it copied, for processes side by side
    result = dict(env=env, ceilings=ceiling, acceptance=shipped_acceptance(args.drafter), rows=[], attention=[],
                  profiles={}, gemm_floor=[])
    print(f"{harness.describe(env)}; ceilings {result['ceilings']}", file=sys.stderr, flush=True)

    def late(what: str) -> bool:
        """True (and `what` recorded as skipped) once the run is past --stop-after seconds: a command's
        time on the device is capped, and a variant started late would be cut off with nothing saved."""
        if time.perf_counter() - START > args.stop_after:
            result.setdefault("skipped", []).append(what)
            return True
        return False

    short, long = args.new_tokens
    k_max = max([args.k, *args.k_sweep])
    slots = lambda prompt: max(cache_slots(prompt, long, k) for k in [k_max, *args.trees])  # noqa: E731
    if dev.type == "cuda":
        for (bs, prompt), queries in ((at, q) for at in args.attention_at for q in (1, args.k + 1)):
            with harness.exclusive(args.gpu_lock):
                result["attention"].append(attention_bench(bs, queries, slots(prompt), dev))
            print(f"  attention {result['attention'][-1]}", file=sys.stderr, flush=True)
            save(result)
    for (bs, prompt), k in ((at, k) for at in args.gemm_at for k in args.gemm_ks):
        with harness.exclusive(args.gpu_lock):
            result["gemm_floor"].append(dict(prompt=prompt, **gemm_floor(bench, bs, k, prompt + long // 2, ceiling)))
        save(result)
    for bs, prompt in args.points:
        max_len = slots(prompt)
        context = prompt + long // 2  # slots a request sees, on average over the timed rounds
        prompts = bench.prompts(bs, prompt)
        lean = [] if (bs, prompt) in args.direct_at else [("lean", 0)]  # its prefill's logits: every position's
        runs = [("decode", 0), *lean] + [("specpass", k) for k in [args.k, *(args.k_sweep if (bs, prompt) in args.k_sweep_at
                                                                      else [])]]
        runs += [(variant, args.k) for variant, at in (("inductor", args.inductor_at),
                                                        ("specpass-no-split-kv", args.no_split_kv_at),
                                                        ("apart", args.apart_at)) if (bs, prompt) in at]
        if (bs, prompt) in args.paired_at:  # the decode step and the round with each --paired switch flipped
            for suffix, _ in map(harness.flipped, args.paired):
                runs += [(f"decode+{suffix}", 0), (f"specpass+{suffix}", args.k)]
        if (bs, prompt) in args.tune_at:  # the tuning times specpass at its K
            runs = [r for r in runs if r[0] != "specpass"]
        for variant, k in runs:
            if variant not in args.variants or late(f"{bs}x{prompt} {variant} K {k}"):
                continue
            start = time.perf_counter()
            dec = bench.decoder(bs, max_len, k, *VARIANTS[variant])
            timer = bench.round_ms_direct if (bs, prompt) in args.direct_at else bench.round_ms
            ms, extra = timer(dec, prompts, short, long)
            row = RoundRow(env=env, variant=variant, bs=bs, prompt=prompt, max_len=max_len, k=k, round_ms=ms, **extra,
                           floor_ms=floors(bench.target, bench.head, bs, k, context, result["ceilings"]),
                           seconds=time.perf_counter() - start)
            with harness.exclusive(args.gpu_lock):
                if variant == "apart":
                    row.phase_ms = dec.generate(prompts, long, timing=True).metrics.phase_ms
                if variant != "apart" and (bs, prompt) in args.profile_at and dev.type == "cuda":
                    result["profiles"][f"{bs}x{prompt} {variant} K {k}"] = kernel_profile(dec, prompts, short, long)
            result["rows"].append(row.asdict())
            save(result)
            print(f"  bs {bs} prompt {prompt} {variant} K {k}: {ms:.3f} ms/round ({row.seconds:.0f} s)",
                  file=sys.stderr, flush=True)
            del dec
            bench.release()
        for tree in args.trees:  # the tree round, fused, specpass: its ms against the chain's (report.tree_table)
            if late(f"{bs}x{prompt} {tree}"):
                continue
            start = time.perf_counter()
            dec = bench.decoder(bs, max_len, tree, "specpass", True)
            ms, extra = bench.round_ms(dec, prompts, short, long)
            result.setdefault("trees", []).append(dict(bs=bs, prompt=prompt, tree=str(tree), steps=tree.steps,
                                                       tokens=tree.tokens, round_ms=ms, **extra,
                                                       seconds=time.perf_counter() - start))
            save(result)
            print(f"  bs {bs} prompt {prompt} {tree}: {ms:.3f} ms/round", file=sys.stderr, flush=True)
            del dec
            bench.release()
        if (bs, prompt) in args.tune_at and not late(f"{bs}x{prompt} tune_k"):
            tune_point(bench, args, bs, prompt, result, save, late)
    return result

"""The loop tensor-parallel (issue 34): decode step and rounds at Llama-3-8B and -70B shape, per TP size.

The zoo's target and its EAGLE-3 head (random weights, bf16), both sharded by torch's plan
(`models.tp.tensor_parallel`, built on the meta device: a rank allocates its shard alone, so the
70B target needs no GPU that holds it whole), one process per GPU under torchrun (NCCL); TP 1 is
one process and no group. Every rank runs the same `Decoder(group=)` in lockstep: CUDA graphs
with NCCL's collectives inside, the whole round one graph. A prompt of P tokens: the rounds run
from a one-token prefill with every request moved to position P (`Bench.round_ms_direct`: a
round's shapes are static, its time does not depend on the values in the slots below).

    python -m benchmarks.tp --model 8b --out tp1.json                                   # TP 1
    torchrun --nproc-per-node 2 -m benchmarks.tp --model 8b --out tp2.json              # TP 2
    torchrun --nproc-per-node 4 -m benchmarks.tp --model 70b --points 1x1024 --out tp4.json
    torchrun --nproc-per-node 2 -m benchmarks.tp --device cpu --quick                   # gloo, tiny models
    python -m benchmarks.tp --table tp1.json tp2.json tp4.json --plot tp.png            # the tables, no GPU

Per point (batch size x prompt length), each variant built, compiled, timed and dropped in turn:
  decode     the target alone (K 0): the baseline
  specpass   the fused chain round at --k, specpass backend
  inductor   the same round, plain Inductor (at --inductor-at points)
  tree       the fused tree round of each --trees shape, specpass
The projected speedup is accepted length / (round / decode), at --accepted (the chain's; 3.6 is the
shipped pair's at K 4) and --tree-accepted (each tree's, measured end to end). With the specpass
row comes the catch-up's collective bytes: the head's catch-up step over K + 1 rows per request,
captured, as plain Inductor compiles it and as specpass rewrites it (`catchup_tp.collective_bytes`).
Processes started side by side with one --gpu-lock file take turns to time (rank 0 holds the lock:
its peers wait on its collectives); a decision to skip a late variant is rank 0's, broadcast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import specpass
from benchmarks import harness
from benchmarks.catchup_tp import collective_bytes, step_inputs
from benchmarks.scale.__main__ import points
from benchmarks.scale.rounds import Bench
from specpass.loop import cache_slots

MODELS = {"8b": "llama3-8b", "70b": "llama3-70b"}


START = time.perf_counter()


def process_group(device: str) -> dist.ProcessGroup | None:
    """The group torchrun launched this process into (NCCL on GPUs, gloo on CPU); None alone."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return dist.group.WORLD


def agreed(flag: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Rank 0's flag on every rank: a choice that differed between ranks would hang the collectives."""
    if group is None:
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.broadcast(t, 0, group=group)
    return bool(t.item())


def catch_up_bytes(bench: Bench, bs: int, rows: int, max_len: int) -> dict[str, dict[str, int]]:
    """Bytes per collective of the head's catch-up step over `rows` rows per request: as captured
    (what plain Inductor compiles) and as specpass rewrites it."""
    head = bench.head
    inputs = step_inputs(head.config, bs, rows, max_len, bench.device, next(head.parameters()).dtype, seed=bs)
    graph = specpass.capture(head.catch_up, *inputs)
    return {"inductor": collective_bytes(graph), "specpass": collective_bytes(specpass.rewrite(graph).graph_module)}


def sweep(args, group: dist.ProcessGroup | None, save) -> dict:
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    bench = Bench(args, MODELS[args.model], group)
    dev = bench.device
    env = harness.environment(dev, next(bench.target.parameters()).dtype,
                              model="tiny-llama" if args.quick else MODELS[args.model], tp=world)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if rank == 0 else (lambda *a: None)
    say(harness.describe(env))
    result = dict(env=env, accepted=args.accepted, tree_accepted=dict(zip(map(str, args.trees), args.tree_accepted)),
                  rows=[])
    short, long = args.new_tokens
    for bs, prompt in args.points:
        max_len = max(cache_slots(prompt, long, k) for k in [args.k, *args.trees])
        prompts = bench.prompts(bs, prompt)
        runs = [("decode", 0, "specpass"), ("specpass", args.k, "specpass")]
        runs += [("inductor", args.k, "inductor")] if (bs, prompt) in args.inductor_at else []
        runs += [("tree", tree, "specpass") for tree in args.trees]
        for variant, k, backend in runs:
            if agreed(time.perf_counter() - START > args.stop_after, group, dev):
                result.setdefault("skipped", []).append(f"{bs}x{prompt} {variant} {k}")
                continue
            start = time.perf_counter()
            dec = bench.decoder(bs, max_len, k, backend, True)
            ms, extra = bench.round_ms_direct(dec, prompts, short, long)
            row = dict(variant=variant, k=str(k), bs=bs, prompt=prompt, max_len=max_len, round_ms=ms, **extra,
                       seconds=time.perf_counter() - start)
            if variant == "specpass":
                row["catch_up_bytes"] = catch_up_bytes(bench, bs, args.k + 1, max_len)
            result["rows"].append(row)
            save(result)
            say(f"  TP {world} bs {bs} prompt {prompt} {variant} {k}: {ms:.3f} ms/round ({row['seconds']:.0f} s)")
            del dec
            bench.release()
    return result


def measured(results: list[dict]) -> list[dict]:
    """One entry per (GPU model, model, TP, point) that has a decode and a specpass row: its rows by
    variant ("decode", "specpass", "inductor", "trees"), round / decode and the projections."""
    out = []
    for result in results:
        env, rows = result["env"], result["rows"]
        for bs, prompt in dict.fromkeys((r["bs"], r["prompt"]) for r in rows):
            at = [r for r in rows if (r["bs"], r["prompt"]) == (bs, prompt)]
            one = {v: next((r for r in at if r["variant"] == v), None) for v in ("decode", "specpass", "inductor")}
            if one["decode"] is None or one["specpass"] is None:
                continue
            decode = one["decode"]["round_ms"]
            ratio = one["specpass"]["round_ms"] / decode
            trees = [dict(row=r, ratio=r["round_ms"] / decode, accepted=result["tree_accepted"].get(r["k"]))
                     for r in at if r["variant"] == "tree"]
            for tree in trees:
                tree["projected"] = tree["accepted"] / tree["ratio"] if tree["accepted"] else None
            out.append(dict(gpu=env["device"].removeprefix("NVIDIA ").split()[0],  # "H100", "H200"
                            model=env["model"], tp=env["tp"], bs=bs, prompt=prompt, **one, trees=trees,
                            ratio=ratio, projected=result["accepted"] / ratio))
    return out


def table(results: list[dict]) -> str:
    """One row per (GPU model, model, TP, point): ms per round of each variant, round / decode, the
    projected speedups and the catch-up's collective bytes; then TP's round / decode against TP 1's on
    the same GPU model (files from different hosts may share a table; their times do not compare)."""
    lines = ["| GPU | model | TP | bs | prompt | decode ms | K round ms | / decode | projected | Inductor round ms "
             "| specpass / Inductor | tree | tree ms | / decode | projected "
             "| catch-up collective MB: Inductor -> specpass |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    points = measured(results)
    for p in points:
        chain, inductor = p["specpass"], p["inductor"]
        moved = {v: sum(b.values()) / 1e6 for v, b in chain["catch_up_bytes"].items()}
        for i, tree in enumerate(p["trees"] or [None]):
            cells = [p["gpu"], p["model"], p["tp"], p["bs"], p["prompt"], f"{p['decode']['round_ms']:.3f}",
                     f"{chain['round_ms']:.3f} (K {chain['k']})", f"{p['ratio']:.3f}", f"{p['projected']:.2f}x",
                     f"{inductor['round_ms']:.3f}" if inductor else "-",
                     f"{inductor['round_ms'] / chain['round_ms']:.3f}x" if inductor else "-"]
            if tree is None:
                cells += ["-"] * 4
            else:
                cells += [tree["row"]["k"], f"{tree['row']['round_ms']:.3f}", f"{tree['ratio']:.3f}",
                          f"{tree['projected']:.2f}x" if tree["projected"] else "-"]
            cells.append(f"{moved['inductor']:.2f} -> {moved['specpass']:.2f}" if i == 0 else "")
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += ["", "round / decode at TP N against TP 1 (same GPU, model and point):", "",
              "| GPU | model | TP | bs | prompt | round / decode | TP 1's | ratio |", "|---|---|---|---|---|---|---|---|"]
    ratios = {(p["gpu"], p["model"], p["tp"], p["bs"], p["prompt"]): p["ratio"] for p in points}
    for (gpu, model, tp, bs, prompt), ratio in ratios.items():
        one = ratios.get((gpu, model, 1, bs, prompt))
        if tp != 1 and one:
            lines.append(f"| {gpu} | {model} | {tp} | {bs} | {prompt} | {ratio:.3f} | {one:.3f} | {ratio / one:.3f} |")
    return "\n".join(lines)


def plot(results: list[dict], out: Path) -> None:
    """Round / decode (left) and the projected speedup (right) per measured point: the chain round
    with specpass and with plain Inductor, and the tree round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = measured(results)
    names = [f"{p['model'].removeprefix('llama3-').upper()} TP {p['tp']}\nbs {p['bs']} ({p['gpu']})" for p in points]
    x = range(len(points))
    fig, (cost, speedup) = plt.subplots(2, 1, figsize=(max(8.0, 1.0 * len(points)), 9))  # one row of names each
    bars = {"chain, specpass": [p["ratio"] for p in points],
            "chain, plain Inductor": [p["inductor"]["round_ms"] / p["decode"]["round_ms"] if p["inductor"] else 0
                                      for p in points],
            "tree, specpass": [p["trees"][0]["ratio"] if p["trees"] else 0 for p in points]}
    width = 0.27
    for i, (label, values) in enumerate(bars.items()):
        cost.bar([j + (i - 1) * width for j in x], values, width, label=label)
    cost.axhline(1.25, color="gray", ls="--", lw=0.8, label="goal at 70B TP 4 bs 1 (1.25)")
    cost.set_ylabel("round ms / decode step ms")
    speedup.bar([j - width / 2 for j in x], [p["projected"] for p in points], width, label="chain K 4 at 3.6 accepted")
    speedup.bar([j + width / 2 for j in x], [p["trees"][0]["projected"] or 0 if p["trees"] else 0 for p in points],
                width, label="tree at its accepted length")
    speedup.axhline(2.8, color="gray", ls="--", lw=0.8, label="goal at 70B TP 4 bs 1 (2.8x)")
    speedup.set_ylabel("projected speedup over decoding")
    for ax in (cost, speedup):
        ax.set_xticks(list(x), names, fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("The loop tensor-parallel: Llama-3 shapes, random weights, bf16, prompt 1024 (a missing bar: not run)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", choices=sorted(MODELS), default="8b")
    parser.add_argument("--points", type=points, default=points("1x1024,8x1024,64x1024"), help="BSxPROMPT,...")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--trees", type=harness.tree_shapes, default=harness.tree_shapes("4,5,16"),
                        metavar="TOPK,STEPS,TOKENS;...")
    parser.add_argument("--accepted", type=float, default=3.6, help="the chain's accepted length (projection)")
    parser.add_argument("--tree-accepted", type=lambda s: [float(x) for x in s.split(",") if x], default=[4.95],
                        help="each tree's accepted length, in --trees order")
    parser.add_argument("--inductor-at", type=points, default=None, help="default: every point")
    parser.add_argument("--new-tokens", type=lambda s: tuple(map(int, s.split(","))), default=(8, 40),
                        help="SHORT,LONG: the rounds timed are those between")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-lock", type=Path)
    parser.add_argument("--stop-after", type=float, default=float("inf"),
                        help="seconds: variants not started by then are skipped (a device call is capped)")
    parser.add_argument("--quick", action="store_true", help="tiny models, one point: checks the script runs")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--table", type=Path, nargs="+", help="print the tables of these JSONs and exit")
    parser.add_argument("--plot", type=Path, help="with --table: also draw the points into this image")
    args = parser.parse_args()
    if args.table:
        results = [json.loads(p.read_text()) for p in args.table]
        print(table(results))
        if args.plot:
            plot(results, args.plot)
        return
    if args.quick:
        args.points, args.new_tokens, args.repeats, args.trees = [(2, 16)], (4, 12), 1, harness.tree_shapes("2,2,4")
    args.inductor_at = args.points if args.inductor_at is None else args.inductor_at
    args.drafter, args.head_layers = "eagle3", None  # what Bench reads
    group = process_group(args.device)
    if group is not None and dist.get_rank(group) != 0:
        args.gpu_lock = None  # rank 0 takes turns for the group
    torch.set_grad_enabled(False)
    result = sweep(args, group, harness.saver(args.out if group is None or dist.get_rank(group) == 0 else None))
    if group is None or dist.get_rank(group) == 0:
        print(table([result]))
    if group is not None:
        specpass.destroy_process_group()  # frees the CUDA graphs holding NCCL collectives first: else it waits forever


if __name__ == "__main__":
    main()

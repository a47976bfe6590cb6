"""The command line of `python -m benchmarks.scale` (the package doc says what it measures)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import benchmarks.scale
from benchmarks import harness
from benchmarks.scale.report import plot, tables
from benchmarks.scale.rounds import HEADS
from benchmarks.scale.sweep import VARIANTS, sweep


def point(text: str) -> tuple[int, int]:
    bs, _, prompt = text.partition("x")
    return int(bs), int(prompt)


def points(text: str) -> list[tuple[int, int]]:
    """BSxPROMPT,... (a command line's --points) -> [(bs, prompt), ...]"""
    return [point(p) for p in text.split(",") if p]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=benchmarks.scale.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--points", default="1x64,16x64,64x64,16x4096", type=points, help="BSxPROMPT,...")
    parser.add_argument("--drafter", default="eagle3", choices=sorted(HEADS),
                        help="eagle3: the chain head; parallel: the P-EAGLE head, one draft forward a round; block: a "
                             "DFlash draft of z-lab's Qwen3-8B-DFlash-b16 size (5 layers), one block forward a round "
                             "(tree rounds: the EAGLE-3 head)")
    parser.add_argument("--head-layers", type=int, help="the head's decoder layers (default: the zoo's, one)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--k-sweep", default="", type=ints)
    parser.add_argument("--k-sweep-at", default="", type=points)
    parser.add_argument("--inductor-at", default="64x64,16x4096", type=points)
    parser.add_argument("--apart-at", default="64x64", type=points)
    parser.add_argument("--no-split-kv-at", default="64x64,16x4096", type=points,
                        help="points where specpass also runs without its split-KV kernel (split_kv=False)")
    parser.add_argument("--paired", nargs="+", default=[], choices=harness.PAIRED, metavar="OPTION",
                        help=f"specpass switches, of {list(harness.PAIRED)}: at --paired-at points the decode step "
                             "and specpass's round also run with each flipped from its default, as decode+SUFFIX "
                             f"and specpass+SUFFIX ({harness.paired_suffixes()})")
    parser.add_argument("--paired-at", default="", type=points)
    parser.add_argument("--profile-at", default="64x64,16x4096", type=points)
    parser.add_argument("--attention-at", default="64x64,16x4096", type=points)
    parser.add_argument("--direct-at", default="", type=points,
                        help="points timed without the prefill (it does not fit at 64x4096)")
    parser.add_argument("--gemm-at", default="", type=points,
                        help="points where the target's and head's GEMMs are timed alone (cuBLAS): `gemm_floor`")
    parser.add_argument("--gemm-ks", default="4", type=ints, help="K at --gemm-at")
    parser.add_argument("--trees", default=[], type=harness.tree_shapes, metavar="TOPK,STEPS,TOKENS;...",
                        help="tree rounds timed at every point (fused, specpass), against the chain's K = steps")
    parser.add_argument("--tune-at", default="", type=points, help="points where Decoder.tune_k picks K")
    parser.add_argument("--tune-ks", default="2,4,6", type=ints)
    parser.add_argument("--tune-max-timings", type=int, default=4, help="K tune_k's search may time beyond --tune-ks")
    parser.add_argument("--gpu-lock", type=Path, help="a file: processes sharing it take turns to time")
    parser.add_argument("--stop-after", type=float, default=float("inf"),
                        help="seconds: start no variant after this (the device caps a command's time)")
    parser.add_argument("--variants", default=",".join(VARIANTS), type=lambda s: s.split(","),
                        help=f"comma-separated, of {list(VARIANTS)}")
    parser.add_argument("--new-tokens", default="8,40", type=lambda s: tuple(int(x) for x in s.split(",")),
                        help="SHORT,LONG generates whose difference times the rounds")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny models, one point: checks the script runs")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path, help="draw docs/scale.png from this JSON, print the tables, exit")
    args = parser.parse_args()
    if args.plot:
        result = json.loads(args.plot.read_text())
        plot(result, harness.ROOT / "docs" / "scale.png")
        print(tables(result))
        return
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if args.quick:
        args.points, args.k_sweep, args.k_sweep_at, args.new_tokens, args.repeats = [(2, 16)], [2], [(2, 16)], (4, 12), 1
        args.inductor_at = args.apart_at = args.profile_at = args.no_split_kv_at = args.direct_at = [(2, 16)]
        args.paired, args.paired_at = list(harness.PAIRED), [(2, 16)]
        args.tune_at = args.gemm_at = [(2, 16)]
        args.tune_ks = [1, 2]
    torch.set_grad_enabled(False)
    print(tables(sweep(args, harness.saver(args.out))))


if __name__ == "__main__":
    main()

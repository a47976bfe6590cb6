"""Acceptance per draft position of trained drafters on the held-out prompts, greedy, on the CPU.

    python -m benchmarks.acceptance --k 4,6,8 --out acceptance.json \
        --drafters eagle:checkpoints/stdlib-llama-eagle3,parallel:checkpoints/stdlib-llama-peagle3

Each drafter (KIND:FOLDER, KIND as examples/generate.py's --eagle/--parallel/--draft/--nextn) at
each K decodes the first --prompts held-out prompts (checkpoints/prompts.json) together, --new-tokens
bytes each, with the shipped target in fp32, eager: what is accepted, not how fast. A round's cost
does not depend on the weights, so the accepted length against a GPU run's ms per round gives
the tokens per ms a retrained head would reach (docs/results.md, issue 25).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from benchmarks import harness
from models.checkpoint import load
from models.drafters import KINDS, load_drafter
from models.llama import Llama
from models.text import encode, load_prompts
from specpass.loop import Decoder, cache_slots


@dataclasses.dataclass(kw_only=True)
class AcceptanceRow(harness.Row):
    """One drafter (variant: its kind) at one K on the held-out prompts."""

    drafter: str  # its folder
    kind: str
    k: int
    prompts: int
    new_tokens: int
    accept_length: float
    acceptance: list[float]  # per draft position 1..K


def drafter_spec(text: str) -> tuple[str, Path]:
    kind, sep, folder = text.partition(":")
    if not sep or kind not in KINDS:
        raise argparse.ArgumentTypeError(f"expected KIND:FOLDER with KIND one of {list(KINDS)}, got {text!r}")
    return kind, Path(folder)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.acceptance", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=harness.ROOT / "checkpoints" / "stdlib-llama")
    parser.add_argument("--drafters", required=True, type=lambda s: [drafter_spec(t) for t in s.split(",")])
    parser.add_argument("--k", default="4,6,8", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    target = load(Llama, args.target, dtype=torch.float32)
    env = harness.environment("cpu", torch.float32)
    prompts = [encode(t) for t in load_prompts()[: args.prompts]]
    save, rows = harness.saver(args.out), []
    for kind, folder in args.drafters:
        drafter = load_drafter(target, kind, folder, dtype=torch.float32)
        for k in args.k:
            max_len = cache_slots(max(map(len, prompts)), args.new_tokens, k)
            metrics = Decoder(target, drafter, k=k, max_batch=len(prompts), max_len=max_len,
                              compile="eager").generate(prompts, args.new_tokens).metrics
            rows.append(AcceptanceRow(env=env, variant=kind, drafter=str(folder), kind=kind, k=k, prompts=len(prompts),
                                      new_tokens=args.new_tokens, accept_length=metrics.accept_length,
                                      acceptance=metrics.acceptance).asdict())
            print(f"{folder} K {k}: accepted length {metrics.accept_length:.3f}, per position "
                  f"{' '.join(f'{a:.3f}' for a in metrics.acceptance)}", flush=True)
            save(rows)


if __name__ == "__main__":
    main()

"""Speculative decoding with specpass: a Llama target and an EAGLE-3, NextN/MTP or standalone draft.

    python examples/generate.py                          # CPU, default checkpoints (made on first use)
    python examples/generate.py --check --k 4            # also plain greedy decoding: every token equal?
    python examples/generate.py --target T --eagle E --prompt "Hello" --prompt "Hi there" \\
        --device cuda --dtype bfloat16                   # CUDA graphs (reduce-overhead) by default on GPU

Text goes through a byte-level tokenizer (256 bytes, then <bos> and <eos>). The default checkpoints
are random-weight tiny models (`checkpoints/`, git-ignored) until trained ones ship: their text is
noise and their drafts are rarely accepted; the loop, the numbers and --check are real.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # models/ lives in the repo root

import specpass  # noqa: E402
from models import zoo  # noqa: E402
from models.checkpoint import CheckpointError, save  # noqa: E402
from models.drafters import load_pair  # noqa: E402
from specpass.speculative import COMPILERS, Decoder  # noqa: E402

BOS, EOS = 256, 257
VOCAB = 258  # the byte tokenizer's
DEFAULTS = {"target": ("tiny-llama", ROOT / "checkpoints" / "byte-llama"),
            "eagle": ("tiny-llama-eagle3", ROOT / "checkpoints" / "byte-llama-eagle3")}
PROMPTS = ["The quick brown fox", "Speculative decoding drafts", "Hi"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def encode(text: str) -> list[int]:
    return [BOS, *text.encode("utf-8")]


def decode(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def default_checkpoint(role: str) -> pathlib.Path:
    """The tiny zoo model for `role` with the tokenizer's vocabulary, written on first use."""
    name, directory = DEFAULTS[role]
    if not (directory / "model.safetensors").is_file():
        model = zoo.build(dataclasses.replace(zoo.config(name), vocab_size=VOCAB), seed=0)
        save(model, model.config, directory)
        print(f"wrote default checkpoint {directory.relative_to(ROOT)} ({name}, random weights)", file=sys.stderr)
    return directory


def _collect_reports() -> list[str]:
    """The specpass report of every graph compiled from here on, with a rewrite in it."""
    reports: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if "rewrote" in text:
                reports.append(text)

    logger = logging.getLogger("specpass")
    logger.addHandler(Collect())
    logger.setLevel(logging.INFO)
    return reports


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=pathlib.Path, help="Llama checkpoint folder (default: a tiny one)")
    draft = parser.add_mutually_exclusive_group()
    draft.add_argument("--eagle", type=pathlib.Path, help="EAGLE-3 head folder (the default, with a tiny one)")
    draft.add_argument("--nextn", type=pathlib.Path, help="NextN/MTP layer folder (DeepSeek-V3 or Qwen3.5)")
    draft.add_argument("--draft", type=pathlib.Path, help="standalone Llama draft folder")
    parser.add_argument("--prompt", action="append", help="repeat for a batch (default: three prompts)")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--compile", choices=COMPILERS, default="specpass")
    parser.add_argument("--handoff", choices=["inductor", "eager"],
                        help="what runs the graphs specpass rewrote (default: Inductor on CUDA; on CPU the "
                             "rewritten graphs run eagerly, since Inductor's C++ builds take 30-60 s)")
    parser.add_argument("--fused-round", action="store_true", help="one compiled graph per round")
    parser.add_argument("--check", action="store_true",
                        help="also report whether every token equals plain greedy decoding's")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.target is None and not (args.draft or args.nextn or args.eagle):
        args.target, args.eagle = default_checkpoint("target"), default_checkpoint("eagle")
    elif args.target is None or not (args.draft or args.nextn or args.eagle):
        print("error: pass --target together with one of --eagle, --nextn, --draft (or none of them)", file=sys.stderr)
        return 2
    kind, draft_dir = next((k, getattr(args, k)) for k in ("eagle", "nextn", "draft") if getattr(args, k))
    try:
        target, drafter = load_pair(args.target, kind, draft_dir, device=args.device, dtype=DTYPES[args.dtype])
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if target.config.vocab_size < VOCAB:
        print(f"error: the byte tokenizer needs a vocabulary of {VOCAB}; {args.target} has {target.config.vocab_size}",
              file=sys.stderr)
        return 2

    cuda = torch.device(args.device).type == "cuda"
    args.handoff = args.handoff or ("inductor" if cuda else "eager")
    backend = specpass.backend(handoff=args.handoff) if args.compile == "specpass" else args.compile
    reports = _collect_reports()
    texts = args.prompt or PROMPTS
    prompts = [encode(t) for t in texts]
    shape = dict(max_batch=len(prompts), max_len=max(map(len, prompts)) + args.max_new_tokens + 2 * args.k + 1,
                 compile=backend, mode="reduce-overhead" if cuda and args.handoff == "inductor" else None)
    spec = Decoder(target, drafter, k=args.k, fused_round=args.fused_round, **shape)
    plain = Decoder(target, None, **shape)

    results = {}
    for name, decoder in (("speculative", spec), ("plain", plain)):
        start = time.perf_counter()
        # A few rounds first: they compile every step and, on GPU, record the CUDA graphs.
        decoder.generate(prompts, max_new_tokens=min(8, args.max_new_tokens), eos_id=EOS)
        if args.compile != "eager":
            print(f"{name}: warm-up (compilation) {time.perf_counter() - start:.1f} s", file=sys.stderr)
        results[name] = decoder.generate(prompts, max_new_tokens=args.max_new_tokens, eos_id=EOS, progress=True)

    out, m, base = results["speculative"], results["speculative"].metrics, results["plain"].metrics
    for text, tokens in zip(texts, out.tokens):
        print(f"{text!r} -> {decode(tokens)!r}")
    for report in reports:
        print(report)
    print(f"drafter: {kind} ({draft_dir}), k = {args.k}, compile = {args.compile}"
          f"{f' (handoff {args.handoff})' if args.compile == 'specpass' else ''}"
          f"{' (fused round)' if args.fused_round else ''}, {args.device} {args.dtype}")
    print(f"mean accepted length: {m.accept_length:.2f} tokens per round (at most {args.k + 1})")
    print("acceptance per draft position: " + " ".join(f"{p:.2f}" for p in m.acceptance))
    print(f"tokens/s: speculative {m.tokens_per_s:.1f}, plain target decoding {base.tokens_per_s:.1f} "
          f"({m.tokens_per_s / base.tokens_per_s:.2f}x)")
    if args.check:
        same = out.tokens == results["plain"].tokens
        print(f"check: every token equals plain greedy decoding: {'yes' if same else 'NO'}")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

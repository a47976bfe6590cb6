"""Speculative decoding with specpass: a Llama target and an EAGLE-3, NextN/MTP or standalone draft.

    python examples/generate.py                   # CPU: the shipped pair completes held-out Python code
    python examples/generate.py --check           # also: every token equal to plain greedy decoding?
    python examples/generate.py --draft checkpoints/stdlib-llama-draft --k 3
    python examples/generate.py --target T --nextn N --prompt "def f(x):" --device cuda --dtype bfloat16
    python examples/generate.py --block checkpoints/stdlib-llama-dflash --k 15       # a DFlash block draft
    python examples/generate.py --temperature 0.6 --top-p 0.95 --seed 0   # speculative sampling
    python examples/generate.py --dtype bfloat16 --exact --check   # exact mode: plain's tokens bit for bit

The default pair (checkpoints/, made by examples/train.py) is a 19M-parameter Llama trained on the
Python standard library's source and an EAGLE-3 head trained on its hidden states; the default
prompts are cut from standard-library modules held out of training (checkpoints/prompts.json).
Text goes through a byte-level tokenizer (256 bytes, then <bos> and <eos>). On a GPU the steps run
as CUDA graphs (mode="reduce-overhead") compiled by Inductor; on a CPU the graphs specpass rewrote
run eagerly (Inductor's C++ builds take most of a minute). Speculative and plain decoding are
compiled the same way and timed after a warm-up run; stderr shows each step as it compiles
(--quiet: not). With --temperature > 0 both sample (the same
--top-k, --top-p and --seed); speculative sampling keeps plain sampling's distribution exactly.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # models/ lives in the repo root

import specpass  # noqa: E402
from models.checkpoint import CheckpointError  # noqa: E402
from models.drafters import load_pair  # noqa: E402
from models.text import EOS, VOCAB, decode, encode, load_prompts  # noqa: E402
from specpass.loop import COMPILERS, Decoder, TreeShape, cache_slots  # noqa: E402
from specpass.loop.tree import depth  # noqa: E402

CHECKPOINTS = ROOT / "checkpoints"
DEFAULT_TARGET, DEFAULT_EAGLE = CHECKPOINTS / "stdlib-llama", CHECKPOINTS / "stdlib-llama-eagle3"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def _show_progress() -> None:
    """specpass's compile progress on stderr ("compiling prefill", "compiled prefill in 12.3 s"): a
    first call compiles for a minute or more with Inductor on a CPU."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(lambda record: not hasattr(record, "report"))  # the reports are printed at the end
    logger = logging.getLogger("specpass")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def at_least(kind: type, low: float, name: str):
    """An argparse type: a `kind` >= low (argparse names it `name` when the text does not parse)."""

    def parse(text: str):
        value = kind(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = name
    return parse


positive_int = at_least(int, 1, "positive_int")


def probability(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def tree_shape(text: str) -> TreeShape:
    """TOPK,STEPS,TOKENS -> a TreeShape."""
    try:
        return TreeShape(*(int(part) for part in text.split(",")))
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"three ints TOPK,STEPS,TOKENS, e.g. 4,5,16: {exc}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=pathlib.Path, default=DEFAULT_TARGET, help="Llama checkpoint folder")
    draft = parser.add_mutually_exclusive_group()
    draft.add_argument("--eagle", type=pathlib.Path, help=f"EAGLE-3 head folder (default: {DEFAULT_EAGLE.name})")
    draft.add_argument("--parallel", type=pathlib.Path, help="parallel-drafting EAGLE-3 head folder (P-EAGLE)")
    draft.add_argument("--block", type=pathlib.Path, help="block draft folder (DFlash, z-lab's layout)")
    draft.add_argument("--nextn", type=pathlib.Path, help="NextN/MTP layer folder (DeepSeek-V3 or Qwen3.5)")
    draft.add_argument("--draft", type=pathlib.Path, help="standalone Llama draft folder")
    parser.add_argument("--prompt", action="append", help="repeat for a batch (default: held-out prompts)")
    parser.add_argument("--num-prompts", type=positive_int, default=2, help="how many default prompts")
    parser.add_argument("--k", type=positive_int, default=4, help="draft tokens per round")
    parser.add_argument("--tree", type=tree_shape, metavar="TOPK,STEPS,TOKENS",
                        help="draft a tree per round instead of a chain: topk children per node, steps levels, "
                             "tokens verified per request (e.g. 4,5,16)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--compile", choices=COMPILERS, default="specpass")
    parser.add_argument("--handoff", choices=["inductor", "eager"],
                        help="what runs the graphs specpass rewrote (default: Inductor on CUDA; on CPU the "
                             "rewritten graphs run eagerly, since Inductor's C++ builds take 30-60 s)")
    parser.add_argument("--round", choices=["fused", "apart"],
                        help="compile the whole round as one graph (one CUDA graph replay per round; default on "
                             "CUDA) or each step apart (default on CPU, where nothing is replayed)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs of each decoder (the median counts)")
    parser.add_argument("--quiet", action="store_true", help="no compile progress lines on stderr")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless every token equals plain greedy decoding's (temperature 0 only)")
    parser.add_argument("--temperature", type=at_least(float, 0, "float"), default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-k", type=at_least(int, 0, "int"), help="sample from the k most likely tokens (0: off)")
    parser.add_argument("--top-p", type=probability, help="sample from the smallest set of tokens of this mass (1: off)")
    parser.add_argument("--seed", type=at_least(int, 0, "int"), default=0, help="the same seed gives the same tokens")
    parser.add_argument("--exact", action="store_true",
                        help="exact mode: both decoders add every sum in a row-invariant order, so speculative "
                             "decoding gives plain decoding's logits bit for bit in any dtype (docs/loop.md)")
    parser.add_argument("--greedy-drafts", action="store_true",
                        help="when sampling, draft the arg-max (q one-hot) instead of sampling drafts")
    args = parser.parse_args(argv)
    if args.exact and args.compile != "specpass":
        parser.error(f"--exact needs --compile specpass (got {args.compile}): specpass's exact pass routes the sums")
    if args.check and args.temperature > 0:
        parser.error("--check compares with plain greedy decoding, so it needs --temperature 0; sampled tokens "
                     "differ from plain sampling's draw by draw (tests/test_sampling.py tests their distribution)")
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        parser.error(f"--device {args.device}: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}, but this torch sees no CUDA GPU: use --device cpu")
    if not (args.eagle or args.parallel or args.block or args.nextn or args.draft):
        args.eagle = DEFAULT_EAGLE
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kind, draft_dir = next((k, getattr(args, k)) for k in ("eagle", "parallel", "block", "nextn", "draft") if getattr(args, k))
    try:
        target, drafter = load_pair(args.target, kind, draft_dir, device=args.device, dtype=DTYPES[args.dtype])
        texts = args.prompt or load_prompts()[: args.num_prompts]
    except (CheckpointError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if target.config.vocab_size < VOCAB:
        print(f"error: the byte tokenizer needs a vocabulary of {VOCAB}; {args.target} has {target.config.vocab_size}",
              file=sys.stderr)
        return 2

    cuda = torch.device(args.device).type == "cuda"
    args.handoff = args.handoff or ("inductor" if cuda else "eager")
    args.round = args.round or ("fused" if cuda else "apart")
    backend = specpass.backend(handoff=args.handoff) if args.compile == "specpass" else args.compile
    reports = _collect_reports()
    if not args.quiet:
        _show_progress()
    prompts = [encode(t) for t in texts]
    k = args.tree or args.k
    max_len = cache_slots(max(map(len, prompts)), args.max_new_tokens, k)
    shape = dict(max_batch=len(prompts), max_len=max_len, exact=args.exact,
                 compile=backend, mode="reduce-overhead" if cuda and args.compile != "eager" else None)
    fused = args.round == "fused"
    decoders = {"speculative": Decoder(target, drafter, k=k, fused_round=fused, greedy_drafts=args.greedy_drafts,
                                       **shape),
                "plain": Decoder(target, None, fused_round=fused, **shape)}
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)

    results, seconds = {}, {}
    for name, decoder in decoders.items():
        start = time.perf_counter()
        # A short run first: it compiles every step and, on GPU, records the CUDA graphs.
        decoder.generate(prompts, max_new_tokens=min(8, args.max_new_tokens), eos_id=EOS, **sampling)
        if args.compile != "eager":
            print(f"{name}: warm-up (compilation) {time.perf_counter() - start:.1f} s", file=sys.stderr)
        runs = [decoder.generate(prompts, max_new_tokens=args.max_new_tokens, eos_id=EOS, **sampling)
                for _ in range(args.repeats)]
        results[name] = runs[0]
        seconds[name] = statistics.median(r.metrics.seconds for r in runs)

    out, m = results["speculative"], results["speculative"].metrics
    for text, tokens in zip(texts, out.tokens):
        print(f"{'=' * 30} prompt {'=' * 30}\n{text}\n{'-' * 28} completion {'-' * 28}\n{decode(tokens)}")
    print("=" * 68)
    for report in reports:
        print(report)
    speed = {name: r.metrics.new_tokens / seconds[name] for name, r in results.items()}
    print(f"drafter: {kind} ({draft_dir}), {f'k = {k}' if args.tree is None else k}, compile = {args.compile}"
          f"{f' (handoff {args.handoff})' if args.compile == 'specpass' else ''}"
          f", round {args.round}, {args.device} {args.dtype}{', exact mode' if args.exact else ''}, {len(prompts)} prompts, "
          + (f"sampling: temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}, seed {args.seed}"
             f"{', greedy drafts' if args.greedy_drafts else ''}" if args.temperature > 0 else "greedy"))
    print(f"mean accepted length: {m.accept_length:.2f} tokens per round (at most {depth(k) + 1})")
    print(f"acceptance per {'draft position' if args.tree is None else 'depth'}: " + " ".join(f"{p:.2f}" for p in m.acceptance))
    print(f"tokens/s: speculative {speed['speculative']:.1f}, plain target decoding {speed['plain']:.1f} "
          f"({speed['speculative'] / speed['plain']:.2f}x, median of {args.repeats} runs each)")
    if args.temperature > 0:
        return 0
    same = out.tokens == results["plain"].tokens
    print(f"check: every token equals plain greedy decoding: {'yes' if same else 'NO'}")
    return 0 if same or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())

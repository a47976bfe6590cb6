"""Exact mode on a GPU: each kernel's row invariance, exact plain against exact speculative decoding
(and the default mode's agreement beside it), and what exact mode costs.

    python -m benchmarks.exact --parts kernels,zoo                    # the checks alone (a few minutes)
    python -m benchmarks.exact --parts shipped --bs 8 --out s8.json   # the shipped pair at bs 8 (one GPU each bs)
    python -m benchmarks.exact --parts llama8b --bs 1,16 --new-tokens 128 --out l.json
    python -m benchmarks.exact --merge s1.json s8.json s64.json --out exact.json   # one record, across bs
    python -m benchmarks.exact --device cpu --parts kernels           # a smoke test on CPU

Parts:
  kernels  each torch.ops.specpass.exact_* op on rows 1, 5, 17 and 64 of a 64-row input against the
           64-row call (torch.equal), fp32 and bf16; attention also with masked slots appended and
           with a tree node's path among hidden slots; and each op against torch's to rounding
  zoo      the tiny zoo target in bf16, 4 ragged prompts x 48 tokens, steps compiled by specpass
           without Inductor: plain against chain, block and parallel rounds, apart and fused, in exact
           and in the default mode (tokens equal?)
  shipped  the shipped pair in bf16 over --prompts held-out prompts (the 32 shipped ones, then their
           first halves) x --new-tokens at each --bs, fused rounds, Inductor, CUDA graphs: plain,
           chain K 4 and K 8 and the tree (4,7,32) (--configs), in each mode: the requests whose
           tokens equal plain decoding's, the agreeing prefix, and decode tokens/s
  llama8b  the same at Llama-3-8B shape with random weights (the zoo's llama3-8b and its EAGLE-3
           head; near ties everywhere) over random 64-token prompts
--merge    one record from several runs' JSON, with the requests whose plain tokens are the same
           at every batch size (a prompt alone and inside a batch of mixed prompts)
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import specpass
from benchmarks import harness
from models import zoo
from models.drafters import ZooDrafter, adapt, load_pair
from models.text import encode, load_prompts
from specpass.loop import Decoder, cache_slots

ops = torch.ops.specpass
CHECKPOINTS = harness.ROOT / "checkpoints"
ROWS = (1, 5, 17, 64)
PROMPTS = [[3, 14, 15], [9, 2, 6, 5, 35, 89, 79, 32, 38], [46], [7, 7, 1, 2]]


def same_rows(op, x, *args) -> bool:
    full = op(x, *args)
    return all(torch.equal(op(x[:m], *args), full[:m]) for m in ROWS)


def kernels(device: str) -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator(device=device).manual_seed(0)

        def r(*shape):
            return torch.randn(*shape, generator=g, device=device).to(dtype)

        x, w, b, w2 = r(64, 3, 96), r(80, 96), r(80), r(96)
        rows = dict(linear=same_rows(ops.exact_linear, x, w, b), matmul=same_rows(ops.exact_matmul, x, r(96, 7)),
                    sum=same_rows(ops.exact_sum, x, [-1], False, False),
                    mean=same_rows(ops.exact_sum, x, [1, 2], True, True),
                    rms_norm=same_rows(ops.exact_rms_norm, x, [96], w2, 1e-6),
                    layer_norm=same_rows(ops.exact_layer_norm, x, [3, 96], None, None, 1e-5),
                    softmax=same_rows(ops.exact_softmax, x, -1, False, None),
                    log_softmax=same_rows(ops.exact_softmax, x, 2, True, torch.float32),
                    logsumexp=same_rows(ops.exact_logsumexp, x, [-1], True))
        q, k, v = r(2, 4, 64, 16), r(2, 2, 40, 16), r(2, 2, 40, 8)
        slots = torch.arange(40, device=device)
        mask = slots[None, None, None, :] <= torch.arange(64, device=device)[None, None, :, None] % 40

        def attend(q, mask, k=k, v=v):
            return ops.exact_attention(q, k, v, mask, False, 0.25, True)

        rows["attention"] = all(torch.equal(attend(q[:, :, :m], mask[:, :, :m]), attend(q, mask)[:, :, :m]) for m in ROWS)
        hidden = torch.zeros(1, 1, 64, 100, dtype=torch.bool, device=device)
        rows["attention, 100 masked slots after"] = torch.equal(
            attend(q, torch.cat([mask, hidden], -1), torch.cat([k, r(2, 2, 100, 16)], 2), torch.cat([v, r(2, 2, 100, 8)], 2)),
            attend(q, mask))
        path = [*range(30), 33, 37]  # a tree node: its path among hidden siblings = the keys packed
        spread = torch.zeros(1, 1, 1, 40, dtype=torch.bool, device=device)
        spread[..., path] = True
        packed = torch.arange(40, device=device) < len(path)
        rows["attention, a tree node's path"] = torch.equal(
            attend(q[:, :, :1], spread), attend(q[:, :, :1], packed, k[:, :, path + [0] * 8], v[:, :, path + [0] * 8]))
        tol = dict(atol=1e-2, rtol=1e-3) if dtype == torch.float32 else dict(atol=3e-1, rtol=3e-2)
        close = dict(linear=(ops.exact_linear(x, w, b), F.linear(x, w, b)),
                     rms_norm=(ops.exact_rms_norm(x, [96], w2, 1e-6), F.rms_norm(x, [96], w2, 1e-6)),
                     softmax=(ops.exact_softmax(x, -1, False, None), x.softmax(-1)),
                     attention=(attend(q, mask),
                                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)))
        out[str(dtype)] = dict(rows=rows, close={name: torch.allclose(a.float(), b.float(), **tol)
                                                 for name, (a, b) in close.items()})
    return out


def zoo_rounds(device: str) -> dict:
    dtype = torch.bfloat16
    target = zoo.build("tiny-llama", seed=0, dtype=dtype, device=device)
    drafters = {"chain": (ZooDrafter(zoo.build("tiny-llama-eagle3", seed=3, dtype=dtype, device=device)), 4),
                "block": (zoo.build("tiny-llama-dflash", seed=4, target=target, dtype=dtype, device=device), 4),
                "parallel": (adapt(zoo.build("tiny-llama-peagle3", seed=3, dtype=dtype, device=device)), 3)}
    common = dict(max_batch=len(PROMPTS), max_len=128, compile=specpass.backend(handoff="eager"))
    out = {}
    for exact in (True, False):
        plain = Decoder(target, None, exact=exact, **common).generate(PROMPTS, 48).tokens
        for name, (drafter, k) in drafters.items():
            for fused in (False, True):
                tokens = Decoder(target, drafter, k=k, exact=exact, fused_round=fused, **common).generate(PROMPTS, 48).tokens
                out[f"{'exact' if exact else 'default'} {name} {'fused' if fused else 'apart'}"] = tokens == plain
    return out


def held_out_prompts(n: int) -> list[list[int]]:
    """n prompts: the shipped held-out ones, then each one's first half (cut at a line), cycled."""
    texts = load_prompts()
    halves = [t[: t.rfind("\n", 0, len(t) // 2) + 1 or len(t) // 2] for t in texts]
    return [encode(t) for t in itertools.islice(itertools.cycle(texts + halves), n)]


def decode_rate(runs) -> float:
    """tokens/s of the rounds alone (after each request's first token, prefill excluded), pooled."""
    tokens = sum(r.metrics.new_tokens - len(r.tokens) for r in runs)
    return tokens / sum(r.metrics.seconds - r.metrics.prefill_seconds for r in runs)


def agreement(target, head, prompts: list[list[int]], bs: int, configs: list, new_tokens: int,
              modes: list[str], out: dict, flush) -> None:
    """Each config (0: plain; K; a TreeShape) in each mode over `prompts` in batches of bs: the
    tokens, decode tokens/s of one pass after a warm-up, and, against plain decoding of the same
    mode, the requests whose tokens are equal and the mean agreeing prefix: into `out`, flushed
    after each (a run cut off by the device's limit keeps what it measured)."""
    batches = [prompts[i:i + bs] for i in range(0, len(prompts), bs)]
    max_len = cache_slots(max(map(len, prompts)), new_tokens, max(c if isinstance(c, int) else c.tokens for c in configs))
    for mode in modes:
        plain = None
        for config in configs:
            dec = Decoder(target, head if config else None, k=config, max_batch=bs, max_len=max_len,
                          mode="reduce-overhead", fused_round=True, exact=mode == "exact")
            start = time.perf_counter()
            dec.generate(batches[0], 8)
            compile_s = time.perf_counter() - start
            runs = [dec.generate(batch, new_tokens) for batch in batches]
            tokens = [t for run in runs for t in run.tokens]
            plain = tokens if not config else plain
            prefix = [next((i for i, (a, b) in enumerate(zip(t, p)) if a != b), len(t)) / len(t)
                      for t, p in zip(tokens, plain)]
            row = dict(decode_tokens_per_s=round(decode_rate(runs)), compile_s=round(compile_s),
                       accept_length=round(sum(r.metrics.accept_length for r in runs) / len(runs), 2),
                       equal=sum(t == p for t, p in zip(tokens, plain)), requests=len(tokens),
                       agreeing_prefix=round(sum(prefix) / len(prefix), 4), tokens=tokens)
            out[f"{mode} {label(config)}"] = row
            flush()
            print(f"  bs {bs} {mode} {label(config)}: " + ", ".join(f"{k} {v}" for k, v in row.items() if k != "tokens"),
                  flush=True)
            del dec
            torch.compiler.reset()


def label(config) -> str:
    return "plain" if not config else f"K {config}" if isinstance(config, int) else str(config)


def shipped(device: str, args, out: dict, flush) -> None:
    target, head = load_pair(CHECKPOINTS / "stdlib-llama", "eagle", CHECKPOINTS / "stdlib-llama-eagle3",
                             device=device, dtype=torch.bfloat16)
    prompts = held_out_prompts(args.prompts)
    for bs in args.bs:
        agreement(target, head, prompts, bs, args.configs, args.new_tokens, args.modes, out.setdefault(f"bs {bs}", {}),
                  flush)


def llama8b(device: str, args, out: dict, flush) -> None:
    target = zoo.build("llama3-8b", device=device, dtype=torch.bfloat16)
    head = ZooDrafter(zoo.build("llama3-8b-eagle3", seed=1, device=device, dtype=torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    for bs in args.bs:
        prompts = torch.randint(0, target.config.vocab_size, (bs, 64), generator=g).tolist()
        agreement(target, head, prompts, bs, args.configs, args.new_tokens, args.modes, out.setdefault(f"bs {bs}", {}),
                  flush)


def merge(paths: list[Path]) -> dict:
    """The runs' records in one (a later run's row of a batch size and config replaces an earlier
    one's), without their tokens, and per part and mode: the requests whose plain tokens are equal
    at every batch size run (the prompts are the same in each)."""
    runs = [json.loads(p.read_text()) for p in paths]
    merged = {"env": [r["env"] for r in runs]}
    merged.update({part: r[part] for r in runs for part in ("kernels", "zoo") if part in r})
    for part in ("shipped", "llama8b"):
        sizes = {}
        for r in runs:  # a later run's row of a batch size and config replaces an earlier one's
            for bs, rows in r.get(part, {}).items():
                sizes.setdefault(bs, {}).update(rows)
        if not sizes:
            continue
        for mode in ("exact", "default"):
            plains = {bs: rows[f"{mode} plain"]["tokens"] for bs, rows in sizes.items() if f"{mode} plain" in rows}
            if len(plains) > 1 and part == "shipped":
                first = next(iter(plains.values()))
                merged[f"{part}: {mode} plain tokens equal at {', '.join(plains)}"] = sum(
                    all(p[i] == first[i] for p in plains.values()) for i in range(len(first)))
        merged[part] = {bs: {config: {k: v for k, v in row.items() if k != "tokens"} for config, row in rows.items()}
                        for bs, rows in sizes.items()}
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--parts", default="kernels,zoo,shipped")
    parser.add_argument("--bs", default="1,8,64", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--prompts", type=int, default=64, help="shipped: how many held-out prompts")
    parser.add_argument("--configs", default="0;4;8;4,7,32", type=configs,
                        help="';'-separated: 0 (plain, first), chain K, or a tree TOPK,STEPS,TOKENS")
    parser.add_argument("--modes", default="exact,default", type=lambda s: s.split(","))
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--merge", nargs="+", type=Path, help="runs' JSON to merge into --out")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    save = harness.saver(args.out)
    if args.merge:
        save(merge(args.merge))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available: run on a GPU, or --device cpu")
    results = {"env": harness.environment(args.device, torch.bfloat16, new_tokens=args.new_tokens)}
    flush = lambda: save(results)  # noqa: E731
    parts = {"kernels": lambda out: out.update(kernels(args.device)),
             "zoo": lambda out: out.update(zoo_rounds(args.device)),
             "shipped": lambda out: shipped(args.device, args, out, flush),
             "llama8b": lambda out: llama8b(args.device, args, out, flush)}
    for part in args.parts.split(","):
        parts[part](results.setdefault(part, {}))
        if part in ("kernels", "zoo"):
            print(f"{part}: {results[part]}", flush=True)
        flush()


def configs(text: str) -> list:
    out = [harness.tree_shapes(c)[0] if "," in c else int(c) for c in text.split(";")]
    if out[0] != 0:
        raise argparse.ArgumentTypeError(f"--configs must start with 0 (plain, the reference), got {text!r}")
    return out


if __name__ == "__main__":
    main()

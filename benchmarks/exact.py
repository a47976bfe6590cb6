"""Exact mode on a GPU: each kernel's row invariance, exact plain against exact speculative decoding
(and the default mode's agreement beside it), and what exact mode costs.

    python -m benchmarks.exact --out exact.json                       # every part, on a GPU
    python -m benchmarks.exact --parts kernels,zoo                    # the checks alone (a few minutes)
    python -m benchmarks.exact --device cpu --parts kernels           # a smoke test on CPU

Parts:
  kernels  each torch.ops.specpass.exact_* op on rows 1, 5, 17 and 64 of a 64-row input against the
           64-row call (torch.equal), fp32 and bf16; attention also with masked slots appended; and
           each op against torch's to rounding
  zoo      the tiny zoo target in bf16, 4 ragged prompts x 48 tokens, steps compiled by specpass
           without Inductor: plain against chain, block and parallel rounds, apart and fused, in exact
           and in the default mode (tokens equal?)
  shipped  the shipped pair in bf16, 8 held-out prompts x 128 tokens at bs 8, fused rounds, Inductor,
           CUDA graphs: plain and chain K 8 in each mode, tokens/s (median of 3) and agreement
"""

from __future__ import annotations

import argparse
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


def shipped(device: str, new_tokens: int) -> dict:
    target, head = load_pair(CHECKPOINTS / "stdlib-llama", "eagle", CHECKPOINTS / "stdlib-llama-eagle3",
                             device=device, dtype=torch.bfloat16)
    prompts = [encode(text) for text in load_prompts()[:8]]
    max_len = cache_slots(max(map(len, prompts)), new_tokens, 8)
    out, tokens = {}, {}
    for exact in (True, False):
        for name, (drafter, k) in {"plain": (None, 0), "chain K 8": (head, 8)}.items():
            dec = Decoder(target, drafter, k=k, max_batch=len(prompts), max_len=max_len, mode="reduce-overhead",
                          fused_round=True, exact=exact)
            start = time.perf_counter()
            dec.generate(prompts, 8)
            compile_s = time.perf_counter() - start
            runs = sorted((dec.generate(prompts, new_tokens) for _ in range(3)), key=lambda r: r.metrics.tokens_per_s)
            tag = f"{'exact' if exact else 'default'} {name}"
            tokens[tag] = runs[1].tokens
            out[tag] = dict(tokens_per_s=round(runs[1].metrics.tokens_per_s), compile_s=round(compile_s),
                            round_ms=round(runs[1].metrics.phase_ms["round"], 4),
                            accept_length=round(runs[1].metrics.accept_length, 2))
            print(f"  {tag}: {out[tag]}", flush=True)
    for mode in ("exact", "default"):
        out[f"{mode}: chain K 8 tokens equal plain's"] = tokens[f"{mode} chain K 8"] == tokens[f"{mode} plain"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--parts", default="kernels,zoo,shipped")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available: run on a GPU, or --device cpu")
    results = {"env": harness.environment(args.device, torch.bfloat16)}
    save = harness.saver(args.out)
    parts = {"kernels": lambda: kernels(args.device), "zoo": lambda: zoo_rounds(args.device),
             "shipped": lambda: shipped(args.device, args.new_tokens)}
    for part in args.parts.split(","):
        results[part] = parts[part]()
        print(f"{part}: {results[part]}", flush=True)
        save(results)


if __name__ == "__main__":
    main()

"""The speculative loop on a GPU: tokens/s with an EAGLE-3 head against plain target decoding.

    python benchmarks/loop_gpu.py                            # H100, bf16, CUDA graphs (~2-3 min)
    python benchmarks/loop_gpu.py --variants plain,spec      # fewer compilations
    python benchmarks/loop_gpu.py --device cpu --quick       # smoke test

Random weights (a Llama target of ~0.2B parameters and an EAGLE-3 head of its width): the head
agrees with the target about as often as chance, so the accepted length is ~1 and the numbers
measure what a round costs, not what a trained head would gain. Every variant decodes the same
batch of prompts of mixed lengths; "agree" compares its tokens with plain greedy decoding
(bf16 verify over K+1 rows and decode over one row may round differently, so a late divergence
is possible without a bug: "prefix" is the mean fraction of tokens before the first difference).
"syncs/rounds" counts host syncs in one more run under torch.cuda's sync debug mode (CUDA only):
one per round plus the final read (3), and whatever the prefill's host-to-device copies add.
Each variant runs once to compile (and record CUDA graphs), then once timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import zoo  # noqa: E402
from models.drafters import ZooDrafter  # noqa: E402
from models.eagle3 import Eagle3Config  # noqa: E402
from models.llama import LlamaConfig  # noqa: E402
from specpass.speculative import Decoder  # noqa: E402

VARIANTS = {  # name: (drafter?, compile, fused_round)
    "plain": (False, "specpass", False),
    "spec": (True, "specpass", False),
    "spec-fused": (True, "specpass", True),
    "spec-inductor": (True, "inductor", False),
}


def configs(quick: bool) -> tuple[LlamaConfig, Eagle3Config]:
    H, layers, heads, kv, hd, mlp, vocab, dvocab = (
        (64, 4, 4, 2, 16, 128, 512, 128) if quick else (1024, 8, 16, 4, 64, 4096, 32000, 8000))
    target = LlamaConfig(vocab_size=vocab, hidden_size=H, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd)
    head = Eagle3Config(vocab_size=vocab, draft_vocab_size=dvocab, hidden_size=H, intermediate_size=mlp,
                        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd)
    return target, head


def prefix_agreement(got: list[list[int]], want: list[list[int]]) -> float:
    fractions = []
    for g, w in zip(got, want):
        same = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        fractions.append(same / max(len(w), 1))
    return sum(fractions) / len(fractions)


def host_syncs(decoder: Decoder, prompts, new: int) -> str:
    """'syncs/rounds' of one generate, as torch.cuda's sync debug mode sees them (the loop's own:
    one per round, plus the final read of tokens, counts and statistics)."""
    if decoder.device.type != "cuda":
        return "-"
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = decoder.generate(prompts, new)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return f"{syncs}/{out.metrics.rounds}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few tokens (smoke test)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    new = args.max_new_tokens or (16 if args.quick else 128)
    target_cfg, head_cfg = configs(args.quick)
    target = zoo.build(target_cfg, seed=0, device=device, dtype=dtype)
    drafter = ZooDrafter(zoo.build(head_cfg, seed=1, device=device, dtype=dtype))
    drafter.model.embed_tokens.weight = target.model.embed_tokens.weight  # EAGLE-3 uses the target's
    g = torch.Generator().manual_seed(0)
    lengths = [max(4, (48 if not args.quick else 12) * (i + 2) // (args.batch + 1)) for i in range(args.batch)]
    prompts = [torch.randint(0, target_cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]
    mode = "reduce-overhead" if device.type == "cuda" else None
    max_len = max(lengths) + new + 2 * args.k + 1
    params = sum(p.numel() for p in target.parameters()) / 1e6
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {where}, torch {torch.__version__}, {args.dtype}, target {params:.0f}M params "
          f"({target_cfg.num_hidden_layers} layers, H {target_cfg.hidden_size}), "
          f"batch {args.batch} (prompt lengths {lengths}), k {args.k}, {new} new tokens, mode {mode}")

    rows, reference = [], None
    for name in ["plain"] + [v for v in variants if v != "plain"]:  # plain first: the reference
        uses_draft, compile, fused = VARIANTS[name]
        torch._dynamo.reset()
        decoder = Decoder(target, drafter if uses_draft else None, k=args.k, max_batch=args.batch, max_len=max_len,
                          compile=compile, mode=mode, fused_round=fused)
        start = time.perf_counter()
        decoder.generate(prompts, new)  # compile, CUDA-graph warm-up and recording
        compile_s = time.perf_counter() - start
        out = decoder.generate(prompts, new)
        timed = decoder.generate(prompts, new, timing=True).metrics if uses_draft and not fused else None
        reference = reference or out.tokens
        m = out.metrics
        rows.append(dict(
            variant=name, compile=compile, fused=fused, tokens_per_s=m.tokens_per_s, accept_length=m.accept_length,
            acceptance=m.acceptance, agree=out.tokens == reference, prefix=prefix_agreement(out.tokens, reference),
            round_ms=m.phase_ms["round"], phase_ms=timed.phase_ms if timed else None, compile_s=compile_s,
            syncs=host_syncs(decoder, prompts, new)))
        print(f"  {name}: {m}", file=sys.stderr)

    base = rows[0]["tokens_per_s"]
    print("| variant | tokens/s | vs plain | accepted length | agree (prefix) | ms/round | "
          "draft / verify / catch-up ms | syncs/rounds | compile s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        phases = "-"
        if r["phase_ms"]:
            phases = " / ".join(f"{r['phase_ms'][p]:.2f}" for p in ("draft", "verify", "catch_up"))
        print(f"| {r['variant']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x | "
              f"{r['accept_length']:.2f} | {'yes' if r['agree'] else 'no'} ({r['prefix']:.2f}) | "
              f"{r['round_ms']:.2f} | {phases} | {r['syncs']} | {r['compile_s']:.0f} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

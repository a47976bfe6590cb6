"""EAGLE-3 catch-up step: plain Inductor vs specpass vs the hand-placed Q-slice, side by side.

The Llama-3-8B-shaped EAGLE-3 head (hidden 4096, 32/8 heads, MLP 14336, draft vocab 32000),
bf16, KV cache 2048 per request. Each step runs `spec_num_tokens` rows per request, writes all
their K/V and samples one live row per request (a different one for each request).

Each variant is compiled once by Inductor and timed twice: launched as is, and captured into
one CUDA graph per shape (as an engine replays its draft step). Median ms per step.

`--fused-qkv` fuses the head's q/k/v projections into one `qkv_proj` (as engines load them) and
compares specpass as it comes (the fused projection split by liveness, Q on the live rows, from
`split_min_rows` rows on), specpass splitting at every size (`split_min_rows=0`) and never
(`split_projections=False`), and the hand-placed Q-slice after the fused projection.

    python -m benchmarks.catchup --out results.json             # the full sweep, on a GPU
    python -m benchmarks.catchup --fused-qkv --tokens 4 --out fused.json
    python -m benchmarks.catchup --device cpu --quick           # a smoke test of the script
"""

import argparse
import json
import pathlib
import types

import torch

import specpass
from benchmarks import harness
from models import zoo
from models.eagle3 import Eagle3Config
from specpass.drafters.attention import attend, write_cache
from specpass.drafters.rope import apply_rope, rope


def hand_catch_up(self, tokens, positions, hidden, live):
    """`Eagle3Head.catch_up` patched by hand the way engines patch their model classes (TokenSpeed
    PR #217 for this head): the live rows are gathered right after the KV write, query side
    included (with a fused qkv_proj the projection stays on every row, as in that patch). Bound to
    the head as a method, so it compiles with the same guards as catch_up."""
    B, T = tokens.shape
    layer, cfg = self.midlayer, self.config
    attn = layer.self_attn
    if hidden.shape[-1] == self.fc.in_features:
        hidden = self.fc(hidden)  # [B, T, H]
    embeds = self.embed_tokens(tokens)
    cos, sin = rope(positions, self.rope_dim, cfg.rope_theta, embeds.dtype)
    x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
    rows = torch.arange(B, device=tokens.device)
    pick = lambda t: t[rows, live][:, None]  # noqa: E731  [B, 1, ...]: the live row only from here on
    kv = attn.n_kv_heads * attn.head_dim
    if hasattr(attn, "qkv_proj"):
        q, k, v = attn.qkv_proj(x).split([attn.n_heads * attn.head_dim, kv, kv], dim=-1)  # every row
        q = pick(q)
    else:
        q, k, v = attn.q_proj(pick(x)), attn.k_proj(x), attn.v_proj(x)
    k = apply_rope(k.view(B, T, attn.n_kv_heads, attn.head_dim), cos, sin)
    write_cache(attn.k_cache, positions, k)  # every row's K/V
    write_cache(attn.v_cache, positions, v.view(B, T, attn.n_kv_heads, attn.head_dim))
    q = apply_rope(q.view(B, 1, attn.n_heads, attn.head_dim), pick(cos), pick(sin))
    out = attend(q, attn.k_cache, attn.v_cache, self.mask(pick(positions)), attn.head_dim**-0.5)
    h = pick(hidden) + attn.o_proj(out.reshape(B, 1, -1))
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return self.lm_head(self.norm(h))[:, 0], h[:, 0]


def fuse_qkv(attn: torch.nn.Module) -> None:
    """Replace q/k/v_proj by one qkv_proj over their concatenated weights, as engines load them."""
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    attn.qkv_proj = torch.nn.Linear(q.in_features, q.out_features + 2 * k.out_features, bias=False,
                                    device=q.weight.device, dtype=q.weight.dtype)
    attn.qkv_proj.weight.data = torch.cat([q.weight, k.weight, v.weight])
    del attn.q_proj, attn.k_proj, attn.v_proj

    def project(self, x, rope_cs):
        B, T, _ = x.shape
        kv = self.n_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([self.n_heads * self.head_dim, kv, kv], dim=-1)
        q, k = q.reshape(B, T, self.n_heads, self.head_dim), k.view(B, T, self.n_kv_heads, self.head_dim)
        return apply_rope(q, *rope_cs), apply_rope(k, *rope_cs), v.view(B, T, self.n_kv_heads, self.head_dim), None

    attn.project = types.MethodType(project, attn)


def step_ms(variants: dict, args, iters: int, graph: bool) -> dict[str, float]:
    """Median ms per step of each variant on `args`, launched as is or as a replay of one CUDA
    graph captured from it; the variants take turns, so drift hits them alike."""
    calls = {name: (lambda fn=fn: fn(*args)) for name, fn in variants.items()}
    if graph:
        calls = {name: harness.capture([call]).replay for name, call in calls.items()}
    return harness.median_ms(calls, iters, warmup=5)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.catchup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2, 4, 8], help="spec_num_tokens")
    parser.add_argument("--cache", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="a tiny head on the CPU: checks the script runs")
    parser.add_argument("--fused-qkv", action="store_true", help="one qkv_proj, as engines load the head")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()

    if args.quick:
        config, dtype, args.batch, args.tokens, args.cache = zoo.config("tiny-llama-eagle3"), torch.float32, [2], [4], 64
    else:
        config, dtype = zoo.config("llama3-8b-eagle3"), torch.bfloat16
    assert isinstance(config, Eagle3Config)
    head = zoo.build(config, device=args.device, dtype=dtype)
    if args.fused_qkv:
        fuse_qkv(head.midlayer.self_attn)
    torch.set_grad_enabled(False)
    harness.dynamo_limits(64)  # one compile per shape and variant
    env = harness.environment(args.device, dtype)
    print(harness.describe(env))
    save = harness.saver(args.out)

    results = []
    for B in args.batch:
        head.setup_caches(B, args.cache, device=args.device, dtype=dtype)
        for T in args.tokens:
            g = torch.Generator(device=args.device).manual_seed(B * 100 + T)
            start = torch.randint(0, args.cache - T, (B, 1), device=args.device, generator=g)
            inputs = (
                torch.randint(0, config.vocab_size, (B, T), device=args.device, generator=g),
                start + torch.arange(T, device=args.device),  # [B, T] positions
                torch.randn(B, T, 3 * config.target_hidden_size, device=args.device, dtype=dtype, generator=g),
                torch.randint(0, T, (B,), device=args.device, generator=g),  # live row per request
            )
            variants = {
                "inductor": torch.compile(head.catch_up, dynamic=False),
                "specpass": torch.compile(head.catch_up, backend=specpass, dynamic=False),
                "hand": torch.compile(types.MethodType(hand_catch_up, head), dynamic=False),
            }
            if args.fused_qkv:
                for name, options in (("never", dict(split_projections=False)), ("always", dict(split_min_rows=0))):
                    variants[f"split_{name}"] = torch.compile(head.catch_up, backend=specpass.backend(**options),
                                                              dynamic=False)
            outputs = {name: [t.clone() for t in fn(*inputs)] for name, fn in variants.items()}
            reference = head.catch_up(*inputs)
            row = {"batch": B, "tokens": T}
            for name, (logits, _) in outputs.items():
                row[f"{name}_argmax_agree"] = (logits.argmax(-1) == reference[0].argmax(-1)).float().mean().item()
                row[f"{name}_max_err"] = (logits.float() - reference[0].float()).abs().max().item()
            if args.device == "cuda":
                for suffix, graph in (("_ms", False), ("_graph_ms", True)):
                    for name, ms in step_ms(variants, inputs, args.iters, graph).items():
                        row[name + suffix] = ms
            results.append(row)
            print(json.dumps(row), flush=True)
            save(results)  # partial results survive a time-out
    report = specpass.explain(head.catch_up, *inputs)
    print(report)
    save({**env, "fused_qkv": args.fused_qkv, "results": results, "report": str(report)})
    if args.device != "cuda":
        return
    if args.fused_qkv:
        names = ("inductor", "hand", "split_never", "split_always", "specpass")
        for suffix, title in (("_graph_ms", "with CUDA graphs"), ("_ms", "without")):
            print(f"\n{title}: ms per step; hand / specpass (> 1: specpass faster)")
            print("| T | bs | rows | Inductor | hand Q-slice | specpass, never split | specpass, always split | "
                  "specpass | never / hand | always / hand | specpass / hand |")
            print("|---|---|---|---|---|---|---|---|---|---|---|")
            for r in results:
                cells = [f"{r[n + suffix]:.3f}" for n in names]
                cells += [f"{r['hand' + suffix] / r[n + suffix]:.3f}x" for n in names[2:]]
                print(f"| {r['tokens']} | {r['batch']} | {r['batch'] * r['tokens']} | " + " | ".join(cells) + " |")
        return
    print("\n| T | bs | Inductor | specpass | hand Q-slice | specpass / hand | speedup | "
          "Inductor (graph) | specpass (graph) | hand (graph) | specpass / hand | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        cells = []
        for suffix in ("_ms", "_graph_ms"):
            base, ours, hand = (r[f"{n}{suffix}"] for n in ("inductor", "specpass", "hand"))
            cells += [f"{base:.3f}", f"{ours:.3f}", f"{hand:.3f}", f"{ours / hand:.3f}", f"{base / ours:.2f}x"]
        print(f"| {r['tokens']} | {r['batch']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

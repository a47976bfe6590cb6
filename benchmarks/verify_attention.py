"""The verify's attention on its own (Llama-3-8B heads: 32 query, 8 K/V, d 128; bf16), per
candidate: µs per call (CUDA-graph replays of 20 calls), max error against fp32 math, and the
K/V bytes' time at the copy bandwidth measured in the same run.

    python -m benchmarks.verify_attention --out attention.json      # on a GPU

K/V in the caches' layout `[B, S, hk, d]`; each request's rows sit at the last positions a 4K
round sees (a few slots of the static cache past them are stale). Candidates:
  cudnn_folded   `specpass.kernels.attend_folded`: GQA folded into the query axis, SDPA (cuDNN
                 under the default order), the fold included
  sdpa_gqa       SDPA's own GQA (enable_gqa), the one-token call's path
  flex_folded    FlexAttention, compiled, on the folded query; block mask built once, outside
  flex_gqa       FlexAttention with enable_gqa, block mask built once
  efficient_split  SDPA's efficient kernel with its log-sum-exp on S chunks moved into the batch
                 axis, merged by log-sum-exp (bias built once)
  triton_split   specpass/kernels/triton_attention.py at its own chunk count (and the best config swept)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import harness
from specpass.kernels import attend_folded

HQ, HK, D = 32, 8, 128


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / (1e3 * harness.graph_ms([lambda: y.copy_(x)] * 5))  # bytes per µs


def case(bs: int, T: int, S: int, bandwidth: float, flex: bool) -> dict:
    from specpass.kernels.triton_attention import attend_split
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    g = torch.Generator(device="cuda").manual_seed(bs * S + T)
    q = torch.randn(bs, T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(bs, S, HK, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    last = S - 1 - torch.randint(0, min(40, S - T), (bs, 1), device="cuda", generator=g)
    pos = last - T + 1 + torch.arange(T, device="cuda")  # [B, T]
    mask = torch.arange(S, device="cuda")[None, None, None, :] <= pos[:, None, :, None]  # [B, 1, T, S]
    scale = D**-0.5
    groups = HQ // HK

    # attend_folded's layout, for the candidates that are not SDPA (FlexAttention, the efficient kernel's chunks)
    def fold(x):  # [B, T, hq, d] -> [B, hk, T*g, d]
        return x.view(bs, T, HK, groups, D).transpose(1, 2).reshape(bs, HK, T * groups, D)

    def unfold(o):  # [B, hk, T*g, d] -> [B, T, hq, d]
        return o.view(bs, HK, T, groups, D).transpose(1, 2).reshape(bs, T, HQ, D)

    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, hk, S, d] views of the caches
    mask_folded = mask[:, :, :, None, :].expand(bs, 1, T, groups, S).reshape(bs, 1, T * groups, S)
    variants = {
        "cudnn_folded": lambda: attend_folded(q, k, v, mask, scale),
        "sdpa_gqa": lambda: F.scaled_dot_product_attention(q.transpose(1, 2), kt, vt, attn_mask=mask, scale=scale,
                                                           enable_gqa=True).transpose(1, 2),
    }
    if flex:
        compiled = torch.compile(flex_attention, dynamic=False)
        block_folded = create_block_mask(lambda b, h, qi, kv: mask[b, 0, qi // groups, kv], bs, None, T * groups, S)
        block_gqa = create_block_mask(lambda b, h, qi, kv: mask[b, 0, qi, kv], bs, None, T, S)
        variants["flex_folded"] = lambda: unfold(compiled(fold(q), kt, vt, block_mask=block_folded, scale=scale))
        variants["flex_gqa"] = lambda: compiled(q.transpose(1, 2), kt, vt, block_mask=block_gqa, scale=scale,
                                                enable_gqa=True).transpose(1, 2)
    chunks = 5 if S % 5 == 0 and S > 1000 else 1
    C = S // chunks
    bias = torch.empty(bs * chunks, HK, T * groups, (C + 15) // 16 * 16, device="cuda", dtype=torch.bfloat16)[..., :C]
    bias.copy_(torch.zeros((), device="cuda", dtype=torch.bfloat16).masked_fill(
        ~mask_folded.view(bs, 1, T * groups, chunks, C).transpose(1, 3).reshape(bs * chunks, 1, T * groups, C), float("-inf")))

    def efficient_split():
        qc = fold(q)[:, None].expand(bs, chunks, HK, T * groups, D).reshape(bs * chunks, HK, T * groups, D)
        kc, vc = (x.view(bs * chunks, C, HK, D).transpose(1, 2) for x in (k, v))
        out, lse = harness.efficient_attention_lse(qc, kc, vc, bias, scale)
        out = out.view(bs, chunks, HK, T * groups, D).float()
        w = torch.softmax(lse[..., :T * groups].view(bs, chunks, HK, T * groups), 1)
        return unfold((w[..., None] * out).sum(1).to(q.dtype))

    variants["efficient_split"] = efficient_split
    variants["triton_split"] = lambda: attend_split(q, k, v, mask, scale)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2).float(), kt.float(), vt.float(), attn_mask=mask,
                                         scale=scale, enable_gqa=True).transpose(1, 2)
    kv_bytes = 2 * bs * S * HK * D * 2
    row = dict(bs=bs, T=T, S=S, kv_us_at_bandwidth=kv_bytes / bandwidth, **harness.time_candidates(variants, ref))
    sweep = {}
    for block_n, warps, stages in ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (32, 4, 3), (64, 8, 3)):
        for splits in (1, 2, 4, 8, 16, 32):
            if splits * block_n > S + block_n:
                continue
            fn = (lambda s=splits, b=block_n, w=warps, st=stages: attend_split(q, k, v, mask, scale, s, b, w, st))
            try:
                err = (fn().float() - ref).abs().max().item()
                sweep[f"n{block_n}_w{warps}_s{stages}_x{splits}"] = (1e3 * harness.graph_ms([fn] * 20), err)
            except Exception as exc:
                sweep[f"n{block_n}_w{warps}_s{stages}_x{splits}"] = (None, f"{type(exc).__name__}: {str(exc)[:200]}")
    timed = {key: us for key, (us, _) in sweep.items() if us is not None}
    best = min(timed, key=timed.get)
    row.update(triton_best=best, triton_best_us=timed[best], triton_best_err=sweep[best][1], triton_sweep=sweep)
    return row


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.verify_attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="16x5x4145,64x5x4145,64x5x113,1x5x4145,16x5x113,16x1x4145,64x1x4145,64x1x113")
    parser.add_argument("--flex-at", default="16x5x4145,64x5x4145,64x5x113")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("CUDA is not available: this benchmark times CUDA kernels (run it on a GPU)")
    save = harness.saver(args.out)
    bandwidth = copy_bandwidth()
    env = harness.environment("cuda", torch.bfloat16, copy_bytes_per_us=bandwidth)
    print(harness.describe(env), flush=True)
    rows = []
    for spec in args.cases.split(","):
        bs, T, S = map(int, spec.split("x"))
        rows.append(case(bs, T, S, bandwidth, spec in args.flex_at.split(",")))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "triton_sweep"}), flush=True)
        save(dict(env=env, rows=rows))
    names = ["cudnn_folded", "sdpa_gqa", "flex_folded", "flex_gqa", "efficient_split", "triton_split", "triton_best"]
    print("| bs | T | slots | K/V at bandwidth µs | " + " | ".join(f"{n} µs (err)" for n in names) + " | best config |")
    for r in rows:
        cells = [f"{r[n + '_us']:.1f} ({r[n + '_err']:.1e})" if n + "_us" in r else ("refused" if n + "_error" in r else "-")
                 for n in names]
        print(f"| {r['bs']} | {r['T']} | {r['S']} | {r['kv_us_at_bandwidth']:.1f} | " + " | ".join(cells)
              + f" | {r['triton_best']} |")


if __name__ == "__main__":
    main()

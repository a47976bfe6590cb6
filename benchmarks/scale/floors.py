"""Floors of the decode step and of each phase of a round (see the package doc): weight and KV-cache
bytes over the copy bandwidth and FLOPs over the bf16 matmul rate, both measured in the same run;
and `gemm_floor`, the GEMMs as cuBLAS runs them."""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from benchmarks import harness
from specpass.drafters import DFlashDraft


def ceilings(device: torch.device) -> dict[str, float]:
    """Achievable copy bandwidth (bytes read + written) and bf16 matmul rate on this device."""
    if device.type != "cuda":
        return dict(bandwidth=1e11, flops=1e12)  # nominal: the CPU run only checks the script
    x = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    copy_ms = harness.event_ms(lambda: y.copy_(x))
    mm_ms = harness.event_ms(lambda: a @ b)
    return dict(bandwidth=2 * x.numel() / copy_ms * 1e3, flops=2 * 8192**3 / mm_ms * 1e3)


def linear_cost(linears: list[nn.Linear], rows: int) -> tuple[float, float]:
    """(weight bytes, FLOPs) of these linears on `rows` rows."""
    return (sum(m.weight.numel() * m.weight.element_size() for m in linears),
            sum(2 * rows * m.in_features * m.out_features for m in linears))


def attention_cost(attn: nn.Module, batch: int, queries: int, context: int, itemsize: int) -> tuple[float, float]:
    """(K/V bytes read, FLOPs) of one layer: `queries` rows per request over `context` slots."""
    kv = 2 * batch * context * attn.n_kv_heads * attn.head_dim * itemsize
    return kv, 4 * batch * queries * context * attn.n_heads * attn.head_dim


def floors(target, head, bs: int, k: int, context: int, ceil: dict, gemm=None) -> dict[str, float]:
    """ms floor of the decode step and of each phase of a round with K drafts (see the module doc).
    gemm(linears, rows) -> ms: the linears at that measured time instead (`gemm_floor`), the rest
    (attention) at its floor."""
    item = next(target.parameters()).element_size()
    t_lin = [m for m in target.modules() if isinstance(m, nn.Linear)]
    t_attn = [layer.self_attn for layer in target.model.layers]

    def lin(linears, rows):  # (bytes, FLOPs, measured ms)
        return (*linear_cost(linears, rows), 0.0) if gemm is None else (0.0, 0.0, gemm(linears, rows))

    def att(*args):
        return (*attention_cost(*args), 0.0)

    def ms(*costs, flops_only=False):
        nbytes, flops, measured = map(sum, zip(*costs))
        return 1e3 * max(0.0 if flops_only else nbytes / ceil["bandwidth"], flops / ceil["flops"]) + measured

    def target_step(rows_per_request):
        return ms(lin(t_lin, bs * rows_per_request),
                  *(att(a, bs, rows_per_request, context, item) for a in t_attn))

    out = dict(decode=target_step(1))
    if isinstance(head, DFlashDraft):
        # the verify, then one block forward (the loop's catch-up step): the K+1 verified rows'
        # context (fc, each layer's K/V projections: GEMMs of their own, as the model runs them), the
        # block's K+1 rows through every layer attending over the context, the target's lm_head on
        # the K drafts
        if not k:
            return out
        attn = [layer.self_attn for layer in head.layers]
        context_lin = [head.fc, *(m for a in attn for m in (a.k_proj, a.v_proj))]
        block_lin = [m for layer in head.layers for m in layer.modules() if isinstance(m, nn.Linear)]
        out.update(draft=0.0, verify=target_step(k + 1), accept=0.0,
                   catch_up=ms(lin(context_lin, bs * (k + 1)), lin(block_lin, bs * (k + 1)), lin([head.lm_head], bs * k),
                               *(att(a, bs, k + 1, context, item) for a in attn)))
        out["round"] = out["verify"] + out["catch_up"]
        return out
    h_layers = head.decoder_layers
    last = h_layers[-1].self_attn
    h_all = [m for m in head.modules() if isinstance(m, nn.Linear) and m is not head.fc]
    # catch-up: fc, every layer but the last, and the last one's K/V on every row (later layers and the
    # K/V write read them); the rest on the live rows
    h_rows_all = [head.fc, last.k_proj, last.v_proj,
                  *(m for layer in h_layers[:-1] for m in layer.modules() if isinstance(m, nn.Linear))]
    h_live = [m for m in h_all if m not in h_rows_all]

    def head_att(rows, live):  # every layer but the last on every row's queries, the last on the live rows
        return [att(layer.self_attn, bs, rows, context, item) for layer in h_layers[:-1]] + [
            att(last, bs, live, context, item)]

    if k and hasattr(head, "draft_parallel"):  # one draft forward: 2K rows write K/V, K live rows go on
        out.update(draft=0.0, verify=target_step(k + 1), accept=0.0,
                   catch_up=ms(lin(h_rows_all, bs * 2 * k), lin(h_live, bs * k), *head_att(2 * k, k)))
        out["round"] = out["verify"] + out["catch_up"]
    elif k:
        out.update(
            draft=(k - 1) * ms(lin(h_all, bs), *head_att(1, 1)),
            verify=target_step(k + 1),
            accept=0.0,
            catch_up=ms(lin(h_rows_all, bs * (k + 1)), lin(h_live, bs), *head_att(k + 1, 1)))
        out["round"] = out["draft"] + out["verify"] + out["catch_up"]
        if gemm is None:
            # the live-row rewrite's ceiling: the catch-up's FLOP time on every row less on its live rows
            # (it removes no bytes: weights and K/V are read once either way)
            out["live_rows_saved"] = (
                ms(lin(h_live, bs * (k + 1)), att(last, bs, k + 1, context, item), flops_only=True)
                - ms(lin(h_live, bs), att(last, bs, 1, context, item), flops_only=True))
    return out


def gemm_floor(bench, bs: int, k: int, context: int, ceil: dict) -> dict[str, float]:
    """What the round could reach with its GEMMs as cuBLAS runs them: each step's linears of the
    target and the head run one after another as the model runs them (bf16 F.linear on the model's
    own weights, every layer's: no weight stays in L2 that would not; M = their rows: bs for the
    decode and draft steps, bs x (K+1) for the verify; CUDA-graph replays); the verify's and the
    decode step's target GEMMs, and `floors` with those times and the attention at its floor (each
    phase's, and the round's)."""
    times: dict[tuple, float] = bench.gemm_times  # (the linears, rows) -> ms, each timed once

    def gemm(linears: list[nn.Linear], rows: int) -> float:
        key = (*map(id, linears), rows)
        if key not in times:
            x = {m.in_features: torch.randn(rows, m.in_features, device=bench.device, dtype=m.weight.dtype)
                 for m in linears}

            def run():
                for m in linears:
                    torch.nn.functional.linear(x[m.in_features], m.weight)

            times[key] = harness.op_ms(run, bench.device)
        return times[key]

    t_lin = [m for m in bench.target.modules() if isinstance(m, nn.Linear)]
    best = floors(bench.target, bench.head, bs, k, context, ceil, gemm)
    out = dict(bs=bs, k=k, decode_gemm_ms=gemm(t_lin, bs), verify_gemm_ms=gemm(t_lin, bs * (k + 1)),
               decode_best_ms=best["decode"], round_best_ms=best["round"], phases_best_ms=best)
    print(f"  gemm floor bs {bs} K {k}: verify GEMMs {out['verify_gemm_ms']:.3f} ms / decode GEMMs "
          f"{out['decode_gemm_ms']:.3f} = {out['verify_gemm_ms'] / out['decode_gemm_ms']:.2f}; with the rest at "
          f"its floor round / decode >= {best['round']:.3f} / {best['decode']:.3f} = "
          f"{best['round'] / best['decode']:.2f}", file=sys.stderr, flush=True)
    return out

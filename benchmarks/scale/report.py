"""The sweep's tables (markdown) and plot (docs/scale.png), from its JSON (see the package doc)."""

from __future__ import annotations

from pathlib import Path

from specpass.loop import expected_accept_length


def projected(result: dict, r: dict, decode_ms: float) -> float:
    return expected_accept_length(result["acceptance"][: r["k"]]) * decode_ms / r["round_ms"]


def baseline_ms(at: list[dict]) -> float | None:
    """A point's baseline: the faster of the loop's plain decoding and the lean baseline's step."""
    return min((x["round_ms"] for x in at if x["variant"] in ("decode", "lean")), default=None)


def tables(result: dict) -> str:
    env, ceil = result["env"], result["ceilings"]
    lines = [f"{env['device']}, torch {env['torch']}, {env['dtype']}; measured ceilings: copy "
             f"{ceil['bandwidth'] / 1e12:.2f} TB/s, bf16 matmul {ceil['flops'] / 1e12:.0f} TFLOP/s; acceptance per "
             "position (shipped pair): " + " ".join(f"{a:.2f}" for a in result["acceptance"]), "",
             "| bs | prompt | variant | K | ms/round | floor ms | / floor | round / baseline | specpass / inductor | "
             "accepted length (shipped) | projected speedup |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = result["rows"]
    for r in rows:
        at = [x for x in rows if (x["bs"], x["prompt"]) == (r["bs"], r["prompt"])]
        baseline = baseline_ms(at)
        base = next((x["round_ms"] for x in at if x["variant"] == "inductor" and x["k"] == r["k"]), None)
        floor = r["floor_ms"]["round" if r["k"] else "decode"]
        ratio = f"{r['round_ms'] / baseline:.2f}" if baseline and r["k"] else "-"
        vs = f"{base / r['round_ms']:.3f}x" if base and r["variant"].startswith("specpass") else "-"
        accept = f"{expected_accept_length(result['acceptance'][:r['k']]):.2f}" if r["k"] else "-"
        speedup = f"{projected(result, r, baseline):.2f}x" if baseline and r["k"] and r["variant"] != "apart" else "-"
        lines.append(f"| {r['bs']} | {r['prompt']} | {r['variant']} | {r['k'] or '-'} | {r['round_ms']:.3f} | "
                     f"{floor:.3f} | {r['round_ms'] / floor:.2f} | {ratio} | {vs} | {accept} | {speedup} |")
    if result.get("trees"):
        lines += ["", "| bs | prompt | tree (topk, steps, tokens) | ms/round | chain K = steps ms/round | tree / chain | "
                  "round / baseline |", "|---|---|---|---|---|---|---|"]
    for t in result.get("trees", []):
        at = [x for x in rows if (x["bs"], x["prompt"]) == (t["bs"], t["prompt"])]
        baseline = baseline_ms(at)
        chain = next((x["round_ms"] for x in at if x["variant"] == "specpass" and x["k"] == t["steps"]), None)
        lines.append(f"| {t['bs']} | {t['prompt']} | {t['tree']} | {t['round_ms']:.3f} | "
                     + (f"{chain:.3f} | {t['round_ms'] / chain:.3f}" if chain else "- | -")
                     + (f" | {t['round_ms'] / baseline:.2f} |" if baseline else " | - |"))
    apart = [r for r in rows if r.get("phase_ms")]
    if apart:
        lines += ["", "| bs | prompt | K | phase | ms (steps apart, CUDA events) | floor ms | / floor |",
                  "|---|---|---|---|---|---|---|"]
        for r in apart:
            for phase in ("draft", "verify", "accept", "catch_up", "between"):
                floor = r["floor_ms"].get(phase)
                ms = r["phase_ms"].get(phase, 0.0)
                cells = f"{floor:.3f} | {ms / floor:.2f}" if floor else "- | -"
                lines.append(f"| {r['bs']} | {r['prompt']} | {r['k']} | {phase} | {ms:.3f} | {cells} |")
    if result.get("tuned"):
        lines += ["", "| bs | prompt | K timed by tune_k | K measured | K chosen by the loop | its tokens/s | "
                  "best measured K | its tokens/s | chosen / best |", "|---|---|---|---|---|---|---|---|---|"]
    for tuned in result.get("tuned", []):
        bs, prompt = tuned["bs"], tuned["prompt"]
        by_k = {r["k"]: r["round_ms"] for r in rows
                if r["variant"] == "specpass" and (r["bs"], r["prompt"]) == (bs, prompt)}
        rate = lambda k: bs * expected_accept_length(result["acceptance"][:k]) / by_k[k] * 1e3  # noqa: E731
        best, chosen = max(by_k, key=rate), tuned["chosen"]
        got, ratio = ((f"{rate(chosen):.0f}", f"{rate(chosen) / rate(best):.3f}") if chosen in by_k
                      else ("not timed", "-"))
        lines.append(f"| {bs} | {prompt} | {tuned['timed']} | {sorted(by_k)} | {chosen} | {got} | {best} | "
                     f"{rate(best):.0f} | {ratio} |")
    for r in rows:
        ours = [x for x in rows
                if x["variant"] == "specpass" and (x["bs"], x["prompt"], x["k"]) == (r["bs"], r["prompt"], r["k"])]
        if r["variant"] == "inductor" and ours:
            saved, removed = r["floor_ms"]["live_rows_saved"], r["round_ms"] - ours[0]["round_ms"]
            lines.append(f"\nbs {r['bs']} prompt {r['prompt']} K {r['k']}: the live-row rewrite removes at most "
                         f"{saved:.3f} ms of the catch-up's FLOPs (no bytes), {saved / r['round_ms']:.1%} of the "
                         f"plain-Inductor round; specpass removed {removed:.3f} ms ({removed / r['round_ms']:.1%})")
    if result.get("gemm_floor"):
        lines += ["", "| bs | K | decode GEMMs ms | verify GEMMs ms | verify / decode GEMMs | decode, GEMMs measured + "
                  "attention floor, ms | round, same, ms | round / decode |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {g['bs']} | {g['k']} | {g['decode_gemm_ms']:.3f} | {g['verify_gemm_ms']:.3f} | "
                  f"{g['verify_gemm_ms'] / g['decode_gemm_ms']:.2f} | {g['decode_best_ms']:.3f} | "
                  f"{g['round_best_ms']:.3f} | "
                  f"{g['round_best_ms'] / g['decode_best_ms']:.2f} |" for g in result["gemm_floor"]]
    if result["attention"]:
        names = ("cudnn", "efficient", "math", "flex", "cudnn_folded", "efficient_folded")
        lines += ["", "| bs | queries | slots | " + " | ".join(f"{n} µs (max err)" for n in names) + " |",
                  "|---|---|---|" + "---|" * len(names)]
        for a in result["attention"]:
            cells = [f"{a[n + '_us']:.1f} ({a[n + '_err']:.1e})" if n + "_us" in a else "refused" for n in names]
            lines.append(f"| {a['bs']} | {a['queries']} | {a['slots']} | " + " | ".join(cells) + " |")
    for where, prof in result["profiles"].items():
        top = prof["top"] if isinstance(prof, dict) else prof  # a list: a fused specpass round, before gaps were kept
        kinds: dict[str, float] = {}
        for p in top:
            kinds[p["kind"]] = kinds.get(p["kind"], 0.0) + p["ms"]
        whole = (f"{prof['kernels']:.1f} kernels, {prof['gpu_ms']:.3f} ms on the GPU, idle {prof['gaps']['idle_us']} us "
                 f"a round; " if isinstance(prof, dict) else "")
        lines += ["", f"profile {where}: {whole}top kernels "
                  + ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])),
                  "| kernel | kind | ms/round | calls/round |", "|---|---|---|---|"]
        lines += [f"| `{p['kernel'][:70]}` | {p['kind']} | {p['ms']:.3f} | {p['calls']:.0f} |" for p in top[:12]]
    return "\n".join(lines)


def plot(result: dict, out: Path) -> None:
    """Left: projected speedup against accepted length per point (K 4); right: ms per round against
    K with the decode step's line (the K sweep)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (curve, by_k) = plt.subplots(1, 2, figsize=(13, 5))
    lengths = [1 + i / 10 for i in range(41)]
    points = sorted({(r["bs"], r["prompt"]) for r in rows})
    k = 4
    for bs, prompt in points:
        at = {x["variant"] + str(x["k"]): x["round_ms"] for x in rows if (x["bs"], x["prompt"]) == (bs, prompt)}
        if "decode0" not in at or f"specpass{k}" not in at:
            continue
        ratio = at["decode0"] / at[f"specpass{k}"]
        line, = curve.plot([L for L in lengths if L <= k + 1], [L * ratio for L in lengths if L <= k + 1],
                           label=f"bs {bs}, prompt {prompt}")
        shipped = expected_accept_length(result["acceptance"][:k])
        curve.plot([shipped], [shipped * ratio], "o", color=line.get_color())
        swept = sorted((x["k"], x["round_ms"]) for x in rows
                       if x["variant"] == "specpass" and (x["bs"], x["prompt"]) == (bs, prompt))
        if len(swept) > 1:
            by_k.plot([s for s, _ in swept], [expected_accept_length(result["acceptance"][:s]) * at["decode0"] / ms
                                              for s, ms in swept], "o-", label=f"bs {bs}, prompt {prompt}")
    curve.axhline(1.0, color="gray", lw=0.8)
    curve.set_xlabel("accepted length (tokens per round)")
    curve.set_ylabel(f"projected speedup over decoding (K {k})")
    curve.legend(fontsize=8)
    curve.grid(alpha=0.3)
    by_k.set_xlabel("K (draft tokens per round)")
    by_k.set_ylabel("projected speedup at the shipped pair's acceptance")
    by_k.legend(fontsize=8)
    by_k.grid(alpha=0.3)
    env = result["env"]
    fig.suptitle(f"Llama-3-8B shape + EAGLE-3 head, fused round, {env['device']}, torch {env['torch']}, {env['dtype']} "
                 "(dots: the shipped pair's accepted length)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)

"""The live-row pass on every causal LM in the installed transformers (CPU, random tiny weights).

    python benchmarks/hf_sweep.py --out hf_sweep.json          # every architecture (~20 min)
    python benchmarks/hf_sweep.py --only llama,phi3,gemma       # some of them
    python benchmarks/hf_sweep.py --table hf_sweep.json         # the markdown table of a run

For each model type in transformers' causal-LM auto mapping: a tiny random config (2 layers,
hidden 32, 2 query heads of 16, 1 KV head, vocabulary 96), a `StaticCache`, a 3-token prefill
run eagerly, then the continuation step `model(4 tokens, cache).logits[:, -1]` captured,
rewritten and run by specpass (rewritten graph run eagerly) against eager: the logits and the
caches. Per architecture: built (or why not; a config whose "tiny" form still has over 5M
parameters is skipped), captured by Dynamo as one graph (or why not), rewritten, exact, matmul
work after / before, and whether it reaches the ideal — every matmul that feeds no KV write runs
on the live rows only — or the op that stops it. Sizes are chosen so the token axis (4, or 3 * 4 flattened) is the only
axis of its size, which is how a matmul on every row is recognised.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specpass.graph import is_mutation  # noqa: E402
from specpass.testing import full_row_matmuls  # noqa: E402

B, PREFIX, T, CACHE = 3, 3, 4, 16
SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
MAX_PARAMS = 5_000_000
def architectures() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    for name, value in SIZES.items():  # attribute_map turns hidden_size into n_embd, d_model, ...
        if hasattr(config, name) or name in getattr(config, "attribute_map", {}):
            setattr(config, name, value)
    text = getattr(config, "text_config", None)
    if text is not None and text is not config:
        for name, value in SIZES.items():
            if hasattr(text, name):
                setattr(text, name, value)
    config.use_cache = True
    return config


def sweep_one(model_type: str, class_name: str) -> dict:
    import transformers
    from transformers import StaticCache

    import specpass

    row: dict = dict(model_type=model_type, model=class_name)
    try:
        config = tiny_config(model_type)
        with torch.device("meta"):  # sizes the config has no knob for can make "tiny" huge
            params = sum(p.numel() for p in getattr(transformers, class_name)(config).parameters())
        if params > MAX_PARAMS:
            return row | dict(built=False, reason=f"the tiny config still has {params / 1e6:.0f}M parameters")
        torch.manual_seed(0)
        model = getattr(transformers, class_name)(config).eval()
    except Exception as exc:
        return row | dict(built=False, reason=f"build: {type(exc).__name__}: {str(exc)[:160]}")
    ids = torch.randint(3, SIZES["vocab_size"], (B, PREFIX + T))

    def new_cache():
        return StaticCache(config=config, max_cache_len=CACHE)

    def step_with(cache):
        def step(tokens, cache_position):
            return model(input_ids=tokens, past_key_values=cache, cache_position=cache_position,
                         use_cache=True).logits[:, -1]
        return step

    positions = torch.arange(PREFIX, PREFIX + T)
    try:
        with torch.no_grad():
            cache = new_cache()
            model(input_ids=ids[:, :PREFIX], past_key_values=cache, use_cache=True)
            want = step_with(cache)(ids[:, PREFIX:], positions)
            want_caches = [t.clone() for t in _cache_tensors(cache)]
    except Exception as exc:
        return row | dict(built=False, reason=f"eager step: {type(exc).__name__}: {str(exc)[:160]}")
    row["built"] = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:  # what a user gets: the step compiled with specpass, against eager
            with torch.no_grad():
                cache = new_cache()
                model(input_ids=ids[:, :PREFIX], past_key_values=cache, use_cache=True)
                torch._dynamo.reset()
                got = torch.compile(step_with(cache), backend=specpass.backend(handoff="eager"))(
                    ids[:, PREFIX:], positions)
            row["exact"] = bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5)) and all(
                torch.allclose(g, w, rtol=1e-5, atol=1e-5)
                for g, w in zip(_cache_tensors(cache), want_caches, strict=True))
            row["max_abs_diff"] = float((got - want).abs().max())
        except Exception as exc:
            try:  # is it specpass, or does Dynamo itself fail on this step?
                with torch.no_grad():
                    torch._dynamo.reset()
                    torch.compile(step_with(new_cache()), backend="eager")(ids[:, PREFIX:], positions)
            except Exception:
                return row | dict(built=False, reason=f"torch.compile fails with backend='eager' too: "
                                                      f"{type(exc).__name__}: {_first_line(exc)}")
            return row | dict(exact=None, reason=f"compiled with specpass: {type(exc).__name__}: {_first_line(exc)}",
                              trace=traceback.format_exc()[-600:])
    row["warnings"] = sorted({str(w.message)[:200] for w in caught if "specpass" in type(w.message).__module__})
    try:  # what the passes did to the whole step, captured as one graph
        result = specpass.rewrite(specpass.capture(step_with(cache), ids[:, PREFIX:], positions))
    except Exception as exc:
        from specpass.capture import CaptureError, find_cause

        cause = find_cause(exc, CaptureError)
        why = f"specpass: {cause}" if cause is not None else f"Dynamo: {type(exc).__name__}: {_first_line(exc)}"
        return row | dict(captured=False, reason=f"not one graph ({why})")
    report = result.report
    fired = [f for f in report.of("live_rows") if f.fired]
    before, after = report.matmul_flops
    full = full_row_matmuls(result.graph_module, {T, B * T})
    writes = any(is_mutation(n) for n in result.graph_module.graph.nodes)
    return row | dict(
        captured=True, rewritten=bool(fired),
        matmul_after_before=after / before if isinstance(before, int) and isinstance(after, int) and before else None,
        ideal=bool(fired) and not full, full_row_matmuls=full[:6], kv_writes=writes,
        stops=[f"{f.where}: {f.message}" for f in report.of("live_rows") if not f.fired][:4], errors=report.errors)


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:160]


def _cache_tensors(cache) -> list[torch.Tensor]:
    out = []
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def table(rows: list[dict]) -> str:
    built = [r for r in rows if r.get("built")]
    captured = [r for r in built if r.get("captured")]
    split = [r for r in built if not r.get("captured")]
    ideal = [r for r in captured if r.get("ideal")]
    wrong = [r["model_type"] for r in built if r.get("exact") is not True]
    lines = [f"{len(rows)} causal-LM types in transformers; {len(built)} built and stepped with a StaticCache; "
             f"compiled with specpass, {len(built) - len(wrong)} of them equal eager (logits and caches)"
             f"{': not ' + ', '.join(wrong) if wrong else ''}. {len(captured)} captured as one graph: "
             f"{sum(1 for r in captured if r.get('rewritten'))} rewritten, {len(ideal)} at the ideal "
             f"({100 * len(ideal) / max(len(captured), 1):.0f}%).", "",
             "| model type | rewritten | exact | matmul work after / before | ideal | what stops it |",
             "|---|---|---|---|---|---|"]
    for r in sorted(captured, key=lambda r: r["model_type"]):
        ratio = f"{r['matmul_after_before']:.3f}" if r.get("matmul_after_before") is not None else "-"
        why = "" if r.get("ideal") else "; ".join(r.get("errors") or r.get("stops") or []) or \
            ("no KV write in the graph (the model keeps no cache here): every layer before the last reads "
             "every row" if not r.get("kv_writes") else "") or \
            ("matmuls on every row: " + ", ".join(r.get("full_row_matmuls") or []))
        why = why.replace("|", "\\|").replace("\n", " ")[:220]
        exact = {True: "yes", False: "**no**", None: "-"}[r.get("exact")]
        lines.append(f"| {r['model_type']} | {'yes' if r.get('rewritten') else 'no'} | {exact} | {ratio} | "
                     f"{'yes' if r.get('ideal') else 'no'} | {why} |")
    lines += ["", "Not one graph (specpass rewrites what it captures in one piece; these compile, "
              "unrewritten where a piece has no gather):", ""]
    lines += [f"- {r['model_type']} (exact: {r.get('exact')}): {r['reason']}"
              for r in sorted(split, key=lambda r: r["model_type"])]
    lines += ["", "Not built (tiny config or StaticCache step failed in transformers itself):", ""]
    lines += [f"- {r['model_type']}: {r['reason']}" for r in sorted(rows, key=lambda r: r["model_type"])
              if not r.get("built")]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--out", type=Path, help="write the rows as JSON (as it goes)")
    parser.add_argument("--table", type=Path, help="print the table of a JSON file and exit")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    import transformers

    transformers.logging.set_verbosity_error()
    archs = architectures()
    if args.only:
        archs = {k: v for k, v in archs.items() if k in args.only.split(",")}
    rows = []
    for model_type, class_name in archs.items():
        start = time.perf_counter()
        rows.append(sweep_one(model_type, class_name))
        rows[-1]["seconds"] = round(time.perf_counter() - start, 1)
        r = rows[-1]
        print(f"{model_type:28s} built={r.get('built')} rewritten={r.get('rewritten')} exact={r.get('exact')} "
              f"ideal={r.get('ideal')} {r['seconds']}s {(r.get('reason') or '; '.join(r.get('stops') or []))[:120]}",
              file=sys.stderr, flush=True)
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()

"""The live-row pass on every causal LM in the installed transformers (CPU, random tiny weights).

    python -m benchmarks.hf_sweep --out hf_sweep.json          # every architecture (~5 min)
    python -m benchmarks.hf_sweep --only llama,phi3,gemma       # some of them
    python -m benchmarks.hf_sweep --table hf_sweep.json         # the markdown table of a run

For each model type in transformers' causal-LM auto mapping: a tiny random config (2 layers,
hidden 32, 2 query heads of 16, 1 KV head, vocabulary 96), a `StaticCache` (passed by the name the
forward takes, `cache` or `past_key_values`; a model that takes neither runs on its new tokens
alone), a 3-token prefill run eagerly, then the continuation step `model(4 tokens,
cache).logits[:, -1]` compiled with specpass (rewritten graphs run eagerly) against eager: the
logits and the caches. Dynamo may break the step into several graph pieces; specpass rewrites
each piece it captures, and the sweep reports what it did to all of them. Per architecture:
built (or why not; a config whose "tiny" form still has over 5M parameters is skipped), the
number of pieces (and where Dynamo broke the graph), rewritten (any piece), exact, matmul work
after / before (over every piece, once per call), and whether it reaches the ideal — no piece
has a matmul on every token row that feeds no KV write, followed across pieces — or, in the
first piece short of it, the op that stops it. Sizes are chosen so the token axis (4, or 3 * 4
flattened) is the only axis of its size, which is how a matmul on every row is recognised.
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

from benchmarks import harness
from specpass.graph import is_mutation
from specpass.hf.adapters import cache_keyword
from specpass.testing import full_row_matmuls

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
    keyword = cache_keyword(model)  # `cache` from transformers 5.24 on, where some models ignore the old name

    def new_cache():
        return StaticCache(config=config, max_cache_len=CACHE)

    def with_cache(cache):  # a model that takes no cache runs on the new tokens only
        return {} if keyword is None else {keyword: cache}

    def step_with(cache):
        def step(tokens, cache_position):
            return model(input_ids=tokens, **with_cache(cache), cache_position=cache_position,
                         use_cache=True).logits[:, -1]
        return step

    positions = torch.arange(PREFIX, PREFIX + T)

    def compile_step(pieces, calls, fullgraph):
        with torch.no_grad():
            cache = new_cache()
            model(input_ids=ids[:, :PREFIX], **with_cache(cache), use_cache=True)
            torch.compiler.reset()
            got = torch.compile(step_with(cache), backend=_recording_backend(pieces, calls), fullgraph=fullgraph,
                                dynamic=False)(ids[:, PREFIX:], positions)
        return got, cache

    try:
        with torch.no_grad():
            cache = new_cache()
            model(input_ids=ids[:, :PREFIX], **with_cache(cache), use_cache=True)
            want = step_with(cache)(ids[:, PREFIX:], positions)
            want_caches = [t.clone() for t in _cache_tensors(cache)]
    except Exception as exc:
        return row | dict(built=False, reason=f"eager step: {type(exc).__name__}: {str(exc)[:160]}")
    row["built"] = True
    pieces: list[dict] = []
    calls: list[tuple[int, tuple, object]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:  # what a user gets: the step compiled with specpass, against eager. As one graph, as
            # specpass's own loop compiles it; where Dynamo cannot, in the pieces it breaks it into.
            try:
                got, cache = compile_step(pieces, calls, fullgraph=True)
            except Exception as exc:
                if pieces:  # Dynamo made its one graph: the failure is specpass's, or the step's
                    raise
                row["not_one_graph"] = f"{type(exc).__name__}: {_first_line(exc)}"
                got, cache = compile_step(pieces, calls, fullgraph=False)
            row["exact"] = bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5)) and all(
                torch.allclose(g, w, rtol=1e-5, atol=1e-5)
                for g, w in zip(_cache_tensors(cache), want_caches, strict=True))
            row["max_abs_diff"] = float((got - want).abs().max())
        except Exception as exc:
            try:  # is it specpass, or does Dynamo itself fail on this step?
                with torch.no_grad():
                    torch.compiler.reset()
                    torch.compile(step_with(new_cache()), backend="eager")(ids[:, PREFIX:], positions)
            except Exception:
                return row | dict(built=False, reason=f"torch.compile fails with backend='eager' too: "
                                                      f"{type(exc).__name__}: {_first_line(exc)}")
            return row | dict(exact=None, reason=f"compiled with specpass: {type(exc).__name__}: {_first_line(exc)}",
                              trace=traceback.format_exc()[-600:])
    row["warnings"] = sorted({str(w.message)[:200] for w in caught if "specpass" in type(w.message).__module__})
    return row | _what_the_passes_did(pieces, calls)


def _recording_backend(pieces: list[dict], calls: list[tuple[int, tuple, object]]):
    """specpass's backend (rewritten graphs run eagerly), once per graph piece Dynamo hands it.
    Per piece it keeps what the passes did (rerun on the same graph: the backend keeps no
    report) and where Dynamo broke the graph; per call, the piece's inputs and outputs, so that
    values can be followed from one piece into the next."""
    import specpass
    from specpass.capture import to_aten_ir
    from specpass.pipeline import run_passes

    compile_piece = specpass.backend(handoff="eager")

    def backend(gm, example_inputs, **kwargs):
        compiled = compile_piece(gm, example_inputs, **kwargs)
        index = len(pieces)
        reason = getattr(gm, "compile_subgraph_reason", None)
        piece = dict(graph_break=_graph_break(reason) if reason is not None and reason.graph_break else None)
        try:
            piece["result"] = run_passes(to_aten_ir(gm, example_inputs), compile_piece.options)
        except Exception as exc:  # the backend compiled this piece unrewritten, and warned why
            piece["unrewritten"] = f"{type(exc).__name__}: {_first_line(exc)}"
        pieces.append(piece)

        def run(*args):
            out = compiled(*args)
            calls.append((index, args, out))
            return out

        return run

    return backend


def _graph_break(reason) -> str:
    where = reason.user_stack[-1] if reason.user_stack else None
    at = f" at {Path(where.filename).name}:{where.lineno}" if where is not None else ""
    return f"{_first_line(reason.reason)}{at}"


def _what_the_passes_did(pieces: list[dict], calls: list[tuple[int, tuple, object]]) -> dict:
    """The row's rewrite columns, over every graph piece of the step (matmul work counted once
    per call of its piece)."""
    captured = [p for p in pieces if "result" in p]
    runs = [sum(1 for index, _, _ in calls if index == i) for i in range(len(pieces))]
    flops = [p["result"].report.matmul_flops if "result" in p else (None, None) for p in pieces]
    before = after = None
    if all(isinstance(x, int) for f in flops for x in f):  # not symbolic (data-dependent sizes) or unknown
        before, after = (sum(n * f[k] for n, f in zip(runs, flops)) for k in (0, 1))
    written = _outputs_feeding_writes(pieces, calls)
    short = []  # (piece, what keeps it short of the ideal)
    for i, piece in enumerate(pieces):
        if "result" not in piece:
            short.append((i, dict(stops=[f"compiled unrewritten ({piece['unrewritten']})"])))
            continue
        gm, report = piece["result"].graph_module, piece["result"].report
        nodes = {n.name: n for n in gm.graph.nodes}
        full = [m for m in full_row_matmuls(gm, {T, B * T}) if not _reaches(gm, nodes[m], written[i])]
        if full or report.errors:
            # where the gathers that moved stopped, then the gathers left alone
            findings = sorted(report.of("live_rows"), key=lambda f: not f.fired)
            short.append((i, dict(full_row_matmuls=full[:6], errors=report.errors,
                                  stops=[f"{f.where}: {f.message}" for f in findings][:4])))
    fired = any(f.fired for p in captured for f in p["result"].report.of("live_rows"))
    # The reason shown is from the first piece with matmuls on every row (a piece specpass could
    # not capture, such as one with no inputs, may have none).
    stopped_in, stop = min(short, key=lambda s: not s[1].get("full_row_matmuls")) if short else (None, {})
    return dict(full_row_matmuls=[], errors=[], stops=[]) | stop | dict(
        pieces=len(pieces), captured=len(captured) == len(pieces), rewritten=fired,
        matmul_after_before=after / before if before else None, ideal=fired and not short, stopped_in=stopped_in,
        kv_writes=any(is_mutation(n) for p in captured for n in p["result"].graph_module.graph.nodes)
        if len(captured) == len(pieces) else None,
        graph_breaks=sorted({p["graph_break"] for p in pieces if p["graph_break"]}))


def _outputs_feeding_writes(pieces: list[dict], calls: list[tuple[int, tuple, object]]) -> list[set[int]]:
    """Per piece, the outputs that feed an in-place (KV) write in a later piece: a later call
    takes them as an input (the same storage, at run time) that reaches a write there, directly
    or through its own outputs. A write made by Python run eagerly between pieces is not seen."""
    feeding: set[int] = set()  # storages that some later call feeds to a write
    written: list[set[int]] = [set() for _ in pieces]
    for index, args, out in reversed(calls):
        if "result" not in pieces[index]:
            continue
        gm = pieces[index]["result"].graph_module
        outputs = {o for o, t in enumerate(harness.leaves(out)) if _storage(t) in feeding}
        written[index] |= outputs
        feeding |= {_storage(a) for p, a in zip(gm.graph.find_nodes(op="placeholder"), args)
                    if _reaches(gm, p, outputs)} - {None}
    return written


def _reaches(gm, node, outputs: set[int]) -> bool:
    """Does `node` feed an in-place write of its graph, or one of these outputs of it?"""
    targets = {leaf for o, leaf in enumerate(harness.leaves(gm.graph.output_node().args[0])) if o in outputs}
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if is_mutation(n) or n in targets:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.users)
    return False


def _storage(x) -> int | None:
    """Where a tensor's data lives: a piece's output and the next piece's input share it."""
    if not isinstance(x, torch.Tensor) or x.untyped_storage().nbytes() == 0:
        return None
    return x.untyped_storage().data_ptr()


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
    compiled = [r for r in built if "pieces" in r]
    split = sorted((r for r in compiled if r["pieces"] > 1), key=lambda r: r["model_type"])
    ideal = [r for r in compiled if r.get("ideal")]
    wrong = [r["model_type"] for r in built if r.get("exact") is not True]
    lines = [f"{len(rows)} causal-LM types in transformers; {len(built)} built and stepped with a StaticCache; "
             f"compiled with specpass, {len(built) - len(wrong)} of them equal eager (logits and caches)"
             f"{': not ' + ', '.join(wrong) if wrong else ''}. {len(compiled) - len(split)} compile to one graph, "
             f"{len(split)} to {sum(r['pieces'] for r in split)} graph pieces; "
             f"{sum(1 for r in compiled if r.get('rewritten'))} rewritten, {len(ideal)} at the ideal "
             f"({100 * len(ideal) / max(len(compiled), 1):.0f}%).", "",
             "| model type | pieces | rewritten | exact | matmul work after / before | ideal | what stops it |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(compiled, key=lambda r: r["model_type"]):
        ratio = f"{r['matmul_after_before']:.3f}" if r.get("matmul_after_before") is not None else "-"
        full = ["matmuls on every row: " + ", ".join(r["full_row_matmuls"])] if r.get("full_row_matmuls") else []
        why = "" if r.get("ideal") else "; ".join(r.get("errors") or []) or \
            ("no KV write in the graph (the model keeps no cache here): every layer before the last reads "
             "every row" if r.get("kv_writes") is False else "") or "; ".join(full + r.get("stops", []))
        if why and r["pieces"] > 1 and r.get("stopped_in") is not None:
            why = f"piece {r['stopped_in'] + 1} of {r['pieces']}: {why}"
        why = why.replace("|", "\\|").replace("\n", " ")[:300]
        exact = {True: "yes", False: "**no**", None: "-"}[r.get("exact")]
        lines.append(f"| {r['model_type']} | {r['pieces']} | {'yes' if r.get('rewritten') else 'no'} | {exact} | "
                     f"{ratio} | {'yes' if r.get('ideal') else 'no'} | {why} |")
    lines += ["", "Graph breaks (Dynamo compiles the step in pieces; specpass rewrites each piece it captures, "
              "and a row gather moves within its piece only):", ""]
    lines += [f"- {r['model_type']} ({r['pieces']} pieces): {'; '.join(r['graph_breaks']) or r.get('not_one_graph')}"
              for r in split]
    failed = [r for r in built if "pieces" not in r]
    if failed:
        lines += ["", "Compiled with specpass, the step raised:", ""]
        lines += [f"- {r['model_type']}: {r['reason']}" for r in sorted(failed, key=lambda r: r["model_type"])]
    lines += ["", "Not built (tiny config or StaticCache step failed in transformers itself):", ""]
    lines += [f"- {r['model_type']}: {r['reason']}" for r in sorted(rows, key=lambda r: r["model_type"])
              if not r.get("built")]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
        why = (r.get("reason") or "; ".join(r.get("stops") or []))[:120]
        print(f"{model_type:28s} built={r.get('built')} pieces={r.get('pieces')} rewritten={r.get('rewritten')} "
              f"exact={r.get('exact')} ideal={r.get('ideal')} {r['seconds']}s {why}", file=sys.stderr, flush=True)
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()

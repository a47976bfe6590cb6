"""`specpass.generate` on every causal LM in the installed transformers, against `model.generate`.

    python -m benchmarks.generate_sweep --out generate_sweep.json        # every family, one process
    python -m benchmarks.generate_sweep --only olmo2,granite,qwen2 --repeat 3
    python -m benchmarks.generate_sweep --handoff eager                  # rewritten graphs run eagerly
    python -m benchmarks.generate_sweep --shards 8                       # 8 processes side by side
    python -m benchmarks.generate_sweep --shards 16 --balance last.json --deadline 540   # dealt by last run's times
    python -m benchmarks.generate_sweep --table generate_sweep.json      # the markdown table of a run

For each model type that `benchmarks.hf_sweep` builds (its tiny random config, with decisive logits),
a draft of the same family (the model's weights moved by a tenth of their spread: it agrees often,
not always) and greedy `specpass.generate` at bs 1 and on a ragged left-padded batch of 3, with the
round fused and apart, against `model.generate(do_sample=False)`. Every family runs in the same
process, one after another, as a user's server would load them: what one family's compiles leave
behind must not change the next one's. A family is first run with the steps eager (`compile="eager"`):
what the loop cannot serve there (specpass's checks refuse it, or it fails) is "not served" with the
reason. Then compiled with specpass, each run is one of

- exact: the tokens are `model.generate`'s, and every step compiled with its rewrites;
- fell back: exact, but a step compiled without rewrites or with a pass dropped (the step and the
  reason: `return_dict_in_generate`'s `rewrites`, "[fallback] ..." and "[error] ..." entries);
- wrong: other tokens;
- crashed: an exception (its type and first line).
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.hf_sweep import MAX_PARAMS, _first_line, architectures, tiny_config

# Left-padded, lengths 3, 7, 1 (pad id 0 never appears in a prompt); bs 1 is the 7-token row.
IDS = torch.tensor([[0, 0, 0, 0, 5, 17, 33], [8, 41, 9, 60, 12, 3, 77], [0, 0, 0, 0, 0, 0, 50]])
BATCHES = {"bs1": [1], "ragged3": [0, 1, 2]}
NEW, K = 12, 3


def build_pair(model_type: str, class_name: str, device: torch.device):
    """(model, draft) of the family, or the reason there is none."""
    import transformers

    config = tiny_config(model_type)
    if hasattr(config, "is_decoder"):  # an encoder's LM head, as a causal LM (specpass refuses it bidirectional)
        config.is_decoder = True
    if hasattr(config, "initializer_range"):
        config.initializer_range = 0.2  # decisive logits: a greedy token is not a near-tie
    with torch.device("meta"):
        params = sum(p.numel() for p in getattr(transformers, class_name)(config).parameters())
    if params > MAX_PARAMS:
        raise ValueError(f"the tiny config still has {params / 1e6:.0f}M parameters")
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(config).eval().to(device)
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            if p.is_floating_point() and p.numel() > 1:
                p.add_(0.1 * p.std() * torch.randn(p.shape, generator=generator).to(device))
    return model, draft


def run_family(model_type: str, class_name: str, compile_with, fused: tuple[bool, ...], device: torch.device) -> dict:
    """The family's row: built or not, served eagerly or not, and a result per (batch, fused)."""
    import specpass

    row: dict = dict(model_type=model_type, model=class_name)
    ids = IDS.to(device)
    try:
        model, draft = build_pair(model_type, class_name, device)
        want = {name: model.generate(ids[rows], attention_mask=(ids[rows] != 0).long(), max_new_tokens=NEW,
                                     do_sample=False) for name, rows in BATCHES.items()}
    except Exception as exc:
        return row | dict(built=False, reason=f"{type(exc).__name__}: {_first_line(exc)}")
    row["built"] = True

    kept = specpass.DecoderCache(keep=1)  # the ragged batch reuses bs 1's compiled steps, as a user's next call would

    def ours(rows, **kw):
        return specpass.generate(model, ids[rows], attention_mask=(ids[rows] != 0).long(), assistant_model=draft,
                                 max_new_tokens=NEW, num_assistant_tokens=K, return_dict_in_generate=True,
                                 decoder_cache=kept, **kw)

    try:  # what the loop serves, before anything compiles
        eager = ours(BATCHES["ragged3"], compile="eager")
    except Exception as exc:
        return row | dict(served=False, reason=f"{type(exc).__name__}: {_first_line(exc)}")
    row["served"] = True
    if not torch.equal(eager.sequences, want["ragged3"]):
        return row | dict(runs={"eager": dict(result="wrong")})
    row["runs"] = {}
    for fused_round in fused:
        for name, rows in BATCHES.items():
            key = f"{name}/{'fused' if fused_round else 'apart'}"
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                start = time.perf_counter()
                try:
                    out = ours(rows, compile=compile_with, fused_round=fused_round)
                except Exception as exc:
                    run = dict(result="crashed", reason=f"{type(exc).__name__}: {_first_line(exc)}",
                               trace=traceback.format_exc()[-800:])
                else:
                    fell_back = {step: [line[:300] for line in lines if line.startswith(("[fallback]", "[error]"))]
                                 for step, lines in out.rewrites.items()}
                    fell_back = {step: lines for step, lines in fell_back.items() if lines}
                    exact = torch.equal(out.sequences, want[name])
                    run = dict(result="wrong" if not exact else "fell back" if fell_back else "exact",
                               fell_back=fell_back, rewritten=sorted(s for s, lines in out.rewrites.items()
                                                                     if any("] rewrote" in x for x in lines)))
            run["seconds"] = round(time.perf_counter() - start, 1)
            run["warnings"] = sorted({_first_line(w.message)[:200] for w in caught
                                      if isinstance(w.message, specpass.SpecpassWarning)})
            row["runs"][key] = run
    return row


def outcome(row: dict) -> str:
    """The family's worst: not built, not served, crashed, wrong, fell back, exact."""
    if not row.get("built"):
        return "not built"
    if not row.get("served"):
        return "not served"
    results = {run["result"] for run in row["runs"].values()}
    return next(r for r in ("crashed", "wrong", "fell back", "exact") if r in results)


def table(rows: list[dict]) -> str:
    served = [r for r in rows if r.get("served")]
    counts = {kind: sum(1 for r in served if outcome(r) == kind) for kind in ("exact", "fell back", "wrong", "crashed")}
    passes = sorted({r.get("pass", 1) for r in rows})
    lines = [f"{len({r['model_type'] for r in rows})} causal-LM types; {len({r['model_type'] for r in served})} served "
             f"by the loop (pass{'es' if len(passes) > 1 else ''} {', '.join(map(str, passes))} over them, one "
             f"process): " + ", ".join(f"{n} {kind}" for kind, n in counts.items()) + ".", "",
             "| pass | model type | outcome | runs (bs1, ragged; apart, fused) | why |", "|---|---|---|---|---|"]
    for r in sorted(served, key=lambda r: (r["model_type"], r.get("pass", 1))):
        runs = ", ".join(f"{key} {run['result']}" for key, run in r["runs"].items())
        why = "; ".join(sorted({run.get("reason", "") for run in r["runs"].values()} - {""}))
        why = why or "; ".join(sorted({f"{step}: {line}" for run in r["runs"].values()
                                        for step, lines in run.get("fell_back", {}).items() for line in lines}))
        why = why.replace("|", "\\|").replace("\n", " ")[:300]
        lines.append(f"| {r.get('pass', 1)} | {r['model_type']} | {outcome(r)} | {runs} | {why} |")
    lines += ["", "Not served by the loop (specpass refuses the model, or transformers' own step fails):", ""]
    lines += [f"- {r['model_type']}: {r['reason']}" for r in sorted(rows, key=lambda r: r["model_type"])
              if r.get("built") and not r.get("served") and r.get("pass", 1) == passes[0]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.generate_sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated model types (in this order)")
    parser.add_argument("--repeat", type=int, default=1, help="passes over the families, in one process")
    parser.add_argument("--handoff", choices=("inductor", "eager"), default="inductor",
                        help="what runs the rewritten graphs: Inductor, or eager (the passes alone; faster)")
    parser.add_argument("--fused", default="apart,fused", help="the rounds: apart, fused or both")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shards", type=int, default=1,
                        help="the families dealt over this many processes run side by side (each its share in sequence)")
    parser.add_argument("--balance", type=Path,
                        help="deal the shards by a previous run's seconds per type (longest first, to the least loaded)")
    parser.add_argument("--deadline", type=float, help="stop the shards after this many seconds, keeping their rows")
    parser.add_argument("--out", type=Path, help="write the rows as JSON (as it goes)")
    parser.add_argument("--table", type=Path, help="print the table of a JSON file and exit")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())["rows"]))
        return
    import transformers

    import specpass

    transformers.logging.set_verbosity_error()
    archs = architectures()
    if args.only:
        archs = {k: archs[k] for k in args.only.split(",")}
    if args.shards > 1:
        result = sharded(archs, args)
        harness.saver(args.out)(result)
        print(table(result["rows"]))
        return
    compile_with = specpass.backend(handoff=args.handoff)
    fused = tuple({"apart": False, "fused": True}[f] for f in args.fused.split(","))
    device = torch.device(args.device)
    result = dict(env=harness.environment(device, "float32", handoff=args.handoff), rows=[])
    save = harness.saver(args.out)
    for repeat in range(1, args.repeat + 1):
        for model_type, class_name in archs.items():
            start = time.perf_counter()
            row = run_family(model_type, class_name, compile_with, fused, device) | {"pass": repeat}
            row["seconds"] = round(time.perf_counter() - start, 1)
            result["rows"].append(row)
            save(result)
            print(f"{repeat} {model_type:28s} {outcome(row):10s} {row['seconds']}s "
                  f"{(row.get('reason') or '')[:100]}", file=sys.stderr, flush=True)
    print(table(result["rows"]))


def sharded(archs: dict[str, str], args: argparse.Namespace) -> dict:
    """The sweep of `archs` dealt over `args.shards` processes (round-robin, or by a previous run's
    seconds with `args.balance`): their rows merged in `archs`' order, pass by pass. Each process
    writes its own rows beside `args.out` as it goes: a run cut off (`args.deadline`) keeps them and
    names the types it did not reach."""
    shares = deal(list(archs), args.shards, args.balance)
    where = args.out.parent if args.out else Path(tempfile.mkdtemp())
    stem = args.out.stem if args.out else "generate_sweep"
    outs = [where / f"{stem}.shard{i}.json" for i in range(len(shares))]
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.generate_sweep", "--only", ",".join(share),
                               "--repeat", str(args.repeat), "--handoff", args.handoff, "--fused", args.fused,
                               "--device", args.device, "--out", str(out)], stdout=subprocess.DEVNULL)
             for share, out in zip(shares, outs) if share]
    deadline = args.deadline
    end = None if deadline is None else time.monotonic() + deadline
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(None if end is None else max(end - time.monotonic(), 0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(f"cut off after {deadline:.0f} s")
    runs = [json.loads(out.read_text()) for out in outs if out.exists()]
    if not runs:
        raise SystemExit(f"no shard wrote its rows (exit codes {codes})")
    order = {name: i for i, name in enumerate(archs)}
    rows = sorted((row for run in runs for row in run["rows"]), key=lambda r: (r["pass"], order[r["model_type"]]))
    reached = {(row["pass"], row["model_type"]) for row in rows}
    cut_off = [name for name in archs if any((p, name) not in reached for p in range(1, args.repeat + 1))]
    return dict(env=runs[0]["env"] | dict(shards=args.shards, shard_exit_codes=codes, cut_off=cut_off), rows=rows)


def deal(names: list[str], shards: int, previous: Path | None) -> list[list[str]]:
    """`names` over `shards` shares: round-robin, or by a previous run's seconds per type, the longest
    first onto the share with the fewest seconds (a type it has no row for counts as its mean)."""
    if previous is None:
        return [names[i::shards] for i in range(shards)]
    seconds = {row["model_type"]: row["seconds"] for row in json.loads(previous.read_text())["rows"]}
    mean = sum(seconds.values()) / max(len(seconds), 1)
    shares: list[list[str]] = [[] for _ in range(shards)]
    loads = [0.0] * shards
    for name in sorted(names, key=lambda n: -seconds.get(n, mean)):
        least = loads.index(min(loads))
        shares[least].append(name)
        loads[least] += seconds.get(name, mean)
    return shares

if __name__ == "__main__":
    main()

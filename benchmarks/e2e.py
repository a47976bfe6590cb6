"""End to end on a GPU: tokens/s of greedy decoding with the shipped pair, every variant side by side.

    python -m benchmarks.e2e --out e2e.json                      # the sweep (bf16), then the fp32 check
    python -m benchmarks.e2e --bs 1,8 --out a.json               # a part of it (results merge by key)
    python -m benchmarks.e2e --plot docs/e2e.json                # docs/e2e.png and the table (CPU, no GPU)
    python -m benchmarks.e2e --device cpu --quick                # a smoke test of the script
    python -m benchmarks.e2e --sampling 0,0.6,1.0,0.6:0.95 --out docs/e2e_sampling.json   # sampled
    python -m benchmarks.e2e --bs 1 --batches 8 --variants eagle3/specpass-fused --k 8 --k-sweep 4,6 \
        --trees "4,7,32;8,5,32" --tuned --tune-tokens 32,256 --no-check --out docs/e2e_tree.json   # tree rounds

Variants, all greedy, on the held-out prompts (checkpoints/prompts.json), no EOS, the same number
of new tokens per request:
  plain          the target alone through our loop (K = 0) as `Decoder` compiles it by default (the
                 specpass backend, then Inductor), one CUDA graph per token
  lean           the lean baseline (benchmarks/lean.py): gpt-fast's decoding, one compiled step per
                 token and nothing else; the tables' ratios ("vs baseline") are against the faster
                 of the two, batch size by batch size
  hf-static      transformers' generate with a static cache, compiled the way its docs say
                 (cache_implementation="static": generate compiles the decoding forward with
                 mode="reduce-overhead"; prefill runs eagerly)
  hf-assisted    transformers' assisted generation, generate(assistant_model=the standalone draft);
                 batch size 1 only (transformers' limit), eager, its default schedule
  DRAFTER/LOOP   our loop with DRAFTER in {eagle3, draft, parallel (the P-EAGLE head: verify + one
                 draft forward per round), dflash (the DFlash block draft: likewise)} and LOOP in {inductor-apart (plain Inductor, one graph
                 per step), specpass-apart, specpass-fused (one graph per round)}
K = 4 for every loop, and each K of --k-sweep for eagle3/, parallel/ and dflash/specpass-fused
(or the --swept ones; the best K per batch size); each tree shape of --trees (TOPK,STEPS,TOKENS;...)
for the swept EAGLE-3 variant; with --tuned, the loop's own choice for the EAGLE-3 head and for the
block draft (`Decoder.tune_k` among plain decoding, each --tune-ks K (the chain's search around them)
and, for the EAGLE-3 head, the --trees shapes, before the timed runs: rounds timed on the first batch,
acceptance measured on every batch; its "compile s" includes the tuning). With --paired OPTION ...
each of our loop's variants also runs compiled with that specpass switch flipped from its default,
beside it as VARIANT+pdl (Inductor's programmatic dependent launch on), VARIANT+coordinate_descent
(Inductor's coordinate-descent tuning on), VARIANT+no-gemv (the GEMV pass off) or
VARIANT+no-gemv_group (each linear its own launch); the lean baseline runs as gpt-fast runs it. With --batches N each
timed pass generates N batches of bs prompts in turn (the next held-out prompts each) and pools
them. "tokens/s" is end to end: generated tokens over the wall time of generate, prefill (eager,
in every variant, HF's too) included; "decode tokens/s" counts the rounds alone (our loops).
Every compiled variant uses CUDA graphs (mode="reduce-overhead"). Processes started side by side
with one --gpu-lock file compile at once and take turns to time (and to tune). A variant's first generate
compiles it (its wall time is "compile s"); then the loop variants are timed interleaved,
`--repeats` passes over all of them (median), and each HF variant `--repeats` times. The
split of a round (draft / verify / accept / catch-up / between rounds) comes from one more run
with CUDA events after each step (steps compiled apart only). "agree" compares the tokens with
plain decoding: exact equality is expected in fp32 (the check at --check-bs after the sweep), while
bf16 verify over K+1 rows and decode over one row may round differently, so bf16 reports the
agreeing prefix (mean fraction of tokens before the first difference).

--sampling T[:P],... times speculative sampling instead: for each temperature T (top-p P), plain
sampling through our loop (the baseline, same T and P) against eagle3/specpass-fused with drafts
sampled from the head's distribution and with greedy drafts (q one-hot), K = --k and each of
--k-sweep, fixed seeds; "round vs greedy" is a round's time over the greedy round's (T = 0) of
the same variant and K in the same run. No fp32 check (sampled tokens differ from plain's by
design; tests/test_sampling.py tests the distribution).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks import harness

CHECKPOINTS = harness.ROOT / "checkpoints"
TARGET, DRAFTERS = CHECKPOINTS / "stdlib-llama", {"eagle3": ("eagle", CHECKPOINTS / "stdlib-llama-eagle3"),
                                                   "draft": ("draft", CHECKPOINTS / "stdlib-llama-draft"),
                                                   "parallel": ("parallel", CHECKPOINTS / "stdlib-llama-peagle3"),
                                                   "dflash": ("block", CHECKPOINTS / "stdlib-llama-dflash")}
LOOPS = {"inductor-apart": ("inductor", False), "specpass-apart": ("specpass", False),
         "specpass-fused": ("specpass", True)}
SWEPT = ("eagle3/specpass-fused", "parallel/specpass-fused", "dflash/specpass-fused")  # the variants also run at each K of --k-sweep
TUNED = "tuned"  # a variant's K: Decoder.tune_k chooses it
START = time.perf_counter()


@dataclasses.dataclass(kw_only=True)
class LoopRow(harness.Row):
    """One variant at one batch size and K (0: no drafts), greedy or sampled; None: not measured
    (the HF variants have no rounds, greedy rows no temperature)."""

    bs: int
    k: int | str  # K, or a tree shape ("tree 4,5,16"); the tuned variant's choice
    agree: bool | None = None  # greedy: the tokens equal the reference's (plain decoding's)
    prefix: float | None = None  # greedy: mean fraction of each request's tokens before the first difference
    temperature: float | None = None
    top_p: float | None = None
    round_vs_greedy: float | None = None  # sampled: ms per round over the same variant's greedy round
    tokens_per_s: float  # median over the passes
    pass_tokens_per_s: list[float] | None  # pass i of every loop variant ran side by side
    decode_tokens_per_s: float | None  # the rounds alone
    prefill_ms: float | None
    accept_length: float | None
    acceptance: list[float] | None
    round_ms: float | None
    phase_ms: dict[str, float] | None  # steps apart: each step's ms (one more run, CUDA events)
    compile_s: float  # the first generate's wall time
    profile: dict | None = None  # --profile: `kernels_per_round`
    host_ms: float | None = None  # on a GPU: the loop's host time a round not spent waiting for the device


def prefix_agreement(got: list[list[int]], want: list[list[int]]) -> float:
    fractions = []
    for g, w in zip(got, want):
        same = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        fractions.append(same / max(len(w), 1))
    return sum(fractions) / len(fractions)


class Bench:
    """Loads the pair once; each loop variant gets its own copy of the models (own KV caches)."""

    def __init__(self, args):
        import torch

        from models.checkpoint import load
        from models.drafters import load_drafter
        from models.llama import Llama
        from models.text import load_prompts

        self.torch, self.args = torch, args
        self.device, self.dtype = torch.device(args.device), getattr(torch, args.dtype)
        self.cudagraphs = "reduce-overhead" if self.device.type == "cuda" else None
        self.target = load(Llama, TARGET, device=self.device, dtype=self.dtype)
        self.drafters = {name: load_drafter(self.target, kind, path, device=self.device, dtype=self.dtype)
                         for name, (kind, path) in DRAFTERS.items()}
        self.prompts = load_prompts()
        self.decoders = {}  # (variant, batch, cache length) -> Decoder: other samplings reuse its models
        harness.dynamo_limits(1024)  # every variant compiles the same step functions again, for its own models

    def batches(self, bs: int) -> list[list[list[int]]]:
        """--batches batches of bs consecutive held-out prompts (cycled)."""
        from models.text import encode

        texts = itertools.cycle(self.prompts)
        return [[encode(t) for t in itertools.islice(texts, bs)] for _ in range(self.args.batches)]

    def run_loops(self, batches, variants: list[tuple], sampling: dict | None = None) -> dict[tuple, dict]:
        """Build and warm up every (name, drafter, compile, fused, K[, greedy drafts]) variant, then
        time them interleaved, `repeats` passes over all of them, so that drift of the host's speed
        during the run (15-25% on these host-bound loops) falls on every variant alike. A pass
        generates every batch of `batches` in turn (`pooled`); tune_k measures acceptance on all of
        them, the rounds' ms and the profile on the first. `sampling`:
        generate's temperature / top_p / seed; a variant built by an earlier call for the same batch
        is reused (its compiled graphs too), so "compile s" is then the new graph's alone."""
        import copy

        from benchmarks.lean import LeanDecoder
        from specpass.loop import Decoder, TreeDrafter, cache_slots

        new = self.args.new_tokens
        ks = [k for v in variants
              for k in ([*range(1, 9), *self.args.tune_ks, *self.args.trees] if v[4] == TUNED else [v[4]])]
        longest = max((new, *(self.args.tune_tokens if any(v[4] == TUNED for v in variants) else ())))
        prompts = batches[0]
        longest_prompt = max(len(p) for batch in batches for p in batch)
        max_len = max(cache_slots(longest_prompt, longest, k) for k in ks)  # every drafter, K and tuning
        sampling = sampling or {}
        decoders, results = {}, {}
        for variant in variants:
            _, drafter, compile, fused, k, *greedy_drafts = variant
            start = time.perf_counter()
            if decoders and start - START > self.args.stop_after:  # the first (the reference) always runs
                print(f"    skipped {variant[0]} K={label(k)}: past --stop-after", file=sys.stderr)
                continue
            if compile == "lean" and (variant, len(prompts), max_len) not in self.decoders:
                self.decoders[variant, len(prompts), max_len] = LeanDecoder(
                    copy.deepcopy(self.target), max_batch=len(prompts), max_len=max_len, mode=self.cudagraphs)
            if (variant, len(prompts), max_len) not in self.decoders:
                target, drafter = copy.deepcopy((self.target, self.drafters[drafter] if drafter else None))
                self.decoders[variant, len(prompts), max_len] = Decoder(
                    target, drafter, k=self.args.k if k == TUNED else k, max_batch=len(prompts), max_len=max_len,
                    compile=compile, mode=self.cudagraphs, fused_round=fused,
                    greedy_drafts=bool(greedy_drafts and greedy_drafts[0]), regional=not self.args.inline)
            decoders[variant] = decoder = self.decoders[variant, len(prompts), max_len]
            if k == TUNED:  # the loop's own choice, timed on these prompts (the GPU its own while it times)
                with harness.exclusive(self.args.gpu_lock):
                    trees = self.args.trees if isinstance(decoder.drafter, TreeDrafter) else ()  # a block drafts none
                    choice = decoder.tune_k([p for batch in batches for p in batch], self.args.tune_ks, off=True,
                                            trees=trees, new_tokens=self.args.tune_tokens, sampling=sampling)
                print(f"    tune_k chose {choice.k}: tokens/ms {({str(c): round(v, 3) for c, v in choice.tokens_per_ms.items()})}",
                      file=sys.stderr)
            first = decoder.generate(prompts, new, **sampling)  # compiles, records the CUDA graphs
            tokens = first.tokens + [t for batch in batches[1:] for t in decoder.generate(batch, new, **sampling).tokens]
            results[variant] = dict(tokens=tokens, runs=[], compile_s=time.perf_counter() - start,
                                    k=label(decoder.k))
            print(f"    compiled {variant[0]} K={label(decoder.k)} in {results[variant]['compile_s']:.0f} s",
                  file=sys.stderr)
        with harness.exclusive(self.args.gpu_lock):
            for i in range(self.args.repeats):
                order = list(decoders)
                order = order[i % len(order):] + order[: i % len(order)]
                for variant in order:
                    results[variant]["runs"].append(pooled([decoders[variant].generate(batch, new, **sampling).metrics
                                                            for batch in batches]))
        for variant, decoder in decoders.items():
            runs, r = results[variant].pop("runs"), results[variant]
            timed = (decoder.generate(prompts, new, timing=True, **sampling).metrics
                     if variant[1] and not variant[3] else None)
            r.update(tokens_per_s=statistics.median(m.tokens_per_s for m in runs),
                     pass_tokens_per_s=[m.tokens_per_s for m in runs],  # pass i of every variant ran side by side
                     # the rounds alone: tokens after each request's first (prefill's) over the loop's time
                     decode_tokens_per_s=statistics.median((m.new_tokens - len(prompts) * len(batches))
                                                           / (m.seconds - m.prefill_seconds)
                                                           for m in runs),
                     prefill_ms=statistics.median(1e3 * m.prefill_seconds for m in runs),
                     accept_length=runs[0].accept_length, acceptance=runs[0].acceptance,
                     round_ms=statistics.median(m.phase_ms["round"] for m in runs),
                     host_ms=statistics.median(m.phase_ms["host"] for m in runs) if "host" in runs[0].phase_ms else None,
                     phase_ms=timed.phase_ms if timed else None)
            if self.args.profile and self.device.type == "cuda":
                r["profile"] = kernels_per_round(decoder, prompts, new, sampling)
        return results

    def run_hf(self, prompts, assistant: bool) -> dict:
        from transformers import LlamaForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch = self.torch
        torch.compiler.reset()
        load = lambda path: LlamaForCausalLM.from_pretrained(path, dtype=self.dtype).to(self.device).eval()  # noqa: E731
        model = load(TARGET)
        kwargs = dict(max_new_tokens=self.args.new_tokens, do_sample=False, pad_token_id=0)
        if assistant:
            kwargs["assistant_model"] = load(DRAFTERS["draft"][1])
        elif self.device.type == "cuda":
            kwargs["cache_implementation"] = "static"
        width = max(map(len, prompts))  # left padding, as transformers' decoder-only generate expects
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)

        def generate():
            start = harness.now(self.device)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, **kwargs)
            return out[:, width:].tolist(), harness.now(self.device) - start

        start = time.perf_counter()
        generate()
        compile_s = time.perf_counter() - start
        runs = [generate() for _ in range(self.args.repeats)]
        seconds = statistics.median(s for _, s in runs)
        return dict(tokens=runs[0][0], tokens_per_s=len(prompts) * self.args.new_tokens / seconds, pass_tokens_per_s=None,
                    decode_tokens_per_s=None, prefill_ms=None, accept_length=None, acceptance=None, round_ms=None, phase_ms=None, compile_s=compile_s)


def pooled(runs: list):
    """One Metrics for several generates run in turn: tokens and seconds summed, the acceptance
    weighted by each run's request-rounds, the ms per round (and the host's, on a GPU) by its rounds."""
    from specpass.loop import Metrics
    from specpass.loop.cost import pooled_acceptance

    rounds, request_rounds = sum(m.rounds for m in runs), max(sum(m.request_rounds for m in runs), 1)
    return Metrics(new_tokens=sum(m.new_tokens for m in runs), rounds=rounds, seconds=sum(m.seconds for m in runs),
                   prefill_seconds=sum(m.prefill_seconds for m in runs),
                   accept_length=sum(m.accept_length * m.request_rounds for m in runs) / request_rounds,
                   acceptance=pooled_acceptance(runs),
                   phase_ms={phase: sum(m.phase_ms[phase] * m.rounds for m in runs) / rounds
                             for phase in ("round", "host") if all(phase in m.phase_ms for m in runs)},
                   request_rounds=request_rounds)


def kernels_per_round(decoder, prompts, new: int, sampling: dict) -> dict:
    """One more generate under torch.profiler: the GPU kernels per round (a round's CUDA graph
    replays its kernels; prefill's few, eager, are counted in and spread over the rounds), their
    summed time per round, the 30 most frequent kernels (name, launches and us per round), and the
    GPU's idle time between them (`gaps`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rounds = decoder.generate(prompts, new, **sampling).metrics.rounds
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.count]
    per_round = lambda v: round(v / rounds, 2)  # noqa: E731
    top = sorted(kernels, key=lambda e: -e.count)[:30]
    return dict(rounds=rounds, kernels=per_round(sum(e.count for e in kernels)),
                us=per_round(sum(e.device_time_total for e in kernels)),
                top=[(e.key[:90], per_round(e.count), per_round(e.device_time_total)) for e in top],
                gaps=harness.gaps_per_round(prof, rounds))


def profiled(profile: dict | None) -> str:
    """A profile's figures a round, for the log line (empty without one)."""
    if not profile:
        return ""
    gaps = profile["gaps"]
    return (f"; a round: {profile['kernels']} kernels, {profile['us']} us on the GPU, idle {gaps['idle_us']} us "
            f"({gaps['long']} gaps >= 5 us: {gaps['long_us']} us, longest {gaps['longest_us']} us)")


def sweep(args, save) -> list[dict]:
    """Every batch size of `args.bs`; `save(rows)` after each row."""
    bench = Bench(args)
    torch = bench.torch
    rows = []
    env = harness.environment(bench.device, args.dtype, new_tokens=args.new_tokens)
    print(harness.describe(env), file=sys.stderr)

    def record(variant: str, bs: int, k: int, result: dict, reference: list[list[int]]):
        agree = result["tokens"] == reference
        prefix = prefix_agreement(result["tokens"], reference)
        row = LoopRow(env=env, variant=variant, bs=bs, agree=agree, prefix=prefix,
                      **{"k": k, **{key: v for key, v in result.items() if key != "tokens"}}).asdict()
        rows.append(row)
        save(rows)
        print(f"  bs {bs} k {k} {variant}: {row['tokens_per_s']:.0f} tok/s, accept {row['accept_length']}, "
              f"round {row['round_ms']} ms, compile {row['compile_s']:.0f} s, agree {agree} ({prefix:.2f})"
              + profiled(row.get("profile")), file=sys.stderr)

    loops = [] if args.no_plain else [("plain", None, "specpass", True, 0), ("lean", None, "lean", True, 0)]
    tuned = []
    for drafter, (loop, (compile, fused)) in itertools.product(DRAFTERS, LOOPS.items()):
        if f"{drafter}/{loop}" in args.variants:
            sweep_k = [k for k in args.k_sweep if k != args.k] if f"{drafter}/{loop}" in args.swept else []
            loops += [(f"{drafter}/{loop}", drafter, compile, fused, k) for k in [args.k, *sweep_k]]
            if f"{drafter}/{loop}" == SWEPT[0]:  # the EAGLE-3 head's trees (when swept)
                loops += [(f"{drafter}/{loop}", drafter, compile, fused, tree) for tree in args.trees
                          if f"{drafter}/{loop}" in args.swept]
            if f"{drafter}/{loop}" in (SWEPT[0], SWEPT[2]):  # the chain head's and the block draft's own choice
                tuned += [(f"{drafter}/{loop}/tuned", drafter, compile, fused, TUNED)] * args.tuned
    loops += tuned  # last: they compile the most, and --stop-after drops them first
    if args.paired:  # each loop again beside itself, each switch flipped; the lean baseline as gpt-fast has it
        import specpass
        backends = {suffix: specpass.backend(**options) for suffix, options in map(harness.flipped, args.paired)}
        paired = []
        for name, drafter, compile, *rest in loops:
            paired.append((name, drafter, compile, *rest))
            if compile == "specpass":
                paired += [(f"{name}+{suffix}", drafter, backend, *rest) for suffix, backend in backends.items()]
        loops = paired
    for bs in args.bs:
        batches = bench.batches(bs)
        results = bench.run_loops(batches, loops)
        reference = results[loops[0]]["tokens"]
        for variant, result in results.items():
            record(variant[0], bs, result.pop("k"), result, reference)
        if "hf-static" in args.variants:
            record("hf-static", bs, 0, bench.run_hf(batches[0], assistant=False), reference[:bs])
        if "hf-assisted" in args.variants and bs == 1:
            record("hf-assisted", bs, 0, bench.run_hf(batches[0], assistant=True), reference[:bs])
        bench.decoders.clear()
        torch.compiler.reset()  # frees the compiled graphs of this batch size
    return rows


def sweep_sampling(args, save) -> list[dict]:
    """Plain sampling against speculative sampling (sampled and greedy drafts) at each temperature
    of `args.sampling` (greedy first, the reference of "round vs greedy") and batch size."""
    bench = Bench(args)
    torch = bench.torch
    env = harness.environment(bench.device, args.dtype, new_tokens=args.new_tokens)
    print(f"{harness.describe(env)}; sampling", file=sys.stderr)
    loops = [("plain", None, "specpass", True, 0, False)]
    for k in dict.fromkeys([args.k, *args.k_sweep]):
        loops += [("eagle3/specpass-fused", "eagle3", "specpass", True, k, False),
                  ("eagle3/specpass-fused-greedy-drafts", "eagle3", "specpass", True, k, True)]
    loops += [("eagle3/specpass-fused", "eagle3", "specpass", True, tree, False) for tree in args.trees]
    loops += [("eagle3/specpass-fused/tuned", "eagle3", "specpass", True, TUNED, False)] * args.tuned
    rows = []
    for bs in args.bs:
        batches = bench.batches(bs)
        greedy_round = {}
        for temperature, top_p in [(0.0, None)] + [t for t in args.sampling if t != (0.0, None)]:
            sampling = dict(temperature=temperature, top_p=top_p, seed=0)
            # greedy drafts change nothing at temperature 0: their greedy round is the sampled drafts' one
            variants = [v for v in loops if not (v[5] and temperature == 0)]
            for (variant, _, _, _, k, _), r in bench.run_loops(batches, variants, sampling).items():
                k = label(k)
                if temperature == 0 and not variant.endswith("/tuned"):
                    greedy_round[variant, k] = greedy_round[f"{variant}-greedy-drafts", k] = r["round_ms"]
                # the loop's choice: against the greedy round of the same K (None: that K not swept)
                greedy = greedy_round.get((variant.removesuffix("/tuned"), k))
                row = LoopRow(env=env, variant=variant, bs=bs, temperature=temperature, top_p=top_p,
                              round_vs_greedy=greedy and r["round_ms"] / greedy,
                              **{key: v for key, v in r.items() if key != "tokens"}).asdict()
                rows.append(row)
                save(rows)
                print(f"  bs {bs} T {temperature} p {top_p} k {k} {variant}: {row['tokens_per_s']:.0f} tok/s, "
                      f"accept {row['accept_length']}, round {row['round_ms']:.3f} ms "
                      f"({ratio(row['round_vs_greedy'])} greedy)" + profiled(r.get("profile")), file=sys.stderr)
        bench.decoders.clear()
        torch.compiler.reset()
    return rows


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def sampling_table(rows: list[dict]) -> str:
    base = {(r["bs"], r["temperature"], r["top_p"]): r["tokens_per_s"] for r in rows if r["variant"] == "plain"}
    lines = ["| bs | temperature | top-p | variant | K | tokens/s | vs plain sampling | accepted length | ms/round | "
             "round vs greedy round |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        accept = f"{r['accept_length']:.2f}" if r["k"] else "-"
        lines.append(f"| {r['bs']} | {r['temperature']} | {r['top_p'] or '-'} | {r['variant']} | {r['k'] or '-'} | "
                     f"{r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base[r['bs'], r['temperature'], r['top_p']]:.2f}x | "
                     f"{accept} | {r['round_ms']:.3f} | {ratio(r['round_vs_greedy'])} |")
    return "\n".join(lines)


def check_fp32(args, save) -> list[dict]:
    """Every loop variant in fp32 at one batch size: tokens exactly equal to plain decoding."""
    args = argparse.Namespace(**{**vars(args), "dtype": "float32", "bs": [args.check_bs], "k_sweep": []})
    return sweep(args, save)


def against_inductor(rows: list[dict], r: dict) -> str:
    """specpass / plain Inductor for the same drafter and K: the median and range of per-pass ratios
    (pass i of both variants ran side by side, so host drift cancels)."""
    drafter, _, loop = r["variant"].partition("/")
    if not loop.startswith("specpass"):
        return "-"
    base = next((b for b in rows if b["variant"] == f"{drafter}/inductor-apart" and b["k"] == r["k"]
                 and (b["bs"], b["dtype"]) == (r["bs"], r["dtype"])), None)
    if base is None or not base.get("pass_tokens_per_s") or not r.get("pass_tokens_per_s"):
        return "-"
    ratios = [a / b for a, b in zip(r["pass_tokens_per_s"], base["pass_tokens_per_s"])]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def baseline(rows: list[dict], key: str, by: tuple[str, ...]) -> dict:
    """Per `by` (batch size, dtype), the faster of plain decoding through the loop and the lean baseline."""
    base: dict = {}
    for r in rows:
        if r["variant"] in ("plain", "lean") and r.get(key):
            at = tuple(r[k] for k in by)
            base[at] = max(base.get(at, 0.0), r[key])
    return base


def table(rows: list[dict]) -> str:
    base = baseline(rows, "tokens_per_s", ("bs", "dtype"))
    decode = baseline(rows, "decode_tokens_per_s", ("bs", "dtype"))
    lines = ["| dtype | bs | variant | K | tokens/s | vs baseline | vs inductor-apart (per pass) | decode tokens/s | "
             "vs baseline | prefill ms | accepted length | ms/round | draft / verify / accept / catch-up / between ms | "
             "agree (prefix) | compile s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratio = lambda v, of: f"{v / of[r['bs'], r['dtype']]:.2f}x" if (r["bs"], r["dtype"]) in of else "-"  # noqa: E731
    for r in rows:  # a run with --no-plain has no ratios to the baseline
        phases = "-"
        if r["phase_ms"]:
            phases = " / ".join(f"{r['phase_ms'].get(p, 0):.3f}" for p in ("draft", "verify", "accept", "catch_up", "between"))
        accept = f"{r['accept_length']:.2f}" if r["accept_length"] is not None else "-"
        round_ms = f"{r['round_ms']:.3f}" if r["round_ms"] is not None else "-"
        rate = r["decode_tokens_per_s"]
        decoding = f"{rate:.0f} | {ratio(rate, decode)} | {r['prefill_ms']:.1f}" if rate else "- | - | -"
        lines.append(f"| {r['dtype']} | {r['bs']} | {r['variant']} | {r['k'] or '-'} | {r['tokens_per_s']:.0f} | "
                     f"{ratio(r['tokens_per_s'], base)} | {against_inductor(rows, r)} | {decoding} | "
                     f"{accept} | {round_ms} | {phases} | "
                     f"{'yes' if r['agree'] else 'no'} ({r['prefix']:.2f}) | {r['compile_s']:.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> None:
    """tokens/s against batch size, one line per variant (the best K of each), bf16 rows; the right
    panel divides each by the baseline at the same batch size (same run): the faster of plain
    decoding through the loop and the lean baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["dtype"] == "bfloat16"]
    base = baseline(rows, "tokens_per_s", ("bs",))
    best: dict[tuple[str, int], float] = {}
    for r in rows:
        best[r["variant"], r["bs"]] = max(best.get((r["variant"], r["bs"]), 0.0), r["tokens_per_s"])
    fig, (absolute, relative) = plt.subplots(1, 2, figsize=(13, 5))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        points = sorted((bs, tps) for (v, bs), tps in best.items() if v == variant)
        style = "o--" if variant.startswith(("plain", "lean", "hf-")) else "o-"
        bss = [bs for bs, _ in points]
        absolute.plot(bss, [tps for _, tps in points], style, label=variant)
        relative.plot(bss, [tps / base[bs,] for bs, tps in points], style, label=variant)
    for ax in (absolute, relative):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (requests)")
        ax.grid(True, which="both", alpha=0.3)
    absolute.set_yscale("log")
    absolute.set_ylabel("tokens/s (greedy, generated tokens)")
    relative.set_ylabel("tokens/s / baseline (the faster of plain and lean decoding)")
    relative.axhline(1.0, color="gray", lw=0.8)
    relative.legend(fontsize=8)
    device = rows[0]["device"] if rows else ""
    fig.suptitle(f"Greedy decoding, shipped 19M target, {device}, bf16, best K per variant")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _temperature(text: str) -> tuple[float, float | None]:
    temperature, _, top_p = text.partition(":")
    return float(temperature), float(top_p) if top_p else None


def label(k) -> int | str:
    """A row's K: the int, or a tree shape's text."""
    return k if isinstance(k, int) else str(k)


def merge(path: Path, rows: list[dict]) -> list[dict]:
    """Rows already in `path` plus these; a row replaces an old one with the same key."""
    key = lambda r: (r["dtype"], r["bs"], r["variant"], r["k"], r.get("temperature"), r.get("top_p"))  # noqa: E731
    old = json.loads(path.read_text()) if path.is_file() else []
    new_keys = {key(r) for r in rows}
    return [r for r in old if key(r) not in new_keys] + rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--bs", default="1,8,32,64", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--k-sweep", default="3,5,6", type=lambda s: [int(x) for x in s.split(",") if x],
                        help="more K for the --swept variants (the best K per batch size)")
    parser.add_argument("--swept", default=",".join(SWEPT), type=lambda s: s.split(","),
                        help=f"the variants also run at each K of --k-sweep, of {', '.join(SWEPT)}")
    all_variants = ["hf-static", "hf-assisted"] + [f"{d}/{loop}" for d in DRAFTERS for loop in LOOPS]
    parser.add_argument("--variants", default=",".join(all_variants), type=lambda s: [v for v in s.split(",") if v],
                        help=f"comma-separated, of {all_variants} (plain and lean run too, unless --no-plain; "
                             "\"\": only they)")
    parser.add_argument("--inline", action="store_true",
                        help="compile every layer inline in each step (Decoder(regional=False)): a layer's residual "
                             "add fuses with the next layer's norm, at more compile time")
    parser.add_argument("--paired", nargs="+", default=[], choices=harness.PAIRED, metavar="OPTION",
                        help=f"also run each of the loop's variants compiled with that specpass switch of "
                             f"{harness.PAIRED} flipped from its default, beside it as VARIANT+SUFFIX "
                             f"({harness.paired_suffixes()})")
    parser.add_argument("--no-plain", action="store_true",
                        help="skip plain decoding in the greedy sweep (agree then compares with the first variant)")
    parser.add_argument("--trees", default=[], type=harness.tree_shapes, metavar="TOPK,STEPS,TOKENS;...",
                        help="tree shapes the swept EAGLE-3 variant also runs at (and --tuned chooses among)")
    parser.add_argument("--tuned", action="store_true",
                        help="also the loop's own choice: Decoder.tune_k among plain, chain K and --trees")
    parser.add_argument("--tune-ks", default="2,6", type=lambda s: [int(x) for x in s.split(",")],
                        help="the chain K --tuned times first")
    parser.add_argument("--tune-tokens", default="8,40", type=lambda s: tuple(int(x) for x in s.split(",")),
                        help="--tuned: the new tokens of the short and the long generate each K is timed by "
                             "(the long one also measures the acceptance)")
    parser.add_argument("--gpu-lock", type=Path,
                        help="a file: processes started side by side with it compile at once and take turns to time")
    parser.add_argument("--stop-after", type=float, default=float("inf"),
                        help="seconds: compile no further variant after this, time those compiled (a device "
                             "command's time is capped, and rows are saved only once a batch size is timed)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=1,
                        help="time this many batches of bs prompts (the next held-out prompts each), generated in turn: "
                             "at bs 1 one prompt's accepted length is where its trajectory goes")
    parser.add_argument("--check-bs", type=int, default=8, help="batch size of the fp32 exactness check")
    parser.add_argument("--no-check", action="store_true", help="skip the fp32 exactness check")
    parser.add_argument("--quick", action="store_true", help="a smoke test: few tokens, one batch size, K 2")
    parser.add_argument("--out", type=Path, help="merge the rows into this JSON file")
    parser.add_argument("--profile", action="store_true",
                        help="CUDA: also profile one generate per variant: kernels, GPU us and idle gaps per round")
    parser.add_argument("--plot", type=Path, help="draw docs/e2e.png from this JSON file, print its table, exit")
    parser.add_argument("--sampling", type=lambda s: [_temperature(t) for t in s.split(",")],
                        help="speculative sampling at these temperatures, each T or T:top_p (see above)")
    args = parser.parse_args()
    if args.plot:
        rows = json.loads(args.plot.read_text())
        plot(rows, harness.ROOT / "docs" / "e2e.png")
        print(table(rows))
        return
    unknown = sorted(set(args.variants) - set(all_variants))
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {all_variants}")
    if args.quick:
        args.bs, args.k, args.k_sweep, args.new_tokens, args.repeats, args.check_bs = [1], 2, [3], 16, 2, 2

    def save(rows: list[dict]) -> None:  # as it goes: a run cut short keeps what it measured
        if args.out:
            args.out.write_text(json.dumps(merge(args.out, rows), indent=1))

    if args.sampling:
        print(sampling_table(sweep_sampling(args, save)))
        return
    rows = sweep(args, save)
    if not args.no_check:
        rows += check_fp32(args, save)
    print(table(rows))


if __name__ == "__main__":
    main()

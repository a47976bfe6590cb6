"""specpass.generate on transformers models against transformers' own generate and the zoo loop.

    python -m benchmarks.hf_generate --out hf_generate.json       # GPU: bs 1, 8, 32, 64, bf16
    python -m benchmarks.hf_generate --quick --device cpu          # a smoke test of the script

The shipped pair loaded by transformers (`LlamaForCausalLM.from_pretrained`: checkpoints/stdlib-llama
and the standalone draft stdlib-llama-draft; the EAGLE-3 head stdlib-llama-eagle3 through the zoo
loader, on the transformers target's embedding). Variants, greedy, no EOS, the same new tokens per
request, the held-out prompts (checkpoints/prompts.json, byte tokenizer models/text.py), left-padded:
  specpass/plain    specpass.generate(model): the target alone, compiled as below
  specpass/draft    specpass.generate(model, assistant_model=the transformers draft)
  specpass/eagle3   specpass.generate(model, assistant_model=ZooDrafter(EAGLE-3 head))
  zoo/plain, zoo/draft, zoo/eagle3  specpass's Decoder on the zoo's Llama with the same weights
  lean              the lean baseline (benchmarks/lean.py, gpt-fast's decoding) on the zoo's Llama with the
                    same weights: one CUDA graph per token, nothing else
  hf-static         model.generate(cache_implementation="static"): transformers compiles the decoding
                    step itself (mode="reduce-overhead"), prefill eager, as its docs say
  hf-assisted       model.generate(assistant_model=the draft): bs 1 only (transformers' limit), eager
  LOOP+guards       a loop variant (specpass/*, zoo/*) with Dynamo's guards evaluated every round
                    (`Decoder.generate` skips them from round 3 on)
  specpass/*+penalty  with repetition_penalty=1.1 (transformers' processor, inside the compiled round;
                    its tokens differ: not "agree")
  LOOP+pdl, LOOP+coordinate_descent, LOOP+no-gemv, LOOP+no-gemv_group   a loop variant compiled with
                    that specpass switch flipped from its default (Inductor's programmatic dependent
                    launch on; Inductor's coordinate-descent tuning on; the GEMV pass off; each linear
                    its own launch)
Ours: specpass with Inductor, CUDA graphs and the fused round on a GPU (specpass.generate's defaults);
on CPU the rewritten graphs run eagerly (--quick: no torch.compile at all). Every variant runs once
to compile and warm up (torch.compiler.reset() runs between batch sizes: compile_s at a later size
is a compile from torch's warm caches, not a new batch size's cost, which
benchmarks/new_batch_sizes.py measures); then `--repeats` interleaved passes over the variants of a
batch size, median tokens/s (new tokens over generate's wall time, prefill included). "agree": the new tokens
equal specpass/plain's (without it, the first variant's). The loop's variants also give the median
prefill ms and ms per round (`Metrics`) and, for ours, "outside": generate's wall time beyond the
Decoder's (argument checks, the output tensor), and the rewrites per compiled step.
`--profile-bs`: at that batch size, one generate of each loop variant under
torch.profiler: per kernel, launches and GPU time (a text file beside `--out`). Rows are written to
`--out` after every batch size; `--plan 64=specpass/eagle3,hf-static` picks the variants per batch
size, `--deadline` starts no batch size or variant past that many seconds. First (unless
--no-qwen3), a tiny random Qwen3 pair (specpass/draft and hf-assisted at bs 1), to show another
family runs; no speed is claimed from it.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import functools
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks import harness

START = time.perf_counter()
PENALTY = 1.1  # "+penalty": specpass.generate(repetition_penalty=PENALTY)
CHECKPOINTS = harness.ROOT / "checkpoints"
TARGET, DRAFT, EAGLE3 = (CHECKPOINTS / n for n in ("stdlib-llama", "stdlib-llama-draft", "stdlib-llama-eagle3"))


@dataclasses.dataclass(kw_only=True)
class GenerateRow(harness.Row):
    """One variant at one batch size; the loop's figures (None for transformers' own generate)."""

    bs: int
    tokens_per_s: float  # new tokens over generate's wall time, median of the passes
    accept_length: float | None = None
    agree: bool  # the new tokens equal the reference's
    compile_s: float | None = None  # the first call's wall time
    rewrites: dict | None = None  # ours: compiled step -> pass -> rewrites
    rounds: int | None = None
    prefill_ms: float | None = None
    round_ms: float | None = None
    outside_ms: float | None = None  # generate's wall time beyond the Decoder's


class Bench:
    def __init__(self, args):
        import torch
        from transformers import LlamaForCausalLM
        from transformers.utils import logging as hf_logging

        from models.checkpoint import load
        from models.drafters import ZooDrafter, load_drafter
        from models.eagle3 import Eagle3Head
        from models.llama import Llama

        hf_logging.disable_progress_bar()
        harness.dynamo_limits(1024)  # every variant compiles the same step functions
        self.torch, self.args = torch, args
        self.device, self.dtype = torch.device(args.device), getattr(torch, args.dtype)
        cuda = self.device.type == "cuda"
        self.compile = "specpass" if cuda else "eager" if args.quick else _cpu_backend()
        self.mode = "reduce-overhead" if cuda else None

        def hf(path):
            model = LlamaForCausalLM.from_pretrained(path, dtype=self.dtype, attn_implementation="sdpa")
            return model.to(self.device).eval()

        self.model, self.draft = hf(TARGET), hf(DRAFT)
        embed = {"embed_tokens.weight": self.model.get_input_embeddings().weight}
        self.eagle3 = ZooDrafter(load(Eagle3Head, EAGLE3, device=self.device, dtype=self.dtype, shared=embed))
        self.zoo = load(Llama, TARGET, device=self.device, dtype=self.dtype)
        self.zoo_drafters = {kind: load_drafter(self.zoo, kind, path, device=self.device, dtype=self.dtype)
                             for kind, path in (("draft", DRAFT), ("eagle", EAGLE3))}

    def prompts(self, bs: int) -> list[list[int]]:
        from models.text import encode, load_prompts

        return [encode(t) for t in itertools.islice(itertools.cycle(load_prompts()), bs)]

    def variants(self, bs: int):
        """name -> a function of the prompts that generates and returns the new tokens per request
        (the first call compiles); built fresh per batch size."""
        import specpass
        from benchmarks.lean import LeanDecoder
        from specpass.loop import Decoder, cache_slots

        new, k = self.args.new_tokens, self.args.k

        def ours(assistant, compile, **options):
            def run(ids, mask, prompts):
                out = specpass.generate(self.model, ids, attention_mask=mask, assistant_model=assistant,
                                        max_new_tokens=new, num_assistant_tokens=k, compile=compile,
                                        mode=self.mode, return_dict_in_generate=True, **options)
                run.rewrites = {step: collections.Counter(line.split("]")[0][1:] for line in lines)
                                for step, lines in out.rewrites.items()}  # step -> pass -> rewrites
                return out.sequences[:, ids.shape[1]:].tolist(), out.metrics
            run.decoders = specpass.generate.cache
            return run

        def zoo(kind, compile):
            target, drafter = copy.deepcopy((self.zoo, self.zoo_drafters[kind] if kind else None))
            decoders, drafts = {}, k if kind else 0

            def run(ids, mask, prompts):
                if not decoders:
                    max_len = cache_slots(max(map(len, prompts)), new, drafts)
                    decoders[0] = Decoder(target, drafter, k=drafts, max_batch=len(prompts), max_len=max_len,
                                          compile=compile, mode=self.mode, fused_round=self.device.type == "cuda")
                out = decoders[0].generate(prompts, new)
                return out.tokens, out.metrics
            run.decoders = decoders.values()
            return run

        def lean():
            target, decoders = copy.deepcopy(self.zoo), {}

            def run(ids, mask, prompts):
                if not decoders:
                    max_len = cache_slots(max(map(len, prompts)), new, 0)
                    backend = "inductor" if self.device.type == "cuda" else "eager"
                    decoders[0] = LeanDecoder(target, max_batch=len(prompts), max_len=max_len, mode=self.mode,
                                              backend=backend)
                out = decoders[0].generate(prompts, new)
                return out.tokens, out.metrics
            return run

        loops = {"specpass/plain": functools.partial(ours, None), "specpass/draft": functools.partial(ours, self.draft),
                 "specpass/eagle3": functools.partial(ours, self.eagle3), "zoo/plain": functools.partial(zoo, None),
                 "zoo/draft": functools.partial(zoo, "draft"), "zoo/eagle3": functools.partial(zoo, "eagle")}
        others = {"hf-static": self.hf_static, "lean": lean}
        if bs == 1:
            others["hf-assisted"] = lambda: self.hf_generate(self.model, dict(assistant_model=self.draft))

        flips = dict(map(harness.flipped, harness.PAIRED))  # "+no-gemv" -> dict(gemv=False)

        def make(name):  # built only when wanted: a zoo variant copies the models
            base, _, suffix = name.partition("+")
            if base in others and not suffix:
                return others[base]()
            if suffix == "penalty" and base.startswith("specpass/"):  # processed inside the round
                return loops[base](self.compile, repetition_penalty=PENALTY)
            if base not in loops or suffix not in ("", "guards", *flips):
                return None
            if suffix in flips:  # the loop compiled with that specpass switch flipped (on CPU: as without)
                return loops[base](specpass.backend(**flips[suffix]) if self.compile == "specpass" else self.compile)
            run = loops[base](self.compile)
            return guarded(run) if suffix == "guards" else run  # "+guards": every round under full guards

        wanted = self.args.plan.get(bs, self.args.variants)
        return {name: run for name in wanted if (run := make(name)) is not None}

    def hf_static(self):
        # generate compiles its decoding step itself with a static cache (mode "reduce-overhead"),
        # prefill eager, as benchmarks/e2e.py's hf-static; compiling model.forward on top of that
        # also compiled the prefill and measured 55 tokens/s at bs 1 (H100), 9x below e2e.py's
        return self.hf_generate(self.model, dict(cache_implementation="static"))

    def hf_generate(self, model, kwargs):
        def run(ids, mask, prompts):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=self.args.new_tokens, do_sample=False,
                                 pad_token_id=0, eos_token_id=None, **kwargs)
            return out[:, ids.shape[1]:].tolist(), None
        return run

    def timed(self, run, ids, mask, prompts) -> tuple[float, list[list[int]], object]:
        """-> (wall seconds, new tokens, the loop's Metrics or None)."""
        start = harness.now(self.device)
        with self.torch.no_grad():
            tokens, metrics = run(ids, mask, prompts)
        return harness.now(self.device) - start, tokens, metrics

    def profile(self, name, run, ids, mask, prompts) -> str:
        """One generate under torch.profiler -> its GPU kernels (prefill included): per kernel name,
        launches and GPU microseconds, most time first."""
        import collections

        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _, _, metrics = self.timed(run, ids, mask, prompts)
        kernels = collections.defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type.name == "CUDA":
                kernels[e.name][0] += 1
                kernels[e.name][1] += e.device_time
        launches, gpu_us = sum(n for n, _ in kernels.values()), sum(t for _, t in kernels.values())
        lines = [f"== {name}: {metrics.rounds} rounds, prefill {1e3 * metrics.prefill_seconds:.2f} ms, "
                 f"{1e3 * (metrics.seconds - metrics.prefill_seconds) / metrics.rounds:.3f} ms/round wall; "
                 f"{launches} kernels, {gpu_us / 1e3:.2f} ms GPU"]
        lines += [f"{n:6d} {t:10.1f} {k[:160]}" for k, (n, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])]
        return "\n".join(lines)


def guarded(run):
    """run with its Decoders' rounds 3 on under Dynamo's guards too (`generate` skips them otherwise)."""

    def with_guards(*args):
        decoders = list(run.decoders)
        for dec in decoders:
            dec.skip_guards = False
        try:
            return run(*args)
        finally:
            for dec in decoders:
                dec.skip_guards = True
    return with_guards


def left_padded(torch, prompts, device):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def _cpu_backend():
    import specpass

    return specpass.backend(handoff="eager")  # Inductor's C++ builds would take minutes


def sweep(args) -> list[dict]:
    bench = Bench(args)
    torch = bench.torch
    env = harness.environment(bench.device, args.dtype, new_tokens=args.new_tokens,
                              k=args.k if isinstance(args.k, int) else str(args.k))
    print(harness.describe(env), file=sys.stderr)
    rows = [] if args.no_qwen3 else tiny_qwen3(args, env)
    for bs in args.bs:
        if time.perf_counter() - START > args.deadline:
            print(f"  bs {bs}: skipped, past --deadline", file=sys.stderr)
            continue
        prompts = bench.prompts(bs)
        ids, mask = left_padded(torch, prompts, bench.device)
        variants = bench.variants(bs)
        results = {}
        for name, run in list(variants.items()):  # compile and warm up
            if time.perf_counter() - START > args.deadline:
                print(f"  bs {bs} {name}: skipped, past --deadline", file=sys.stderr)
                del variants[name]
                continue
            seconds, tokens, metrics = bench.timed(run, ids, mask, prompts)
            results[name] = dict(tokens=tokens, compile_s=seconds, runs=[])
            print(f"  bs {bs} {name}: first call {seconds:.1f} s", file=sys.stderr)
        for i in range(args.repeats):  # interleaved, in a rotating order: drift falls on every variant alike
            order = list(variants)[i % len(variants):] + list(variants)[: i % len(variants)]
            for name in order:
                seconds, _, metrics = bench.timed(variants[name], ids, mask, prompts)
                results[name]["runs"].append((seconds, metrics))
        reference = results.get("specpass/plain", next(iter(results.values())))["tokens"]
        for name, r in results.items():
            seconds = statistics.median(s for s, _ in r["runs"])
            row = GenerateRow(env=env, variant=name, bs=bs, tokens_per_s=bs * args.new_tokens / seconds,
                              agree=r["tokens"] == reference, compile_s=r["compile_s"],
                              rewrites=getattr(variants[name], "rewrites", None))
            loop = [m for _, m in r["runs"] if m is not None]
            if loop:
                row.accept_length, row.rounds = loop[0].accept_length, loop[0].rounds
                row.prefill_ms = statistics.median(1e3 * m.prefill_seconds for m in loop)
                row.round_ms = statistics.median(1e3 * (m.seconds - m.prefill_seconds) / m.rounds for m in loop)
                row.outside_ms = statistics.median(1e3 * (s - m.seconds) for s, m in r["runs"])
            rows.append(row.asdict())
        if bs == args.profile_bs:
            text = "\n\n".join(bench.profile(name, variants[name], ids, mask, prompts)
                               for name in variants if name.startswith(("specpass/", "zoo/", "lean")))
            print("\n".join(line for line in text.splitlines() if line.startswith("==")), file=sys.stderr)
            if args.out:
                args.out.with_suffix(".profile.txt").write_text(text)
        if args.out:  # after every batch size: a run cut short keeps what it measured
            args.out.write_text(json.dumps(rows, indent=1))
        print(table(rows), file=sys.stderr)
        torch.compiler.reset()  # each batch size's first call compiles again (from torch's warm caches)
    return rows


def tiny_qwen3(args, env: dict) -> list[dict]:
    """A tiny random Qwen3 and a perturbed copy as its draft: another family, end to end (no speed claim).
    "agree": the new tokens equal the target's own `generate(do_sample=False)`."""
    import torch
    import transformers

    import specpass

    env = dict(env, dtype="float32")  # the tiny pair's own
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, initializer_range=0.2)
    model = transformers.Qwen3ForCausalLM(config).to(args.device).eval()
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.1 * p.std() * torch.randn_like(p))
    ids = torch.randint(3, 512, (1, 32), device=args.device)
    common = dict(max_new_tokens=args.new_tokens, eos_token_id=None, pad_token_id=0)
    compile = "specpass" if args.device == "cuda" else "eager"
    runs = {"qwen3-tiny specpass/draft": lambda: specpass.generate(model, ids, assistant_model=draft, compile=compile,
                                                                   **common),
            "qwen3-tiny hf-assisted": lambda: model.generate(ids, assistant_model=draft, do_sample=False, **common)}
    with torch.no_grad():
        reference = model.generate(ids, do_sample=False, **common)
        rows = []
        for name, run in runs.items():
            run()  # compiles
            start = time.perf_counter()
            out = run()
            if args.device == "cuda":
                torch.cuda.synchronize()
            rows.append(GenerateRow(env=env, variant=name, bs=1, agree=torch.equal(out, reference),
                                    tokens_per_s=args.new_tokens / (time.perf_counter() - start)).asdict())
    return rows


def table(rows: list[dict]) -> str:
    """The rows; "vs lean": tokens/s over the lean baseline's at the same batch size (one process)."""
    lean = {r["bs"]: r["tokens_per_s"] for r in rows if r["variant"] == "lean"}
    lines = ["| bs | variant | tokens/s | vs lean | accepted length | prefill ms | ms/round | outside ms | agree |",
             "|---|---|---|---|---|---|---|---|---|"]
    cell = lambda r, key, form: format(r[key], form) if r.get(key) is not None else "-"  # noqa: E731
    for r in rows:
        same_model = r["bs"] in lean and not r["variant"].startswith("qwen3-tiny")
        ratio = f"{r['tokens_per_s'] / lean[r['bs']]:.2f}x" if same_model else "-"
        lines.append(f"| {r['bs']} | {r['variant']} | {r['tokens_per_s']:.0f} | {ratio} | "
                     f"{cell(r, 'accept_length', '.2f')} | {cell(r, 'prefill_ms', '.2f')} | {cell(r, 'round_ms', '.3f')} | "
                     f"{cell(r, 'outside_ms', '.2f')} | {r['agree']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--bs", default="1,8,32,64", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--k", type=harness.k_or_tree, default=4, metavar="K|TOPK,STEPS,TOKENS",
                        help="the drafts per round, or a tree shape: tree rounds")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", default="specpass/plain,specpass/draft,specpass/eagle3,zoo/draft,zoo/eagle3,"
                        "lean,hf-static,hf-assisted", type=lambda s: s.split(","))
    parser.add_argument("--quick", action="store_true", help="a smoke test: bs 1 and 2, 8 tokens, 1 repeat, fp32")
    parser.add_argument("--out", type=Path, help="write the rows to this JSON file (after every batch size)")
    parser.add_argument("--profile-bs", type=int, help="profile one generate of each loop variant at this batch size")
    parser.add_argument("--no-qwen3", action="store_true", help="skip the tiny Qwen3 pair")
    parser.add_argument("--plan", action="append", default=[], metavar="BS=VARIANTS",
                        help="the variants at one batch size, in this order (repeatable; sets --bs in that order)")
    parser.add_argument("--deadline", type=float, default=float("inf"),
                        help="seconds after start past which no new batch size or variant starts")
    args = parser.parse_args()
    plan = [entry.split("=", 1) for entry in args.plan]
    args.plan = {int(bs): variants.split(",") for bs, variants in plan}
    if plan:
        args.bs = list(args.plan)
    if args.quick:
        args.bs, args.new_tokens, args.repeats, args.dtype = [1, 2], 8, 1, "float32"
    rows = sweep(args)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()

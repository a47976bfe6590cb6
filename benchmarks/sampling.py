"""Sampling reads of the logits: eager, plain Inductor and specpass, against Inductor's bare arg-max.

    python -m benchmarks.sampling --out sampling.json                  # GPU sweep (H100: ~2 min)
    python -m benchmarks.sampling --dtype float32 --bs 16 256 1280 --vocab 151936
    python -m benchmarks.sampling --device cpu --quick                 # smoke test, small sizes

The forms (each what an engine writes):
  top1      softmax(x).topk(1): the drafted token and its probability (greedy EAGLE drafting)
  argmax    softmax(x).argmax(-1): the token alone
  logprob   log_softmax(x).argmax(-1) and the log-probability gathered at it (a sampled token's)
  verify    log_softmax(x).gather(-1, ids): the target's log-probability of K drafted tokens
With a prologue the pass folds into the op's read (issue 22):
  top1_float      softmax(x.float(), -1).topk(1)
  temperature     (x / 0.7).softmax(-1).max(-1)
  per_request     softmax(x.float() / T[:, None], -1).max(-1), a temperature per request
  logprob_float   log_softmax(x.float()).argmax(-1) and the log-probability gathered at it
  greedy          softmax(x.float(), -1).max(-1).indices (the loop's greedy token)
A tree draft step's expansion (issue 33): each frontier row's top-k tokens and their log-probabilities
(the scores), at bs * k rows (--topk, default 4), against Inductor's bare `x.float().topk(k, -1)`:
  tree_log          log_softmax(x.float(), -1).topk(k, -1) (specpass.loop.tree_math.expand)
  tree_softmax      softmax(x.float(), -1).topk(k, -1), then the values' log (probabilities, then log)
  tree_temperature  log_softmax(x.float() / 0.7, -1).topk(k, -1)
The sample op (torch.ops.specpass.sample, specpass.sampling), timed as called (no compiler):
  sample          a draw from softmax(x / 0.7)
  sample_floor    the same over x >= a given floor (top-k / top-p applied)
  floor_sample    specpass.sampling.floor_of (top-k 50, top-p 0.95), compiled, and then
                  sample_floor: what a filtering request costs
  floor_of        floor_of alone

Each is compiled for one static shape at a time (Dynamo is reset between shapes) and checked
against eager on tie-free logits (each row's maximum lifted 1.0 above the rest; for the tree forms,
each row's top k, 1.0 apart). Times are medians in microseconds per call. On CUDA, two timers:
  in-stream  one CUDA graph holds N calls back to back, each on its own copy of the logits (N
             copies span 4 x the L2 cache, so every call reads cold logits, as a sampling step
             inside an engine's graph does); a replay's time / N. The main figures.
  isolated   triton.testing.do_bench (L2 zeroed between calls) of a CUDA-graph replay of one
             call: the latency of a lone call, graph launch included (the "isolated" columns of
             the JSON).
On CPU, perf_counter. "bw" is the logits' bytes over specpass's in-stream time, as a fraction of
the device's peak memory bandwidth; "read" is the same for the fastest plain read of the logits
(a row sum, best of a few Triton decompositions, timed the same way): what any kernel that reads
every logit once can reach at that size (the JSON also has "read_whole_rows", the best with one
program per row, and "op", torch.ops.specpass.top1_lse alone). "/ argmax" is specpass's time over
Inductor's bare `argmax` of the same logits ("/ topk", the tree forms': over its bare `topk`).
--configs also times the op's kernel at every tile and split it can take (the JSON's "configs": E,
warps, splits, us), to tune kernels/triton_top1.config_for on another device.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import specpass
import specpass.kernels  # noqa: F401  registers torch.ops.specpass.top1_lse
from benchmarks import harness

K = 4  # drafted tokens read by `verify`


def top1(x):
    return torch.softmax(x, -1).topk(1)


def argmax(x):
    return torch.softmax(x, -1).argmax(-1)


def logprob(x):
    logprobs = torch.log_softmax(x, -1)
    token = logprobs.argmax(-1)
    return token, logprobs.gather(-1, token[:, None])


def verify(x, ids):
    return torch.log_softmax(x, -1).gather(-1, ids)


def bare_argmax(x):
    return x.argmax(-1)


def top1_float(x):
    return torch.softmax(x.float(), -1).topk(1)


def temperature(x):
    return (x / 0.7).softmax(-1).max(-1)


def per_request(x, t):
    return torch.softmax(x.float() / t[:, None], -1).max(-1)


def logprob_float(x):
    return logprob(x.float())


def greedy(x):
    return torch.softmax(x.float(), -1).max(-1).indices


def tree_log(x, k):
    return torch.log_softmax(x.float(), -1).topk(k, -1)


def tree_softmax(x, k):
    top = torch.softmax(x.float(), -1).topk(k, -1)
    return top.values.log(), top.indices


def tree_temperature(x, k):
    return torch.log_softmax(x.float() / 0.7, -1).topk(k, -1)


def bare_topk(x, k):
    return x.float().topk(k, -1)


FORMS = {"top1": top1, "argmax": argmax, "logprob": logprob, "verify": verify, "top1_float": top1_float,
         "temperature": temperature, "per_request": per_request, "logprob_float": logprob_float, "greedy": greedy,
         "tree_log": tree_log, "tree_softmax": tree_softmax, "tree_temperature": tree_temperature}
TREE = ("tree_log", "tree_softmax", "tree_temperature")  # fn(x, k) at bs * k rows, against bare_topk
SAMPLING = ("sample", "sample_floor", "floor_sample", "floor_of")
VARIANTS = {"eager": None, "inductor": "inductor", "specpass": specpass}  # name: torch.compile backend


def sampling_calls(x: torch.Tensor) -> dict:
    """name -> fn(logits) of the sampling forms, for logits shaped as x."""
    from specpass.kernels.counter import key
    from specpass.sampling import TARGET, Params, floor_of

    bs = x.shape[0]
    params = Params.make(bs, bs, x.device, temperature=0.7, top_k=50, top_p=0.95, seed=0)
    keys = key(params.seed, torch.zeros(bs, dtype=torch.int64, device=x.device), TARGET)
    floor = torch.compile(floor_of, dynamic=False)
    fixed_floor = floor(x, params)
    sample = torch.ops.specpass.sample
    return {"sample": lambda xi: sample(xi, params.temperature, keys, None),
            "sample_floor": lambda xi: sample(xi, params.temperature, keys, fixed_floor),
            "floor_sample": lambda xi: sample(xi, params.temperature, keys, floor(xi, params)),
            "floor_of": lambda xi: floor(xi, params)}


def compiled_buffers(compiled, *args) -> tuple:
    """(the first call's outputs, how many buffers of the logits' full size its code allocates: a
    prologue written out before a kernel that reads it again)."""
    out, code = harness.inductor_code(compiled, *args)
    bs, vocab = args[0].shape
    return out, sum(line.count(f"(({bs}, {vocab}), ") for src in code for line in src.splitlines()
                    if "empty_strided" in line)


def logits_for(bs: int, vocab: int, device: str, dtype: torch.dtype, top: int = 1) -> torch.Tensor:
    """[bs, vocab] random logits whose `top` largest of each row are 1.0 apart and 1.0 above the
    rest, in a random place: no ties among them, clear of softmax rounding."""
    g = torch.Generator(device="cpu").manual_seed(bs * 1_000_003 + vocab)
    x = torch.randn(bs, vocab, generator=g)
    first = torch.randint(0, vocab, (bs, 1), generator=g)
    places = (first + torch.arange(top) * (vocab // top)) % vocab  # [bs, top], distinct
    x.scatter_(1, places, x.amax(dim=-1, keepdim=True) + torch.arange(top, 0, -1, dtype=x.dtype))
    return x.to(device=device, dtype=dtype)


def peak_bandwidth(device: str) -> float | None:
    """Bytes/s the device's memory moves at most: 2 transfers per clock over the bus."""
    if not device.startswith("cuda"):
        return None
    props = torch.cuda.get_device_properties(device)
    clock, width = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)  # kHz, bits
    return 2 * clock * 1e3 * width / 8 if clock and width else None


def rotation(x: torch.Tensor) -> list[torch.Tensor]:
    """Copies of x spanning 4 x the L2 cache (at least 4, at most 256): read in turn, each is cold."""
    l2 = torch.cuda.get_device_properties(x.device).L2_cache_size if x.is_cuda else 0
    n = max(4, min(256, -(-4 * l2 // (x.numel() * x.element_size()))))
    return [x.clone() for _ in range(n)]


def in_stream_us(calls: list, reps: int) -> float:
    """Median us per call of a CUDA graph of `calls`, back to back."""
    return 1e3 * harness.graph_ms(calls, iters=reps, warmup=1)


def isolated_us(call, quick: bool) -> float:
    """do_bench's median of a CUDA-graph replay of one call (L2 zeroed before each)."""
    from triton.testing import do_bench

    return 1e3 * do_bench(harness.capture([call]).replay, warmup=10 if quick else 25, rep=30 if quick else 100,
                          return_mode="median")


def split_counts(rows: int, vocab: int, block: int, sms: int, per_sm=(1, 4, 16)) -> list[int]:
    """Programs per row to try: 1, and enough for `per_sm` programs per SM (rows of at least a block each)."""
    return sorted({1} | {max(1, min(-(-int(p * sms) // rows), vocab // block)) for p in per_sm})


def read_floors_us(xs: list[torch.Tensor], reps: int) -> dict[str, float]:
    """The fastest plain read of the logits, timed as the forms are: a row sum over splits of each
    row and tile widths, the best of them ("read") and the best with one program per row
    ("read_whole_rows"). Benchmarks only: Triton is imported here."""
    import triton
    import triton.language as tl

    @triton.jit
    def row_sum(x_ptr, stride, V, chunk, out_ptr, splits, BLOCK: tl.constexpr):
        row, part = tl.program_id(0), tl.program_id(1)
        base = x_ptr + row.to(tl.int64) * stride
        start = part * chunk
        end = tl.minimum(start + chunk, V)
        acc = tl.zeros([BLOCK], tl.float32)
        for j in range(start, end, BLOCK):
            cols = j + tl.arange(0, BLOCK)
            acc += tl.load(base + cols, mask=cols < end, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * splits + part, tl.sum(acc, 0))

    R, V = xs[0].shape
    vec = 16 // xs[0].element_size()
    sms = torch.cuda.get_device_properties(xs[0].device).multi_processor_count
    best = {"read": float("inf"), "read_whole_rows": float("inf")}
    for warps in (4, 8, 16):
        block = vec * 32 * warps
        for splits in split_counts(R, V, block, sms):
            chunk = -(-V // splits // block) * block
            splits = -(-V // chunk)
            out = torch.empty(R, splits, device=xs[0].device)
            us = in_stream_us([lambda x=x: row_sum[(R, splits)](x, x.stride(0), V, chunk, out, splits, BLOCK=block,
                                                                  num_warps=warps) for x in xs], reps)
            best["read"] = min(best["read"], us)
            if splits == 1:
                best["read_whole_rows"] = min(best["read_whole_rows"], us)
    return best


def op_configs_us(xs: list[torch.Tensor], reps: int) -> list[list]:
    """[E, num_warps, splits, us] of torch.ops.specpass.top1_lse's kernel at every configuration
    tried, timed as the forms are (to tune kernels/triton_top1.config_for on a device)."""
    from specpass.kernels import triton_top1

    R, V = xs[0].shape
    vec = 16 // xs[0].element_size()
    sms = torch.cuda.get_device_properties(xs[0].device).multi_processor_count
    want = xs[0].float().argmax(-1)
    found = []
    for E in (1, 2, 4):
        for warps in (4, 8, 16):
            for splits in split_counts(R, V, E * vec * 32 * warps, sms, per_sm=(0.5, 1, 2, 4, 8, 16)):
                config = (E, warps, splits)
                assert torch.equal(triton_top1.top1_lse(xs[0], config=config)[0], want), config
                found.append([*config, in_stream_us([lambda x=x: triton_top1.top1_lse(x, config=config) for x in xs],
                                                    reps)])
    return found


def run_shape(bs: int, vocab: int, dtype: torch.dtype, device: str, quick: bool, configs: bool = False,
              forms: list[str] | None = None, variants: list[str] | None = None, topk: int | None = None) -> dict:
    """Times `forms` at one shape: without topk, forms not in TREE over [bs, vocab] against Inductor's
    bare argmax; with it, the TREE forms over [bs * topk, vocab] (a draft step's frontier rows)
    against its bare topk."""
    rows = bs * topk if topk else bs
    x = logits_for(rows, vocab, device, dtype, top=topk or 1)
    ids = torch.randint(0, vocab, (rows, K), device=device, generator=torch.Generator(device=device).manual_seed(0))
    temperatures = torch.rand(rows, device=device, generator=torch.Generator(device=device).manual_seed(1)) + 0.5
    extras = {"verify": (ids,), "per_request": (temperatures,), **dict.fromkeys(TREE, (topk,))}
    baseline, bare, bare_extra = ("topk", bare_topk, (topk,)) if topk else ("argmax", bare_argmax, ())
    cuda = device.startswith("cuda")
    xs = rotation(x) if cuda else [x]
    reps = 10 if quick else 50
    row: dict = {"bs": bs, "rows": rows, "vocab": vocab, "dtype": str(dtype).removeprefix("torch."),
                 "baseline": baseline, "us": {}, "isolated_us": {}, "full_size_buffers": {}}

    def bench(name: str, fn, extra: tuple = ()) -> None:
        if not cuda:
            row["us"][name] = 1e3 * harness.host_ms(lambda: fn(x, *extra), repeats=3 if quick else 50)
            return
        row["us"][name] = in_stream_us([lambda xi=xi: fn(xi, *extra) for xi in xs], reps)
        row["isolated_us"][name] = isolated_us(lambda: fn(x, *extra), quick)

    torch.compiler.reset()
    with torch.no_grad():
        if cuda:
            row["us"].update(read_floors_us(xs, reps))
            if not topk:  # the op is the top-1 forms' kernel
                row["us"]["op"] = in_stream_us([lambda xi=xi: torch.ops.specpass.top1_lse(xi) for xi in xs], reps)
                if configs:
                    row["configs"] = op_configs_us(xs, reps)
        compiled_bare = torch.compile(bare, dynamic=False, fullgraph=True)
        compiled_bare(x, *bare_extra)
        bench(f"inductor_{baseline}", compiled_bare, bare_extra)
        for form in forms or (TREE if topk else [*(f for f in FORMS if f not in TREE), *SAMPLING]):
            if form in SAMPLING:
                bench(form, sampling_calls(x)[form])
                continue
            fn = FORMS[form]
            extra = extras.get(form, ())
            outputs = {}
            for name in variants or VARIANTS:
                backend = VARIANTS[name]
                if backend is None:
                    call = fn
                    outputs[name] = call(x, *extra)
                else:
                    call = torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)
                    outputs[name], row["full_size_buffers"][f"{form}/{name}"] = compiled_buffers(call, x, *extra)
                bench(f"{form}/{name}", call, extra)
            outputs.setdefault("eager", fn(x, *extra))
            for name in outputs.keys() - {"eager"}:
                for got, want in zip(harness.leaves(outputs[name]), harness.leaves(outputs["eager"]), strict=True):
                    if want.is_floating_point():
                        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
                    else:
                        assert torch.equal(got, want), f"{form}/{name}: indices differ from eager at {rows} x {vocab}"
    return row


def table(rows: list[dict], peak: float | None, baseline: str) -> str:
    """The rows timed against Inductor's bare `baseline` (argmax or topk), one line per form."""
    lines = [f"| dtype | bs | rows | vocab | read | Inductor {baseline} | form | eager | Inductor | specpass | bw "
             f"| / {baseline} | Inductor / specpass | full-size buffers (Inductor, specpass) |", "|---" * 14 + "|"]
    for r in rows:
        t, size = r["us"], r["rows"] * r["vocab"] * (2 if r["dtype"] in ("bfloat16", "float16") else 4)
        share = (lambda us: f"{size / (us * 1e-6) / peak:.2f}") if peak else (lambda us: "-")
        read = share(t["read"]) if "read" in t else "-"
        cell = (lambda key: f"{t[key]:.1f}" if key in t else "-")
        for form in [f for f in (*FORMS, *SAMPLING) if f"{f}/specpass" in t or f in t]:
            ours = t.get(f"{form}/specpass", t.get(form))
            inductor = t.get(f"{form}/inductor")
            buffers = r["full_size_buffers"]
            bare = t[f"inductor_{baseline}"]
            lines.append(f"| {r['dtype']} | {r['bs']} | {r['rows']} | {r['vocab']} | {read} | {bare:.1f} | {form} "
                         f"| {cell(f'{form}/eager')} | {cell(f'{form}/inductor')} | {ours:.1f} | {share(ours)} "
                         f"| {ours / bare:.2f} | {f'{inductor / ours:.2f}' if inductor else '-'} "
                         f"| {buffers.get(f'{form}/inductor', '-')}, {buffers.get(f'{form}/specpass', '-')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sampling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes and few iterations (smoke test)")
    parser.add_argument("--bs", type=int, nargs="+", default=None, help="default: 1 16 64 256 1280")
    parser.add_argument("--vocab", type=int, nargs="+", default=None, help="default: 32000 128256 151936")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--configs", action="store_true",
                        help="CUDA: also time the op's kernel at each tile and split configuration (tuning)")
    parser.add_argument("--forms", nargs="+", choices=[*FORMS, *SAMPLING], default=None, help="default: all")
    parser.add_argument("--topk", type=int, default=4, help="the tree forms' k: each runs at bs * k rows")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None, help="default: all")
    parser.add_argument("--out", type=Path, default=None, help="write all results as JSON here")
    args = parser.parse_args()

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("CUDA is not available; use --device cpu --quick for a smoke test")
    bss = args.bs or ([1, 16] if args.quick else [1, 16, 64, 256, 1280])
    vocabs = args.vocab or ([1000, 32000] if args.quick else [32000, 128256, 151936])
    if not 1 <= args.topk <= min(vocabs):
        parser.error(f"--topk {args.topk} must be at least 1 and at most the smallest vocabulary, {min(vocabs)}")
    dtype = getattr(torch, args.dtype)
    env = harness.environment(args.device, dtype)
    name = env["device"]
    peak = peak_bandwidth(args.device)
    print(f"{harness.describe(env)}; peak bandwidth {f'{peak / 1e12:.2f} TB/s' if peak else '-'}", flush=True)

    forms = args.forms or [*FORMS, *SAMPLING]
    groups = [(topk, chosen) for topk, chosen in ((None, [f for f in forms if f not in TREE]),
                                                  (args.topk, [f for f in forms if f in TREE])) if chosen]
    t0 = time.perf_counter()
    rows = []
    for vocab in vocabs:
        for bs in bss:
            for topk, chosen in groups:
                rows.append(run_shape(bs, vocab, dtype, args.device, args.quick, args.configs, chosen, args.variants,
                                      topk))
                print(f"{args.dtype} bs={bs} rows={rows[-1]['rows']} vocab={vocab}: "
                      + ", ".join(f"{k} {v:.1f}" for k, v in rows[-1]["us"].items())
                      + (f"; best configuration {min(rows[-1]['configs'], key=lambda c: c[-1])}"
                         if "configs" in rows[-1] else ""), flush=True)
    cuda = args.device.startswith("cuda")
    meta = {**env, "peak_bandwidth": peak,
            "timer": "in-stream CUDA graph over rotating logits; isolated replay in isolated_us" if cuda else "wall",
            "quick": args.quick, "seconds": round(time.perf_counter() - t0, 1), "command": " ".join(sys.argv)}
    if args.out:
        harness.saver(args.out, indent=2)({"meta": meta, "rows": rows})
        print(f"wrote {args.out}")
    how = "in-stream, calls back to back in a CUDA graph over cold logits" if cuda else "plain calls"
    print(f"\nmedian us per call, {how} ({name}, torch {torch.__version__}, {meta['seconds']} s):\n")
    for baseline in dict.fromkeys(r["baseline"] for r in rows):
        print(table([r for r in rows if r["baseline"] == baseline], peak, baseline) + "\n")


if __name__ == "__main__":
    main()

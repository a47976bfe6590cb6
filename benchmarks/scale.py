"""The loop at Llama-3-8B shape: decode step and round, each phase against its floor (issue 24).

The zoo's `llama3-8b` target and `llama3-8b-eagle3` head (random weights, bf16), the project's
`Decoder` with CUDA graphs. A round's shapes are static, so its time does not depend on what is
accepted: random weights accept nothing, every round costs what a trained pair's would. The
projected speedup uses the shipped pair's measured acceptance per draft position (docs/e2e.json).

    python benchmarks/scale.py --out scale.json                    # the sweep, on a GPU
    python benchmarks/scale.py --points 64x64 --variants specpass --k-sweep 2,6 --out a.json
    python benchmarks/scale.py --plot docs/scale.json              # docs/scale.png and the tables (CPU)
    python benchmarks/scale.py --quick --device cpu                # a smoke test: tiny models
    python benchmarks/scale.py --drafter parallel --head-layers 2 --variants specpass  # P-EAGLE, as shipped

Per point (batch size x prompt length), each variant is built, compiled, timed and dropped in turn
(they share the weights; each sets up its own caches):
  decode         the target alone (K = 0), one fused graph per step: the baseline
  specpass       the fused round (one graph per round), specpass backend
  inductor       the fused round, plain Inductor (at --inductor-at points)
  specpass-gqa   the fused round with SDPA's own GQA (enable_gqa with the explicit mask) at every query
                 count, instead of `attend`'s fold of several tokens' query heads (at --gqa-at points)
  apart          specpass, steps compiled apart, CUDA events after each step: the phase split
                 (draft / verify / accept / catch-up) (at --apart-at points)
At --tune-at points the loop picks K itself (`Decoder.tune_k` at --tune-ks, the shipped acceptance,
then its search), and the chosen K's tokens/s is set against the best K timed: the chosen K and the --k-sweep K are
timed on the tuning decoder, which keeps every K it compiled. Processes started side by side with
one --gpu-lock file compile at once and take turns to time (each holds the GPU alone while it times;
another's compile may still run its warm-up on the GPU then: a row's samples_ms shows it).
ms per round = (loop time of a long generate - loop time of a short one) / (rounds difference):
prefill, the first round's warm-up and the one round run after the last cancel out. At --direct-at
points (64 x 4K: the prefill's logits alone would take 67 GB) the rounds run from a one-token
prefill with every request moved to the prompt's position, timed over the same rounds.

Floors: each phase's weight and KV-cache bytes over the copy bandwidth measured in the same run,
and its matmul and attention FLOPs over the bf16 matmul rate measured in the same run; a phase's
floor is the larger of the two, a round's the sum of its phases'. Attention bytes count the slots a
request can see (its prompt plus what it has generated), not the whole static cache. At --gemm-at
points (K: --gemm-ks) every linear is also timed alone through cuBLAS at its rows (`gemm_floor`): the
verify's GEMMs against the decode step's, and the round / decode the floors would give with the
GEMMs at that measured time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import specpass  # noqa: E402
from models import layers, zoo  # noqa: E402
from models.layers import attend  # noqa: E402
from models.drafters import adapt  # noqa: E402
from specpass.speculative import Decoder, _clone, cache_slots, expected_accept_length, prefill  # noqa: E402

SHIPPED = {  # --drafter -> its measured acceptance: a file and the rows of it that hold it
    "eagle3": (ROOT / "docs" / "e2e.json", dict(variant="eagle3/specpass-fused", dtype="bfloat16")),
    "parallel": (ROOT / "docs" / "acceptance_parallel3.json", dict(kind="parallel"))}  # the two-layer head
HEADS = {"eagle3": "eagle3", "parallel": "peagle3"}  # --drafter -> the zoo's head, llama3-8b-<this>
START = time.perf_counter()


def point(text: str) -> tuple[int, int]:
    bs, _, prompt = text.partition("x")
    return int(bs), int(prompt)


def shipped_acceptance(drafter: str = "eagle3") -> list[float]:
    """Acceptance per draft position of the shipped head: the chain head's from its bf16 fused specpass
    run on the H100, the parallel head's from the 32 held-out prompts (fp32: bf16 rounds leave the
    greedy text early at bs 1); the run with the most positions, and beyond it each position keeps
    the last measured conditional rate."""
    path, match = SHIPPED[drafter]
    rows = [r for r in json.loads(path.read_text())
            if all(r.get(key) == value for key, value in match.items()) and r["acceptance"]]
    best = max(rows, key=lambda r: (len(r["acceptance"]), r.get("bs", 0)))
    acc = list(best["acceptance"])
    rate = acc[-1] / acc[-2]
    while len(acc) < 8:
        acc.append(acc[-1] * rate)
    return acc


# --- ceilings and floors


def ceilings(device: torch.device) -> dict[str, float]:
    """Achievable copy bandwidth (bytes read + written) and bf16 matmul rate on this device."""
    if device.type != "cuda":
        return dict(bandwidth=1e11, flops=1e12)  # nominal: the CPU run only checks the script
    x = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    copy_ms = gpu_ms(lambda: y.copy_(x))
    mm_ms = gpu_ms(lambda: a @ b)
    return dict(bandwidth=2 * x.numel() / copy_ms * 1e3, flops=2 * 8192**3 / mm_ms * 1e3)


def gpu_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


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
    h_layers = head.decoder_layers
    last = h_layers[-1].self_attn
    h_all = [m for m in head.modules() if isinstance(m, nn.Linear) and m is not head.fc]
    # catch-up: fc, every layer but the last, and the last one's K/V on every row (later layers and the
    # K/V write read them); the rest on the live rows
    h_rows_all = [head.fc, last.k_proj, last.v_proj,
                  *(m for layer in h_layers[:-1] for m in layer.modules() if isinstance(m, nn.Linear))]
    h_live = [m for m in h_all if m not in h_rows_all]

    def lin(linears, rows):  # (bytes, FLOPs, measured ms)
        return (*linear_cost(linears, rows), 0.0) if gemm is None else (0.0, 0.0, gemm(linears, rows))

    def att(*args):
        return (*attention_cost(*args), 0.0)

    def ms(*costs, flops_only=False):
        nbytes, flops, measured = map(sum, zip(*costs))
        return 1e3 * max(0.0 if flops_only else nbytes / ceil["bandwidth"], flops / ceil["flops"]) + measured

    def head_att(rows, live):  # every layer but the last on every row's queries, the last on the live rows
        return [att(layer.self_attn, bs, rows, context, item) for layer in h_layers[:-1]] + [
            att(last, bs, live, context, item)]

    def target_step(rows_per_request):
        return ms(lin(t_lin, bs * rows_per_request),
                  *(att(a, bs, rows_per_request, context, item) for a in t_attn))

    out = dict(decode=target_step(1))
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

            times[key] = op_ms(run, bench.device)
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


# --- the loop


class Bench:
    def __init__(self, args):
        self.args, self.device = args, torch.device(args.device)
        dtype = torch.float32 if args.quick else torch.bfloat16
        base = "tiny-llama" if args.quick else "llama3-8b"
        names = (base, f"{base}-{HEADS[args.drafter]}")
        self.target = zoo.build(names[0], device=self.device, dtype=dtype)
        head = zoo.config(names[1])
        if args.head_layers:
            head = dataclasses.replace(head, num_hidden_layers=args.head_layers)
        self.head = zoo.build(head, device=self.device, dtype=dtype)
        self.head.embed_tokens = self.target.model.embed_tokens  # EAGLE-3 uses the target's, by reference
        self.mode = "reduce-overhead" if self.device.type == "cuda" else None
        torch._dynamo.config.recompile_limit = 1024
        torch._dynamo.config.cache_size_limit = 1024
        self.gemm_times: dict[tuple, float] = {}  # `gemm_floor`'s, by the linears and rows

    def prompts(self, bs: int, length: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(bs * 7919 + length)
        return torch.randint(0, self.target.config.vocab_size, (bs, length), generator=g).tolist()

    def decoder(self, bs: int, max_len: int, k: int, compile: str, fused: bool) -> Decoder:
        drafter = adapt(self.head) if k else None
        if self.args.quick:  # the rewritten graphs run eagerly: Inductor's C++ builds would take minutes
            compile = specpass.backend(handoff="eager") if compile == "specpass" else "eager"
        return Decoder(self.target, drafter, k=max(k, 1), max_batch=bs, max_len=max_len, compile=compile,
                       mode=self.mode, fused_round=fused, compile_prefill=False)  # its time cancels out

    def round_ms(self, dec: Decoder, prompts, short: int, long: int) -> tuple[float, dict]:
        """ms per round from the difference of a long and a short generate (median of repeats; each in samples_ms)."""
        dec.generate(prompts, short)  # compiles, records the CUDA graphs
        samples = []
        with exclusive(self.args.gpu_lock):
            for _ in range(self.args.repeats):
                a, b = (dec.generate(prompts, n).metrics for n in (short, long))
                loop_seconds = (b.seconds - b.prefill_seconds) - (a.seconds - a.prefill_seconds)
                samples.append(loop_seconds / (b.rounds - a.rounds))
        return 1e3 * statistics.median(samples), dict(prefill_ms=1e3 * a.prefill_seconds,
                                                      samples_ms=[1e3 * s for s in samples])

    def round_ms_direct(self, dec: Decoder, prompts, short: int, long: int) -> tuple[float, dict]:
        """ms per round without the prefill, whose logits do not fit at 64 x 4K (67 GB): a one-token
        prefill, every request moved to the prompt's position (the slots below hold zeros: a round's
        time does not depend on them, its shapes are static), then rounds replayed as `generate` runs
        them; the loop's clock over `long - short` rounds after `short`, median of repeats."""
        bs, prompt = len(prompts), len(prompts[0])
        state, carry = prefill(dec.prefill_step, [p[:1] for p in prompts], [long] * bs, [-1] * bs, None, dec.k, bs,
                               dec.max_len, dec.device)  # after `long` tokens a request runs frozen
        state = state._replace(pos=state.pos + prompt - 1)

        def rounds(n):
            nonlocal state, carry
            for _ in range(n):
                if dec.cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                state, carry, _ = dec._round(state, carry, None)
                if dec.cudagraphs:
                    state, carry = _clone(state), _clone(carry)

        rounds(short)  # compiles, records the CUDA graphs
        samples = []
        with exclusive(self.args.gpu_lock):
            for _ in range(self.args.repeats):
                start = dec._clock()
                rounds(long - short)
                samples.append((dec._clock() - start) / (long - short))
        return 1e3 * statistics.median(samples), dict(prefill_ms=0.0, samples_ms=[1e3 * s for s in samples])

    def release(self):
        torch._dynamo.reset()  # frees the compiled graphs and their CUDA-graph pools
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


@contextlib.contextmanager
def exclusive(lock: Path | None):
    """The GPU to this process alone (an exclusive lock on the --gpu-lock file) while it times."""
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def attend_gqa(q, k, v, mask, scale):
    """SDPA's own GQA at every query count (models.layers.attend folds several tokens' query heads)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
        enable_gqa=k.shape[2] != q.shape[2])
    return out.transpose(1, 2)


def kernel_profile(dec: Decoder, prompts, short: int, long: int) -> list[dict]:
    """GPU time per round by kernel name: a profiled long generate minus a profiled short one."""
    from torch.profiler import ProfilerActivity, profile

    per_run = []
    for n in (short, long):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            rounds = dec.generate(prompts, n).metrics.rounds
        totals: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                t = totals.setdefault(e.name, [0.0, 0])
                t[0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                t[1] += 1
        per_run.append((rounds, totals))
    (r0, t0), (r1, t1) = per_run
    rows = []
    for name, (us, calls) in t1.items():
        us0, calls0 = t0.get(name, (0.0, 0))
        rows.append(dict(kernel=name[:120], kind=kernel_kind(name), ms=(us - us0) / 1e3 / (r1 - r0),
                         calls=(calls - calls0) / (r1 - r0)))
    return sorted(rows, key=lambda r: -r["ms"])


def kernel_kind(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("fmha", "attention", "attn", "cudnn", "flash", "sdpa")):
        return "attention"
    if any(s in n for s in ("gemm", "xmma", "cutlass", "nvjet", "sm90", "matmul", "mm_")):
        return "matmul"
    return "triton" if n.startswith("triton") else "other"


def attention_bench(bs: int, queries: int, slots: int, device: torch.device) -> dict[str, float]:
    """One verify-shaped attention call (Llama-3-8B heads) per SDPA backend and FlexAttention: µs,
    CUDA-graph replays; and each one's max error against the math backend in fp32."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    hq, hk, d = 32, 8, 128
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(bs, hq, queries, d, device=device, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(bs, hk, slots, d, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    start = torch.randint(0, slots - queries, (bs, 1), device=device, generator=g)
    pos = start + torch.arange(queries, device=device)  # [B, T]
    mask = torch.arange(slots, device=device)[None, None, None, :] <= pos[:, None, :, None]  # [B, 1, T, S]

    def sdpa(backend):
        def run():
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return run

    groups = hq // hk  # GQA folded into the query axis: [B, hk, T*g, d] against K/V read once per K/V head
    q_folded = q.view(bs, hk, groups, queries, d).transpose(2, 3).reshape(bs, hk, queries * groups, d)
    mask_folded = mask[:, :, :, None].expand(bs, 1, queries, groups, slots).reshape(bs, 1, queries * groups, slots)

    def folded(backend):
        def run():
            with sdpa_kernel([backend]):
                out = torch.nn.functional.scaled_dot_product_attention(q_folded, k, v, attn_mask=mask_folded)
            return out.view(bs, hk, queries, groups, d).transpose(2, 3).reshape(bs, hq, queries, d)
        return run

    flex = torch.compile(flex_attention, dynamic=False)

    def flex_run():
        block = create_block_mask(lambda b, h, qi, kv: kv <= pos[b, qi], bs, None, queries, slots, device=device)
        return flex(q, k, v, block_mask=block, enable_gqa=True)

    variants = {"cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
                "math": sdpa(SDPBackend.MATH), "flex": flex_run,
                "cudnn_folded": folded(SDPBackend.CUDNN_ATTENTION),
                "efficient_folded": folded(SDPBackend.EFFICIENT_ATTENTION)}
    with sdpa_kernel([SDPBackend.MATH]):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    return dict(bs=bs, queries=queries, slots=slots, **time_candidates(variants, ref))


def time_candidates(variants: dict, ref: torch.Tensor) -> dict[str, float | str]:
    """Each candidate's largest error against `ref` and µs per call (CUDA-graph replays); one that
    refuses the shapes gives why instead."""
    out = {}
    for name, fn in variants.items():
        try:
            out[f"{name}_err"] = (fn().float() - ref).abs().max().item()
            out[f"{name}_us"] = 1e3 * graph_ms(fn)
        except Exception as exc:  # a candidate that refuses these shapes says why
            out[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return out


def graph_ms(fn, calls: int = 20) -> float:
    """ms per call of `fn`, replayed as one CUDA graph of `calls` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return gpu_ms(graph.replay) / calls


def op_ms(fn, device: torch.device) -> float:
    """ms per call: CUDA-graph replays on a GPU (`graph_ms`), else the host clock (the CPU run checks the script)."""
    if device.type == "cuda":
        return graph_ms(fn, calls=2)
    fn()
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


# --- the sweep


def sweep(args, save) -> dict:
    bench = Bench(args)
    dev = bench.device
    env = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", torch=torch.__version__,
               dtype=str(next(bench.target.parameters()).dtype).removeprefix("torch."), drafter=args.drafter,
               head_layers=bench.head.config.num_hidden_layers)
    with exclusive(args.gpu_lock):
        ceiling = ceilings(dev)
    bench.release()  # the 4 GB it copied, for processes side by side
    result = dict(env=env, ceilings=ceiling, acceptance=shipped_acceptance(args.drafter), rows=[], attention=[],
                  profiles={}, gemm_floor=[])
    print(f"# {env}; ceilings {result['ceilings']}", file=sys.stderr, flush=True)
    short, long = args.new_tokens
    k_max = max([args.k, *args.k_sweep])
    if dev.type == "cuda":
        for (bs, prompt), queries in ((at, q) for at in args.attention_at for q in (1, args.k + 1)):
            with exclusive(args.gpu_lock):
                slots = cache_slots(prompt, long, k_max, parallel=True)
                result["attention"].append(attention_bench(bs, queries, slots, dev))
            print(f"  attention {result['attention'][-1]}", file=sys.stderr, flush=True)
            save(result)
    for (bs, prompt), k in ((at, k) for at in args.gemm_at for k in args.gemm_ks):
        with exclusive(args.gpu_lock):
            result["gemm_floor"].append(dict(prompt=prompt, **gemm_floor(bench, bs, k, prompt + long // 2, ceiling)))
        save(result)
    for bs, prompt in args.points:
        max_len = cache_slots(prompt, long, k_max, parallel=True)
        context = prompt + long // 2  # slots a request sees, on average over the timed rounds
        prompts = bench.prompts(bs, prompt)
        runs = [("decode", 0, "specpass", True)]
        ks = [args.k, *(args.k_sweep if (bs, prompt) in args.k_sweep_at else [])]
        runs += [("specpass", k, "specpass", True) for k in ks]
        if (bs, prompt) in args.inductor_at:
            runs.append(("inductor", args.k, "inductor", True))
        if (bs, prompt) in args.gqa_at:
            runs.append(("specpass-gqa", args.k, "specpass", True))
        if (bs, prompt) in args.apart_at:
            runs.append(("apart", args.k, "specpass", False))
        if (bs, prompt) in args.tune_at:  # the tuning times specpass at its K
            runs = [r for r in runs if r[0] != "specpass"]
        for variant, k, compile, fused in runs:
            if variant not in args.variants or out_of_time(args, result, f"{bs}x{prompt} {variant} K {k}"):
                continue
            start = time.perf_counter()
            layers.attend = attend_gqa if variant == "specpass-gqa" else attend
            dec = bench.decoder(bs, max_len, k, compile, fused)
            timer = bench.round_ms_direct if (bs, prompt) in args.direct_at else bench.round_ms
            ms, extra = timer(dec, prompts, short, long)
            layers.attend = attend
            row = dict(env, variant=variant, bs=bs, prompt=prompt, max_len=max_len, k=k, round_ms=ms, **extra,
                       floor_ms=floors(bench.target, bench.head, bs, k, context, result["ceilings"]),
                       seconds=time.perf_counter() - start)
            with exclusive(args.gpu_lock):
                if variant == "apart":
                    row["phase_ms"] = dec.generate(prompts, long, timing=True).metrics.phase_ms
                if variant == "specpass" and k == args.k and (bs, prompt) in args.profile_at and dev.type == "cuda":
                    result["profiles"][f"{bs}x{prompt}"] = kernel_profile(dec, prompts, short, long)[:40]
            result["rows"].append(row)
            save(result)
            print(f"  bs {bs} prompt {prompt} {variant} K {k}: {ms:.3f} ms/round ({row['seconds']:.0f} s)",
                  file=sys.stderr, flush=True)
            del dec
            bench.release()
        if (bs, prompt) in args.tune_at and not out_of_time(args, result, f"{bs}x{prompt} tune_k"):
            tune_point(bench, args, bs, prompt, result, save)
    return result


def out_of_time(args, result: dict, what: str) -> bool:
    """True (and `what` recorded as skipped) once the run is past --stop-after seconds: a command's
    time on the device is capped, and a variant started late would be cut off with nothing saved."""
    late = time.perf_counter() - START > args.stop_after
    if late:
        result.setdefault("skipped", []).append(what)
    return late


def tune_point(bench: Bench, args, bs: int, prompt: int, result: dict, save) -> None:
    """The loop picks K: `Decoder.tune_k` times the fused specpass round at --tune-ks, prices
    K = 1..8 at the shipped pair's acceptance and searches (at most --tune-max-timings more K); the
    chosen K and the --k-sweep K it did not time are then timed the same way on its decoder (nearest
    the chosen first), so the chosen K's tokens/s can be set against the best timed K's."""
    short, long = args.new_tokens
    acceptance = result["acceptance"]
    max_len = cache_slots(prompt, long, len(acceptance), parallel=True)
    prompts = bench.prompts(bs, prompt)
    context = prompt + long // 2
    start = time.perf_counter()
    dec = bench.decoder(bs, max_len, args.k, "specpass", True)
    time_round = dec._round_ms

    def logged(k, *rest):  # each K printed as it is timed: a run cut off still shows what tune_k timed
        ms, measured_acceptance = time_round(k, *rest)
        print(f"  bs {bs} prompt {prompt} tune_k timed K {k}: {ms:.3f} ms/round ({time.perf_counter() - start:.0f} s)",
              file=sys.stderr, flush=True)
        return ms, measured_acceptance

    dec._round_ms = logged
    tune = lambda repeats: dec.tune_k(prompts, args.tune_ks, acceptance=acceptance,  # noqa: E731
                                      new_tokens=args.new_tokens, repeats=repeats, max_timings=args.tune_max_timings)
    if args.gpu_lock:  # compiles every K (kept), so that the tuning below only times
        tune(1)
    with exclusive(args.gpu_lock):
        choice = tune(args.repeats)
    measured = dict(choice.round_ms)
    swept = {choice.k, *(args.k_sweep if (bs, prompt) in args.k_sweep_at else [])} - set(measured)
    for k in sorted(swept, key=lambda k: (abs(k - choice.k), k)):
        if not out_of_time(args, result, f"{bs}x{prompt} K {k} on the tuning decoder"):
            dec._bind(k)
            measured[k], _ = bench.round_ms(dec, prompts, short, long)
    seconds = time.perf_counter() - start
    for k, ms in sorted(measured.items()):
        result["rows"].append(dict(result["env"], variant="specpass", bs=bs, prompt=prompt, max_len=max_len, k=k,
                                   round_ms=ms, floor_ms=floors(bench.target, bench.head, bs, k, context,
                                                                result["ceilings"]),
                                   seconds=seconds / len(measured)))
    result.setdefault("tuned", []).append(dict(bs=bs, prompt=prompt, timed=list(choice.round_ms), why=choice.why,
                                               verified=choice.verified, chosen=choice.k,
                                               tokens_per_ms=choice.tokens_per_ms))
    save(result)
    print(f"  bs {bs} prompt {prompt} tune_k: K {choice.k} of {sorted(choice.tokens_per_ms)}, timed "
          f"{ {k: round(v, 3) for k, v in measured.items()} } ({seconds:.0f} s)", file=sys.stderr, flush=True)
    del dec
    bench.release()


# --- tables and plot


def projected(result: dict, r: dict, decode_ms: float) -> float:
    return expected_accept_length(result["acceptance"][: r["k"]]) * decode_ms / r["round_ms"]


def tables(result: dict) -> str:
    env, ceil = result["env"], result["ceilings"]
    lines = [f"{env['device']}, torch {env['torch']}, {env['dtype']}; measured ceilings: copy "
             f"{ceil['bandwidth'] / 1e12:.2f} TB/s, bf16 matmul {ceil['flops'] / 1e12:.0f} TFLOP/s; acceptance per "
             "position (shipped pair): " + " ".join(f"{a:.2f}" for a in result["acceptance"]), "",
             "| bs | prompt | variant | K | ms/round | floor ms | / floor | round / decode | specpass / inductor | "
             "accepted length (shipped) | projected speedup |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = result["rows"]
    for r in rows:
        at = [x for x in rows if (x["bs"], x["prompt"]) == (r["bs"], r["prompt"])]
        decode = next((x["round_ms"] for x in at if x["variant"] == "decode"), None)
        base = next((x["round_ms"] for x in at if x["variant"] == "inductor" and x["k"] == r["k"]), None)
        floor = r["floor_ms"]["round" if r["k"] else "decode"]
        ratio = f"{r['round_ms'] / decode:.2f}" if decode and r["k"] else "-"
        vs = f"{base / r['round_ms']:.3f}x" if base and r["variant"].startswith("specpass") else "-"
        accept = f"{expected_accept_length(result['acceptance'][:r['k']]):.2f}" if r["k"] else "-"
        speedup = f"{projected(result, r, decode):.2f}x" if decode and r["k"] and r["variant"] != "apart" else "-"
        lines.append(f"| {r['bs']} | {r['prompt']} | {r['variant']} | {r['k'] or '-'} | {r['round_ms']:.3f} | "
                     f"{floor:.3f} | {r['round_ms'] / floor:.2f} | {ratio} | {vs} | {accept} | {speedup} |")
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
        kinds: dict[str, float] = {}
        for p in prof:
            kinds[p["kind"]] = kinds.get(p["kind"], 0.0) + p["ms"]
        lines += ["", f"profile {where} (fused specpass round, top kernels): "
                  + ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])),
                  "| kernel | kind | ms/round | calls/round |", "|---|---|---|---|"]
        lines += [f"| `{p['kernel'][:70]}` | {p['kind']} | {p['ms']:.3f} | {p['calls']:.0f} |" for p in prof[:12]]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    points = lambda s: [point(p) for p in s.split(",") if p]  # noqa: E731
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--points", default="1x64,16x64,64x64,16x4096", type=points, help="BSxPROMPT,...")
    parser.add_argument("--drafter", default="eagle3", choices=sorted(HEADS),
                        help="eagle3: the chain head; parallel: the P-EAGLE head, one draft forward a round")
    parser.add_argument("--head-layers", type=int, help="the head's decoder layers (default: the zoo's, one)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--k-sweep", default="", type=lambda s: [int(x) for x in s.split(",") if x])
    parser.add_argument("--k-sweep-at", default="", type=points)
    parser.add_argument("--inductor-at", default="64x64,16x4096", type=points)
    parser.add_argument("--apart-at", default="64x64", type=points)
    parser.add_argument("--gqa-at", default="64x64,16x4096", type=points)
    parser.add_argument("--profile-at", default="64x64,16x4096", type=points)
    parser.add_argument("--attention-at", default="64x64,16x4096", type=points)
    parser.add_argument("--direct-at", default="", type=points,
                        help="points timed without the prefill (it does not fit at 64x4096)")
    parser.add_argument("--gemm-at", default="", type=points,
                        help="points where the target's and head's GEMMs are timed alone (cuBLAS): `gemm_floor`")
    parser.add_argument("--gemm-ks", default="4", type=lambda s: [int(x) for x in s.split(",")], help="K at --gemm-at")
    parser.add_argument("--tune-at", default="", type=points, help="points where Decoder.tune_k picks K")
    parser.add_argument("--tune-ks", default="2,4,6", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--tune-max-timings", type=int, default=4, help="K tune_k's search may time beyond --tune-ks")
    parser.add_argument("--gpu-lock", type=Path, help="a file: processes sharing it take turns to time")
    parser.add_argument("--stop-after", type=float, default=float("inf"),
                        help="seconds: start no variant after this (the device caps a command's time)")
    parser.add_argument("--variants", default="decode,specpass,inductor,specpass-gqa,apart", type=lambda s: s.split(","))
    parser.add_argument("--new-tokens", default="8,40", type=lambda s: tuple(int(x) for x in s.split(",")),
                        help="SHORT,LONG generates whose difference times the rounds")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny models, one point: checks the script runs")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path, help="draw docs/scale.png from this JSON, print the tables, exit")
    args = parser.parse_args()
    if args.plot:
        result = json.loads(args.plot.read_text())
        plot(result, ROOT / "docs" / "scale.png")
        print(tables(result))
        return
    if args.quick:
        args.points, args.k_sweep, args.k_sweep_at, args.new_tokens, args.repeats = [(2, 16)], [2], [(2, 16)], (4, 12), 1
        args.inductor_at = args.apart_at = args.profile_at = args.gqa_at = args.direct_at = args.tune_at = [(2, 16)]
        args.gemm_at = [(2, 16)]
        args.tune_ks = [1, 2]
    save = (lambda r: args.out.write_text(json.dumps(r, indent=1))) if args.out else (lambda r: None)
    torch.set_grad_enabled(False)
    print(tables(sweep(args, save)))


if __name__ == "__main__":
    main()

"""The loop picks K (`Decoder.tune_k`), and the chosen K is set against the best K timed (see the package doc)."""

from __future__ import annotations

import functools
import sys
import time
from typing import Callable

from benchmarks import harness
from benchmarks.scale.floors import floors
from benchmarks.scale.rounds import Bench, RoundRow
from specpass.loop import cache_slots


def tune_point(bench: Bench, args, bs: int, prompt: int, result: dict, save, late: Callable[[str], bool]) -> None:
    """`Decoder.tune_k` (the chain's K alone) times the fused specpass round at --tune-ks, prices K = 1..8 at the shipped
    pair's acceptance and searches (at most --tune-max-timings more K); the chosen K and the
    --k-sweep K it did not time are then timed the same way on its decoder (nearest the chosen
    first), so the chosen K's tokens/s can be set against the best timed K's. late(what): True
    (and `what` recorded as skipped) once the run is past its time."""
    short, long = args.new_tokens
    acceptance = result["acceptance"]
    max_len = cache_slots(prompt, long, len(acceptance))
    prompts = bench.prompts(bs, prompt)
    context = prompt + long // 2
    start = time.perf_counter()
    dec = bench.decoder(bs, max_len, args.k, "specpass", True)

    def timed(k: int, ms: float) -> None:  # each K printed as it is timed: a run cut off still shows what tune_k timed
        print(f"  bs {bs} prompt {prompt} tune_k timed K {k}: {ms:.3f} ms/round ({time.perf_counter() - start:.0f} s)",
              file=sys.stderr, flush=True)

    nest = getattr(bench.head, "drafts_nest", True)  # else each K's acceptance is measured (random weights: ~0)
    tune = functools.partial(dec.tune_k, prompts, args.tune_ks, on_timed=timed, acceptance=acceptance if nest else None,
                             new_tokens=args.new_tokens, max_timings=args.tune_max_timings)
    if args.gpu_lock:  # compiles every K (kept), so that the tuning below only times
        tune(repeats=1)
    with harness.exclusive(args.gpu_lock):
        choice = tune(repeats=args.repeats)
    measured = dict(choice.round_ms)
    swept = {choice.k, *(args.k_sweep if (bs, prompt) in args.k_sweep_at else [])} - set(measured)
    for k in sorted(swept, key=lambda k: (abs(k - choice.k), k)):
        if not late(f"{bs}x{prompt} K {k} on the tuning decoder"):
            dec.use_k(k)
            measured[k], _ = bench.round_ms(dec, prompts, short, long)
    seconds = time.perf_counter() - start
    for k, ms in sorted(measured.items()):
        floor = floors(bench.target, bench.head, bs, k, context, result["ceilings"])
        result["rows"].append(RoundRow(env=result["env"], variant="specpass", bs=bs, prompt=prompt, max_len=max_len,
                                       k=k, round_ms=ms, floor_ms=floor, seconds=seconds / len(measured)).asdict())
    result.setdefault("tuned", []).append(dict(bs=bs, prompt=prompt, timed=list(choice.round_ms), why=choice.why,
                                               verified=choice.verified, chosen=choice.k,
                                               tokens_per_ms=choice.tokens_per_ms))
    save(result)
    print(f"  bs {bs} prompt {prompt} tune_k: K {choice.k} of {sorted(choice.tokens_per_ms)}, timed "
          f"{ {k: round(v, 3) for k, v in measured.items()} } ({seconds:.0f} s)", file=sys.stderr, flush=True)
    del dec, tune
    bench.release()

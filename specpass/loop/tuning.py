"""`Decoder.tune_k` (a method of the driver's Decoder, `decoder` here): the round for a batch size
chosen from measured costs. Each candidate K (or tree shape, or plain decoding) is compiled, its
rounds timed (`Decoder.round_ms`) and its acceptance measured; cost.py prices the untimed K and
names the next one to time."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from specpass.loop.checks import check_prompts, check_sampling, check_tuning
from specpass.loop.cost import (KChoice, batch_busy, choose_k, expected_accept_length, next_k_to_time,
                                pooled_acceptance, price)
from specpass.loop.shapes import round_spec
from specpass.loop.tree import TreeShape


def tune_k(decoder: Any, prompts: Sequence[Sequence[int]], ks: Sequence[int] = (2, 6), *,
           acceptance: Sequence[float] | None = None, new_tokens: tuple[int, int] = (8, 40),
           repeats: int = 3, max_timings: int = 4, off: bool = False, trees: Sequence[TreeShape] = (),
           sampling: Mapping[str, Any] | None = None,
           on_timed: Callable[[Any, float], None] | None = None) -> KChoice:
    """Choose the round for this batch size from measured costs: plain decoding (K 0), the
    chain's best K, or a tree shape; then decode with it.

    Each K in `ks` is compiled (and kept: switching back costs nothing) and its ms per round
    timed on `prompts` (`round_ms` with `new_tokens` = (short, long) and `repeats`); a round's
    shapes are static: its time does not depend on what is accepted. acceptance: per draft
    position 1..N (`Metrics.acceptance` of a run at K >= N, e.g. on the traffic this decoder
    serves); None measures it on `prompts` at the largest K timed (chain drafting: one run at
    the largest K gives every smaller K's). The candidates are K = 1..N whose caches fit the
    prompts and `new_tokens[1]`, priced by `price`. Then a local search: while the best-priced K
    or a neighbour K +- 1 is untimed, time the one `next_k_to_time` names and price again, at
    most `max_timings` times; so the chosen K is measured, and better than its measured
    neighbours.

    A batch runs until its last request is done, so a K's measured tokens per ms count the
    rounds its finished requests idle (`batch_busy` of its long generates: a round shape whose
    acceptance varies more across requests idles more); the chain's search prices the untimed K
    without it, and the choice is the best timed K.

    Then, against that K's tokens per ms: plain decoding (off=True), timed (a round emits one
    token), and each shape of `trees` (e.g. `specpass.loop.TREES`), timed with its accepted length
    measured on `prompts` (a tree's acceptance is its own: no chain run gives it; measure it on
    long enough generates, `new_tokens`). The most tokens per ms wins. A drafter whose drafts
    depend on K (`drafts_nest` False: DFlash's block, whose positions attend to each other both
    ways) has no shared acceptance: each K in `ks` is timed and priced with its own, measured.
    sampling: generate's temperature / top_k / top_p / seed the traffic is served with (default greedy): every
    round is timed and every acceptance measured with them. on_timed(k, ms) is called after
    each K or shape is timed.

    prompts: more than max_batch (a sample of the traffic) run in batches of max_batch for the
    acceptance, pooled over them (`pooled_acceptance`); the rounds are timed on the first
    batch. At bs 1 one prompt's acceptance is only where its one trajectory goes.
    """
    if decoder.drafter is None:
        raise ValueError("plain decoding (drafter=None) drafts nothing: there is no K to tune")
    timed = check_tuning(ks, acceptance, new_tokens, repeats, max_timings)
    nests = getattr(decoder.drafter, "drafts_nest", True)  # a run at K gives every smaller K's acceptance
    if acceptance is not None and not nests:
        raise ValueError("acceptance= prices every K from one run, but this drafter's drafts depend on K "
                         "(drafts_nest is False: a DFlash block): leave it None, each K's is measured")
    sampling = check_sampling(sampling)
    for tree in trees:
        if not isinstance(tree, TreeShape):
            raise ValueError(f"trees must hold specpass.TreeShape values, got {tree!r}")
    short, long = new_tokens
    batches = [prompts[i:i + decoder.max_batch] for i in range(0, len(prompts), decoder.max_batch)] or [prompts]
    specs = {k: round_spec(decoder.drafter, k) for k in [*timed, *trees]}
    for k, spec in specs.items():  # every K fits the caches, checked before anything compiles
        try:
            for batch in batches:
                check_prompts(batch, [long] * len(batch), decoder.vocab_size, decoder.max_len, spec)
        except ValueError as exc:
            raise ValueError(f"tuning at K = {k}: {exc}") from None
    longest = max(len(p) for p in prompts)
    fits = lambda k: round_spec(decoder.drafter, k).cache_slots(longest, long) <= decoder.max_len  # noqa: E731

    def time_k(k: int) -> tuple[float, list[float]]:
        decoder.use_k(specs.get(k, k))
        ms, run = decoder.round_ms(batches[0], short, long, repeats, sampling)
        runs = [decoder.generate(batch, long, **sampling).metrics for batch in batches] if len(batches) > 1 else [run]
        busy[k] = batch_busy(runs, [len(batch) for batch in batches])
        if on_timed is not None:
            on_timed(k, ms)
        return ms, pooled_acceptance(runs)

    round_ms, why, measured, busy = {}, {}, {}, {}
    for k in timed:
        round_ms[k], measured[k] = time_k(k)
        why[k] = "given"
    per_depth = {} if nests else dict(measured)  # the acceptance reported per K or tree: its own, measured
    if nests:
        acceptance = list(measured[timed[-1]] if acceptance is None else acceptance)
        candidates = acceptance[:next((k - 1 for k in range(1, len(acceptance) + 1) if not fits(k)), None)]
        while (k := next_k_to_time(round_ms, candidates)) is not None and len(why) < len(timed) + max_timings:
            best = choose_k(round_ms, candidates)
            why[k] = "priced best" if k == best else f"neighbour of K {best}, priced best"
            round_ms[k], _ = time_k(k)
        verified = k is None
        rates = {k: expected_accept_length(acceptance[:k]) * busy.get(k, 1.0) / ms
                 for k, ms in price(round_ms, len(candidates)).items()}
        chosen = choose_k(round_ms, candidates)
        if verified:  # the priced best and its neighbours were timed: the best of the timed
            chosen = max((k for k in round_ms if k in rates), key=rates.get)
    else:  # each K drafts its own tokens (a DFlash block): each timed K priced with its own acceptance
        acceptance = measured[timed[-1]]
        rates = {k: expected_accept_length(measured[k]) * busy[k] / round_ms[k] for k in timed}
        chosen, verified = max(rates, key=rates.get), True
    for k in [0] * off + list(trees):
        round_ms[k], per_depth[k] = time_k(k)
        why[k] = "the drafter off: plain decoding" if k == 0 else "a tree shape"
        rates[k] = expected_accept_length(per_depth[k]) * busy[k] / round_ms[k]
        if rates[k] > rates[chosen]:
            chosen = k
    decoder.use_k(chosen)
    return KChoice(chosen, round_ms, acceptance, rates, why, verified,
                   {k: v for k, v in per_depth.items() if k != 0})


"""The choice of K: tokens per round from the acceptance per draft position, ms per round priced
from the K measured, and the local search `Decoder.tune_k` runs with them; then the chain's best
against plain decoding (K 0) and tree shapes, each timed with its measured acceptance."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass
class KChoice:
    """What `Decoder.tune_k` measured and chose. Keys are K (0: plain decoding) or tree shapes."""

    k: Any  # the K (0: the drafter off) or TreeShape the decoder runs from now on
    round_ms: dict[Any, float]  # K -> measured ms per round, in the order timed
    acceptance: list[float]  # the chain's, per draft position 1..N: its candidates are K = 1..N that fit the caches
    tokens_per_ms: dict[Any, float]  # K -> tokens per ms per request of the batch: the chain's priced (the timed K
    # with the rounds its done requests idled counted, `batch_busy`), plain's and trees' measured
    why: dict[Any, str]  # K -> why it was timed: given in `ks`, the search's reason, off, a tree shape
    verified: bool  # the chain's K and its neighbours were all timed (False: max_timings stopped the search)
    own_acceptance: dict[Any, list[float]] = dataclasses.field(default_factory=dict)  # tree, or K of a drafter
    # whose drafts depend on K -> per depth, measured at it


def pooled_acceptance(runs: Sequence[Any]) -> list[float]:
    """The acceptance per draft position over several runs (`Metrics` of generates at one K),
    each weighted by its active request-rounds, as one run of them all would count it (one run: its
    own, unrounded)."""
    if len(runs) == 1:
        return list(runs[0].acceptance)
    total = max(sum(m.request_rounds for m in runs), 1)
    return [sum(a * m.request_rounds for a, m in zip(column, runs)) / total
            for column in zip(*(m.acceptance for m in runs))]


def batch_busy(runs: Sequence[Any], requests: Sequence[int]) -> float:
    """The fraction of a batch's request-rounds in which the request was still decoding, over
    several runs (`Metrics`, each of requests[i] requests): a generate runs until its last request
    is done, so a round shape's tokens per ms for the batch are its accepted length times this."""
    return sum(m.request_rounds for m in runs) / max(sum(m.rounds * b for m, b in zip(runs, requests)), 1)


def expected_accept_length(acceptance: Sequence[float]) -> float:
    """Tokens per round per request at K = len(acceptance): the bonus plus each accepted draft
    (acceptance[i]: the fraction of request-rounds that accept draft i+1, `Metrics.acceptance`)."""
    return 1.0 + sum(acceptance)


def choose_k(round_ms: dict[int, float], acceptance: Sequence[float]) -> int:
    """The K in 1..len(acceptance) with the most tokens per ms, from measured ms per round at two or
    more K (`round_ms`, K -> ms, `price`) and acceptance per draft position measured at the largest K.

    Chain drafting: whether draft i is accepted depends on drafts 1..i only, so one run at the
    largest K gives every smaller K's acceptance.
    """
    cost = price(round_ms, len(acceptance))
    return max(cost, key=lambda k: expected_accept_length(acceptance[:k]) / cost[k])


def price(round_ms: dict[int, float], k_max: int) -> dict[int, float]:
    """ms per round for K = 1..k_max: measured where it was; between two measured K on the straight
    line between them; outside, on the line through the two nearest measured K. The round is not
    linear in K (the verify's bs x (K+1) rows fill matmul tiles in steps), so a far line only
    guides `next_k_to_time`. A larger K does more work and the round has a fixed part (the weights
    read): a K above the measured is priced no lower than the largest measured, one below no lower
    than the line from the origin to the smallest measured."""
    if len(round_ms) < 2:
        raise ValueError(f"choose_k needs ms per round at two K or more, got {sorted(round_ms)}")
    timed = sorted(round_ms)

    def line(a: int, b: int, k: int) -> float:
        return round_ms[a] + (round_ms[b] - round_ms[a]) * (k - a) / (b - a)

    cost = {}
    for k in range(1, k_max + 1):
        below, above = [t for t in timed if t <= k], [t for t in timed if t >= k]
        if k in round_ms:
            cost[k] = round_ms[k]
        elif below and above:
            cost[k] = line(below[-1], above[0], k)
        elif below:
            cost[k] = max(line(below[-2], below[-1], k), round_ms[below[-1]])
        else:
            cost[k] = max(line(above[0], above[1], k), round_ms[above[0]] * k / above[0])
    return cost


def next_k_to_time(round_ms: dict[int, float], acceptance: Sequence[float]) -> int | None:
    """The K that `Decoder.tune_k`'s search times next: of the K `choose_k` picks and its neighbours
    K-1, K+1 (within 1..len(acceptance)), the untimed one priced best; None when all are timed, so
    the choice is a measured local optimum."""
    cost = price(round_ms, len(acceptance))
    chosen = choose_k(round_ms, acceptance)
    untimed = [k for k in (chosen - 1, chosen, chosen + 1) if k in cost and k not in round_ms]
    return max(untimed, key=lambda k: expected_accept_length(acceptance[:k]) / cost[k], default=None)

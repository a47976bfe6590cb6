"""Batched speculative decoding, greedy or sampled: chain drafting, K draft tokens per round.

    dec = Decoder(target, drafter, k=4, max_batch=len(prompts), max_len=256)
    out = dec.generate(prompts, max_new_tokens=64, eos_id=2)   # out.tokens, out.metrics
    out = dec.generate(prompts, 64, temperature=0.6, top_p=0.95, seed=0)   # speculative sampling
    plain = Decoder(target, None, max_batch=..., max_len=...)  # the target's own decoding
    dec.tune_k(prompts, (2, 6), acceptance=out.metrics.acceptance)  # K for this batch size, timed; then used

One round, for a request whose last emitted token x_n sits at position n (the target has not
seen it yet; the drafter has, and holds its guess d_1 for position n+1):

    draft     d_2..d_K: K-1 draft steps at positions n+1..n+K-1                        [B, K]
    verify    the target on [x_n, d_1..d_K] at positions n..n+K -> y_0..y_K, a         [B, K+1]
              greedy: y = its arg-maxes, a = the longest prefix with d_{i+1} == y_i; sampled:
              draft i kept with probability min(1, p_i(d_i) / q_i(d_i)), a = the first rejected,
              y_a drawn from norm(max(0, p_a - q_a)) (p_K: the bonus) (specpass/sampling.py)
    accept    emit d_1..d_a (= y_0..y_{a-1}) and y_a
    catch-up  the drafter on y_0..y_K at positions n+1..n+K+1 (with the target's hidden
              states at n..n+K), live row a -> d_1 of the next round

A parallel drafter (`ParallelDrafter`: P-EAGLE, PARD) has no draft steps: its catch-up is one draft
forward over y_0..y_K and K-1 slots of its own that makes the next round's d_1..d_K at once
(`parallel_catch_up`); the round is verify -> accept -> that forward.

The four are pure functions of device tensors with static shapes (`draft`, `verify`, `accept`,
`catch_up`), and `decode_round` composes them. `Decoder` is the driver: it binds the models,
compiles the steps — one graph each, or the whole round as one graph, from the same functions —
and the prefill (`prefill_step`, one graph for every prompt length), prefills, and loops. KV
caches are addressed by position (rejected slots are masked, then overwritten; nothing is
copied), finished requests keep running in the batch and emit nothing, and the only host sync per
round reads one flag, all done? (on a GPU the previous round's, so the device never waits for the
host). See docs/loop.md.

specpass does not import the model zoo: a target and a drafter are anything with the methods of
`Target` and `Drafter` below (the zoo's adapters are in models/drafters.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import numbers
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

import specpass
from specpass.kernels.counter import key, uniform
from specpass.sampling import (ACCEPT, DRAFT, TARGET, Params, accepts, draw, floor_of, gumbel_argmax, logprobs,
                               per_request, residual)


class Target(Protocol):
    """The verified model: a module with static KV caches addressed by per-request position."""

    def parameters(self) -> Any: ...

    def setup_caches(self, max_batch: int, max_len: int) -> None: ...

    def __call__(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """tokens, positions [B, T] -> logits [B, T, V]."""

    def forward_with_hidden(self, tokens: Tensor, positions: Tensor, kind: str) -> tuple[Tensor, Tensor]:
        """-> (logits [B, T, V], the hidden states a drafter reads, [B, T, Hh]) for `Drafter.hidden_kind`."""


class Drafter(Protocol):
    """A draft model. Row t of a catch-up holds the token at position p+t and, when the drafter
    reads the target's states (`hidden_kind` is not None), the target's hidden state at p+t-1."""

    hidden_kind: str | None  # the `kind` passed to Target.forward_with_hidden; None: no hidden

    def setup_caches(self, max_batch: int, max_len: int) -> None: ...

    def catch_up(self, tokens: Tensor, positions: Tensor, hidden: Tensor | None,
                 live: Tensor) -> tuple[Tensor, Tensor]:
        """[B, T] tokens and positions, [B, T, Hh] hidden, [B] live row -> (logits [B, Vd], hidden [B, Hd])
        of row live[b]; every row's K/V is written."""

    def draft_step(self, tokens: Tensor, positions: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """[B] token, [B] position, [B, Hd] the previous step's hidden -> (logits [B, Vd], hidden [B, Hd])."""

    def to_target(self, ids: Tensor) -> Tensor:
        """Draft-vocabulary ids -> target ids (identity when the vocabularies are the same)."""

    # Optional: `get_input_embeddings() -> nn.Embedding`, the embedding the drafter reads target ids
    # with; `Decoder` then checks up front that it takes every id of the target's vocabulary.


class ParallelDrafter(Drafter, Protocol):
    """A drafter that makes all K drafts in one forward (P-EAGLE, PARD): its round is verify +
    one draft forward, no draft steps (`parallel_catch_up`)."""

    def draft_parallel(self, tokens: Tensor, positions: Tensor, hidden: Tensor | None, live: Tensor,
                       k: int) -> Tensor:
        """[B, T] tokens and contiguous positions, [B, T, Hh] hidden, [B] live row -> logits [B, k, Vd]:
        row j predicts the token at positions[b, live[b]] + 1 + j. Rows after live[b] are the
        drafter's own (mask slots, padding); every row's K/V is written."""


class State(NamedTuple):
    """Per-request decoding state; every field lives on the device, shapes never change."""

    last: Tensor  # [B] the last emitted token x_n, not yet seen by the target
    pos: Tensor  # [B] its position n (frozen once the request is done)
    out: Tensor  # [B, max_len] emitted tokens; columns past `count` are scratch
    count: Tensor  # [B] tokens emitted
    limit: Tensor  # [B] max_new_tokens (0 for padding rows of the batch)
    eos: Tensor  # [B] the request's EOS id, -1 for none
    done: Tensor  # [B] bool
    stats: Tensor  # [K+1] int64: active request-rounds, then how many accepted draft i = 1..K


# --- the steps: pure, traceable (static shapes, no host syncs)


class Proposal(NamedTuple):
    """The distribution drafts were sampled from: q [..., Vd] over the draft's vocabulary, and q
    at each draft. None where drafts are greedy: q is one-hot at the draft."""

    probs: Tensor
    at: Tensor


def greedy(drafter: Drafter, logits: Tensor) -> Tensor:
    """Draft logits [B, Vd] -> target ids [B]. topk = 1 written the way engines write it,
    softmax -> max; specpass's arg-max pass drops the softmax. Only the index is used."""
    return drafter.to_target(torch.softmax(logits.float(), -1).max(-1).indices)


def propose(drafter: Drafter, sampled: bool, logits: Tensor, params: Params | None,
            pos: Tensor) -> tuple[Tensor, Proposal | None]:
    """Draft logits [B, Vd] for position pos [B] -> (target ids [B], the proposal or None):
    greedy, or drawn from the draft's distribution processed as the target's is."""
    if params is None or not sampled:
        return greedy(drafter, logits), None
    log_q = logprobs(logits, params, floor_of(logits, params))  # [B, Vd]
    ids = gumbel_argmax(log_q, key(params.seed, pos, DRAFT))  # drawn where q is made: one kernel
    q = log_q.exp()
    return drafter.to_target(ids), Proposal(q, q.gather(1, ids[:, None])[:, 0])


def draft(drafter: Drafter, k: int, sampled: bool, d1: Tensor, q1: Proposal | None, pos: Tensor, h: Tensor,
          params: Params | None) -> tuple[Tensor, Proposal | None]:
    """d_1 [B] (and its proposal), n [B], the catch-up's hidden [B, Hd] -> d_1..d_K [B, K] (target
    ids) and their proposals [B, K, Vd], [B, K]: K-1 draft steps."""
    drafts, proposals = [d1], [q1]
    for i in range(1, k):
        logits, h = drafter.draft_step(drafts[-1], pos + i, h)  # d_i at position n+i -> d_{i+1}
        d, q = propose(drafter, sampled, logits, params, pos + i + 1)
        drafts.append(d)
        proposals.append(q)
    if q1 is None:
        return torch.stack(drafts, 1), None
    return torch.stack(drafts, 1), Proposal(*(torch.stack(parts, 1) for parts in zip(*proposals)))


def propose_rows(drafter: Drafter, sampled: bool, logits: Tensor, params: Params | None,
                 pos: Tensor) -> tuple[Tensor, Proposal | None]:
    """`propose` on K drafts per request: logits [B, K, Vd] at positions pos [B, K] -> (target ids
    [B, K], proposals [B, K, Vd], [B, K] or None). Each draft is drawn from its own distribution."""
    B, K = pos.shape
    rows = None if params is None else Params(*(None if t is None else t.repeat_interleave(K) for t in params))
    ids, q = propose(drafter, sampled, logits.flatten(0, 1), rows, pos.flatten())
    return ids.view(B, K), None if q is None else Proposal(q.probs.view(B, K, -1), q.at.view(B, K))


def draft_parallel(drafter: ParallelDrafter, k: int, sampled: bool, tokens: Tensor, positions: Tensor,
                   hidden: Tensor | None, live: Tensor, params: Params | None) -> tuple[Tensor, Proposal | None]:
    """One draft forward on [B, T] rows, live row live [B] -> d_1..d_K [B, K] and their proposals."""
    logits = drafter.draft_parallel(tokens, positions, hidden, live, k)  # [B, K, Vd]
    at = positions.gather(1, live[:, None]) + 1 + torch.arange(k, device=live.device)  # [B, K] the drafts' positions
    return propose_rows(drafter, sampled, logits, params, at)


def carried(d: Tensor, q: Proposal | None, pos: Tensor, h: Tensor | None,
            params: Params | None) -> tuple[Tensor, Proposal | None]:
    """A parallel drafter's draft step: the previous round's draft forward already made d_1..d_K."""
    return d, q


def verify(target: Target, hidden_kind: str | None, to_target: Callable[[Tensor], Tensor] | None, last: Tensor,
           pos: Tensor, d: Tensor, q: Proposal | None,
           params: Params | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The target on [x_n, d] at positions n..n+K -> (y [B, K+1]: d_1..d_a then the target's
    token y_a, the rest padding; a [B] drafts accepted; the hidden states the drafter reads
    [B, K+1, Hh], or None)."""
    tokens = torch.cat([last[:, None], d], 1)  # [B, K+1]
    positions = pos[:, None] + torch.arange(d.shape[1] + 1, device=d.device)  # [B, K+1]
    if hidden_kind is None:
        logits, hidden = target(tokens, positions), None
    else:
        logits, hidden = target.forward_with_hidden(tokens, positions, hidden_kind)
    if params is None:
        y = logits.argmax(-1)
        return y, first_true(d != y[:, :-1]), hidden
    return *judge(logits, d, q, params, pos, to_target), hidden


def judge(logits: Tensor, d: Tensor, q: Proposal | None, params: Params, pos: Tensor,
          to_target: Callable[[Tensor], Tensor] | None) -> tuple[Tensor, Tensor]:
    """Speculative sampling: the target's logits [B, K+1, V] at positions n..n+K, drafts d [B, K]
    drawn from q (None: greedy drafts, q one-hot) -> (y [B, K+1], a [B]). The emitted tokens are
    distributed as plain sampling from the target's processed distribution p (tests/test_sampling.py)."""
    B, K, V = d.shape[0], d.shape[1], logits.shape[-1]
    rows = torch.arange(B, device=d.device)
    if K == 0:  # plain sampling: one read of the logits
        floor = floor_of(logits[:, 0], params)
        token = draw(logits[:, 0], params, key(params.seed, pos + 1, TARGET), floor)
        return token[:, None], torch.zeros_like(pos)
    log_p = logprobs(logits, params, floor_of(logits, params))  # [B, K+1, V]
    p_d = log_p[:, :K].gather(2, d[..., None])[..., 0].exp()  # [B, K]
    q_d = torch.ones_like(p_d) if q is None else q.at
    u = uniform(key(params.seed, pos[:, None] + 1 + torch.arange(K, device=d.device), ACCEPT))  # [B, K]
    a = first_true(~accepts(u, p_d, q_d))  # [B] the first rejected draft; K: all accepted
    # y_a ~ norm(max(0, p_a - q_a)), q_K = 0 (the bonus token: p_K itself)
    p_a = log_p[rows, a].exp()  # [B, V]
    rejected = (a < K)[:, None]
    at = a.clamp(max=K - 1)
    if q is None:
        q_a = torch.nn.functional.one_hot(d[rows, at], V).float()
    else:
        ids = to_target(torch.arange(q.probs.shape[-1], device=d.device))  # the draft vocabulary in target ids
        q_a = p_a.new_zeros(B, V).index_copy(1, ids, q.probs[rows, at])
    q_a = torch.where(rejected, q_a, 0.0)
    token = gumbel_argmax(residual(p_a, q_a), key(params.seed, pos + 1 + a, TARGET))
    y = torch.cat([d, d[:, :1]], 1).scatter(1, a[:, None], token[:, None])
    return y, a


def accept(state: State, y: Tensor, a: Tensor) -> tuple[State, Tensor]:
    """The target's y [B, K+1] with a [B] drafts accepted -> (next state, all done [])."""
    K = y.shape[1] - 1
    t = torch.arange(K + 1, device=y.device)

    # This round emits y_0..y_a (d_1..d_a, then the target's y_a), cut after an EOS and at the budget.
    emitting = (t <= a[:, None]) & ~state.done[:, None]  # [B, K+1]
    is_eos = (y == state.eos[:, None]) & emitting
    emitting &= t <= first_true(is_eos)[:, None]  # nothing after the first EOS
    emitting &= state.count[:, None] + t < state.limit[:, None]
    # Columns past count + emitted are scratch: the next round (or nothing) overwrites them.
    out = state.out.scatter(1, state.count[:, None] + t, y)
    count = state.count + emitting.sum(1)
    done = state.done | (count >= state.limit) | (is_eos & emitting).any(1)

    active = ~state.done
    accepted = (a[:, None] > t[:K]) & active[:, None]  # [B, K] draft i+1 accepted
    stats = state.stats + torch.cat([active.sum()[None], accepted.sum(0)])
    pos = torch.where(active, state.pos + a + 1, state.pos)  # y_a, at n+a+1, is the new x_n
    last = torch.where(active, y.gather(1, a[:, None])[:, 0], state.last)
    # State(...) spelled out: torch 2.11's Dynamo rebuilds NamedTuple._replace as an empty tuple.
    state = State(last=last, pos=pos, out=out, count=count, limit=state.limit, eos=state.eos, done=done,
                  stats=stats)
    return state, done.all()  # all done: what the host reads each round


def first_true(mask: Tensor) -> Tensor:
    """[B, N] bool -> [B] the index of each row's first True, N where there is none.

    One reduction, no scan: argmax returns the first maximum, and a True column appended to every
    row gives rows without a True the answer N.
    """
    return torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1).int().argmax(1)


def cache_slots(prompt_len: int, max_new_tokens: int, k: int, parallel: bool = False) -> int:
    """The cache slots (`Decoder`'s max_len) a request needs. A finished request runs on frozen (the
    host reads `done` rounds late; other requests go on) at a position up to prompt + budget + K - 1,
    and a round writes past it: verify K+1 slots, the chain drafter's catch-up and draft steps up to
    K+1, a parallel drafter's one draft forward 2K (K+1 catch-up rows, K-1 mask slots)."""
    return prompt_len + max_new_tokens + (3 * k if parallel else 2 * k + 1)


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


def catch_up(drafter: Drafter, sampled: bool, y: Tensor, pos: Tensor, hidden: Tensor | None, a: Tensor,
             params: Params | None) -> tuple[Tensor, Proposal | None, Tensor]:
    """The drafter on y_0..y_K at positions n+1..n+K+1, live row a -> (next d_1 [B], its proposal,
    hidden [B, Hd]).

    All K+1 rows write their K/V; only row a is sampled: the graph specpass's live-row pass rewrites.
    """
    positions = pos[:, None] + 1 + torch.arange(y.shape[1], device=y.device)  # [B, K+1]
    logits, h = drafter.catch_up(y, positions, hidden, a)
    d1, q1 = propose(drafter, sampled, logits, params, pos + a + 2)  # the next round's d_1 is at n+a+2
    return d1, q1, h


def parallel_catch_up(drafter: ParallelDrafter, k: int, sampled: bool, y: Tensor, pos: Tensor,
                      hidden: Tensor | None, a: Tensor, params: Params | None) -> tuple[Tensor, Proposal | None, None]:
    """A parallel drafter's catch-up is the round's one draft forward: y_0..y_K at positions
    n+1..n+K+1 with live row a, then K-1 mask slots -> (the next d_1..d_K [B, K], proposals, None)."""
    positions = pos[:, None] + 1 + torch.arange(y.shape[1], device=y.device)  # [B, K+1]
    return *draft_parallel(drafter, k, sampled, y, positions, hidden, a, params), None


class Steps(NamedTuple):
    """A round's steps with their models bound: the functions above, or their compiled forms.
    `params` (the last argument of draft, verify and catch-up) is None for greedy decoding."""

    draft: Callable[..., tuple[Tensor, Proposal | None]] | None  # (d1, q1, pos, h, params) -> d, q; None: plain
    verify: Callable[..., tuple[Tensor, Tensor, Tensor | None]]  # (last, pos, d, q, params) -> y, a, hidden
    accept: Callable[[State, Tensor, Tensor], tuple[State, Tensor]]  # (state, y, a) -> state, done
    catch_up: Callable[..., tuple[Tensor, Proposal | None, Tensor]] | None  # (y, pos, hidden, a, params) -> d1, q1, h


class Carry(NamedTuple):
    """What the catch-up hands the next round: d_1, its proposal, the drafter's hidden state (a
    parallel drafter: d_1..d_K [B, K], their proposals, None)."""

    d1: Tensor | None
    q1: Proposal | None
    h: Tensor | None


def decode_round(steps: Steps, state: State, carry: Carry,
                 params: Params | None) -> tuple[State, Carry, Tensor]:
    """One round: draft -> verify -> accept -> catch-up. -> (state, carry, all done)."""
    pos = state.pos
    # Plain decoding verifies no drafts: an empty [B, 0] block.
    d, q = steps.draft(*carry[:2], pos, carry.h, params) if steps.draft is not None else (pos[:, None][:, :0], None)
    y, a, hidden = steps.verify(state.last, pos, d, q, params)
    state, finished = steps.accept(state, y, a)
    if steps.catch_up is not None:
        carry = Carry(*steps.catch_up(y, pos, hidden, a, params))
    return state, carry, finished


def prefill_step(target: Target, drafter: Drafter | None, k: int, sampled: bool, tokens: Tensor, lengths: Tensor,
                 params: Params | None) -> tuple[Tensor, Carry]:
    """Right-padded prompts tokens [B, P+1] (column P is room for x_n) of lengths [B] through the
    target, then the drafter -> (x_n [B], the first token of each request, at position n = length;
    the carry of the first round).

    Traceable with P symbolic: `Decoder` compiles it once for every prompt length. Only row
    length - 1 of the target's logits is read, and only the drafter's live rows: the graph
    specpass's live-row pass rewrites (the lm_heads then run on one row per request).
    """
    B, P = tokens.shape[0], tokens.shape[1] - 1
    positions = torch.arange(P + 1, device=tokens.device).expand(B, -1)  # [B, P+1]
    kind = drafter.hidden_kind if drafter is not None else None
    if kind is None:
        logits, hidden = target(tokens[:, :P], positions[:, :P]), None
    else:
        logits, hidden = target.forward_with_hidden(tokens[:, :P], positions[:, :P], kind)
    last = logits[torch.arange(B, device=tokens.device), lengths - 1]  # [B, V]
    if params is None:
        first = last.argmax(-1)
    else:
        first = draw(last, params, key(params.seed, lengths, TARGET), floor_of(last, params))
    if drafter is None:
        return first, Carry(None, None, None)
    tokens = tokens.scatter(1, lengths[:, None], first[:, None])
    # A drafter that reads target states starts at position 1: row t pairs the token at t+1
    # with the target's state at t. A standalone one reads the prompt from position 0.
    o = 0 if kind is None else 1
    if hasattr(drafter, "draft_parallel"):
        return first, Carry(*draft_parallel(drafter, k, sampled, tokens[:, o:], positions[:, o:], hidden, lengths - o,
                                            params), None)
    logits, h = drafter.catch_up(tokens[:, o:], positions[:, o:], hidden, lengths - o)
    return first, Carry(*propose(drafter, sampled, logits, params, lengths + 1), h)


@torch.no_grad()
def prefill(step: Callable[..., tuple[Tensor, Carry]], prompts: Sequence[Sequence[int]], limits: list[int],
            eos: list[int], params: Params | None, k: int, max_batch: int, max_len: int,
            device: torch.device) -> tuple[State, Carry]:
    """The prompts, right-padded into max_batch rows, through `step` (`prefill_step` bound to the
    models, or its compiled form); emits each request's first token. -> the first round's state and carry."""
    # Two rows or more: one would specialize the compiled prefill to a single row (Dynamo's size-1 rule).
    B, P = max_batch, max(2, *(len(p) for p in prompts))
    idle = B - len(prompts)  # padding rows: a one-token prompt, no budget, done from the start
    lengths = torch.tensor([len(p) for p in prompts] + [1] * idle, device=device)
    tokens = torch.zeros(B, P + 1, dtype=torch.long, device=device)  # [B, P+1]: prompt, then x_n
    tokens[: len(prompts), :P] = torch.tensor([list(p) + [0] * (P - len(p)) for p in prompts], device=device)
    torch._dynamo.maybe_mark_dynamic(tokens, 1)  # one graph for every prompt length
    first, carry = step(tokens, lengths, params)

    limit = torch.tensor(limits + [0] * idle, device=device)
    eos_t = torch.tensor(eos + [-1] * idle, device=device)
    out = torch.zeros(B, max_len, dtype=torch.long, device=device)  # wider than any budget + K + 1
    out[:, 0] = first
    count = (limit > 0).long()
    state = State(last=first, pos=lengths, out=out, count=count, limit=limit, eos=eos_t,
                  done=(count >= limit) | (first == eos_t), stats=torch.zeros(k + 1, dtype=torch.long, device=device))
    return state, carry


# --- the driver


@dataclasses.dataclass
class Metrics:
    new_tokens: int
    rounds: int  # decoding rounds (steps, for plain decoding)
    seconds: float  # prefill + rounds, wall clock
    prefill_seconds: float
    accept_length: float  # tokens per round per active request: accepted drafts + the bonus token
    acceptance: list[float]  # per draft position 1..K: the fraction of active request-rounds accepting it
    phase_ms: dict[str, float]  # mean ms per round: "round"; with timing=True (steps apart) also each step

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def __str__(self) -> str:
        phases = ", ".join(f"{k} {v:.3f}" for k, v in self.phase_ms.items())
        acceptance = " ".join(f"{p:.2f}" for p in self.acceptance) or "-"
        return (f"{self.new_tokens} tokens in {self.rounds} rounds, {self.seconds:.2f} s "
                f"({self.tokens_per_s:.1f} tokens/s); mean accepted length {self.accept_length:.2f}; "
                f"acceptance per draft position {acceptance}; ms per round: {phases}")


@dataclasses.dataclass
class Output:
    tokens: list[list[int]]  # per prompt, the generated tokens (EOS included when hit)
    metrics: Metrics


@dataclasses.dataclass
class KChoice:
    """What `Decoder.tune_k` measured and chose."""

    k: int  # the K the decoder runs from now on
    round_ms: dict[int, float]  # K -> measured ms per round, in the order timed
    acceptance: list[float]  # per draft position 1..N: the candidates are K = 1..N that fit the caches
    tokens_per_ms: dict[int, float]  # K -> the cost model's tokens per ms per request
    why: dict[int, str]  # K -> why it was timed: given in `ks`, or the search's reason
    verified: bool  # the chosen K and its neighbours were all timed (False: max_timings stopped the search)


COMPILERS = ("specpass", "inductor", "eager")


class Decoder:
    """Decoding of `target`, greedy or sampled, speculative when `drafter` is given.

    compile: "specpass" (default), "inductor", "eager" (no torch.compile), or a backend callable
      (e.g. `specpass.backend(handoff="eager")`). Every step is compiled with static shapes; the
      prefill (`prefill_step`) once, with the prompt length symbolic, in the default mode.
    mode: torch.compile's mode; "reduce-overhead" gives CUDA graphs (one per compiled graph).
    fused_round: compile the whole round as one graph (one CUDA graph replay per round) instead
      of one graph per step (draft, verify, accept, catch-up).
    greedy_drafts: when sampling, draft the arg-max (q one-hot, vLLM's default) instead of drawing
      drafts from the draft's distribution; the output distribution is the same either way.
    max_batch, max_len: the static cache shapes; `generate` pads the batch with idle rows.
    compile_prefill: False runs the prefill uncompiled (a benchmark of the rounds alone skips its
      compile, about a minute at 8B shape).
    `dec.prefill_step(tokens, lengths, params)`: `prefill_step` bound to the models and compiled,
    what `generate` runs through `prefill` (benchmarks/prefill.py times it).
    """

    def __init__(self, target: Target, drafter: Drafter | None = None, *, k: int = 4, max_batch: int,
                 max_len: int, compile: str | Callable = "specpass", mode: str | None = None,
                 fused_round: bool = False, greedy_drafts: bool = False, compile_prefill: bool = True):
        _require(target, "target", Target, ("parameters", "setup_caches", "__call__"))
        if drafter is not None:
            _require(drafter, "drafter", Drafter, ("hidden_kind", "setup_caches", "catch_up", "draft_step", "to_target"))
            if drafter.hidden_kind is not None:
                _require(target, "target", Target, ("forward_with_hidden",))
            if not _is_int(k) or k < 1:
                raise ValueError(f"k (draft tokens per round) must be an int >= 1, got {k!r}; "
                                 "for plain decoding pass drafter=None")
        for name, value in (("max_batch", max_batch), ("max_len", max_len)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1 (a static cache size), got {value!r}")
        if not (compile in COMPILERS if isinstance(compile, str) else callable(compile)):
            raise ValueError(f"compile must be one of {list(COMPILERS)} or a backend callable, got {compile!r}")
        if not isinstance(compile_prefill, bool):
            raise ValueError(f"compile_prefill must be True or False, got {compile_prefill!r}")
        parameter = next(iter(target.parameters()), None)
        if parameter is None:
            raise ValueError("the target has no parameters: the loop puts its state on the device of the target's")
        self.target, self.drafter = target, drafter
        self.k = k if drafter is not None else 0
        self.max_batch, self.max_len = max_batch, max_len
        self.device = parameter.device
        self.cudagraphs = mode == "reduce-overhead" and compile != "eager"
        self.fused_round = fused_round
        self.greedy_drafts = greedy_drafts
        target.setup_caches(max_batch, max_len)
        if drafter is not None:
            drafter.setup_caches(max_batch, max_len)
        self.vocab_size = self._probe()
        self._wrap = _compiler(compile, mode)
        self._wrap_prefill = _compiler(compile if compile_prefill else "eager", None, dynamic=None)
        self._bound: dict[int, tuple] = {}  # K -> its steps and compiled forms (`tune_k` switches K)
        self._bind(self.k)

    def _bind(self, k: int) -> None:
        """Decode with K drafts per round from now on: the steps with K bound, compiled (lazily) once per K."""
        if k not in self._bound:
            target, drafter, wrap = self.target, self.drafter, self._wrap
            kind = drafter.hidden_kind if drafter is not None else None
            sampled = not self.greedy_drafts
            steps = Steps(
                draft=functools.partial(draft, drafter, k, sampled) if drafter is not None else None,
                verify=functools.partial(verify, target, kind, drafter.to_target if drafter is not None else None),
                accept=accept,
                catch_up=functools.partial(catch_up, drafter, sampled) if drafter is not None else None)
            if hasattr(drafter, "draft_parallel"):  # verify + one draft forward per round
                steps = steps._replace(draft=carried, catch_up=functools.partial(parallel_catch_up, drafter, k, sampled))
            if self.fused_round:
                compiled, run_round = None, wrap(functools.partial(decode_round, steps), "decode_round")
            else:  # `carried` moves nothing: no graph
                compiled = Steps(*(s if s is None or s is carried else wrap(s, name)
                                   for name, s in zip(Steps._fields, steps)))
                run_round = functools.partial(decode_round, compiled)
            # Prompt lengths vary: one graph with a symbolic length, no CUDA graphs (one would be
            # recorded per length, for one call of large kernels per generate).
            # A chain drafter's prefill does not read K: every K shares the one compiled first.
            shared = not hasattr(drafter, "draft_parallel") and next(iter(self._bound.values()), None)
            prefill = shared[3] if shared else self._wrap_prefill(
                functools.partial(prefill_step, target, drafter, k, sampled), "prefill")
            self._bound[k] = steps, compiled, run_round, prefill
        self.k = k
        self.steps, self._steps, self._round, self.prefill_step = self._bound[k]

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 eos_id: int | Sequence[int] | None = None, timing: bool = False, *,
                 temperature: float | Sequence[float] = 0.0, top_k: int | Sequence[int] | None = None,
                 top_p: float | Sequence[float] | None = None, seed: int | Sequence[int] | None = None) -> Output:
        """Decode each prompt; per-request `max_new_tokens`, `eos_id` and sampling parameters (a
        value for all or one per prompt).

        temperature: 0 (default) is greedy decoding; > 0 samples from softmax(logits / temperature),
          cut to the `top_k` largest logits (0: off) and then to the smallest set of mass `top_p`
          (1: off), as plain sampling from the target would (specpass/sampling.py). Speculative
          sampling keeps that distribution exactly. seed: one int (each request gets its own
          stream of it) or one per request; the same seeds give the same tokens. None: a fresh one.
        timing=True also splits the round time into its steps (steps compiled apart): CUDA events
        (the host clock on CPU) after each step, read once at the end, so no sync is added.
        """
        B = len(prompts)
        limits = per_request(max_new_tokens, B, "max_new_tokens", int, lambda v: v >= 1, ">= 1")
        eos = per_request(-1 if eos_id is None else eos_id, B, "eos_id", int, lambda v: v >= -1, ">= -1")  # -1: none
        params = Params.make(B, self.max_batch, self.device, temperature, top_k, top_p, seed)  # None: greedy
        prompts = self._check(prompts, limits)
        start = self._clock()
        state, carry = prefill(self.prefill_step, prompts, limits, eos, params, self.k, self.max_batch, self.max_len,
                               self.device)
        prefill_end = self._clock()

        timer = _PhaseTimer(self.device) if timing and not self.fused_round else None
        run_round = self._round if timer is None else functools.partial(
            decode_round, Steps(*(timer.timed(name, step) for name, step in zip(Steps._fields, self._steps))))
        rounds, flags = 0, _DoneFlags(self.device)
        with contextlib.ExitStack() as unguarded:
            while True:
                if self.cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                if timer is not None:
                    timer.mark("between")
                state, carry, finished = run_round(state, carry, params)
                if self.cudagraphs:  # the next replay overwrites this one's outputs
                    state, carry = _clone(state), _clone(carry)
                rounds += 1
                if flags.push(finished):  # the round's one host sync
                    rounds -= flags.lag  # a round run after all were done emitted nothing
                    break
                if rounds == 2:  # rounds 3 on run without guard evaluation: see _skip_guards
                    unguarded.enter_context(_skip_guards())
        end = self._clock()

        out, count, stats = state.out.tolist(), state.count.tolist(), state.stats.tolist()
        active = max(stats[0], 1)
        phases = {k: 1e3 * v / rounds for k, v in (timer.totals() if timer else {}).items()}
        metrics = Metrics(
            new_tokens=sum(count), rounds=rounds, seconds=end - start, prefill_seconds=prefill_end - start,
            accept_length=1 + sum(stats[1:]) / active, acceptance=[s / active for s in stats[1:]],
            phase_ms={"round": 1e3 * (end - prefill_end) / rounds, **phases})
        return Output([row[:n] for row, n in zip(out[:B], count[:B])], metrics)

    def tune_k(self, prompts: Sequence[Sequence[int]], ks: Sequence[int] = (2, 6), *,
               acceptance: Sequence[float] | None = None, new_tokens: tuple[int, int] = (8, 40),
               repeats: int = 3, max_timings: int = 4) -> KChoice:
        """Choose K for this batch size from measured costs, then decode with it (`choose_k`).

        Each K in `ks` is compiled (and kept: switching back costs nothing) and its ms per round
        timed on `prompts` (greedy; the batch padded to max_batch as `generate` pads it): the loop
        time of a `new_tokens[1]` generate minus a `new_tokens[0]` one over the rounds between, median
        of `repeats`, so prefill and compiling cancel. A round's shapes are static: its time does not
        depend on what is accepted. acceptance: per draft position 1..N (`Metrics.acceptance` of a
        run at K >= N, e.g. on the traffic this decoder serves); None measures it on `prompts` at the
        largest K timed (chain drafting: one run at the largest K gives every smaller K's). The
        candidates are K = 1..N whose caches fit the prompts and `new_tokens[1]`, priced by `price`.
        Then a local search: while the best-priced K or a neighbour K +- 1 is untimed, time the one
        `next_k_to_time` names and price again, at most `max_timings` times; so the chosen K is
        measured, and better than its measured neighbours.
        """
        if self.drafter is None:
            raise ValueError("plain decoding (drafter=None) drafts nothing: there is no K to tune")
        timed = sorted(set(ks)) if all(_is_int(k) and k >= 1 for k in ks) else []
        if len(timed) < 2:
            raise ValueError(f"ks must hold two or more different K >= 1 to time (a line through their costs), "
                             f"got {list(ks)!r}")
        if acceptance is not None and (len(acceptance) == 0 or not all(
                isinstance(a, numbers.Real) and 0 <= a <= 1 for a in acceptance)):
            raise ValueError(f"acceptance must list, per draft position 1..N, the fraction of request-rounds "
                             f"accepting it (Metrics.acceptance: floats in [0, 1]), got {acceptance!r}")
        short, long = new_tokens
        if not (_is_int(short) and _is_int(long) and 1 <= short < long) or not _is_int(repeats) or repeats < 1:
            raise ValueError(f"new_tokens must be (short, long) ints with 1 <= short < long and repeats an int >= 1, "
                             f"got {new_tokens!r}, {repeats!r}")
        if not _is_int(max_timings) or max_timings < 0:
            raise ValueError(f"max_timings (K timed by the search beyond ks) must be an int >= 0, got {max_timings!r}")
        previous = self.k
        for k in timed:  # every K fits the caches, checked before anything compiles
            self._bind(k)
            try:
                self._check(prompts, [long] * len(prompts))
            except ValueError as exc:
                self._bind(previous)
                raise ValueError(f"tuning at K = {k}: {exc}") from None
        parallel = hasattr(self.drafter, "draft_parallel")
        longest = max(len(p) for p in prompts)
        fits = lambda k: cache_slots(longest, long, k, parallel) <= self.max_len  # noqa: E731
        round_ms, why, measured = {}, {}, []
        for k in timed:
            round_ms[k], measured = self._round_ms(k, prompts, short, long, repeats)
            why[k] = "given"
        acceptance = list(measured if acceptance is None else acceptance)
        candidates = acceptance[:next((k - 1 for k in range(1, len(acceptance) + 1) if not fits(k)), None)]
        while (k := next_k_to_time(round_ms, candidates)) is not None and len(why) < len(timed) + max_timings:
            best = choose_k(round_ms, candidates)
            why[k] = "priced best" if k == best else f"neighbour of K {best}, priced best"
            round_ms[k], _ = self._round_ms(k, prompts, short, long, repeats)
        chosen = choose_k(round_ms, candidates)
        self._bind(chosen)
        rates = {k: expected_accept_length(acceptance[:k]) / ms for k, ms in price(round_ms, len(candidates)).items()}
        return KChoice(chosen, round_ms, acceptance, rates, why, verified=k is None)

    def _round_ms(self, k: int, prompts: Sequence[Sequence[int]], short: int, long: int,
                  repeats: int) -> tuple[float, list[float]]:
        """Decode with K from now on; its ms per round (`tune_k`) and the acceptance of the last long run."""
        self._bind(k)
        self.generate(prompts, short)  # compiles; on a GPU, records the CUDA graphs
        samples = []
        for _ in range(repeats):
            a, b = (self.generate(prompts, n).metrics for n in (short, long))
            samples.append((b.seconds - b.prefill_seconds - a.seconds + a.prefill_seconds) / (b.rounds - a.rounds))
        return 1e3 * statistics.median(samples), b.acceptance

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @torch.no_grad()
    def _probe(self) -> int:
        """One token through the target and the drafter before anything is compiled, so that models
        which do not fit fail here, named, not inside a kernel mid-decoding (on a GPU an id out of
        range is a device-side assert). Writes cache slots 0 and 1, which every prefill overwrites.
        -> the target's vocabulary size."""
        zeros = torch.zeros(self.max_batch, 1, dtype=torch.long, device=self.device)
        kind = self.drafter.hidden_kind if self.drafter is not None else None
        if kind is None:
            logits, hidden = self.target(zeros, zeros), None
        else:
            logits, hidden = self.target.forward_with_hidden(zeros, zeros, kind)
        V = logits.shape[-1]
        if self.drafter is None:
            return V
        try:
            draft_logits, _ = self.drafter.catch_up(zeros, zeros + 1, hidden, zeros[:, 0])
        except Exception as exc:  # a shape mismatch somewhere inside the drafter
            reads = f"the target's {kind!r} hidden states {list(hidden.shape)}" if kind else "one token"
            reason = (str(exc).strip().splitlines() or [""])[0]
            sizes = " (its hidden sizes, e.g. EAGLE-3's target_hidden_size, must match the target's)" if kind else ""
            raise ValueError(f"the drafter does not fit the target: its catch_up fails on {reads} "
                             f"({type(exc).__name__}: {reason}). Use a drafter made for this target{sizes}") from exc
        ids = self.drafter.to_target(torch.arange(draft_logits.shape[-1], device=self.device))
        if not torch.equal(ids.clamp(0, V - 1), ids):  # not .all().item(): tests count .item() as host syncs
            outside = ids[(ids < 0) | (ids >= V)]
            raise ValueError(f"the drafter's vocabulary does not fit the target's: to_target maps {len(outside)} of its "
                             f"{len(ids)} ids outside the target's {V} (e.g. {outside[:3].tolist()}); use a drafter "
                             "made for this target")
        embeddings = getattr(self.drafter, "get_input_embeddings", None)
        rows = embeddings().num_embeddings if embeddings is not None else V
        if rows < V:
            raise ValueError(f"the drafter embeds {rows} token ids but the target's vocabulary has {V}: it reads "
                             "every token the target emits; use a drafter made for this target")
        return V

    def _check(self, prompts: Sequence[Sequence[int]], limits: list[int]) -> list[list[int]]:
        """Each problem named, with what to do -> the prompts as lists of ints."""
        if len(prompts) == 0:
            raise ValueError("no prompts: pass a list of prompts, each a list of token ids")
        if len(prompts) > self.max_batch:
            raise ValueError(f"{len(prompts)} prompts but max_batch is {self.max_batch}: raise max_batch "
                             f"or generate in batches of {self.max_batch}")
        checked = []
        for i, (prompt, limit) in enumerate(zip(prompts, limits)):
            if isinstance(prompt, (str, bytes)):
                raise TypeError(f"prompt {i} is a {type(prompt).__name__}: encode the text to token ids first")
            ids = list(prompt)
            if not ids:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token (e.g. BOS)")
            # Plain ints in range: three passes in C (a Python loop per token took 34 ms at 64 x 450 tokens).
            if not (all(type(t) is int for t in ids) and 0 <= min(ids) and max(ids) < self.vocab_size):
                for j, t in enumerate(ids):
                    if not _is_int(t) or not 0 <= t < self.vocab_size:
                        raise ValueError(f"prompt {i} holds {t!r} at index {j}, not a token id of the target's "
                                         f"vocabulary (ints 0..{self.vocab_size - 1}): encode it with the target's "
                                         "tokenizer")
                ids = [int(t) for t in ids]  # other integer types (numpy's)
            need = cache_slots(len(ids), limit, self.k, hasattr(self.drafter, "draft_parallel"))
            if len(ids) >= self.max_len:
                raise ValueError(f"prompt {i} has {len(ids)} tokens but max_len is {self.max_len}: raise max_len "
                                 f"(to {need} for max_new_tokens {limit}) or shorten the prompt")
            if need > self.max_len:
                raise ValueError(f"prompt {i} ({len(ids)} tokens) + max_new_tokens {limit} needs {need} cache "
                                 f"slots at K {self.k} (`cache_slots`), but max_len is {self.max_len}: raise max_len "
                                 f"to {need}, or lower max_new_tokens or shorten the prompt")
            checked.append(ids)
        return checked


def _compiler(compile: str | Callable, mode: str | None,
              dynamic: bool | None = False) -> Callable[[Callable, str], Callable]:
    """-> wrap(fn, name): fn compiled as one graph, under a code object of its own named `name`."""
    if compile == "eager":
        return lambda fn, name: fn
    backend = specpass if compile == "specpass" else compile  # the module is a backend; "inductor"; a callable
    return lambda fn, name: torch.compile(_own_code(fn, name), backend=backend, mode=mode, fullgraph=True,
                                          dynamic=dynamic)


def _own_code(fn: Callable, name: str) -> Callable:
    """fn called from a function whose code object is its own. torch.compile calls every
    functools.partial through one shared function (torch._dynamo.external_utils.wrap_inline's
    `inner`), and Dynamo keeps at most 8 graphs per code object that guard on the same models: the
    steps of all Decoders over one pair would share that room, and the rest run uncompiled."""

    def step(*args: Any) -> Any:
        return fn(*args)

    step.__code__ = step.__code__.replace(co_name=name)  # a new code object
    step.__name__ = step.__qualname__ = name
    return step


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _require(model: Any, role: str, protocol: type, members: tuple[str, ...]) -> None:
    missing = [m for m in members if not hasattr(model, m)]
    if missing:
        raise TypeError(f"the {role} ({type(model).__name__}) lacks {missing}: a {role} needs the members of "
                        f"specpass.speculative.{protocol.__name__}")


def _skip_guards() -> contextlib.AbstractContextManager:
    """The caller's compiler stance, without guard evaluation (a call runs the one compiled graph
    its code object holds; with several, only the guards that tell them apart).

    `generate` enters it after round 2. Rounds 1 (on the prefill's tensors) and 2 (on round 1's
    outputs) run under every guard, so other models, K, batch, options or sampling parameters still
    recompile. Each later round runs the same compiled round on the outputs of the round before,
    which match round 2's inputs in everything a guard checks (dtype, shape, stride, device), and
    nothing that runs between rounds changes the models, the options or global state: its guards
    would pass. That saves their host time per round (tests/test_speculative.py; docs/loop.md).
    The stance is process-wide: while a loop runs, other threads' compiled code skips guards too.
    """
    stance = torch._dynamo.eval_frame._stance  # private: set_stance has no getter
    return torch.compiler.set_stance(stance.stance, skip_guard_eval_unsafe=True, force_backend=stance.backend)


def _clone(value: Any) -> Any:
    """A copy of a CUDA-graph replay's outputs (tensors in nested tuples), which the next replay overwrites."""
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, tuple):
        items = map(_clone, value)
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


class _DoneFlags:
    """The host's view of "all done". On a GPU, `push` reads the previous round's flag (copied to
    pinned memory as that round ends) while this round runs, so the device never idles waiting
    for the host; that costs one round after the last, which runs on finished requests and emits
    nothing (`lag` = 1). On a CPU the flag is read at once."""

    def __init__(self, device: torch.device):
        self.lag = int(device.type == "cuda")
        self.pending: list[tuple[Tensor, Any]] = []

    def push(self, finished: Tensor) -> bool:
        if not self.lag:
            return bool(finished.item())
        event = torch.cuda.Event()
        self.pending.append((finished.to("cpu", non_blocking=True), event))
        event.record()
        if len(self.pending) <= self.lag:
            return False
        flag, event = self.pending.pop(0)
        event.synchronize()
        return bool(flag.item())


class _PhaseTimer:
    """Time per phase of the round without host syncs: a CUDA event (on CPU the host clock) is
    recorded after each phase; the totals are read once, after the loop."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, Any]] = []  # (the phase that just ended, event or time)

    def mark(self, phase: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((phase, event))
        else:
            self.marks.append((phase, time.perf_counter()))

    def timed(self, phase: str, step: Callable | None) -> Callable | None:
        if step is None:
            return None

        def run(*args: Any) -> Any:
            out = step(*args)
            self.mark(phase)
            return out

        return run

    def totals(self) -> dict[str, float]:
        """Seconds per phase; "between" is the host loop between rounds (the sync, the copies)."""
        if self.cuda:
            torch.cuda.synchronize()
        totals: dict[str, float] = {}
        for (_, start), (phase, end) in zip(self.marks, self.marks[1:]):
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            totals[phase] = totals.get(phase, 0.0) + seconds
        return totals

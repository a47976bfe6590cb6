"""The steps every round shape shares: pure, traceable functions of device tensors with static
shapes (no host syncs). A round shape (chain.py, parallel.py, plain.py) binds them to its models.

One round, for a request whose last emitted token x_n sits at position n (the target has not
seen it yet; the drafter has, and holds its guess d_1 for position n+1):

    draft     d_1..d_K: the shape's draft step (chain: K-1 draft steps)                  [B, K]
    verify    the target on [x_n, d_1..d_K] at positions n..n+K -> y_0..y_K, a         [B, K+1]
              (its logits processed first where the call asks: processors.py)
              greedy: y = its arg-maxes, a = the longest prefix with d_{i+1} == y_i; sampled:
              draft i kept with probability min(1, p_i(d_i) / q_i(d_i)), a = the first rejected,
              y_a drawn from norm(max(0, p_a - q_a)) (p_K: the bonus) (`judge`, specpass/sampling.py)
    accept    emit d_1..d_a (= y_0..y_{a-1}) and y_a
    catch-up  the shape's drafter on y_0..y_K with live row a -> the next round's carry

`decode_round` composes them; `prefill_step` is the prefill: the target on the prompts, the first
tokens, then the shape's drafter half.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from specpass.kernels.counter import key, uniform
from specpass.loop.processors import Processing, after_emitting, processed
from specpass.loop.protocols import Drafter, Target
from specpass.sampling import (ACCEPT, DRAFT, TARGET, Params, accepts, draw, floor_of, gumbel_argmax, logprobs,
                               residual)


class State(NamedTuple):
    """Per-request decoding state; every field lives on the device, shapes never change."""

    last: Tensor  # [B] the last emitted token x_n, not yet seen by the target
    pos: Tensor  # [B] its position n (frozen once the request is done)
    out: Tensor  # [B, max_len] emitted tokens; columns past `count` are scratch
    count: Tensor  # [B] tokens emitted
    limit: Tensor  # [B] max_new_tokens (0 for padding rows of the batch)
    eos: Tensor  # [B, E] the request's EOS ids (any one stops it), -1 where it has fewer than E
    done: Tensor  # [B] bool
    stats: Tensor  # [K+1] int64: active request-rounds, then how many accepted draft i = 1..K
    processing: Processing | None = None  # the logits processors that read the prefix (processors.py)


class Proposal(NamedTuple):
    """The distribution drafts were sampled from: q [..., Vd] over the draft's vocabulary, and q
    at each draft. None where drafts are greedy: q is one-hot at the draft."""

    probs: Tensor
    at: Tensor


class Carry(NamedTuple):
    """What the catch-up hands the next round: d_1, its proposal, the drafter's hidden state (a
    parallel drafter: d_1..d_K [B, K], their proposals, None)."""

    d1: Tensor | None
    q1: Proposal | None
    h: Tensor | None


class Steps(NamedTuple):
    """A round's steps with their models bound: the functions of a round shape, or their compiled
    forms. `params` (the last argument of draft, verify and catch-up) is None for greedy decoding."""

    draft: Callable[..., tuple[Tensor, Proposal | None]] | None  # (d1, q1, pos, h, params) -> d, q; None: plain
    verify: Callable[..., tuple[Tensor, Tensor, Tensor | None]]  # (state, d, q, params) -> y, a, hidden
    accept: Callable[[State, Tensor, Tensor], tuple[State, Tensor]]  # (state, y, a) -> state, done
    catch_up: Callable[..., tuple[Tensor, Proposal | None, Tensor]] | None  # (y, pos, hidden, a, params) -> d1, q1, h


def is_int(value: object) -> bool:
    """An int (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


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


def carried(d: Tensor, q: Proposal | None, pos: Tensor, h: Tensor | None,
            params: Params | None) -> tuple[Tensor, Proposal | None]:
    """The draft step of a shape whose catch-up already made d_1..d_K: it moves nothing (no graph)."""
    return d, q


def verify(target: Target, hidden_kind: str | None, drafter: Drafter | None, state: State, d: Tensor,
           q: Proposal | None, params: Params | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The target on [x_n, d] at positions n..n+K -> (y [B, K+1]: d_1..d_a then the target's
    token y_a, the rest padding; a [B] drafts accepted; the hidden states the drafter reads
    [B, K+1, Hh], or None)."""
    pos = state.pos
    tokens = torch.cat([state.last[:, None], d], 1)  # [B, K+1]
    t = torch.arange(d.shape[1] + 1, device=d.device)
    positions = pos[:, None] + t  # [B, K+1]
    if hidden_kind is None:
        logits, hidden = target(tokens, positions), None
    else:
        logits, hidden = target.forward_with_hidden(tokens, positions, hidden_kind)
    if state.processing is not None:  # row j follows x_n and d_1..d_j
        B = len(pos)
        reads = (t[:, None] >= t[None, :]).expand(B, -1, -1)
        logits = processed(state.processing, logits, state.count, tokens, t.expand(B, -1), reads)
    if params is None:
        y = logits.argmax(-1)
        return y, first_true(d != y[:, :-1]), hidden
    return *judge(logits, d, q, params, pos, drafter.to_target if drafter is not None else None), hidden


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
    is_eos = (y[:, :, None] == state.eos[:, None, :]).any(2) & emitting
    emitting &= t <= first_true(is_eos)[:, None]  # nothing after the first EOS
    emitting &= state.count[:, None] + t < state.limit[:, None]
    processing = after_emitting(state.processing, y, emitting)
    # y_t goes to column count + t; columns past count + emitted are scratch: the next round (or
    # nothing) overwrites them. A select, pointwise for Inductor: a scatter ran as ATen's kernel
    # after a copy of out (a profile of a plain step).
    col = torch.arange(state.out.shape[1], device=y.device) - state.count[:, None]  # [B, L]
    out = torch.where((col >= 0) & (col <= K), y.gather(1, col.clamp(0, K)), state.out)
    count = state.count + emitting.sum(1)
    done = state.done | (count >= state.limit) | (is_eos & emitting).any(1)

    active = ~state.done
    accepted = (a[:, None] > t[:K]) & active[:, None]  # [B, K] draft i+1 accepted
    stats = state.stats + torch.cat([active.sum()[None], accepted.sum(0)])
    pos = torch.where(active, state.pos + a + 1, state.pos)  # y_a, at n+a+1, is the new x_n
    last = torch.where(active, y.gather(1, a[:, None])[:, 0], state.last)
    # State(...) spelled out: torch 2.11's Dynamo rebuilds NamedTuple._replace as an empty tuple.
    state = State(last=last, pos=pos, out=out, count=count, limit=state.limit, eos=state.eos, done=done,
                  stats=stats, processing=processing)
    return state, done.all()  # all done: what the host reads each round


def first_true(mask: Tensor) -> Tensor:
    """[B, N] bool -> [B] the index of each row's first True, N where there is none.

    One reduction, no scan: argmax returns the first maximum, and a True column appended to every
    row gives rows without a True the answer N.
    """
    return torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1).int().argmax(1)


def decode_round(steps: Steps, state: State, carry: Carry,
                 params: Params | None) -> tuple[State, Carry, Tensor]:
    """One round: draft -> verify -> accept -> catch-up. -> (state, carry, all done)."""
    pos = state.pos
    # Plain decoding verifies no drafts: an empty [B, 0] block.
    d, q = steps.draft(*carry[:2], pos, carry.h, params) if steps.draft is not None else (pos[:, None][:, :0], None)
    y, a, hidden = steps.verify(state, d, q, params)
    state, finished = steps.accept(state, y, a)
    if steps.catch_up is not None:
        carry = Carry(*steps.catch_up(y, pos, hidden, a, params))
    return state, carry, finished


def decode_round_in_place(steps: Steps, state: State, carry: Carry, params: Params | None) -> Tensor:
    """`decode_round` writing the next state and carry over these ones -> all done. The loop's
    fused round: its state and carry stay in the same buffers from round to round (`round_buffers.InPlaceRound`),
    so a CUDA graph's replay neither copies them in nor has its outputs cloned."""
    new_state, new_carry, finished = decode_round(steps, state, carry, params)
    for old, new in zip(pytree.tree_leaves((state, carry)), pytree.tree_leaves((new_state, new_carry))):
        if new is not old:  # the limits and EOS ids never change; plain decoding carries nothing
            old.copy_(new)
    return finished


def prefill_step(target: Target, hidden_kind: str | None, catch_up: Callable[..., Carry] | None, tokens: Tensor,
                 lengths: Tensor, params: Params | None, processing: Processing | None) -> tuple[Tensor, Carry]:
    """Right-padded prompts tokens [B, P+1] (column P is room for x_n) of lengths [B] through the
    target, then the drafter's half of the prefill, `catch_up` (the round shape's; None: plain
    decoding) -> (x_n [B], the first token of each request, at position n = length; the carry of
    the first round).

    Traceable with P symbolic: `Decoder` compiles it once for every prompt length. Only row
    length - 1 of the target's logits is read, and only the drafter's live rows: the graph
    specpass's live-row pass rewrites (the lm_heads then run on one row per request).
    """
    B, P = tokens.shape[0], tokens.shape[1] - 1
    positions = torch.arange(P + 1, device=tokens.device).expand(B, -1)  # [B, P+1]
    if hidden_kind is None:
        logits, hidden = target(tokens[:, :P], positions[:, :P]), None
    else:
        logits, hidden = target.forward_with_hidden(tokens[:, :P], positions[:, :P], hidden_kind)
    last = logits[torch.arange(B, device=tokens.device), lengths - 1]  # [B, V]
    if processing is not None:  # the first token: none emitted before it, its prefix the prompt
        none = torch.zeros(B, 1, dtype=torch.long, device=tokens.device)
        last = processed(processing, last[:, None], none[:, 0], none, none, none[..., None].bool())[:, 0]
    if params is None:
        first = last.argmax(-1)
    else:
        first = draw(last, params, key(params.seed, lengths, TARGET), floor_of(last, params))
    if catch_up is None:
        return first, Carry(None, None, None)
    tokens = tokens.scatter(1, lengths[:, None], first[:, None])
    # A drafter that reads target states starts at position 1: row t pairs the token at t+1
    # with the target's state at t. A standalone one reads the prompt from position 0.
    o = 0 if hidden_kind is None else 1
    return first, catch_up(tokens[:, o:], positions[:, o:], hidden, lengths - o, lengths, params)

"""The chain round: K-1 draft steps, verify, accept, then the drafter's catch-up on the verified
rows, whose live row drafts the next round's d_1. Any `ChainDrafter` (EAGLE-3, NextN/MTP, a standalone
draft) gets this shape.

    draft     d_2..d_K: K-1 draft steps at positions n+1..n+K-1                        [B, K]
    catch-up  the drafter on y_0..y_K at positions n+1..n+K+1 (with the target's hidden
              states at n..n+K), live row a -> d_1 of the next round
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from specpass.loop import steps
from specpass.loop.protocols import ChainDrafter, Target
from specpass.loop.steps import Carry, Proposal, Steps, is_int
from specpass.sampling import Params


def draft(drafter: ChainDrafter, k: int, sampled: bool, d1: Tensor, q1: Proposal | None, pos: Tensor, h: Tensor,
          params: Params | None) -> tuple[Tensor, Proposal | None]:
    """d_1 [B] (and its proposal), n [B], the catch-up's hidden [B, Hd] -> d_1..d_K [B, K] (target
    ids) and their proposals [B, K, Vd], [B, K]: K-1 draft steps."""
    drafts, proposals = [d1], [q1]
    for i in range(1, k):
        logits, h = drafter.draft_step(drafts[-1], pos + i, h)  # d_i at position n+i -> d_{i+1}
        d, q = steps.propose(drafter, sampled, logits, params, pos + i + 1)
        drafts.append(d)
        proposals.append(q)
    if q1 is None:
        return torch.stack(drafts, 1), None
    return torch.stack(drafts, 1), Proposal(*(torch.stack(parts, 1) for parts in zip(*proposals)))


def catch_up_round(drafter: ChainDrafter, sampled: bool, y: Tensor, pos: Tensor, hidden: Tensor | None, a: Tensor,
                   params: Params | None) -> tuple[Tensor, Proposal | None, Tensor]:
    """The drafter on y_0..y_K at positions n+1..n+K+1, live row a -> (next d_1 [B], its proposal,
    hidden [B, Hd]).

    All K+1 rows write their K/V; only row a is sampled: the graph specpass's live-row pass rewrites.
    """
    positions = pos[:, None] + 1 + torch.arange(y.shape[1], device=y.device)  # [B, K+1]
    logits, h = drafter.catch_up(y, positions, hidden, a)
    d1, q1 = steps.propose(drafter, sampled, logits, params, pos + a + 2)  # the next round's d_1 is at n+a+2
    return d1, q1, h


def catch_up_prompt(drafter: ChainDrafter, sampled: bool, tokens: Tensor, positions: Tensor, hidden: Tensor | None,
                    live: Tensor, n: Tensor, params: Params | None) -> Carry:
    """The prefill's drafter half: the prompt and x_n (tokens, positions [B, T]), live row [B] at x_n,
    at position n [B] -> the first round's carry (d_1 at n+1, its proposal, hidden)."""
    logits, h = drafter.catch_up(tokens, positions, hidden, live)
    return Carry(*steps.propose(drafter, sampled, logits, params, n + 1), h)


class ChainRound:
    """The `RoundShape` of a `ChainDrafter`: K-1 draft steps and a catch-up per round."""

    drafter_protocol = ChainDrafter
    prefill_reads_k = False  # the prefill's catch-up drafts d_1 only: every K shares one compiled prefill

    def cache_slots(self, prompt_len: int, max_new_tokens: int, k: int) -> int:
        """A finished request runs on frozen at a position up to prompt + budget + K - 1 (the host
        reads `done` rounds late; other requests go on), and a round writes past it: verify K+1
        slots, the catch-up and draft steps up to K+1."""
        return prompt_len + max_new_tokens + 2 * k + 1

    def takes(self, k: object) -> bool:
        return is_int(k) and k >= 1

    def bind(self, target: Target, drafter: ChainDrafter, k: int, sampled: bool, slots: int) -> Steps:
        return Steps(draft=functools.partial(draft, drafter, k, sampled),
                     verify=functools.partial(steps.verify, target, drafter.hidden_kind, drafter),
                     accept=steps.accept,
                     catch_up=functools.partial(catch_up_round, drafter, sampled))

    def prefill_catch_up(self, drafter: ChainDrafter, k: int, sampled: bool) -> Callable[..., Carry]:
        return functools.partial(catch_up_prompt, drafter, sampled)


CHAIN = ChainRound()

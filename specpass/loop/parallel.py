"""The parallel round: verify, accept, then one draft forward over the verified rows and K-1 mask
slots of the drafter's own, which makes the next round's d_1..d_K at once. A `ParallelDrafter`
(P-EAGLE, PARD) gets this shape: it has no draft steps (its draft step is `steps.carried`).

    catch-up  the drafter on y_0..y_K at positions n+1..n+K+1, live row a, then K-1 mask
              slots -> d_1..d_K of the next round                                      [B, K]
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from specpass.loop import steps
from specpass.loop.protocols import ParallelDrafter, Target
from specpass.loop.steps import Carry, Proposal, Steps, is_int
from specpass.sampling import Params


def propose_rows(drafter: ParallelDrafter, sampled: bool, logits: Tensor, params: Params | None,
                 pos: Tensor) -> tuple[Tensor, Proposal | None]:
    """`steps.propose` on K drafts per request: logits [B, K, Vd] at positions pos [B, K] -> (target
    ids [B, K], proposals [B, K, Vd], [B, K] or None). Each draft is drawn from its own distribution."""
    B, K = pos.shape
    rows = None if params is None else Params(*(None if t is None else t.repeat_interleave(K) for t in params))
    ids, q = steps.propose(drafter, sampled, logits.flatten(0, 1), rows, pos.flatten())
    return ids.view(B, K), None if q is None else Proposal(q.probs.view(B, K, -1), q.at.view(B, K))


def draft_forward(drafter: ParallelDrafter, k: int, sampled: bool, tokens: Tensor, positions: Tensor,
                  hidden: Tensor | None, live: Tensor, params: Params | None) -> tuple[Tensor, Proposal | None]:
    """One draft forward on [B, T] rows, live row live [B] -> d_1..d_K [B, K] and their proposals."""
    logits = drafter.draft_parallel(tokens, positions, hidden, live, k)  # [B, K, Vd]
    at = positions.gather(1, live[:, None]) + 1 + torch.arange(k, device=live.device)  # [B, K] the drafts' positions
    return propose_rows(drafter, sampled, logits, params, at)


def catch_up_round(drafter: ParallelDrafter, k: int, sampled: bool, y: Tensor, pos: Tensor,
                   hidden: Tensor | None, a: Tensor, params: Params | None) -> tuple[Tensor, Proposal | None, None]:
    """The round's one draft forward: y_0..y_K at positions n+1..n+K+1 with live row a, then K-1
    mask slots -> (the next d_1..d_K [B, K], proposals, None)."""
    positions = pos[:, None] + 1 + torch.arange(y.shape[1], device=y.device)  # [B, K+1]
    return *draft_forward(drafter, k, sampled, y, positions, hidden, a, params), None


def catch_up_prompt(drafter: ParallelDrafter, k: int, sampled: bool, tokens: Tensor, positions: Tensor,
                    hidden: Tensor | None, live: Tensor, n: Tensor, params: Params | None) -> Carry:
    """The prefill's drafter half: one draft forward on the prompt and x_n, live row [B] at x_n
    -> the first round's carry (d_1..d_K [B, K], their proposals, None)."""
    return Carry(*draft_forward(drafter, k, sampled, tokens, positions, hidden, live, params), None)


class ParallelRound:
    """The `RoundShape` of a `ParallelDrafter`: verify, accept and one draft forward per round."""

    drafter_protocol = ParallelDrafter
    prefill_reads_k = True  # the prefill's draft forward makes K drafts: one compiled prefill per K

    def cache_slots(self, prompt_len: int, max_new_tokens: int, k: int) -> int:
        """A finished request runs on frozen at a position up to prompt + budget + K - 1 (the host
        reads `done` rounds late; other requests go on), and a round writes past it: verify K+1
        slots, the draft forward 2K (K+1 catch-up rows, K-1 mask slots)."""
        return prompt_len + max_new_tokens + 3 * k

    def takes(self, k: object) -> bool:
        return is_int(k) and k >= 1

    def bind(self, target: Target, drafter: ParallelDrafter, k: int, sampled: bool, slots: int) -> Steps:
        return Steps(draft=steps.carried,
                     verify=functools.partial(steps.verify, target, drafter.hidden_kind, drafter),
                     accept=steps.accept,
                     catch_up=functools.partial(catch_up_round, drafter, k, sampled))

    def prefill_catch_up(self, drafter: ParallelDrafter, k: int, sampled: bool) -> Callable[..., Carry]:
        return functools.partial(catch_up_prompt, drafter, k, sampled)


PARALLEL = ParallelRound()

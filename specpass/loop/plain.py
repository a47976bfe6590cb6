"""Plain decoding: the target's own decoding with the same code (K = 0: the verify of an empty
draft block is one decode step), with no drafter or with one switched off (K 0, chosen under load).
The tokens/s baseline and the lossless reference."""

from __future__ import annotations

import functools

from specpass.loop import steps
from specpass.loop.protocols import Target
from specpass.loop.steps import Steps


class PlainRound:
    """The `RoundShape` of no drafter: verify and accept, nothing drafted or carried."""

    drafter_protocol = None
    prefill_reads_k = False

    def cache_slots(self, prompt_len: int, max_new_tokens: int, k: int) -> int:
        """The chain's count at K = 0: a step verifies one token and drafts none."""
        return prompt_len + max_new_tokens + 1

    def takes(self, k: object) -> bool:
        return k == 0

    def bind(self, target: Target, drafter: None, k: int, sampled: bool, slots: int) -> Steps:
        return Steps(draft=None, verify=functools.partial(steps.verify, target, None, None), accept=steps.accept,
                     catch_up=None)

    def prefill_catch_up(self, drafter: None, k: int, sampled: bool) -> None:
        return None


PLAIN = PlainRound()

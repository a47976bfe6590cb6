"""Round shapes: how a round is made of the shared steps (steps.py) for one kind of drafter, and
which one a drafter gets. One module per shape, each exposing one `RoundShape` object:

    plain.py     PLAIN     no drafter: the target's own decoding
    chain.py     CHAIN     a `Drafter`: K-1 draft steps, then a catch-up
    parallel.py  PARALLEL  a `ParallelDrafter`: one draft forward makes the next round's K drafts

A new shape (a tree round) is a module with its object and its drafter Protocol, listed in SHAPES.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from specpass.loop.chain import CHAIN
from specpass.loop.parallel import PARALLEL
from specpass.loop.plain import PLAIN
from specpass.loop.protocols import Drafter, Target, missing, require
from specpass.loop.steps import Carry, Steps


class RoundShape(Protocol):
    """A round's shape: what `Decoder` asks of it, once per K."""

    drafter_protocol: type | None  # the Protocol a drafter satisfies to get this shape; None: no drafter
    prefill_reads_k: bool  # False: every K shares one compiled prefill

    def cache_slots(self, prompt_len: int, max_new_tokens: int, k: int) -> int:
        """The cache slots (`Decoder`'s max_len) a request needs at K, counting what a round writes
        past the position a finished request stays at."""

    def bind(self, target: Target, drafter: Any, k: int, sampled: bool) -> Steps:
        """The round's steps (draft, verify, accept, catch_up) with the models and K bound; sampled:
        drafts are drawn from the drafter's distribution when a request samples (else its arg-max)."""

    def prefill_catch_up(self, drafter: Any, k: int, sampled: bool) -> Callable[..., Carry] | None:
        """The drafter's half of the prefill, bound: (tokens, positions [B, T], hidden [B, T, Hh] or
        None, live [B] the row of x_n, n [B] its position, params) -> the first round's carry.
        None: no drafter."""


SHAPES: tuple[RoundShape, ...] = (PARALLEL, CHAIN)  # the drafter shapes, the narrowest Protocol first, Drafter last


def round_shape(drafter: Any) -> RoundShape:
    """The shape of the rounds `drafter` drafts for, from the Protocol it satisfies (None: plain
    decoding). Anything else is refused, with the members of `Drafter` it lacks."""
    if drafter is None:
        return PLAIN
    require(drafter, "drafter", Drafter)  # every drafter shape's Protocol extends Drafter
    return next(shape for shape in SHAPES if not missing(drafter, shape.drafter_protocol))


def cache_slots(prompt_len: int, max_new_tokens: int, k: int) -> int:
    """The cache slots (`Decoder`'s max_len) a request needs at K whatever its drafter: the most
    any round shape needs (`round_shape(drafter).cache_slots` for one drafter's)."""
    return max(shape.cache_slots(prompt_len, max_new_tokens, k) for shape in (PLAIN, *SHAPES))

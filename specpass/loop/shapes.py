"""Round shapes: how a round is made of the shared steps (steps.py) for one kind of drafter, and
which one a drafter gets. One module per shape, each exposing one `RoundShape` object:

    plain.py     PLAIN     K 0 (or no drafter): the target's own decoding
    chain.py     CHAIN     K >= 1, a `ChainDrafter`: K-1 draft steps, then a catch-up
    parallel.py  PARALLEL  K >= 1, a `ParallelDrafter`: one draft forward makes the next round's K drafts
                           (P-EAGLE's mask slots, DFlash's block)
    tree.py      TREE      a `TreeShape`, a `TreeDrafter` (and a `TreeTarget`): a drafted tree verified whole

A shape is chosen by the K it `takes` and the drafter Protocol it needs, so one drafter may run
several (`Decoder.use_k` switches). A new shape is a module with its object, listed in SHAPES.

`round_spec(drafter, k)` checks K once and returns a `RoundSpec`: the shape with K bound, what
every later step (the cache's length, the prompts' check, binding the steps) asks instead of K.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from specpass.loop.chain import CHAIN
from specpass.loop.parallel import PARALLEL
from specpass.loop.plain import PLAIN
from specpass.loop.protocols import Drafter, Target, missing, require
from specpass.loop.steps import Carry, Steps, is_int
from specpass.loop.tree import TREE, TreeShape


class RoundShape(Protocol):
    """A round's shape: what `Decoder` asks of it, once per K."""

    drafter_protocol: type | None  # the Protocol a drafter satisfies to get this shape; None: no drafter
    prefill_reads_k: bool  # False: every K shares one compiled prefill

    def takes(self, k: object) -> bool:
        """Whether this shape runs at `k` (an int K, a `TreeShape`)."""

    def cache_slots(self, prompt_len: int, max_new_tokens: int, k: int) -> int:
        """The cache slots (`Decoder`'s max_len) a request needs at K, counting what a round writes
        past the position a finished request stays at."""

    def bind(self, target: Target, drafter: Any, k: int, sampled: bool, slots: int) -> Steps:
        """The round's steps (draft, verify, accept, catch_up) with the models, K and the caches'
        slots bound; sampled: drafts are drawn from the drafter's distribution when a request
        samples (else its arg-max)."""

    def prefill_catch_up(self, drafter: Any, k: int, sampled: bool) -> Callable[..., Carry] | None:
        """The drafter's half of the prefill, bound: (tokens, positions [B, T], hidden [B, T, Hh] or
        None, live [B] the row of x_n, n [B] its position, params) -> the first round's carry.
        None: no drafter."""


SHAPES: tuple[RoundShape, ...] = (TREE, PARALLEL, CHAIN)  # the drafter shapes, the narrowest Protocol first


def round_shape(drafter: Any, k: object = 1) -> RoundShape:
    """The shape of the rounds `drafter` drafts at `k`: PLAIN at K 0 or without a drafter, TREE at a
    `TreeShape`, else the narrowest Protocol the drafter satisfies. A drafter that lacks members of
    `Drafter`, of `TreeDrafter` at a TreeShape, or of every shape's at an int K is refused, naming them."""
    if drafter is None or PLAIN.takes(k):
        return PLAIN
    require(drafter, "drafter", Drafter)  # every drafter shape's Protocol extends Drafter
    if TREE.takes(k):
        require(drafter, "drafter of tree rounds", TREE.drafter_protocol)
    shape = next((s for s in SHAPES if s.takes(k) and not missing(drafter, s.drafter_protocol)), None)
    if shape is None:
        lacks = {s.drafter_protocol.__name__: missing(drafter, s.drafter_protocol) for s in SHAPES if s.takes(k)}
        raise TypeError(f"the drafter ({type(drafter).__name__}) drafts in no round shape: it lacks "
                        + " or ".join(f"{names} (specpass.{name})" for name, names in lacks.items()))
    return shape


@dataclasses.dataclass(frozen=True)
class RoundSpec:
    """A drafter's rounds at one K (or tree shape): their shape, with K bound (`round_spec`)."""

    shape: RoundShape
    k: int | TreeShape

    @property
    def prefill_reads_k(self) -> bool:
        return self.shape.prefill_reads_k

    def cache_slots(self, prompt_len: int, max_new_tokens: int) -> int:
        return self.shape.cache_slots(prompt_len, max_new_tokens, self.k)

    def bind(self, target: Target, drafter: Any, sampled: bool, slots: int) -> Steps:
        return self.shape.bind(target, drafter, self.k, sampled, slots)

    def prefill_catch_up(self, drafter: Any, sampled: bool) -> Callable[..., Carry] | None:
        return self.shape.prefill_catch_up(drafter, self.k, sampled)


def round_spec(drafter: Any, k: Any, name: str = "k") -> RoundSpec:
    """The one check of K (named `name` where the caller took it: specpass.generate's
    num_assistant_tokens), whatever the entry point -> the drafter's rounds at K."""
    if drafter is None and k != 0:
        raise ValueError(f"plain decoding (drafter=None) drafts nothing: K is 0, got {k!r}")
    if drafter is not None and not (is_int(k) and k >= 0 or isinstance(k, TreeShape)):
        hint = f": pass specpass.TreeShape{tuple(k)}" if isinstance(k, (tuple, list)) and len(k) == 3 else ""
        raise ValueError(f"{name} must be an int >= 0 (draft tokens per round; 0: the drafter off, plain decoding) "
                         f"or a specpass.TreeShape(topk, steps, tokens) (tree rounds), got {k!r}{hint}")
    return RoundSpec(round_shape(drafter, k), k)


def cache_slots(prompt_len: int, max_new_tokens: int, k: int | TreeShape) -> int:
    """The cache slots (`Decoder`'s max_len) a request needs at K (or a `TreeShape`) whatever its
    drafter: the most any round shape running at it needs, `aligned`."""
    return aligned(max(shape.cache_slots(prompt_len, max_new_tokens, k)
                       for shape in (PLAIN, *SHAPES) if shape.takes(k) or shape is PLAIN))


def aligned(slots: int) -> int:
    """Slots rounded up to a multiple of 16: every row of a [.., S] bool mask then starts 16-byte
    aligned, which the split-KV kernel needs to read it in vectors (kernels/triton_attention.py)."""
    return -(-slots // 16) * 16

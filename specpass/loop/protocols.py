"""What the loop asks of its models: `Target`; `Drafter`, what every drafter has, and what each round
shape adds to it: `ChainDrafter`, `ParallelDrafter`, and for tree rounds `TreeTarget`, `TreeDrafter`.

specpass does not import the model zoo: a target and a drafter are anything with these members
(the zoo's adapters are in models/drafters.py, transformers' in specpass/hf/adapters.py). The
Protocols are runtime-checkable (`isinstance`); which one a drafter satisfies (has every member of,
`missing`) decides its round shape, once (`specpass.loop.shapes.round_shape`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class Target(Protocol):
    """The verified model: a module with static KV caches addressed by per-request position."""

    def parameters(self) -> Any: ...

    def setup_caches(self, max_batch: int, max_len: int) -> None: ...

    def __call__(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """tokens, positions [B, T] -> logits [B, T, V]."""

    def forward_with_hidden(self, tokens: Tensor, positions: Tensor, kind: str) -> tuple[Tensor, Tensor]:
        """-> (logits [B, T, V], the hidden states a drafter reads, [B, T, Hh]) for `Drafter.hidden_kind`
        ("eagle3", "layers:i,j,..": `hidden_indices`; a target may know others, e.g. the zoo's "last").
        Needed only when the drafter reads them (its hidden_kind is not None)."""


@runtime_checkable
class Drafter(Protocol):
    """A draft model, whatever its round shape. Row t of a catch-up holds the token at position p+t
    and, when the drafter reads the target's states (`hidden_kind` is not None), the target's hidden
    state at p+t-1."""

    hidden_kind: str | None  # the `kind` passed to Target.forward_with_hidden; None: no hidden

    def setup_caches(self, max_batch: int, max_len: int) -> None: ...

    def catch_up(self, tokens: Tensor, positions: Tensor, hidden: Tensor | None,
                 live: Tensor) -> tuple[Tensor, Tensor]:
        """[B, T] tokens and positions, [B, T, Hh] hidden, [B] live row -> (logits [B, Vd], hidden [B, Hd])
        of row live[b]; every row's K/V is written."""

    def to_target(self, ids: Tensor) -> Tensor:
        """Draft-vocabulary ids -> target ids (identity when the vocabularies are the same)."""

    # Optional: `get_input_embeddings() -> nn.Embedding`, the embedding the drafter reads target ids
    # with; `Decoder` then checks up front that it takes every id of the target's vocabulary.


@runtime_checkable
class ChainDrafter(Drafter, Protocol):
    """A drafter that drafts one token a step (EAGLE-3, NextN/MTP, a standalone draft): its round is
    K-1 draft steps and a catch-up (specpass/loop/chain.py)."""

    def draft_step(self, tokens: Tensor, positions: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """[B] token, [B] position, [B, Hd] the previous step's hidden -> (logits [B, Vd], hidden [B, Hd])."""


@runtime_checkable
class ParallelDrafter(Drafter, Protocol):
    """A drafter that makes all K drafts in one forward (P-EAGLE, PARD, DFlash's block): its round is
    verify + one draft forward, no draft steps (specpass/loop/parallel.py)."""

    def draft_parallel(self, tokens: Tensor, positions: Tensor, hidden: Tensor | None, live: Tensor,
                       k: int) -> Tensor:
        """[B, T] tokens and contiguous positions, [B, T, Hh] hidden, [B] live row -> logits [B, k, Vd]:
        row j predicts the token at positions[b, live[b]] + 1 + j. Rows after live[b] are the
        drafter's own (mask slots, padding); every row's K/V is written."""

    # Optional: `drafts_nest: bool` (default True), False when a draft depends on the later ones (DFlash's
    # block attends both ways): then no run at one K gives another K's acceptance (`Decoder.tune_k`).


@runtime_checkable
class TreeTarget(Target, Protocol):
    """A target that verifies a draft tree: rows written to cache slots apart from their RoPE
    positions (siblings share a position), under the loop's own mask, and cache slots copied (the
    accepted path moved to the positions later rounds read)."""

    def forward_tree(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor,
                     kind: str | None) -> tuple[Tensor, Tensor | None]:
        """tokens, positions (RoPE), slots (where each row's K/V is written) [B, T], mask [B, 1, T, S]
        bool (row t sees slot s) -> (logits [B, T, V], the hidden states of `kind` [B, T, Hh] or None)."""

    def copy_slots(self, src: Tensor, dst: Tensor) -> None:
        """Every cache: slot dst[b, t] takes what slot src[b, t] holds ([B, T]; all read before any write)."""


@runtime_checkable
class TreeDrafter(Drafter, Protocol):
    """A drafter that drafts a tree: its step runs on any rows, each at its own slot, under the
    loop's mask (specpass/loop/tree.py)."""

    def draft_tree_step(self, tokens: Tensor, positions: Tensor, slots: Tensor, hidden: Tensor,
                        mask: Tensor) -> tuple[Tensor, Tensor]:
        """tokens, positions, slots [B, T] (positions and slots as the loop numbers them: a token's
        position), hidden [B, T, Hd] (each row's parent's hidden output), mask [B, 1, T, S] over the
        slots so numbered -> (logits [B, T, Vd], hidden [B, T, Hd])."""


def hidden_indices(kind: str, layers: int) -> tuple[int, ...]:
    """Which hidden states a drafter's `hidden_kind` reads, for a target of L layers, as indices into
    transformers' `hidden_states` (L + 1: the embeddings, then each layer's output, the last after
    the final norm), which every target's `forward_with_hidden` follows:
    "eagle3": (2, L//2, L-3), as EAGLE-3 reads them; "layers:i,j,..": the outputs of decoder layers
    i, j, .. (0-based), hidden_states[i + 1], as DFlash's target_layer_ids name them."""
    if kind == "eagle3":
        if layers < 3:
            raise ValueError(f"EAGLE-3 reads layers 2, L//2 and L-3: the target needs 3 layers or more, not {layers}")
        return 2, layers // 2, layers - 3
    name, _, listed = kind.partition(":")
    ids = [int(i) for i in listed.split(",") if i.strip().lstrip("-").isdigit()] if name == "layers" else []
    if not ids or len(ids) != len(listed.split(",")):
        raise ValueError(f"the target gives the hidden states of kind 'eagle3' or 'layers:i,j,..' (decoder layers' "
                         f"outputs), not {kind!r}; a transformers target does not report 'last' (NextN/MTP's state "
                         "before the final norm): use an EAGLE-3 or DFlash head, or a standalone draft")
    outside = [i for i in ids if not 0 <= i < layers]
    if outside:
        raise ValueError(f"the drafter reads the outputs of layers {outside}, but the target has {layers} layers "
                         f"(0..{layers - 1}): use a drafter made for this target")
    return tuple(i + 1 for i in ids)


@functools.cache
def members(protocol: type) -> tuple[str, ...]:
    """The names a Protocol asks for, in the order written, its bases' first: annotated attributes,
    then methods."""
    found: list[str] = []
    for cls in reversed(protocol.__mro__):
        if Protocol not in cls.__bases__:  # object, Protocol, Generic: not a protocol written here
            continue
        methods = [name for name, value in vars(cls).items()
                   if callable(value) and (not name.startswith("_") or name == "__call__")]
        found += [name for name in [*inspect.get_annotations(cls), *methods] if name not in found]
    return tuple(found)


def missing(model: Any, protocol: type, optional: tuple[str, ...] = ()) -> list[str]:
    """The members of `protocol` that `model` lacks, but `optional`."""
    return [name for name in members(protocol) if name not in optional and not hasattr(model, name)]


def require(model: Any, role: str, protocol: type, optional: tuple[str, ...] = ()) -> None:
    """Refuse a model that lacks members of `protocol` (but `optional`), naming them."""
    lacks = missing(model, protocol, optional)
    if lacks:
        raise TypeError(f"the {role} ({type(model).__name__}) lacks {lacks}: a {role} needs the members of "
                        f"specpass.{protocol.__name__}")

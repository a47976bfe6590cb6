"""A draft model (drafters/base.py's `Draft`) behind the loop's `Drafter` protocol.

    drafter = adapt(head)                            # an EAGLE-3 or P-EAGLE head
    drafter = DraftAdapter(model, hidden_kind)       # any Draft: "eagle3", "last" (NextN) or None

The loop asks a drafter for three facts besides its steps: which target hidden states its
catch-up reads (`hidden_kind`, the kind `Target.forward_with_hidden` takes), how its ids map to
the target's (`to_target`), and which embedding reads the target's ids (`get_input_embeddings`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from specpass.drafters.base import Draft
from specpass.drafters.eagle3 import Eagle3Head
from specpass.drafters.peagle import ParallelEagle3Head


class DraftAdapter(nn.Module):
    """A draft model as a `Drafter`.

    A draft that reads the target's states (EAGLE-3, NextN) pairs the token at position p with
    the target's hidden state at p-1; its K/V goes to slot p-1, as SGLang lays out the draft cache
    (slot s holds token s+1 and target state s). Addressed by the token's position instead, slot 0
    would never be written, yet every row would attend to it. RoPE sees only differences of
    positions, so the shift changes nothing else.
    """

    def __init__(self, model: Draft, hidden_kind: str | None):
        super().__init__()
        self.model = model
        self.hidden_kind = hidden_kind
        self.shift = 0 if hidden_kind is None else 1

    def setup_caches(self, max_batch: int, max_len: int) -> None:
        self.model.setup_caches(max_batch, max_len)

    def catch_up(self, tokens, positions, hidden, live):
        return self.model.catch_up(tokens, positions - self.shift, hidden, live)

    def draft_step(self, tokens, positions, hidden):
        return self.model.draft_step(tokens, positions - self.shift, hidden)

    def draft_tree_step(self, tokens, positions, slots, hidden, mask):
        """`specpass.TreeDrafter`'s step: slots and the mask's columns shift as positions do (slot
        s holds position s + shift; no row sees a column past the cache)."""
        if self.shift:
            mask = torch.nn.functional.pad(mask[..., self.shift:], (0, self.shift))
        return self.model.forward_rows(tokens, positions - self.shift, hidden, slots - self.shift, mask)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.to_target(ids)

    def get_input_embeddings(self) -> nn.Embedding:
        """What the loop checks against the target's vocabulary (the drafter reads every target id)."""
        return self.model.get_input_embeddings()


class ParallelDraftAdapter(DraftAdapter):
    """A parallel-drafting head as a `ParallelDrafter`: K drafts per forward."""

    def draft_parallel(self, tokens, positions, hidden, live, k):
        return self.model.draft_parallel(tokens, positions - self.shift, hidden, live, k)


def adapt(head: Eagle3Head) -> DraftAdapter:
    """An EAGLE-3 head's adapter (P-EAGLE's drafts in parallel); both read the "eagle3" states."""
    if not isinstance(head, Eagle3Head):
        raise TypeError(f"adapt takes an EAGLE-3 head (specpass.drafters.Eagle3Head), got {type(head).__name__}; "
                        "wrap another draft model as DraftAdapter(model, hidden_kind)")
    cls = ParallelDraftAdapter if isinstance(head, ParallelEagle3Head) else DraftAdapter
    return cls(head, "eagle3")

"""Zoo drafts behind `specpass.Drafter`, and loading a target + draft pair from folders.

    drafter = ZooDrafter(zoo.build("tiny-llama-eagle3"))        # EAGLE-3, NextN or a standalone Llama
    target, drafter = load_pair(target_dir, "eagle", eagle_dir)  # checked against each other
    drafter = adapt(zoo.build("tiny-llama-peagle3"))             # a parallel head: ParallelZooDrafter
    other = load_drafter(target, "draft", draft_dir)             # another draft for the same target

`Llama` is already a `specpass.Target` (`__call__`, `forward_with_hidden`,
`setup_caches`); the drafts need only three facts the loop asks for: which target hidden states
their catch-up reads (`hidden_kind`), how their ids map to the target's (`to_target`), and where
their K/V goes.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from models.checkpoint import CheckpointError, load, read_config
from models.eagle3 import Eagle3Config, Eagle3Head
from models.llama import Llama, LlamaConfig
from models.nextn import NextN, NextNConfig
from models.peagle import ParallelEagle3Head

HIDDEN_KIND = {Eagle3Head: "eagle3", ParallelEagle3Head: "eagle3", NextN: "last", Llama: None}
KINDS = {"eagle": Eagle3Head, "parallel": ParallelEagle3Head, "nextn": NextN,
         "draft": Llama}  # the example's --eagle/--parallel/--nextn/--draft


class ZooDrafter(nn.Module):
    """A zoo draft model as a `Drafter`.

    EAGLE-3 and NextN pair the token at position p with the target's hidden state at p-1; their
    K/V goes to slot p-1, as SGLang lays out the draft cache (slot s holds token s+1 and target
    state s). Addressed by the token's position instead, slot 0 would never be written, yet every
    row would attend to it. RoPE sees only differences of positions, so the shift changes nothing else.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        if type(model) not in HIDDEN_KIND:
            known = [c.__name__ for c in HIDDEN_KIND]
            raise TypeError(f"no drafter adapter for {type(model).__name__}; known: {known}")
        self.model = model
        self.hidden_kind = HIDDEN_KIND[type(model)]
        self.shift = 0 if self.hidden_kind is None else 1

    def setup_caches(self, max_batch: int, max_len: int) -> None:
        self.model.setup_caches(max_batch, max_len)

    def catch_up(self, tokens, positions, hidden, live):
        return self.model.catch_up(tokens, positions - self.shift, hidden, live)

    def draft_step(self, tokens, positions, hidden):
        return self.model.draft_step(tokens, positions - self.shift, hidden)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.to_target(ids) if isinstance(self.model, Eagle3Head) else ids

    def get_input_embeddings(self) -> nn.Embedding:
        """What the loop checks against the target's vocabulary (the drafter reads every target id)."""
        return self.model.model.embed_tokens if isinstance(self.model, Llama) else self.model.embed_tokens


class ParallelZooDrafter(ZooDrafter):
    """A parallel-drafting head as a `specpass.ParallelDrafter`: K drafts per forward."""

    def draft_parallel(self, tokens, positions, hidden, live, k):
        return self.model.draft_parallel(tokens, positions - self.shift, hidden, live, k)


def adapt(model: nn.Module) -> ZooDrafter:
    """The adapter a zoo draft model needs."""
    return ParallelZooDrafter(model) if isinstance(model, ParallelEagle3Head) else ZooDrafter(model)


def check_pair(target: LlamaConfig, draft: Eagle3Config | NextNConfig | LlamaConfig) -> None:
    """Raise CheckpointError when a draft cannot run against this target (vocabulary, hidden sizes)."""
    name = type(draft).__name__.removesuffix("Config")
    problems = []
    if draft.vocab_size != target.vocab_size:
        problems.append(f"vocabulary: the target has {target.vocab_size} tokens, the {name} draft {draft.vocab_size}")
    if isinstance(draft, Eagle3Config) and draft.target_hidden_size != target.hidden_size:
        problems.append(f"EAGLE-3 target_hidden_size {draft.target_hidden_size} != the target's hidden_size "
                        f"{target.hidden_size}")
    if isinstance(draft, Eagle3Config) and draft.hidden_size != target.hidden_size:
        problems.append(f"EAGLE-3 hidden_size {draft.hidden_size} != the target's hidden_size {target.hidden_size} "
                        "(the head uses the target's embedding)")
    if isinstance(draft, NextNConfig) and draft.hidden_size != target.hidden_size:
        problems.append(f"NextN hidden_size {draft.hidden_size} != the target's hidden_size {target.hidden_size} "
                        "(it reads the target's last hidden state)")
    if problems:
        raise CheckpointError("the draft does not fit the target:\n  " + "\n  ".join(problems))


def load_pair(target_dir: str | Path, kind: str, draft_dir: str | Path, device=None,
              dtype: torch.dtype | None = None) -> tuple[Llama, ZooDrafter]:
    """Load a Llama target and a draft of `kind` ("eagle", "nextn" or "draft"), checked against each
    other from their config.json files before any weight is read."""
    target_config, _ = read_config(Llama, target_dir)
    check_pair(target_config, read_config(KINDS[kind], draft_dir)[0])
    target = load(Llama, target_dir, device=device, dtype=dtype)
    return target, load_drafter(target, kind, draft_dir, device=device, dtype=dtype)


def load_drafter(target: Llama, kind: str, draft_dir: str | Path, device=None,
                 dtype: torch.dtype | None = None) -> ZooDrafter:
    """A draft of `kind` for an already loaded target (EAGLE-3 uses the target's embedding)."""
    cls = KINDS[kind]
    check_pair(target.config, read_config(cls, draft_dir)[0])
    shared = {"embed_tokens.weight": target.model.embed_tokens.weight} if issubclass(cls, Eagle3Head) else None
    return adapt(load(cls, draft_dir, device=device, dtype=dtype, shared=shared))

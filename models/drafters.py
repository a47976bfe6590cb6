"""Zoo drafts behind `specpass.Drafter`, and loading a target + draft pair from folders.

    drafter = ZooDrafter(zoo.build("tiny-llama-eagle3"))        # EAGLE-3, NextN or a standalone Llama
    target, drafter = load_pair(target_dir, "eagle", eagle_dir)  # checked against each other
    drafter = adapt(zoo.build("tiny-llama-peagle3"))             # a parallel head: ParallelZooDrafter
    other = load_drafter(target, "draft", draft_dir)             # another draft for the same target

`Llama` is already a `specpass.Target` (`__call__`, `forward_with_hidden`, `setup_caches`); the
drafts go behind the library's adapter (`specpass.drafters.DraftAdapter`: the position shift of the
draft cache), which needs to know which target hidden states their catch-up reads. EAGLE-3 and
P-EAGLE folders load with the library's loader, `specpass.load_drafter`, as a transformers user
loads them.
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
from specpass import drafters
from specpass.drafters.load import fit_problems

KINDS = {"eagle": Eagle3Head, "parallel": ParallelEagle3Head, "block": drafters.DFlashDraft, "nextn": NextN,
         "draft": Llama}  # the example's --eagle/--parallel/--block/--nextn/--draft
LIBRARY_KINDS = ("eagle", "parallel", "block")  # public formats, loaded (and checked) by specpass.load_drafter


def hidden_kind(model: nn.Module) -> str | None:
    """The target states a zoo draft's catch-up reads: "eagle3", "last" (NextN) or None (standalone)."""
    if isinstance(model, drafters.Eagle3Head):
        return "eagle3"
    if isinstance(model, NextN):
        return "last"
    if isinstance(model, Llama):
        return None
    raise TypeError(f"no drafter adapter for {type(model).__name__}; known: Eagle3Head, ParallelEagle3Head, "
                    "NextN, Llama")


class ZooDrafter(drafters.DraftAdapter):
    """A zoo draft model as a `Drafter` (the library's adapter, its hidden kind read off the model)."""

    def __init__(self, model: nn.Module):
        super().__init__(model, hidden_kind(model))


class ParallelZooDrafter(ZooDrafter, drafters.ParallelDraftAdapter):
    """A parallel-drafting head as a `specpass.ParallelDrafter`: K drafts per forward."""


def adapt(model: nn.Module) -> ZooDrafter | drafters.DFlashDraft:
    """The adapter a zoo draft model needs (a DFlash draft is the library's drafter itself: none)."""
    if isinstance(model, drafters.DFlashDraft):
        return model
    return ParallelZooDrafter(model) if isinstance(model, drafters.ParallelEagle3Head) else ZooDrafter(model)


def check_pair(target: LlamaConfig, draft: Eagle3Config | NextNConfig | LlamaConfig) -> None:
    """Raise CheckpointError when a draft cannot run against this target (vocabulary, hidden sizes)."""
    if isinstance(draft, Eagle3Config):
        problems = fit_problems(draft, target.vocab_size, target.hidden_size)
    else:
        name = type(draft).__name__.removesuffix("Config")
        problems = []
        if draft.vocab_size != target.vocab_size:
            problems.append(f"vocabulary: the target has {target.vocab_size} tokens, the {name} draft "
                            f"{draft.vocab_size}")
        if isinstance(draft, NextNConfig) and draft.hidden_size != target.hidden_size:
            problems.append(f"NextN hidden_size {draft.hidden_size} != the target's hidden_size {target.hidden_size} "
                            "(it reads the target's last hidden state)")
    if problems:
        raise CheckpointError("the draft does not fit the target:\n  " + "\n  ".join(problems))


def load_pair(target_dir: str | Path, kind: str, draft_dir: str | Path, device=None,
              dtype: torch.dtype | None = None) -> tuple[Llama, drafters.DraftAdapter]:
    """Load a Llama target and a draft of `kind` ("eagle", "parallel", "block" (DFlash), "nextn" or "draft"),
    checked against each other from their config.json files before any weight is read."""
    target_config, _ = read_config(Llama, target_dir)
    if kind != "block":  # the library's loader checks a DFlash draft against the loaded target
        check_pair(target_config, read_config(KINDS[kind], draft_dir)[0])
    target = load(Llama, target_dir, device=device, dtype=dtype)
    return target, load_drafter(target, kind, draft_dir, device=device, dtype=dtype)


def load_drafter(target: Llama, kind: str, draft_dir: str | Path, device=None,
                 dtype: torch.dtype | None = None) -> drafters.DraftAdapter | drafters.DFlashDraft:
    """A draft of `kind` for an already loaded target: EAGLE-3, P-EAGLE and DFlash heads through the
    library's loader (sharing the target's embedding), the others as zoo checkpoints."""
    if kind in LIBRARY_KINDS:
        drafter = drafters.load_drafter(draft_dir, target, device=device, dtype=dtype)
        found = ("block" if isinstance(drafter, drafters.DFlashDraft)
                 else "parallel" if isinstance(drafter, drafters.ParallelDraftAdapter) else "eagle")
        if found != kind:
            names = dict(eagle="chain EAGLE-3", parallel="parallel-drafting (P-EAGLE)", block="DFlash block")
            raise CheckpointError(f"{draft_dir} holds a {names[found]} head, not a {names[kind]} one: load it as "
                                  f"{found!r}")
        return drafter
    cls = KINDS[kind]
    check_pair(target.config, read_config(cls, draft_dir)[0])
    return adapt(load(cls, draft_dir, device=device, dtype=dtype))

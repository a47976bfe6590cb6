"""A parallel-drafting EAGLE-3 head: K draft tokens from one forward (P-EAGLE, arXiv 2602.01469;
vLLM's "Unified Parallel Drafting", #32887, which also serves PARD).

The chain head (drafters/eagle3.py) drafts d_1 from the catch-up, then d_2..d_K from K-1 more draft
steps, each on the previous one's output. This head appends K-1 *mask slots* to the catch-up
instead: the mask token (`mask_token_id` in config.json) with a learned `mask_hidden` ([3·Ht], in
the target's fused space, so `fc` projects it like a real row) at the positions after the last
verified token. One forward; the drafts are read from the last verified row and the mask rows.

    catch-up rows    t <= live[b]             the verified tokens, the target's states (EAGLE's shift)
    mask slots       live[b] < t < live[b]+K  mask_token_id, mask_hidden
    padding          the rest                 written to slots no later row sees, then overwritten

Rows are laid out per request in one static block of T + K - 1 rows (T verified rows, of which
rows after `live` are padding). The mask slots take the padding rows' places, so every row has its
own position and cache slot: no two rows write the same slot. The K drafts are rows
live[b] .. live[b]+K-1: `x[arange(B)[:, None], rows]`, the K live rows of specpass's live-row pass.

Checkpoint layout: the public EAGLE-3 one (`LlamaForCausalLMEagle3`) plus `mask_hidden`; the config
adds `parallel_drafting: true` and `mask_token_id` (the names vLLM reads). With `num_hidden_layers` > 1
(P-EAGLE's heads are deeper) the layers are vLLM's `layers.N.*`. In one layer a mask slot attends to
the earlier mask slots' inputs, all the same; from the second layer on it attends to their first
layer's states, which carry what they predict. Every layer writes K/V for every row.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from specpass.drafters.eagle3 import Eagle3Config, Eagle3Head


@dataclasses.dataclass
class ParallelEagle3Config(Eagle3Config):
    mask_token_id: int | None = None  # required; the id the mask slots embed
    parallel_drafting: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.mask_token_id is None or not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must be a token id below vocab_size {self.vocab_size}, "
                             f"got {self.mask_token_id!r}")
        if not self.parallel_drafting:
            raise ValueError("a ParallelEagle3Config drafts in parallel: parallel_drafting must be true")


class ParallelEagle3Head(Eagle3Head):
    def __init__(self, config: ParallelEagle3Config):
        super().__init__(config)
        self.mask_hidden = nn.Parameter(torch.zeros(3 * config.target_hidden_size))

    def mask_slots(self, tokens: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, live: torch.Tensor,
                   k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T] tokens, positions (contiguous per request), [B, T, 3Ht] hidden, [B] live -> the
        [B, T+K-1] rows of the draft forward: the K-1 rows after live[b] are mask slots."""
        t = torch.arange(tokens.shape[1] + k - 1, device=tokens.device)  # [T+K-1]
        masked = (t > live[:, None]) & (t < live[:, None] + k)  # [B, T+K-1]
        tokens = torch.where(masked, self.config.mask_token_id, F.pad(tokens, (0, k - 1)))
        positions = positions[:, :1] + t
        hidden = torch.where(masked[..., None], self.mask_hidden.to(hidden.dtype), F.pad(hidden, (0, 0, 0, k - 1)))
        return tokens, positions, hidden

    def draft_parallel(self, tokens: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                       live: torch.Tensor, k: int) -> torch.Tensor:
        """One draft forward -> logits [B, K, V_draft]; row j predicts the token at
        positions[b, live[b]] + 1 + j. Every row's K/V is written; the K live rows are selected
        only at the end (the graph the live-row pass rewrites)."""
        logits, _ = self.forward_rows(*self.mask_slots(tokens, positions, hidden, live, k))  # [B, T+K-1, Vd]
        rows = live[:, None] + torch.arange(k, device=live.device)  # [B, K]
        return logits[torch.arange(logits.shape[0], device=live.device)[:, None], rows]

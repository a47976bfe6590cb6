"""transformers' logits processors that read the prefix, in tensor form, inside the compiled steps;
and any other processor, called on the host per verified position.

A processor changes the target's logits before a token is chosen from them (greedy or drawn), and
what it does depends on the tokens before that position. Under speculation one verify scores
several positions at once: row j of a chain's verify follows x_n and the drafts d_1..d_j, a tree's
node follows its ancestors. Each row is processed with the prefix plain decoding would have had
there (the emitted tokens, then the drafts on the way to it), so the token chosen at every
accepted position is the one plain decoding with the same processors chooses: greedy tokens equal
`model.generate`'s, and speculative sampling keeps the processed distribution (drafts are drawn
unprocessed; the acceptance corrects for it, as for any draft distribution).

    min_new_tokens        an EOS id is not chosen while fewer than min_new tokens were emitted
    repetition_penalty    a logit of a token in the prefix (`penalty_context`, then the emitted
                          tokens) is divided by the penalty, or multiplied where negative
    no_repeat_ngram_size  a token that would complete an n-gram already in the prefix
                          (`prefix_context`, then the emitted tokens) is not chosen
    custom                any (input_ids, scores) -> scores, last (transformers appends a user's
                          processors to its own): called once per verified position of each
                          request, with that position's prefix as input_ids [1, L]; on the host,
                          so its steps run uncompiled

The contexts are what transformers reads before the new tokens: its input_ids (a left-padded
batch's padding included, except where a processor leaves it out). Processing runs on the fp32
logits (transformers casts them before its processors). A Decoder that processes nothing carries
`State.processing = None`: its graphs hold none of this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor


class Processing(NamedTuple):
    """Per-request processors on the device; a field is None where no request uses it (no graph)."""

    min_new: Tensor | None  # [B] int64: no EOS before this many tokens are emitted
    eos: Tensor | None  # [B, V] bool: the EOS ids min_new holds back
    penalty: Tensor | None  # [B] fp32 repetition penalty (1: off)
    seen: Tensor | None  # [B, V] bool: the tokens the penalty reads (its context, then each emitted token)
    ngram: int | None  # no_repeat_ngram_size, one for the batch
    history: Tensor | None  # [B, W] int64: the prefix context, then the emitted tokens; past `length` scratch
    length: Tensor | None  # [B] int64: tokens in `history`
    custom: Callable[[Tensor, Tensor], Tensor] | None = None  # any other processor (input_ids, scores) -> scores

    @staticmethod
    def make(rows: int, vocab: int, width: int, device: torch.device, eos: list[list[int]], min_new: Sequence[int],
             penalty: Sequence[float], penalty_context: Sequence[Sequence[int]], ngram: int,
             prefix_context: Sequence[Sequence[int]], custom: Callable | None = None) -> "Processing | None":
        """Per request (padded to `rows` with idle rows): its EOS ids, min_new_tokens, repetition
        penalty and what it reads before the emitted tokens; the n-gram size and the custom processor
        for all, and what they read, in `width` columns of history. None when no request processes
        anything."""
        holds = any(m > 0 and ids for m, ids in zip(min_new, eos))
        penalizes = any(p != 1.0 for p in penalty)
        reads_prefix = bool(ngram) or custom is not None
        if not (holds or penalizes or reads_prefix):
            return None
        idle = rows - len(eos)
        held = seen = history = None
        if holds:
            held = torch.zeros(rows, vocab, dtype=torch.bool)
            for b, ids in enumerate(eos):
                held[b, ids] = True
        if penalizes:
            seen = torch.zeros(rows, vocab, dtype=torch.bool)
            for b, ids in enumerate(penalty_context):
                seen[b, list(ids)] = True
        if reads_prefix:
            history = torch.zeros(rows, width, dtype=torch.long)
            for b, ids in enumerate(prefix_context):
                history[b, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
        lengths = [len(ids) for ids in prefix_context] + [0] * idle if reads_prefix else None
        return Processing(
            min_new=torch.tensor(list(min_new) + [0] * idle, device=device) if holds else None,
            eos=held.to(device) if holds else None,
            penalty=(torch.tensor(list(penalty) + [1.0] * idle, dtype=torch.float32, device=device)
                     if penalizes else None),
            seen=seen.to(device) if penalizes else None,
            ngram=ngram or None,
            history=history.to(device) if reads_prefix else None,
            length=torch.tensor(lengths, device=device) if reads_prefix else None,
            custom=custom)


def processed(processing: Processing | None, logits: Tensor, count: Tensor, tokens: Tensor, depth: Tensor,
              reads: Tensor) -> Tensor:
    """The logits [B, N, V] of a verify's N rows, processed; row j follows tokens[:, j].

    count [B]: tokens emitted before the verify; tokens [B, N]: x_n, then the drafts; depth [B, N]:
    each token's drafts from x_n (a chain: j; a tree: its node's depth); reads [B, N, N] bool: row j's
    prefix holds tokens[:, i] (a chain: i <= j; a tree: i an ancestor of j or j)."""
    if processing is None:
        return logits
    logits = logits.float()
    B, N, V = logits.shape
    if processing.penalty is not None:
        hits = torch.zeros(B, N, V, dtype=torch.int32, device=logits.device)
        hits = hits.scatter_add(2, tokens[:, None, :].expand(B, N, N), reads.int())
        present = processing.seen[:, None, :] | (hits > 0)  # [B, N, V]
        penalty = processing.penalty[:, None, None]
        logits = torch.where(present, torch.where(logits < 0, logits * penalty, logits / penalty), logits)
    if processing.ngram is not None:
        logits = logits.masked_fill(_repeating(processing, V, tokens, depth, reads), float("-inf"))
    if processing.min_new is not None:
        holding = count[:, None] + depth < processing.min_new[:, None]  # [B, N]
        logits = logits.masked_fill(holding[..., None] & processing.eos[:, None, :], float("-inf"))
    if processing.custom is not None:
        logits = _custom(processing, logits, tokens, depth, reads)
    return logits


def _custom(processing: Processing, logits: Tensor, tokens: Tensor, depth: Tensor, reads: Tensor) -> Tensor:
    """The custom processor at each row of each request that has a prefix (an idle row has none):
    input_ids [1, L] row j's prefix, scores [1, V] its logits."""
    ext, size = _prefixes(processing, tokens, depth, reads)
    out = logits.clone()
    for b, (length, sizes) in enumerate(zip(processing.length.tolist(), size.tolist())):
        for j, n in enumerate(sizes if length else ()):
            out[b, j] = processing.custom(ext[b, j, :n][None], logits[b, j][None])[0]
    return out


def _prefixes(processing: Processing, tokens: Tensor, depth: Tensor, reads: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's prefix: (ext [B, N, W + N + 1], whose row j holds in its first size[b, j] columns the
    history, then the drafts on the way to j in depth order; size [B, N])."""
    history, length = processing.history, processing.length
    B, N = tokens.shape
    W = history.shape[1]
    # Draft i goes to column length + depth_i - 1 where row j reads it (x_n, depth 0, is the
    # history's last token); the rest goes to a spare last column.
    ext = torch.cat([history, history.new_zeros(B, N + 1)], 1)[:, None, :].expand(B, N, W + N + 1)
    at = torch.where(reads & (depth[:, None, :] > 0), length[:, None, None] + depth[:, None, :] - 1, W + N)
    ext = ext.scatter(2, at, tokens[:, None, :].expand(B, N, N))
    return ext, length[:, None] + depth


def _repeating(processing: Processing, vocab: int, tokens: Tensor, depth: Tensor, reads: Tensor) -> Tensor:
    """[B, N, V] bool: the tokens that would complete, after row j's prefix (the history, then the
    drafts on the way to j in depth order), an n-gram already in that prefix. transformers'
    NoRepeatNGramLogitsProcessor: the last n-1 tokens matched against every window of the prefix,
    a matching window banning the token after it; nothing under n tokens."""
    n = processing.ngram
    B, N = tokens.shape
    ext, size = _prefixes(processing, tokens, depth, reads)
    windows = ext.unfold(2, n, 1)  # [B, N, S, n]
    start = torch.arange(windows.shape[2], device=tokens.device)
    suffix = ext.gather(2, (size[..., None] - (n - 1) + torch.arange(n - 1, device=tokens.device)).clamp(min=0))
    matches = (windows[..., :-1] == suffix[:, :, None, :]).all(-1)  # [B, N, S]
    matches &= (start + n - 1 < size[..., None]) & (size[..., None] >= n)
    banned = torch.zeros(B, N, vocab + 1, dtype=torch.bool, device=tokens.device)
    banned = banned.scatter(2, torch.where(matches, windows[..., -1].clamp(max=vocab), vocab), True)
    return banned[..., :vocab]


def after_emitting(processing: Processing | None, y: Tensor, emitting: Tensor) -> Processing | None:
    """The processing after a round emits y [B, T] where `emitting` [B, T] (a prefix of each row):
    the penalty has seen them, the n-gram history ends with them."""
    if processing is None or (processing.seen is None and processing.history is None):
        return processing
    seen, history, length = processing.seen, processing.history, processing.length
    if seen is not None:
        hits = torch.zeros(seen.shape, dtype=torch.int32, device=y.device).scatter_add(1, y, emitting.int())
        seen = seen | (hits > 0)
    if history is not None:
        T = y.shape[1]
        col = torch.arange(history.shape[1], device=y.device) - length[:, None]  # [B, W]
        inside = (col >= 0) & (col < T)
        took = emitting.gather(1, col.clamp(0, T - 1)) & inside
        history = torch.where(took, y.gather(1, col.clamp(0, T - 1)), history)
        length = length + emitting.sum(1)
    return processing._replace(seen=seen, history=history, length=length)

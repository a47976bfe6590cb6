"""Train the shipped models on the Python standard library's source, one GPU, about 8 minutes.

    python examples/train.py --stdlib DIR --out checkpoints                # both phases
    python examples/train.py --target checkpoints/stdlib-llama --out checkpoints   # phase 2 only
    python examples/train.py --device cpu --tiny --target-steps 20 --drafts-steps 20 --batch 4 \\
        --seq-len 64 --eval-windows 4 --out /tmp/smoke                     # CPU smoke run, seconds

Phase 1, the target: a 19M-parameter byte-level Llama (models.text: 256 bytes + BOS + EOS),
next-byte cross-entropy on random windows of the training modules. Its checkpoint is written as
soon as the phase ends; `--target DIR` starts from such a folder instead.
Phase 2, against the frozen target (the bf16 weights it ships with), jointly:
  - an EAGLE-3 head, by EAGLE-3's training-time test: soft cross-entropy against the target's
    distribution over `--rollout` steps, step j weighted 0.8**j, aligned as inference runs it
    (`eagle3_rollout`);
  - a 2-layer standalone Llama draft, distilled with soft cross-entropy against the target.
With `--parallel`, phase 2 trains a parallel-drafting EAGLE-3 head instead (models/peagle.py;
P-EAGLE, arXiv 2602.01469): one forward over the verified rows plus K-1 mask slots at every slot at
once, depths kept by conditional drop-token sampling (depth j keeps a random `--cod-ratio`**j of
the slots, nested in depth j-1's), KL to the target's distribution (`parallel_rows`), with `--layers`
layers (the midlayer, then decoder layers). It writes stdlib-llama-peagle3/ and train_log_parallel.json.
With `--dflash`, phase 2 trains a DFlash block draft instead (specpass/drafters/dflash.py; arXiv
2602.06036): blocks [x_s, mask x K] at random anchors s of each window, all at once, each attending
to the target's states at positions < s (`fc` over layers 1, 5 and 9) and to its own block, KL to the
target's distribution at s..s+K-1, draft j weighted exp(-(j-1)/7) (`dflash_rows`); it shares the
target's embedding and lm_head. It writes stdlib-llama-dflash/ (z-lab's layout) and train_log_dflash.json.
Each phase has a wall-clock budget, compilation included: the number of steps (and so the cosine
schedule) follows from the step time measured after warm-up; `--target-steps` / `--drafts-steps`
fix it instead. Then an evaluation on the held-out modules, and the folders under --out:
stdlib-llama/, stdlib-llama-eagle3/, stdlib-llama-draft/ (bf16, shards under 16 MiB),
prompts.json (held-out prompts) and train_log.json (configs, steps, times, losses, evaluation).

The corpus is the standard library under --stdlib (default: this Python's); the shipped models
were trained on CPython 3.11.7's, carried to the GPU as a tarball of its .py files:

    cd "$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" && \\
        find . -name '*.py' -not -path '*/site-packages/*' | sort | tar cJf /tmp/stdlib.tar.xz -T -

and run as `tar xJf stdlib.tar.xz -C /tmp/stdlib && python examples/train.py --stdlib /tmp/stdlib`
on one H100 (checkpoints/train_log.json). Re-run on another Python, the training reads that
Python's standard library (models/text.py), and the held-out split and prompts follow it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import pathlib
import platform
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # models/ lives in the repo root

from models.checkpoint import checkpoint_tensors, load, save  # noqa: E402
from models.eagle3 import Eagle3Config, Eagle3Head  # noqa: E402
from models.llama import Llama, LlamaConfig  # noqa: E402
from models.peagle import ParallelEagle3Config, ParallelEagle3Head  # noqa: E402
from models.text import BOS  # noqa: E402
from models.text import HELD_OUT, VOCAB, corpus, make_prompts  # noqa: E402
from specpass.drafters import load_drafter  # noqa: E402
from specpass.drafters.dflash import DFlashConfig, DFlashDraft  # noqa: E402
from specpass.drafters.rope import rope  # noqa: E402

TARGET = LlamaConfig(vocab_size=VOCAB, hidden_size=384, intermediate_size=1024, num_hidden_layers=12,
                     num_attention_heads=6, num_key_value_heads=2, head_dim=64, rope_theta=10000.0,
                     max_position_embeddings=2048)
EAGLE3 = Eagle3Config(vocab_size=VOCAB, draft_vocab_size=VOCAB, hidden_size=384, intermediate_size=1024,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=64, rope_theta=10000.0,
                      max_position_embeddings=2048)
PEAGLE3 = ParallelEagle3Config(**dataclasses.asdict(EAGLE3), mask_token_id=BOS)  # BOS only starts a file
DFLASH = DFlashConfig(vocab_size=VOCAB, hidden_size=384, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                      target_layer_ids=[1, 5, 9], mask_token_id=BOS, block_size=16)
DRAFT = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=10000.0,
                    tie_word_embeddings=True, max_position_embeddings=2048)
TINY = dict(  # --tiny: the same shapes of model, small enough for a CPU test
    target=dataclasses.replace(TARGET, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                               num_attention_heads=4, head_dim=16),
    eagle3=dataclasses.replace(EAGLE3, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
                               target_hidden_size=64),
    peagle3=dataclasses.replace(PEAGLE3, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
                                target_hidden_size=64),
    dflash=dataclasses.replace(DFLASH, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
                               target_layer_ids=[1, 3, 5], block_size=8),
    draft=dataclasses.replace(DRAFT, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=16),
)
NAMES = dict(target="stdlib-llama", eagle3="stdlib-llama-eagle3", draft="stdlib-llama-draft",
             peagle3="stdlib-llama-peagle3", dflash="stdlib-llama-dflash")
SHARD_BYTES = 15 * 2**20  # files come back from the GPU machine in pieces of 16 MiB at most
STEP_DECAY = 0.8  # EAGLE-3's weight of rollout step j: 0.8**j
DFLASH_DECAY = 7.0  # DFlash's weight of draft j: exp(-(j-1)/7)


# --- forwards for training: the zoo modules' own submodules, full sequences, no KV cache


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """q `[B, T, nh, d]`, k/v `[B, S, nkv, d]` -> `[B, T, nh, d]`: causal (S = T) when mask is None,
    else over the keys `mask [T, S]` allows. Scale head_dim**-0.5, as the cached attention
    (`specpass.drafters.attention.attend`)."""
    rep = q.shape[2] // k.shape[2]  # GQA: repeat K/V heads, which the flash and memory-efficient kernels need
    k, v = (t.repeat_interleave(rep, dim=2).transpose(1, 2) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, is_causal=mask is None)
    return out.transpose(1, 2)


def llama_forward(model: Llama, tokens: torch.Tensor,
                  capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """tokens `[B, T]` at positions 0..T-1 -> (logits `[B, T, V]`, the inputs of the `capture` layers):
    `model(tokens, positions)` after `setup_caches`, without the cache."""
    cfg = model.config
    x = model.model.embed_tokens(tokens)  # [B, T, H]
    rope_cs = rope(torch.arange(tokens.shape[1], device=tokens.device)[None], cfg.head_dim, cfg.rope_theta, x.dtype)
    inputs = {}
    for i, layer in enumerate(model.model.layers):
        if i in capture:
            inputs[i] = x
        attn = layer.self_attn
        q, k, v, gate = attn.project(layer.input_layernorm(x), rope_cs)
        h = x + attn.output(attention(q, k, v), gate)
        x = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.model.norm(x)), [inputs[i] for i in capture]


def rollout_mask(T: int, j: int, device) -> torch.Tensor:
    """`[T, (j+1)·T]` bool: the keys rollout step j's query at slot s attends to, over the keys of
    steps 0..j side by side. Step 0's at slots <= s-j (the catch-up up to the accepted token), step
    m's at slot s-j+m (the draft steps since): the cache inference's j-th draft step reads."""
    s, t = torch.arange(T, device=device)[:, None], torch.arange(T, device=device)[None, :]
    return torch.cat([t <= s - j] + [t == s - j + m for m in range(1, j + 1)], dim=1)


def eagle3_rollout(head: Eagle3Head, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """EAGLE-3's training-time test: `steps` draft steps at every slot at once -> logits `[B, T, Vd]` per step.

    Slot s holds token x_{s+1} (`tokens [B, T]`) at RoPE position s (ZooDrafter's alignment). Step 0
    is the catch-up: hidden = fc(f_s), the target's fused states `features [B, T, 3Ht]`, causal. Step
    j >= 1 at slot s continues step j-1's output hidden at slot s-1, with the K/V inference would
    have in its cache (`rollout_mask`). Row s of step j predicts x_{s+2}; rows s < j have no
    inference counterpart (their hidden is padding): leave them out of losses.
    """
    if head.config.num_hidden_layers != 1:
        raise ValueError("the chain head's training-time test trains a one-layer head (num_hidden_layers 1)")
    layer, attn = head.midlayer, head.midlayer.self_attn
    T = tokens.shape[1]
    embeds = layer.input_layernorm(head.embed_tokens(tokens))  # [B, T, H], the same at every step
    rope_cs = rope(torch.arange(T, device=tokens.device)[None], head.rope_dim, head.config.rope_theta, embeds.dtype)
    hidden = head.fc(features)  # [B, T, H]
    keys, values, logits = [], [], []
    for j in range(steps):
        q, k, v, gate = attn.project(torch.cat([embeds, layer.hidden_norm(hidden)], dim=-1), rope_cs)
        keys.append(k)
        values.append(v)
        mask = None if j == 0 else rollout_mask(T, j, tokens.device)  # step 0: plain causal
        h = hidden + attn.output(attention(q, torch.cat(keys, 1), torch.cat(values, 1), mask), gate)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits.append(head.lm_head(head.norm(h)))
        hidden = F.pad(h[:, :-1], (0, 0, 1, 0))  # step j+1 at slot s reads step j's hidden at slot s-1
    return logits


def cod_sizes(T: int, depths: int, ratio: float) -> list[int]:
    """Rows per depth under conditional drop-token sampling: T, then round(T * ratio**j)."""
    return [max(1, round(T * ratio**j)) for j in range(depths)]


def cod_rows(T: int, depths: int, ratio: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Conditional drop-token sampling: the rows of a parallel head's training forward -> (anchor
    slot [N], depth [N]). Depth 0 is every slot (the verified rows); depth j >= 1 keeps
    round(T * ratio**j) slots at random, a subset of depth j-1's (one permutation's prefixes)."""
    order = torch.rand(T, device=device).argsort()
    anchors = [order[:n].sort().values for n in cod_sizes(T, depths, ratio)]
    return torch.cat(anchors), torch.cat([torch.full_like(a, j) for j, a in enumerate(anchors)])


def parallel_rows(head: ParallelEagle3Head, tokens: torch.Tensor, features: torch.Tensor, anchor: torch.Tensor,
                  depth: torch.Tensor) -> torch.Tensor:
    """A parallel head's draft forward at every slot at once -> logits `[B, N, Vd]`.

    Slot s holds token x_{s+1} (`tokens [B, T]`) and the target's fused state f_s (`features`), at
    RoPE position s, as `eagle3_rollout`'s step 0. Row (s, j), j >= 1 (`anchor`, `depth` [N], from
    `cod_rows`) is the j-th mask slot after slot s: mask token, `mask_hidden`, position s + j; it
    attends to slots <= s and to mask slots 1..j of s, as in inference's forward when s is the last
    verified slot, in every layer of the head. Row (s, j) predicts x_{s+2+j}.
    """
    first, *rest = head.decoder_layers
    B, T = tokens.shape
    masks = anchor.numel() - T
    toks = torch.cat([tokens, tokens.new_full((B, masks), head.config.mask_token_id)], 1)  # [B, N]
    hidden = torch.cat([head.fc(features), head.fc(head.mask_hidden).expand(B, masks, -1)], 1)  # [B, N, H]
    x = torch.cat([first.input_layernorm(head.embed_tokens(toks)), first.hidden_norm(hidden)], dim=-1)
    rope_cs = rope((anchor + depth)[None], head.rope_dim, head.config.rope_theta, x.dtype)
    a_q, a_k, d_q, d_k = anchor[:, None], anchor[None], depth[:, None], depth[None]
    mask = ((d_k == 0) & (a_k <= a_q)) | ((d_k > 0) & (a_k == a_q) & (d_k <= d_q))  # [N, N]

    def block(layer, x, residual):  # one layer's attention and MLP over the rows, `mask` between them
        q, k, v, gate = layer.self_attn.project(x, rope_cs)
        h = residual + layer.self_attn.output(attention(q, k, v, mask), gate)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    h = block(first, x, hidden)
    for layer in rest:
        h = block(layer, layer.input_layernorm(h), h)
    return head.lm_head(head.norm(h))


def parallel_kl(head: ParallelEagle3Head, target: Llama, x: torch.Tensor, depths: int, ratio: float,
                autocast, weigh: str = "depth") -> tuple[torch.Tensor, torch.Tensor]:
    """x `[B, L]` -> (KL(target || head) per row `[B, N]`, the weight of each row `[N]`: the weights
    sum to 1, 0 for a row without a label in the window). Row (s, j)'s target is the target's
    distribution at position s+1+j. `weigh`: "depth", each depth weighs the same; "row", each
    labelled row the same (depth j then weighs as its share of the rows, about ratio**j)."""
    with torch.no_grad(), autocast():
        logits, features = llama_forward(target, x, target.eagle3_layers)
    log_p = logits.float().log_softmax(-1)  # [B, L, V]
    L = x.shape[1]
    anchor, depth = cod_rows(L - 1, depths, ratio, x.device)
    with autocast():
        head_logits = parallel_rows(head, x[:, 1:], torch.cat(features, -1)[:, :-1], anchor, depth)
    label = anchor + 1 + depth  # [N]
    valid = label <= L - 1
    log_p = log_p[:, label.clamp(max=L - 1)]  # [B, N, V]
    kl = (log_p.exp() * (log_p - head_logits.float().log_softmax(-1))).sum(-1)
    if weigh == "row":
        return kl, valid / valid.sum()
    per_depth = torch.zeros(depths, device=x.device).index_add(0, depth, valid.float())  # [depths]
    return kl, valid / per_depth[depth] / depths


@torch.no_grad()
def evaluate_parallel(target: Llama, head: ParallelEagle3Head, held_out: torch.Tensor, length: int, batch: int,
                      max_windows: int, depths: int, autocast) -> dict:
    """Per depth j (draft j+1), on consecutive held-out windows with every slot kept: the head's
    agreement with the target's arg-max at that position, given the true prefix."""
    n = min(max_windows, held_out.numel() // length)
    windows = held_out[: n * length].view(n, length).long()
    hits, counts = torch.zeros(depths, dtype=torch.float64), torch.zeros(depths, dtype=torch.float64)
    T = length - 1
    anchor = torch.arange(T, device=held_out.device).repeat(depths)
    depth = torch.arange(depths, device=held_out.device).repeat_interleave(T)
    label = anchor + 1 + depth
    valid = label <= T
    for x in windows.split(batch):
        with autocast():
            logits, features = llama_forward(target, x, target.eagle3_layers)
            head_logits = parallel_rows(head, x[:, 1:], torch.cat(features, -1)[:, :-1], anchor, depth)
        agree = (head_logits.argmax(-1) == logits.argmax(-1)[:, label.clamp(max=T)]) & valid  # [B, N]
        hits += agree.sum(0).view(depths, T).sum(1).double().cpu()
        counts += (valid.view(depths, T).sum(1) * x.shape[0]).double().cpu()
    return dict(windows=n, bytes=n * length, agreement=(hits / counts).tolist())


def dflash_rows(draft: DFlashDraft, x: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor,
                k: int) -> torch.Tensor:
    """A DFlash draft's blocks at every anchor at once -> logits `[B, M, K, V]`.

    x `[B, L]`, features `[B, L, n·H]` (the target's states at positions 0..L-1), anchors `[M]`. The
    block at anchor s is [x_s, mask x K] at positions s..s+K; its rows attend to the context at
    positions < s and to the whole block, in every layer, as inference's block forward does when
    x_s is the last verified token. Block row j >= 1 predicts x_{s+j}.
    """
    cfg = draft.config
    B, L = x.shape
    M = anchors.numel()
    ctx = draft.hidden_norm(draft.fc(features))  # [B, L, H]
    offsets = torch.arange(k + 1, device=x.device)
    tokens = torch.where(offsets == 0, x[:, anchors, None], cfg.mask_token_id)  # [B, M, K+1]
    h = draft.embed_tokens(tokens).flatten(1, 2)  # [B, N = M(K+1), H]
    rope_block = rope((anchors[:, None] + offsets).flatten()[None], cfg.head_dim, cfg.rope_theta, h.dtype)
    rope_ctx = rope(torch.arange(L, device=x.device)[None], cfg.head_dim, cfg.rope_theta, h.dtype)
    block = torch.arange(M, device=x.device).repeat_interleave(k + 1)  # [N] each row's block
    mask = torch.cat([torch.arange(L, device=x.device) < anchors[block][:, None],  # the context before s
                      block[:, None] == block[None, :]], dim=1)  # [N, L + N]: and its own block
    for layer in draft.layers:
        a = layer.self_attn
        k_ctx, v_ctx = a.context_kv(ctx, rope_ctx)
        q, k_blk, v_blk, _ = a.project(layer.input_layernorm(h), rope_block)
        h = h + a.output(attention(q, torch.cat([k_ctx, k_blk], 1), torch.cat([v_ctx, v_blk], 1), mask), None)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = h.view(B, M, k + 1, -1)[:, :, 1:]
    return draft.lm_head(draft.norm(h))


def dflash_kl(draft: DFlashDraft, target: Llama, x: torch.Tensor, anchors: torch.Tensor, k: int,
              autocast) -> torch.Tensor:
    """x `[B, L]`, anchors `[M]` (each <= L - K) -> KL(target || draft) `[B, M, K]`: draft j of the
    block at s against the target's distribution at position s+j-1 (which predicts x_{s+j})."""
    capture = tuple(i + 1 for i in draft.config.target_layer_ids)  # layer i's output: layer i+1's input
    with torch.no_grad(), autocast():
        logits, features = llama_forward(target, x, capture)
    with autocast():
        draft_logits = dflash_rows(draft, x, torch.cat(features, -1), anchors, k)
    log_p = logits.float().log_softmax(-1)[:, anchors[:, None] + torch.arange(k, device=x.device)]  # [B, M, K, V]
    return (log_p.exp() * (log_p - draft_logits.float().log_softmax(-1))).sum(-1)


@torch.no_grad()
def evaluate_dflash(target: Llama, draft: DFlashDraft, held_out: torch.Tensor, length: int, batch: int,
                    max_windows: int, k: int, autocast) -> dict:
    """Per draft j, on consecutive held-out windows, blocks at every 4th position: the draft's
    agreement with the target's arg-max at that position given the true prefix, and the expected
    accepted length of a greedy block of K (the bonus token plus the drafts up to the first miss)."""
    n = min(max_windows, held_out.numel() // length)
    windows = held_out[: n * length].view(n, length).long()
    anchors = torch.arange(1, length - k + 1, 4, device=held_out.device)
    capture = tuple(i + 1 for i in draft.config.target_layer_ids)
    hits, runs, count = torch.zeros(k, dtype=torch.float64), 0.0, 0
    for x in windows.split(batch):
        with autocast():
            logits, features = llama_forward(target, x, capture)
            draft_logits = dflash_rows(draft, x, torch.cat(features, -1), anchors, k)
        want = logits.argmax(-1)[:, anchors[:, None] + torch.arange(k, device=x.device)]  # [B, M, K]
        agree = draft_logits.argmax(-1) == want
        hits += agree.double().sum((0, 1)).cpu()
        runs += agree.long().cumprod(-1).sum().item()
        count += agree.shape[0] * agree.shape[1]
    return dict(windows=n, blocks=count, agreement=(hits / count).tolist(), accepted_length=1 + runs / count)


def draft_outputs(target: Llama, head: Eagle3Head, draft: Llama, x: torch.Tensor, steps: int):
    """x `[B, T]` -> (target logits `[B, T, V]`, no grad; head logits per step `[B, T-1, V]`, slot s
    for the token at s+1, predicting s+2; draft logits `[B, T, V]`)."""
    with torch.no_grad():
        logits, features = llama_forward(target, x, target.eagle3_layers)
    features = torch.cat(features, dim=-1)  # [B, T, 3H]
    head_logits = eagle3_rollout(head, x[:, 1:], features[:, :-1], steps)
    draft_logits, _ = llama_forward(draft, x)
    return logits, head_logits, draft_logits


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Per row: -sum(probs * log_softmax(logits)) `[B, T]`."""
    return -(probs * logits.float().log_softmax(-1)).sum(-1)


# --- training


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """Hugging Face's Llama initialisation: weights N(0, 0.02²), norms 1."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, std)
        elif isinstance(module, nn.RMSNorm):
            nn.init.ones_(module.weight)


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine down to a tenth of the peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def compiled_first_step(loss_fn, x: torch.Tensor, compile: bool):
    """Forward and backward of the first batch through torch.compile(loss_fn) (eager when not
    `compile`, or, with a warning, when compiling fails). -> (the loss function from now on, parts)."""
    if compile:
        compiled = torch.compile(loss_fn)
        try:
            loss, parts = compiled(x)
            loss.backward()
            return compiled, parts
        except Exception as e:  # noqa: BLE001 - any compiler failure: train eagerly instead
            warnings.warn(f"torch.compile failed, training eagerly: {type(e).__name__}: {e}")
    loss, parts = loss_fn(x)
    loss.backward()
    return loss_fn, parts


def train_phase(name: str, loss_fn, models: list[nn.Module], sample, lr: float, budget_s: float,
                steps: int | None, warmup: int, compile: bool, log_every: int) -> dict:
    """AdamW (decay on matrices), warm-up + cosine, gradient clipping per model at 1.0.

    `loss_fn(x) -> (loss, parts [n])`. Without `steps`, the step count is set once the step time is
    measured (steps 5-14) so that the phase ends `budget_s` after it began, compilation included.
    """
    params = [[p for p in m.parameters() if p.requires_grad] for m in models]
    flat = [p for ps in params for p in ps]
    groups = [dict(params=[p for p in flat if p.dim() >= 2], weight_decay=0.1),
              dict(params=[p for p in flat if p.dim() < 2], weight_decay=0.0)]
    cuda = flat[0].is_cuda
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=cuda)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    total, warmup = steps, max(1, min(warmup, steps // 5)) if steps else warmup
    start = time.perf_counter()
    history, step, step_s = [], 0, None
    while total is None or step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr, warmup, total or 10**9)
        x = sample()
        if step == 0:
            loss_fn, parts = compiled_first_step(loss_fn, x, compile)
            sync()
            first_step_s = time.perf_counter() - start
        else:
            loss, parts = loss_fn(x)
            loss.backward()
        for ps in params:
            nn.utils.clip_grad_norm_(ps, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append(parts.detach())
        step += 1
        if step == 5:
            sync()
            t0 = time.perf_counter()
        if step == 15:
            sync()
            step_s = (time.perf_counter() - t0) / 10
            if total is None:
                total = step + max(0, int((budget_s - (time.perf_counter() - start)) / step_s))
        if step % log_every == 0 or step == total:
            recent = " ".join(f"{v:.3f}" for v in torch.stack(history[-log_every:]).float().mean(0).tolist())
            print(f"{name} {step:5d}/{total} lr {opt.param_groups[0]['lr']:.2e} loss {recent} "
                  f"{time.perf_counter() - start:6.1f}s", flush=True)
        if steps is None and time.perf_counter() - start > 1.1 * budget_s:  # a slower stretch: stop anyway
            warnings.warn(f"{name}: over budget, stopped at step {step} of {total}")
            break
    sync()
    losses = torch.stack(history).float()
    result = dict(steps=step, wall_s=round(time.perf_counter() - start, 1), first_step_s=round(first_step_s, 1),
                  step_s=step_s, tokens_per_s=x.numel() / step_s if step_s else None, lr=lr, warmup=warmup,
                  loss_first=losses[: min(10, step)].mean(0).tolist(),
                  loss_final=losses[-min(50, step):].mean(0).tolist(),
                  peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
    if step_s:
        print(f"{name}: {step} steps in {result['wall_s']}s (the first, compiling, {result['first_step_s']}s), "
              f"{1e3 * step_s:.1f} ms/step, {result['tokens_per_s']:,.0f} tokens/s", flush=True)
    return result


def sampler(tokens: torch.Tensor, batch: int, length: int, seed: int):
    """Random windows `[batch, length]` (int64) of a token stream, reproducible from `seed`."""
    g = torch.Generator(device=tokens.device).manual_seed(seed)
    offsets = torch.arange(length, device=tokens.device)

    def sample() -> torch.Tensor:
        starts = torch.randint(0, tokens.numel() - length, (batch, 1), device=tokens.device, generator=g)
        return tokens[starts + offsets].long()
    return sample


# --- evaluation on the held-out modules


@torch.no_grad()
def evaluate(target: Llama, head: Eagle3Head, draft: Llama, held_out: torch.Tensor, length: int, batch: int,
             max_windows: int, steps: int, autocast) -> dict:
    """Consecutive windows of the held-out stream: per byte, the target's loss and top-1 accuracy,
    the draft's loss and agreement with the target's arg-max, and each rollout step's agreement."""
    n = min(max_windows, held_out.numel() // length)
    windows = held_out[: n * length].view(n, length).long()
    sums = torch.zeros(4 + steps, dtype=torch.float64, device=held_out.device)
    counts = torch.zeros_like(sums)
    for x in windows.split(batch):
        with autocast():
            logits, head_logits, draft_logits = draft_outputs(target, head, draft, x, steps)
        best = logits.argmax(-1)  # [B, T]
        nxt, best_p = x[:, 1:], best[:, :-1]  # rows with a next byte
        rows = [F.cross_entropy(logits[:, :-1].float().flatten(0, 1), nxt.flatten(), reduction="none"),
                (best_p == nxt).flatten(),
                F.cross_entropy(draft_logits[:, :-1].float().flatten(0, 1), nxt.flatten(), reduction="none"),
                (draft_logits[:, :-1].argmax(-1) == best_p).flatten()]
        rows += [(hl[:, j:].argmax(-1) == best[:, 1 + j:]).flatten() for j, hl in enumerate(head_logits)]
        sums += torch.stack([r.double().sum() for r in rows])
        counts += torch.tensor([r.numel() for r in rows], dtype=torch.float64, device=sums.device)
    means = (sums / counts).tolist()
    return dict(windows=n, bytes=n * length, target_loss=means[0], target_top1=means[1], draft_loss=means[2],
                draft_agreement=means[3], eagle3_agreement=means[4:])


def report(ev: dict) -> str:
    steps = " ".join(f"{a:.3f}" for a in ev["eagle3_agreement"])
    return "\n".join([
        f"held-out: {ev['windows']} windows, {ev['bytes']:,} bytes ({', '.join(HELD_OUT)})",
        f"{'model':8} {'loss (nats/byte)':>17} {'top-1':>7}",
        f"{'target':8} {ev['target_loss']:17.4f} {ev['target_top1']:7.3f}   (= the next byte)",
        f"{'draft':8} {ev['draft_loss']:17.4f} {ev['draft_agreement']:7.3f}   (= the target's arg-max)",
        f"{'eagle3':8} {'':>17} {steps}   (= the target's arg-max, rollout steps 0..{len(ev['eagle3_agreement']) - 1})",
    ])


# --- the command


def save_bf16(model: nn.Module, directory: pathlib.Path) -> None:
    tensors, _ = checkpoint_tensors(model)
    save({n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in tensors.items()},
         model.config, directory, max_shard_bytes=SHARD_BYTES)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stdlib", type=pathlib.Path, help="standard-library root (default: this Python's)")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "checkpoints")
    p.add_argument("--target", type=pathlib.Path, help="a trained target folder: skip phase 1")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny models (CPU smoke runs)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64, help="windows per step, phase 1")
    p.add_argument("--drafts-batch", type=int, default=64, help="windows per step, phase 2")
    p.add_argument("--target-seconds", type=float, default=300.0, help="phase 1 budget, compilation included")
    p.add_argument("--drafts-seconds", type=float, default=170.0, help="phase 2 budget, compilation included")
    p.add_argument("--target-steps", type=int, help="phase 1 steps (instead of the budget)")
    p.add_argument("--drafts-steps", type=int, help="phase 2 steps (instead of the budget)")
    p.add_argument("--target-lr", type=float, default=1.5e-3)
    p.add_argument("--drafts-lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100, help="warm-up steps (at most a fifth of fixed --*-steps)")
    p.add_argument("--rollout", type=int, default=4, help="EAGLE-3 training-time-test steps")
    p.add_argument("--parallel", action="store_true",
                   help="phase 2 trains a parallel-drafting head (stdlib-llama-peagle3) instead; needs --target")
    p.add_argument("--dflash", action="store_true",
                   help="phase 2: a DFlash block draft (stdlib-llama-dflash/), --layers layers, --blocks anchors a window")
    p.add_argument("--blocks", type=int, default=64, help="dflash: blocks trained per window")
    p.add_argument("--depths", type=int, default=8, help="parallel: draft positions trained (K at most)")
    p.add_argument("--cod-ratio", type=float, default=0.7, help="parallel: depth j keeps ratio**j of the slots")
    p.add_argument("--weigh", choices=["depth", "row"], default="depth",
                   help="parallel: each depth weighs the same, or each kept row (depth j ~ cod-ratio**j)")
    p.add_argument("--layers", type=int, default=1,
                   help="parallel: the head's layers (num_hidden_layers): the midlayer, then decoder layers")
    p.add_argument("--init-from", type=pathlib.Path,
                   help="parallel: start from this one-layer EAGLE-3 (chain) head folder of the same shape: its "
                        "midlayer is layer 0; mask_hidden is new, layers after the first start as identities. "
                        "dflash: go on training this DFlash folder (--layers must be its layers)")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="auto: on for CUDA")
    p.add_argument("--eval-windows", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    began = time.perf_counter()
    device = torch.device(args.device)
    cfgs = TINY if args.tiny else dict(target=TARGET, eagle3=EAGLE3, draft=DRAFT, peagle3=PEAGLE3, dflash=DFLASH)
    compile = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda"
                else contextlib.nullcontext)  # CPU: fp32
    torch.manual_seed(args.seed)
    dirs = {k: args.out / v for k, v in NAMES.items()}
    args.out.mkdir(parents=True, exist_ok=True)

    train_tokens, held_out = (t.to(device) for t in corpus(args.stdlib))
    (args.out / "prompts.json").write_text(json.dumps(make_prompts(args.stdlib, args.prompts), indent=1) + "\n")
    log = dict(args={k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()},
               configs={k: c.to_dict() for k, c in cfgs.items()}, held_out=list(HELD_OUT),
               corpus=dict(train_tokens=train_tokens.numel(), held_out_tokens=held_out.numel()),
               torch=torch.__version__, python=platform.python_version(),
               device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
               compile=compile)

    def write_log() -> None:
        log["wall_s"] = round(time.perf_counter() - began, 1)
        (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")

    print(f"corpus: {train_tokens.numel():,} training tokens, {held_out.numel():,} held out "
          f"({time.perf_counter() - began:.1f}s)", flush=True)
    target_dir = args.target
    if target_dir is None:
        target = Llama(cfgs["target"]).to(device)
        init_weights(target)

        def target_loss(x):
            with autocast():
                logits, _ = llama_forward(target, x[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
            return loss, loss[None]

        log["target"] = train_phase("target", target_loss, [target], sampler(train_tokens, args.batch, args.seq_len + 1,
                                    args.seed), args.target_lr, args.target_seconds, args.target_steps, args.warmup,
                                    compile, args.log_every)
        target_dir = dirs["target"]
        save_bf16(target, target_dir)
        write_log()
    log["target_dir"] = str(target_dir)
    if args.dflash:
        cfg = dataclasses.replace(cfgs["dflash"], num_hidden_layers=args.layers)
        return train_dflash(args, cfg, target_dir, dirs["dflash"], train_tokens, held_out, log, began,
                            compile, autocast)
    if args.parallel:
        cfg = dataclasses.replace(cfgs["peagle3"], num_hidden_layers=args.layers)
        return train_parallel(args, cfg, target_dir, dirs["peagle3"], train_tokens, held_out, log, began,
                              compile, autocast)

    # Phase 2 trains against the target as shipped: bf16 weights (held in fp32).
    target = load(Llama, target_dir, device=device, dtype=torch.float32).requires_grad_(False)
    head, draft = Eagle3Head(cfgs["eagle3"]).to(device), Llama(cfgs["draft"]).to(device)
    init_weights(head)
    init_weights(draft)
    head.t2d.fill_(True)  # the draft vocabulary is the whole byte vocabulary: d2t stays 0
    head.embed_tokens.weight = target.model.embed_tokens.weight  # shared and frozen, as at inference

    def drafts_loss(x):
        with autocast():
            logits, head_logits, draft_logits = draft_outputs(target, head, draft, x, args.rollout)
        probs = logits.float().softmax(-1)
        # Step j's rows s >= j have an inference counterpart; row s's label is the target at s+1.
        head_steps = [soft_cross_entropy(hl[:, j:], probs[:, 1 + j:]).mean() for j, hl in enumerate(head_logits)]
        head_loss = sum(STEP_DECAY**j * loss for j, loss in enumerate(head_steps))
        draft_loss = soft_cross_entropy(draft_logits, probs).mean()
        return head_loss + draft_loss, torch.stack([head_loss, *head_steps, draft_loss])

    log["drafts"] = train_phase("eagle3+draft", drafts_loss, [head, draft],
                                sampler(train_tokens, args.drafts_batch, args.seq_len, args.seed + 1), args.drafts_lr,
                                args.drafts_seconds, args.drafts_steps, args.warmup, compile, args.log_every)
    log["drafts"]["loss_parts"] = ["eagle3 weighted", *[f"eagle3 step {j}" for j in range(args.rollout)], "draft"]
    save_bf16(head, dirs["eagle3"])
    save_bf16(draft, dirs["draft"])

    log["eval"] = evaluate(target, head.eval(), draft.eval(), held_out, args.seq_len, args.drafts_batch,
                           args.eval_windows, args.rollout, autocast)
    write_log()
    print(report(log["eval"]))
    print(f"wrote {', '.join(str(dirs[k]) for k in ('target', 'eagle3', 'draft'))}, prompts.json, train_log.json in "
          f"{log['wall_s']:.0f}s", flush=True)
    return log


def init_from_chain(head: ParallelEagle3Head, chain_dir: pathlib.Path) -> None:
    """Copy a one-layer chain EAGLE-3 head's weights (same shape) into the parallel head: its midlayer
    is layer 0, so depth 0 starts at the chain head's catch-up. Layers after the first get zero
    `o_proj` and `down_proj`: they add nothing until trained, so the head starts as the chain head.
    The embedding stays the target's; `mask_hidden` keeps its init."""
    chain = load(Eagle3Head, chain_dir, device=head.fc.weight.device, dtype=torch.float32,
                 shared={"embed_tokens.weight": head.embed_tokens.weight})
    shape = [f.name for f in dataclasses.fields(Eagle3Config) if f.name != "num_hidden_layers"]
    ours, theirs = ({n: getattr(c, n) for n in shape} for c in (head.config, chain.config))
    if theirs != ours or chain.config.num_hidden_layers != 1:
        raise ValueError(f"--init-from {chain_dir}: not a one-layer head of the parallel head's shape "
                         f"({dataclasses.asdict(chain.config)} against {ours}); train with the chain head's shape")
    state = {k: v for k, v in chain.state_dict().items() if k != "embed_tokens.weight"}
    if head.config.num_hidden_layers > 1:
        state = {k.replace("midlayer.", "layers.0.", 1) if k.startswith("midlayer.") else k: v for k, v in state.items()}
    missing, unexpected = head.load_state_dict(state, strict=False)
    later = [n for n, _ in head.named_parameters() if n.startswith("layers.") and not n.startswith("layers.0.")]
    if sorted(missing) != sorted(["embed_tokens.weight", "mask_hidden", *later]) or unexpected:
        raise ValueError(f"--init-from {chain_dir}: not a chain EAGLE-3 head of this layout "
                         f"(missing {missing}, unexpected {unexpected})")
    with torch.no_grad():
        for layer in head.decoder_layers[1:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def train_parallel(args, cfg: ParallelEagle3Config, target_dir, out_dir, train_tokens, held_out, log, began,
                   compile, autocast) -> dict:
    """Phase 2 with --parallel: the parallel head alone against the frozen target."""
    device = train_tokens.device
    target = load(Llama, target_dir, device=device, dtype=torch.float32).requires_grad_(False)
    head = ParallelEagle3Head(cfg).to(device)
    init_weights(head)
    nn.init.normal_(head.mask_hidden, 0.0, 0.02)
    head.t2d.fill_(True)
    head.embed_tokens.weight = target.model.embed_tokens.weight
    if args.init_from is not None:
        init_from_chain(head, args.init_from)
    log["configs"] = dict(target=target.config.to_dict(), peagle3=cfg.to_dict())

    def loss_fn(x):
        kl, weight = parallel_kl(head, target, x, args.depths, args.cod_ratio, autocast, args.weigh)  # [B, N], [N]
        sizes = cod_sizes(x.shape[1] - 1, args.depths, args.cod_ratio)
        per_row, labelled = kl.mean(0), (weight > 0).float()  # [N]
        per_depth = torch.stack([(k * v).sum() / v.sum() for k, v in zip(per_row.detach().split(sizes),
                                                                          labelled.split(sizes))])  # [depths]
        loss = (per_row * weight).sum()
        return loss, torch.cat([loss.detach()[None], per_depth])  # logged: the loss, mean KL at each depth

    log["parallel"] = train_phase("peagle3", loss_fn, [head], sampler(train_tokens, args.drafts_batch, args.seq_len,
                                  args.seed + 1), args.drafts_lr, args.drafts_seconds, args.drafts_steps, args.warmup,
                                  compile, args.log_every)
    log["parallel"]["loss_parts"] = [f"kl weighted by {args.weigh}", *[f"kl depth {j}" for j in range(args.depths)]]
    save_bf16(head, out_dir)
    log["eval"] = evaluate_parallel(target, head.eval(), held_out, args.seq_len, 16, args.eval_windows, args.depths,
                                    autocast)
    log["wall_s"] = round(time.perf_counter() - began, 1)
    (args.out / "train_log_parallel.json").write_text(json.dumps(log, indent=1) + "\n")
    print("held-out agreement with the target's arg-max per draft position:",
          " ".join(f"{a:.3f}" for a in log["eval"]["agreement"]))
    print(f"wrote {out_dir}, train_log_parallel.json in {log['wall_s']:.0f}s", flush=True)
    return log


def train_dflash(args, cfg: DFlashConfig, target_dir, out_dir, train_tokens, held_out, log, began,
                 compile, autocast) -> dict:
    """Phase 2 with --dflash: the block draft alone against the frozen target, over its embedding
    and lm_head."""
    device = train_tokens.device
    target = load(Llama, target_dir, device=device, dtype=torch.float32).requires_grad_(False)
    draft = DFlashDraft(cfg, target.model.embed_tokens, target.lm_head).to(device)
    own = [draft.fc, draft.hidden_norm, draft.layers, draft.norm]  # not the target's embedding and lm_head
    if args.init_from is not None:  # every tensor of the draft's own, or load_state_dict names what differs
        draft.load_state_dict(load_drafter(args.init_from, target).state_dict())
    else:
        for module in own:
            init_weights(module)
    k = cfg.block_size - 1
    weight = torch.exp(-torch.arange(k, device=device) / DFLASH_DECAY)
    weight = weight / weight.sum()  # [K]
    g = torch.Generator(device=device).manual_seed(args.seed + 2)
    log["configs"] = dict(target=target.config.to_dict(), dflash=cfg.to_dict())

    def loss_fn(x):
        anchors = torch.randperm(x.shape[1] - k, device=device, generator=g)[: args.blocks] + 1  # [M] in 1..L-K
        kl = dflash_kl(draft, target, x, anchors, k, autocast).mean((0, 1))  # [K]
        loss = (kl * weight).sum()
        return loss, torch.cat([loss.detach()[None], kl.detach()])

    log["dflash"] = train_phase("dflash", loss_fn, own, sampler(train_tokens, args.drafts_batch, args.seq_len,
                                args.seed + 1), args.drafts_lr, args.drafts_seconds, args.drafts_steps, args.warmup,
                                compile, args.log_every)
    log["dflash"]["loss_parts"] = ["kl weighted", *[f"kl draft {j + 1}" for j in range(k)]]
    tensors = {name: t.detach().to(torch.bfloat16) for name, t in draft.state_dict().items()
               if not name.startswith(("embed_tokens.", "lm_head."))}
    save(tensors, cfg, out_dir, max_shard_bytes=SHARD_BYTES)
    log["eval"] = evaluate_dflash(target, draft.eval(), held_out, args.seq_len, 16, args.eval_windows, k, autocast)
    log["wall_s"] = round(time.perf_counter() - began, 1)
    (args.out / "train_log_dflash.json").write_text(json.dumps(log, indent=1) + "\n")
    print("held-out agreement with the target's arg-max per draft:", " ".join(f"{a:.3f}" for a in log["eval"]["agreement"]),
          f"; a greedy block of {k} accepts {log['eval']['accepted_length']:.2f} tokens", flush=True)
    print(f"wrote {out_dir}, train_log_dflash.json in {log['wall_s']:.0f}s", flush=True)
    return log


if __name__ == "__main__":
    main()

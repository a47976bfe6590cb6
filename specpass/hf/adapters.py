"""A transformers causal LM behind specpass's `Target` and `Drafter` protocols, unmodified.

    target = HFTarget(model)        # verify: logits [B, T, V]; EAGLE-3 hidden states; a draft tree's verify
    drafter = HFDrafter(draft)      # a standalone draft with the target's vocabulary; a draft tree's steps

Both call the model's own forward with `position_ids` [B, T] (per request), a 4D mask and a
`PositionCache` (cache.py), so one batch holds requests at different positions, and a draft
tree's rows sit at the loop's slots under its mask (`specpass.TreeTarget`, `specpass.TreeDrafter`).
`check_model` and `check_tree` refuse, up front and with what to do, the models this cannot
drive exactly.
"""

from __future__ import annotations

import inspect
import weakref

import torch
import torch.nn as nn
from torch import Tensor

from specpass.hf.cache import PositionCache, causal, visible
from specpass.loop.protocols import hidden_indices

ATTENTION = ("sdpa", "eager")  # the implementations that read an arbitrary 4D mask
LAYER_TYPES = ("full_attention", "sliding_attention")


def check_model(model: nn.Module, role: str) -> None:
    """Raise ValueError / TypeError when specpass cannot drive `model` (role: "model" or "assistant_model")."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"{role} is a {type(model).__name__}, not a transformers PreTrainedModel: pass a causal LM "
                        "(e.g. AutoModelForCausalLM.from_pretrained(...))")
    config = model.config
    name = type(model).__name__
    if config.is_encoder_decoder:
        raise ValueError(f"{role} ({name}) is an encoder-decoder model; specpass drives decoder-only causal LMs")
    if getattr(config, "is_decoder", True) is False:  # only encoder-style configs carry the flag
        raise ValueError(f"{role} ({name}) has config.is_decoder=False: its attention is bidirectional, so a position's "
                         "logits change with the tokens after it and no cache of past keys serves it; load it with "
                         "is_decoder=True to use it as a causal LM")
    if getattr(model, "_is_stateful", False) or any(t not in LAYER_TYPES for t in _layer_types(config)):
        kinds = sorted(set(_layer_types(config)) - set(LAYER_TYPES)) or ["a recurrent state"]
        raise ValueError(f"{role} ({name}) keeps {', '.join(kinds)}: a rejected draft would have to be rolled "
                         "back out of its state, which the loop never does (it only overwrites K/V slots); "
                         "use an attention-only model")
    accepts = inspect.signature(model.forward).parameters
    missing = [p for p in ("position_ids", "attention_mask") if p not in accepts]
    if cache_keyword(model) is None:
        missing.append("cache (past_key_values before transformers 5.24)")
    if missing:
        raise ValueError(f"{role} ({name}).forward takes no {missing}: the loop passes per-request positions, "
                         "its own cache and a 4D mask")
    if config._attn_implementation not in ATTENTION:
        raise ValueError(f"{role} ({name}) uses attn_implementation={config._attn_implementation!r}, which does not "
                         f"read a 4D mask; load it with attn_implementation='sdpa' (or 'eager')")
    if not _causal(model):
        raise ValueError(f"{role} ({name}) is not causal: changing the last of three tokens changed the logits at "
                         "the two before it, so its attention reads later tokens and no cache of past keys serves "
                         "it; use a causal LM (an encoder's LM head: load it with is_decoder=True, in a "
                         "transformers version that honours it)")


_CAUSAL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its probe's answer


@torch.no_grad()
def _causal(model: nn.Module) -> bool:
    """Whether the model's logits at a position ignore the tokens after it, by a probe: the config
    flags that say so are not always honoured. A model the probe cannot run (its weights not
    materialized, say) passes: the loop then fails with its own reason."""
    if model not in _CAUSAL:
        first = next(iter(model.parameters()), None)
        vocab = getattr(model.config.get_text_config(), "vocab_size", None) or 8
        try:
            ids = torch.tensor([[1, 2, 3], [1, 2, 4]], device=first.device if first is not None else None) % vocab
            logits = model(input_ids=ids, use_cache=False).logits[:, :2].float()
        except Exception:
            return True
        _CAUSAL[model] = torch.allclose(logits[0], logits[1], rtol=1e-3, atol=1e-3 * float(logits.abs().max()))
    return _CAUSAL[model]


def cache_keyword(model: nn.Module) -> str | None:
    """The name `model.forward` takes its KV cache by: `cache` from transformers 5.24 on (where
    `past_key_values` is a deprecated alias), `past_key_values` before; None if neither."""
    accepts = inspect.signature(model.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in accepts), None)


def check_pair(model: nn.Module, assistant: nn.Module, tokenizers: tuple = (None, None)) -> None:
    """Raise ValueError when a standalone draft does not share the target's vocabulary: the same
    `vocab_size`, the same bos/eos/pad ids where both configs set them, and, when both tokenizers
    are given, the same vocabulary."""
    a, b = model.config, assistant.config
    problems = []
    if a.vocab_size != b.vocab_size:
        problems.append(f"vocab_size: the model has {a.vocab_size}, the assistant {b.vocab_size}")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        x, y = getattr(a, key, None), getattr(b, key, None)
        if x is not None and y is not None and x != y:
            problems.append(f"{key}: the model has {x}, the assistant {y}")
    if all(t is not None for t in tokenizers) and tokenizers[0].get_vocab() != tokenizers[1].get_vocab():
        problems.append("the two tokenizers map tokens to different ids")
    if problems:
        raise ValueError("the assistant model does not share the model's tokenizer:\n  " + "\n  ".join(problems)
                         + "\nspecpass verifies draft tokens id for id: use a draft trained with the same tokenizer")


def sliding_window(config, max_len: int) -> int | None:
    """The window every layer's mask gets, None for none. Refuses a mix of sliding and full layers
    whose window is shorter than the cache (the loop passes one mask to all layers)."""
    window = getattr(config, "sliding_window", None)
    types = set(_layer_types(config))
    if window is None or window >= max_len or types == {"full_attention"}:
        return None
    if "full_attention" in types:
        raise ValueError(f"the model mixes full-attention layers with {window}-token sliding windows, shorter than "
                         f"the {max_len}-slot cache; specpass passes one mask to every layer: shorten the prompt + "
                         f"max_new_tokens below {window} tokens")
    return window


def check_tree(model: nn.Module, role: str, steps: int, max_len: int) -> None:
    """Raise ValueError when a draft tree `steps` deep is not shallower than `model`'s sliding
    window: the mask cuts the window on slot numbers (cache.visible), and a tree's nodes sit at
    slots past their positions, which is exact only while every node lies within the window of its root."""
    window = sliding_window(model.config, max_len)
    if window is not None and steps >= window:
        raise ValueError(f"{role} ({type(model).__name__}) attends through a {window}-token sliding window, and a "
                         f"draft tree {steps} steps deep reaches past it from its root: use a TreeShape with "
                         f"steps < {window}")


def _layer_types(config) -> list[str]:
    return list(getattr(config, "layer_types", None) or [])


class HFTarget(nn.Module):
    """`specpass.Target` (and `specpass.TreeTarget`) over a transformers causal LM (its `forward`, unchanged)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.cache_keyword: str | None = None  # read in setup_caches, once per Decoder: `forward_tree` runs every step
        self.cache: PositionCache | None = None
        self.window: int | None = None
        # SDPA reads a bool mask; eager attention adds the mask to its scores
        self.mask_dtype = torch.bool if model.config._attn_implementation == "sdpa" else model.dtype

    def setup_caches(self, max_batch: int, max_len: int) -> None:
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit is not None and max_len > limit:  # a learned position table has no row past it (GPT-2)
            raise ValueError(f"the cache needs {max_len} positions (the longest prompt + max_new_tokens + what "
                             f"a round writes past them, `cache_slots`) "
                             f"but {type(self.model).__name__} was made for {limit} positions: lower max_new_tokens "
                             "or shorten the prompts")
        self.window = sliding_window(self.model.config, max_len)
        self.cache = PositionCache(self.model.config.num_hidden_layers, max_len)
        self.cache_keyword = cache_keyword(self.model)

    def forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        return self.forward_tree(tokens, positions, None, None, None)[0]

    def forward_with_hidden(self, tokens: Tensor, positions: Tensor, kind: str) -> tuple[Tensor, Tensor]:
        """-> (logits [B, T, V], hidden [B, T, n·H]): the `hidden_states` `kind` names, concatenated
        (`hidden_indices`)."""
        return self.forward_tree(tokens, positions, None, None, kind)

    def forward_tree(self, tokens: Tensor, positions: Tensor, slots: Tensor | None, mask: Tensor | None,
                     kind: str | None) -> tuple[Tensor, Tensor | None]:
        """`specpass.TreeTarget`'s verify, and every other call: tokens, positions (RoPE) [B, T],
        each row's K/V written at slots [B, T], seeing the slots `mask` [B, 1, T, S] bool marks
        (both None: slot = position, seeing slots up to it) -> (logits [B, T, V], the hidden
        states of `kind` [B, T, n·H], or None for kind None)."""
        self.cache.write_slots = positions if slots is None else slots
        seen = causal(positions, self.cache.slots) if mask is None else mask
        out = self.model(input_ids=tokens, position_ids=positions,
                         attention_mask=visible(positions, seen, self.window, self.mask_dtype),  # [B, 1, T, S]
                         **{self.cache_keyword: self.cache}, use_cache=True, output_hidden_states=kind is not None)
        if kind is None:
            return out.logits, None
        states = out.hidden_states
        return out.logits, torch.cat([states[i] for i in hidden_indices(kind, len(states) - 1)], dim=-1)

    def copy_slots(self, src: Tensor, dst: Tensor) -> None:
        """`specpass.TreeTarget`'s: every layer's slot dst[b, t] takes slot src[b, t]'s K/V ([B, T])."""
        self.cache.copy_slots(src, dst)


class HFDrafter(nn.Module):
    """`specpass.Drafter` (and `specpass.TreeDrafter`) over a standalone transformers causal LM
    with the target's vocabulary. Its catch-up is the plain forward, then one row per request: the
    gather that specpass's live-row pass moves up to right after the KV writes. It carries no
    hidden state."""

    hidden_kind = None

    def __init__(self, model: nn.Module):
        super().__init__()
        self.lm = HFTarget(model)

    def setup_caches(self, max_batch: int, max_len: int) -> None:
        self.lm.setup_caches(max_batch, max_len)

    def catch_up(self, tokens: Tensor, positions: Tensor, hidden: None, live: Tensor) -> tuple[Tensor, Tensor]:
        """[B, T] tokens, positions, [B] live -> (logits [B, V] of row live[b], an empty hidden [B, 0])."""
        logits = self.lm(tokens, positions)  # [B, T, V]
        row = logits[torch.arange(logits.shape[0], device=logits.device), live]  # [B, V]
        return row, row[:, :0]

    def draft_step(self, tokens: Tensor, positions: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """[B] token, [B] position -> (logits [B, V], the empty hidden passed in)."""
        return self.lm(tokens[:, None], positions[:, None])[:, 0], hidden

    def draft_tree_step(self, tokens: Tensor, positions: Tensor, slots: Tensor, hidden: Tensor,
                        mask: Tensor) -> tuple[Tensor, Tensor]:
        """A draft tree's frontier: tokens, positions, slots [B, T], mask [B, 1, T, S] -> (logits
        [B, T, V], the empty hidden passed in, [B, T, 0])."""
        return self.lm.forward_tree(tokens, positions, slots, mask, None)[0], hidden

    def to_target(self, ids: Tensor) -> Tensor:
        return ids

    def get_input_embeddings(self) -> nn.Embedding:
        return self.lm.model.get_input_embeddings()

"""`Decoder`'s checks of what it is given: each problem named, with what to do, before anything
is compiled or run."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from specpass.loop.distributed import Ranks
from specpass.loop.protocols import Target, require
from specpass.loop.compiling import COMPILERS
from specpass.loop.shapes import RoundSpec, round_shape
from specpass.loop.steps import is_int
from specpass.loop.tree import TreeShape
from specpass.options import Options
from specpass.sampling import per_request


def check_models(target: Any, drafter: Any) -> None:
    """The target and the drafter have the members the loop calls."""
    require(target, "target", Target, optional=("forward_with_hidden",))
    round_shape(drafter)
    if drafter is not None and drafter.hidden_kind is not None:
        require(target, "target", Target)  # the drafter reads the target's hidden states


def check_cache_size(name: str, value: Any) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 (a static cache size), got {value!r}")


def check_options(max_batch: Any, max_len: Any, compile: Any, compile_prefill: Any, skip_guards: Any,
                  regional: Any) -> None:
    check_cache_size("max_batch", max_batch)
    check_cache_size("max_len", max_len)
    if not (compile in COMPILERS if isinstance(compile, str) else callable(compile)):
        raise ValueError(f"compile must be one of {list(COMPILERS)} or a backend callable, got {compile!r}")
    for name, value in (("compile_prefill", compile_prefill), ("skip_guards", skip_guards), ("regional", regional)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")


def check_exact(exact: Any, compile: Any, compile_prefill: Any, group: Any, device: torch.device) -> None:
    """exact=True: specpass's backend compiles every step (its exact pass routes the kernels), on one process."""
    if not isinstance(exact, bool):
        raise ValueError(f"exact must be True or False, got {exact!r}")
    if not exact:
        return
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"exact=True runs on CPU and CUDA, not on {device.type}: its row-invariant kernels are "
                         "written for those two")
    if not (compile == "specpass" or isinstance(getattr(compile, "options", None), Options)):
        raise ValueError(f"exact=True needs compile='specpass' (or a specpass.backend(...)), got {compile!r}: "
                         "specpass's exact pass is what routes every sum to a row-invariant kernel")
    if not compile_prefill:
        raise ValueError("exact=True needs the prefill compiled (compile_prefill=True): an eager prefill adds in "
                         "cuBLAS's and ATen's orders, which change with the prompt lengths in the batch")
    if group is not None:
        raise ValueError("exact=True with group= (tensor parallel) is not supported: the all-reduce adds the ranks' "
                         "partial sums in an order the collective library chooses by message size, which the "
                         "rows per step change; run exact mode on one process")


def check_background(background_compile: Any, exact: bool, group: Any) -> None:
    """background_compile=True: its uncompiled rounds give the compiled rounds' tokens only where the
    sums need not be bit for bit the compiled ones, and every rank switches alike."""
    if not isinstance(background_compile, bool):
        raise ValueError(f"background_compile must be True or False, got {background_compile!r}")
    if background_compile and exact:
        raise ValueError("background_compile=True with exact=True is not supported: the uncompiled steps that run "
                         "until the compile lands add in ATen's orders, not exact mode's; drop one of them")
    if background_compile and group is not None:
        raise ValueError("background_compile=True with group= (tensor parallel) is not supported: each rank's "
                         "compile lands at its own round, and the ranks' logits would differ in between; "
                         "compile in the foreground")


def check_ranks_option(group: Any, check_ranks: Any) -> None:
    if not isinstance(check_ranks, bool):
        raise ValueError(f"check_ranks must be True or False, got {check_ranks!r}")
    if check_ranks and group is None:
        raise ValueError("check_ranks=True compares the ranks of a tensor-parallel Decoder: pass the process group "
                         "the models are sharded over as group=")


def device_of(target: Target) -> torch.device:
    parameter = next(iter(target.parameters()), None)
    if parameter is None:
        raise ValueError("the target has no parameters: the loop puts its state on the device of the target's")
    return parameter.device


@torch.no_grad()
def probe(target: Target, drafter: Any, max_batch: int, device: torch.device, ranks: Ranks | None = None) -> int:
    """One token through the target and the drafter before anything is compiled, so that models
    which do not fit fail here, named, not inside a kernel mid-decoding (on a GPU an id out of
    range is a device-side assert). Writes cache slots 0 and 1, which every prefill overwrites.
    With ranks, their logits are checked equal on every rank. -> the target's vocabulary size."""
    zeros = torch.zeros(max_batch, 1, dtype=torch.long, device=device)
    kind = drafter.hidden_kind if drafter is not None else None
    if kind is None:
        logits, hidden = target(zeros, zeros), None
    else:
        logits, hidden = target.forward_with_hidden(zeros, zeros, kind)
    V = logits.shape[-1]
    if drafter is None:
        if ranks is not None:
            ranks.check_models(logits, None)
        return V
    try:
        draft_logits, _ = drafter.catch_up(zeros, zeros + 1, hidden, zeros[:, 0])
    except Exception as exc:  # a shape mismatch somewhere inside the drafter
        reads = f"the target's {kind!r} hidden states {list(hidden.shape)}" if kind else "one token"
        reason = (str(exc).strip().splitlines() or [""])[0]
        sizes = " (its hidden sizes, e.g. EAGLE-3's target_hidden_size, must match the target's)" if kind else ""
        raise ValueError(f"the drafter does not fit the target: its catch_up fails on {reads} "
                         f"({type(exc).__name__}: {reason}). Use a drafter made for this target{sizes}") from exc
    if ranks is not None:
        ranks.check_models(logits, draft_logits)
    ids = drafter.to_target(torch.arange(draft_logits.shape[-1], device=device))
    if not torch.equal(ids.clamp(0, V - 1), ids):  # not .all().item(): tests count .item() as host syncs
        outside = ids[(ids < 0) | (ids >= V)]
        raise ValueError(f"the drafter's vocabulary does not fit the target's: to_target maps {len(outside)} of its "
                         f"{len(ids)} ids outside the target's {V} (e.g. {outside[:3].tolist()}); use a drafter "
                         "made for this target")
    embeddings = getattr(drafter, "get_input_embeddings", None)
    rows = embeddings().num_embeddings if embeddings is not None else V
    if rows < V:
        raise ValueError(f"the drafter embeds {rows} token ids but the target's vocabulary has {V}: it reads "
                         "every token the target emits; use a drafter made for this target")
    return V


def check_prompts(prompts: Sequence[Sequence[int]], limits: list[int], vocab_size: int, max_len: int,
                  spec: RoundSpec) -> list[list[int]]:
    """Each problem named, with what to do -> the prompts as lists of ints. spec: the rounds they run."""
    if len(prompts) == 0:
        raise ValueError("no prompts: pass a list of prompts, each a list of token ids")
    checked = []
    for i, (prompt, limit) in enumerate(zip(prompts, limits)):
        if isinstance(prompt, (str, bytes)):
            raise TypeError(f"prompt {i} is a {type(prompt).__name__}: encode the text to token ids first")
        ids = list(prompt)
        if not ids:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token (e.g. BOS)")
        # Plain ints in range: three passes in C (a Python loop per token is slow on a batch of long
        # prompts: docs/results.md, transformers models through specpass.generate).
        if not (all(type(t) is int for t in ids) and 0 <= min(ids) and max(ids) < vocab_size):
            for j, t in enumerate(ids):
                if not is_int(t) or not 0 <= t < vocab_size:
                    raise ValueError(f"prompt {i} holds {t!r} at index {j}, not a token id of the target's "
                                     f"vocabulary (ints 0..{vocab_size - 1}): encode it with the target's "
                                     "tokenizer")
            ids = [int(t) for t in ids]  # other integer types (numpy's)
        need = spec.cache_slots(len(ids), limit)
        if len(ids) >= max_len:
            raise ValueError(f"prompt {i} has {len(ids)} tokens but max_len is {max_len}: raise max_len "
                             f"(to {need} for max_new_tokens {limit}) or shorten the prompt")
        if need > max_len:
            raise ValueError(f"prompt {i} ({len(ids)} tokens) + max_new_tokens {limit} needs {need} cache "
                             f"slots at K {spec.k} (`cache_slots`), but max_len is {max_len}: raise max_len "
                             f"to {need}, or lower max_new_tokens or shorten the prompt")
        checked.append(ids)
    return checked


def check_position(position: Any, prompts: list[list[int]], limits: list[int], max_len: int,
                   spec: RoundSpec) -> None:
    """`Decoder.start(position=...)`: an int at or past every prompt's end, from which every request
    still fits the caches."""
    if not is_int(position) or position < 1:
        raise ValueError(f"position must be an int >= 1 (where every request continues after the prefill), "
                         f"got {position!r}")
    for i, (prompt, limit) in enumerate(zip(prompts, limits)):
        if position < len(prompt):
            raise ValueError(f"position {position} is inside prompt {i} ({len(prompt)} tokens): it moves requests "
                             f"forward, past their prompts; pass {len(prompt)} or more")
        need = spec.cache_slots(position, limit)
        if need > max_len:
            raise ValueError(f"position {position} + max_new_tokens {limit} (request {i}) needs {need} cache slots at "
                             f"K {spec.k} (`cache_slots`), but max_len is {max_len}: raise max_len to {need}, or lower "
                             "position or max_new_tokens")


def check_tuning(ks: Sequence[Any], acceptance: Sequence[Any] | None, new_tokens: Any, repeats: Any,
                 max_timings: Any) -> list[int]:
    """`Decoder.tune_k`'s arguments -> the K to time, sorted."""
    timed = sorted(set(ks)) if all(is_int(k) and k >= 1 for k in ks) else []
    if len(timed) < 2:
        raise ValueError(f"ks must hold two or more different K >= 1 to time (a line through their costs), "
                         f"got {list(ks)!r}")
    if acceptance is not None and (len(acceptance) == 0 or not all(
            isinstance(a, numbers.Real) and 0 <= a <= 1 for a in acceptance)):
        raise ValueError(f"acceptance must list, per draft position 1..N, the fraction of request-rounds "
                         f"accepting it (Metrics.acceptance: floats in [0, 1]), got {acceptance!r}")
    check_timing(*new_tokens, repeats)
    if not is_int(max_timings) or max_timings < 0:
        raise ValueError(f"max_timings (K timed by the search beyond ks) must be an int >= 0, got {max_timings!r}")
    return timed


def check_timing(short: Any, long: Any, repeats: Any) -> None:
    """The new tokens of the short and the long generate a round is timed by, and the repeats."""
    if not (is_int(short) and is_int(long) and 1 <= short < long) or not is_int(repeats) or repeats < 1:
        raise ValueError(f"the new tokens of the two generates timed must be ints short, long with 1 <= short < long "
                         f"and repeats an int >= 1, got {short!r}, {long!r}, {repeats!r}")


SAMPLING_ARGUMENTS = ("temperature", "top_k", "top_p", "seed")


def check_processors(min_new_tokens: Any, repetition_penalty: Any, penalty_context: Any, no_repeat_ngram_size: Any,
                     prefix_context: Any, logits_processor: Any, prompts: list[list[int]], vocab: int, max_len: int,
                     compiles: bool, sharded: bool,
                     ) -> tuple[list[int], list[float], list[list[int]], int, list[list[int]], Callable | None]:
    """generate's logits processors, one value for all requests or one each -> (min_new_tokens,
    repetition penalties, the ids each penalty reads before the emitted ones, the n-gram size, the
    ids the n-gram ban and logits_processor read before the emitted ones, logits_processor)."""
    B = len(prompts)
    min_new = per_request(min_new_tokens, B, "min_new_tokens", int, lambda v: v >= 0, ">= 0 (0: off)")
    penalty = per_request(repetition_penalty, B, "repetition_penalty", float, lambda p: 0 < p < float("inf"),
                          "> 0 and finite (1: off; transformers' rule: > 1 penalizes repeats)")
    if not is_int(no_repeat_ngram_size) or no_repeat_ngram_size < 0:
        raise ValueError(f"no_repeat_ngram_size must be an int >= 0 (0: off), got {no_repeat_ngram_size!r}")
    if logits_processor is not None and not callable(logits_processor):
        raise ValueError(f"logits_processor must be callable as (input_ids, scores) -> scores (a transformers "
                         f"LogitsProcessorList), got {logits_processor!r:.200}")
    if logits_processor is not None and (compiles or sharded):
        raise ValueError("logits_processor runs on the host at every verified position, which a compiled step "
                         "cannot call out to: use Decoder(compile='eager') (one process), or the processors "
                         "that run compiled (min_new_tokens, repetition_penalty, no_repeat_ngram_size)")
    prefix_context = _context("prefix_context", prefix_context, prompts, vocab, "the n-gram ban and logits_processor")
    if logits_processor is not None and not all(prefix_context):
        raise ValueError("prefix_context holds an empty row: logits_processor reads each request's prefix, which "
                         "is never empty (transformers passes input_ids)")
    if (no_repeat_ngram_size or logits_processor is not None) and max(map(len, prefix_context)) >= max_len:
        raise ValueError(f"prefix_context holds {max(map(len, prefix_context))} ids, as many as the caches' {max_len} "
                         "slots or more: it must leave room for the new tokens")
    return (min_new, penalty, _context("penalty_context", penalty_context, prompts, vocab, "the repetition penalty"),
            no_repeat_ngram_size, prefix_context, logits_processor)


def _context(name: str, context: Any, prompts: list[list[int]], vocab: int, reader: str) -> list[list[int]]:
    """The ids a processor reads before the emitted ones, per request (None: the prompts), checked."""
    if context is None:
        return prompts
    rows = [list(ids) for ids in context] if isinstance(context, Sequence) else None
    if rows is None or len(rows) != len(prompts) or not all(is_int(t) and 0 <= t < vocab for ids in rows for t in ids):
        raise ValueError(f"{name} must hold one sequence of token ids in [0, {vocab}) per prompt ({len(prompts)}), "
                         f"the ids {reader} reads before the emitted ones; got {context!r:.200}")
    return rows


def check_sampling(sampling: Any) -> dict[str, Any]:
    """The generate arguments a round is timed with: a mapping of some of SAMPLING_ARGUMENTS, or None (greedy)."""
    if sampling is None:
        return {}
    if not isinstance(sampling, Mapping) or set(sampling) - set(SAMPLING_ARGUMENTS):
        raise ValueError(f"sampling must be None or a mapping of generate's {', '.join(SAMPLING_ARGUMENTS)}, "
                         f"got {sampling!r}")
    return dict(sampling)

"""`specpass.generate`: speculative decoding of a transformers causal LM, in `model.generate`'s terms.

    out = specpass.generate(model, input_ids, attention_mask=mask, assistant_model=draft, max_new_tokens=64)
    specpass.generate.cache.clear()   # frees the compiled Decoders it keeps (and the models they hold)

Left-padded `input_ids` [B, P] and `attention_mask` in; prompt + new tokens out, [B, P + N], rows
that stop early padded with `pad_token_id`, as `model.generate` returns them. do_sample=True samples
with `temperature`, `top_k`, `top_p` (the model's generation_config's where not given, as
`generate` takes them) and `seed`; speculative sampling keeps that distribution exactly.
The loop is specpass's `Decoder` (specpass/loop/) over the adapters in adapters.py.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from specpass.compile_backend import backend as specpass_backend, warn
from specpass.hf.adapters import HFDrafter, HFTarget, check_model, check_pair, check_tree
from specpass.loop import Decoder, Metrics, State, TreeShape, round_spec
from specpass.loop.checks import check_cache_size
from specpass.loop.shapes import aligned
from specpass.report import Report, collecting_reports
from specpass.tensor_parallel import follow, localize, shard

SAMPLING = ("temperature", "top_k", "top_p", "seed")
# Applied inside the round (loop/processors.py)
PROCESSORS = ("min_new_tokens", "min_length", "repetition_penalty", "no_repeat_ngram_size")
# eos_token_id's default: the generation config's (an explicit None is no EOS, as in model.generate)
FROM_CONFIG = type("FromGenerationConfig", (), {"__repr__": lambda self: "<the generation config's>"})()
# The requests a new Decoder's caches hold: later calls of up to as many reuse its compiled steps;
# more grow the caches (to twice as many rows at least), which compiles the steps again.
ROWS = 8


@dataclasses.dataclass
class GenerateOutput:
    """What `generate(..., return_dict_in_generate=True)` returns."""

    sequences: Tensor  # [B, P + N] prompt + new tokens, padded
    metrics: Metrics  # accepted length, acceptance per draft position, tokens/s, ms per round
    # Per compiled step (prefill, draft, verify, accept, catch_up): what specpass rewrote; a pass
    # dropped ("[error] ...") or the step compiled without rewrites ("[fallback] ...") says why.
    rewrites: dict[str, list[str]]


class _Entry(NamedTuple):
    decoder: Decoder
    recorder: _Recorder
    models: tuple[Any, Any]  # the model and the assistant: held, so their ids in the key cannot be reused


class DecoderCache:
    """The compiled Decoders `generate` keeps for reuse, one per configuration (the model and the
    assistant, K or the tree shape, cache length, compile options; not the batch size: a Decoder's
    steps are compiled with the batch symbolic and serve every size, its caches growing past
    `ROWS` requests; without a `cache_len` a call takes a kept Decoder whose cache is long enough,
    so shorter prompts compile nothing either), each holding its models, KV caches and compiled
    graphs (CUDA graphs on a GPU: one recorded per batch size); the least recently used is dropped
    beyond `keep`.

        specpass.generate.cache                  the one `generate` uses by default (keep=4)
        len(cache), list(cache)                  its Decoders, least recently used first
        cache.clear()                            drop them all: the models are freed once nothing else holds them
        mine = specpass.DecoderCache(keep=1)     your own: generate(..., decoder_cache=mine)
    """

    def __init__(self, keep: int = 4):
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
            raise ValueError(f"keep (compiled Decoders kept) must be an int >= 0, got {keep!r}")
        self.keep = keep
        self._entries: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Decoder]:
        return iter([entry.decoder for entry in self._entries.values()])

    def __repr__(self) -> str:
        return f"DecoderCache(keep={self.keep}, holding {len(self)})"

    def clear(self) -> None:
        self._entries.clear()

    def _slots(self, config: tuple, need: int) -> int | None:
        """The shortest cache of at least `need` slots among the kept Decoders of `config`, if any."""
        return min((slots for (kept, slots) in self._entries if kept == config and slots >= need), default=None)

    def _get(self, key: tuple, models: tuple[Any, Any], build: Callable[[], tuple[Decoder, _Recorder]]) -> _Entry:
        """The entry for key, built when missing (after dropping the least recently used beyond keep - 1,
        so that their caches are freed before new ones are allocated)."""
        entry = self._entries.get(key)
        if entry is None:
            while self._entries and len(self._entries) >= self.keep:
                self._entries.popitem(last=False)
            entry = _Entry(*build(), models)
            if self.keep:
                self._entries[key] = entry
        else:
            self._entries.move_to_end(key)
        return entry


@torch.no_grad()
def generate(model: nn.Module, input_ids: Tensor, *, max_new_tokens: int, attention_mask: Tensor | None = None,
             assistant_model: Any = None, num_assistant_tokens: int | TreeShape = 4,
             eos_token_id: int | list[int] | None = FROM_CONFIG, pad_token_id: int | None = None,
             do_sample: bool | None = None, generation_config: Any = None,
             tokenizer: Any = None, assistant_tokenizer: Any = None, compile: str | Callable = "specpass",
             mode: str | None = None, fused_round: bool | None = None, cache_len: int | None = None,
             max_batch: int | None = None, return_dict_in_generate: bool = False,
             decoder_cache: DecoderCache | None = None, exact: bool = False, streamer: Any = None,
             background_compile: bool = False, logits_processor: Any = None,
             **sampling: Any) -> Tensor | GenerateOutput:
    """Lossless speculative decoding of `model`, greedy or sampled; see docs/hf.md.

    assistant_model: None (plain decoding, compiled the same way), a transformers causal LM with the
      model's tokenizer (a standalone draft), or any `specpass.Drafter`, e.g. an
      EAGLE-3 head (`models.drafters.ZooDrafter`), which reads the model's hidden states.
    num_assistant_tokens: K, the drafts per round, or a `specpass.TreeShape(topk, steps, tokens)`:
      tree rounds (a drafted tree verified whole; the assistant must be a `specpass.TreeDrafter`,
      as a standalone draft and an EAGLE-3 head are). eos_token_id (an id or a list: any stops a
      request; None: no EOS, as model.generate takes an explicit None), pad_token_id, do_sample:
      default the generation config's: `generation_config`, else the model's, as `model.generate`
      reads them; a field of it that changes tokens and that specpass does not apply
      (no_repeat_ngram_size, bad_words_ids, ...) is refused by name, never ignored.
    min_new_tokens, min_length, repetition_penalty, no_repeat_ngram_size: transformers' logits
      processors, applied at every verified position with the prefix plain decoding has there
      (loop/processors.py).
    logits_processor: any other transformers processor (a `LogitsProcessorList`, e.g. a grammar's),
      applied after those above at every verified position with its prefix as input_ids (one
      request at a time); it runs on the host, so the steps run uncompiled (compile="eager").
    stop_strings (with tokenizer=): a request stops after the token that completes one, as with
      transformers' `StopStringCriteria`.
      streamer: transformers' streamer protocol, one request, a round's tokens at a time.
      tokenizer, assistant_tokenizer: when both are given, their vocabularies
      must be the same. compile: "specpass", "inductor", "eager" or a backend callable; mode,
      fused_round: default CUDA graphs ("reduce-overhead") and the fused round on a GPU.
    cache_len: the static cache length. Default: the slots the call needs (the longest prompt +
      max_new_tokens + 2K + 1, 3K for a parallel drafter, steps - 1 + max(tokens, steps + 2 +
      (steps - 1) * topk) for a tree: the round shape's `cache_slots`) served by the shortest kept
      Decoder that has as many, else rounded up to a quarter of its power of two (5/8 to 8/8 of it;
      within the models' max_position_embeddings) for a new one: prompts of other lengths reuse the
      compiled steps, at the cost of attention over up to a quarter more slots than needed. A fixed
      one is used as given.
    max_batch: the most requests a call will bring. The caches hold max(it, the call's, `ROWS`)
      requests, and every batch size up to that reuses the compiled steps; a call that brings more
      grows them (to twice as many at least) and compiles the steps again (their capacity is static:
      docs/hf.md). Give the largest batch you serve, at the first call.
    decoder_cache: where the compiled Decoders are kept for the next call (default `generate.cache`,
      which keeps 4; a `DecoderCache` of your own, or `DecoderCache(keep=0)` to keep none).
    exact: exact mode (`Decoder`'s): the model's logits bit for bit those of plain decoding in exact
      mode, whatever the assistant and the batch; needs compile="specpass" and one process.
    background_compile: decode at once with the steps uncompiled while they compile on a worker
      thread, and switch to them between rounds as they land (`Decoder`'s; not with exact mode).
    sampling (with do_sample=True): `temperature`, `top_k`, `top_p` (default: the model's
      generation_config's, as `generate`), `seed` (the same seed gives the same tokens).
    """
    check_model(model, "model")
    standalone = isinstance(assistant_model, PreTrainedModel)  # else None or a specpass Drafter
    if standalone:
        check_model(assistant_model, "assistant_model")
        check_pair(model, assistant_model, (tokenizer, assistant_tokenizer))
    if "draft_tree" in sampling:
        raise TypeError("generate() takes tree rounds as num_assistant_tokens=specpass.TreeShape(topk, steps, tokens), "
                        "not draft_tree=")
    drafter = HFDrafter(assistant_model) if standalone else assistant_model
    spec = round_spec(drafter, num_assistant_tokens if drafter is not None else 0, "num_assistant_tokens")
    k = spec.k
    prompts = _prompts(input_ids, attention_mask)
    config = _generation_config(model, generation_config)
    stop_strings = sampling.pop("stop_strings", None)
    stop_strings = stop_strings if stop_strings is not None else config.stop_strings
    eos = _eos(config, eos_token_id)
    on_round = _in_order(_stopping(stop_strings, tokenizer, input_ids, eos) if stop_strings is not None else None,
                         _streaming(streamer, input_ids) if streamer is not None else None)
    pad = next((p for p in (pad_token_id, config.pad_token_id, *eos[:1]) if p is not None), None)
    processors = {name: sampling.pop(name) for name in PROCESSORS if name in sampling}
    options = _sampling(config, do_sample if do_sample is not None else bool(config.do_sample), sampling)
    options |= _processors(config, processors, input_ids, prompts)
    if logits_processor is not None and not (isinstance(logits_processor, list) and not logits_processor):
        if exact:
            raise ValueError("exact=True with logits_processor is not supported: the processor runs on the host, "
                             "so the steps run uncompiled, and exact mode needs them compiled")
        warn("logits_processor runs on the host at every verified position (a round trip each): the steps run "
             "uncompiled")
        options |= {"logits_processor": logits_processor, "prefix_context": input_ids.tolist()}
        compile = "eager"

    need = spec.cache_slots(max(map(len, prompts)), max_new_tokens)
    if cache_len is not None and cache_len < need:
        raise ValueError(f"cache_len {cache_len} is shorter than the {need} slots the longest prompt + max_new_tokens "
                         f"need at K {k} (`cache_slots`): raise it to {need} or more")
    if max_batch is not None:
        check_cache_size("max_batch", max_batch)
    cache = decoder_cache if decoder_cache is not None else generate.cache
    config = (id(model), id(assistant_model), k, compile, mode, fused_round, exact, background_compile)  # any B
    slots = cache_len or cache._slots(config, need) or _new_slots(need, (model, assistant_model))
    if isinstance(k, TreeShape):
        check_tree(model, "model", k.steps, slots)
        if standalone:
            check_tree(assistant_model, "assistant_model", k.steps, slots)
    cuda = model.device.type == "cuda"
    mode = mode if mode is not None else "reduce-overhead" if cuda else None
    fused_round = fused_round if fused_round is not None else cuda

    def build() -> tuple[Decoder, _Recorder]:
        backend = specpass_backend() if compile == "specpass" else compile
        # tp_plan="auto": the local shards, so that the passes see the graph (DTensors cannot be captured)
        target, group = localize(model) if any(isinstance(p, DTensor) for p in model.parameters()) else (model, None)
        held = _drafter_at_tp(drafter, model, target, group) if group is not None else drafter
        return Decoder(HFTarget(target), held, k=spec, max_batch=max(len(prompts), max_batch or ROWS), max_len=slots,
                       compile=backend, mode=mode, fused_round=fused_round, group=group, exact=exact,
                       background_compile=background_compile), _Recorder()

    decoder, recorder, _ = cache._get((config, slots), (model, assistant_model), build)
    if max_batch is not None:
        decoder.reserve(max_batch)  # a kept Decoder: grown where this call asks for more

    with collecting_reports() as reports:
        out = decoder.generate(prompts, max_new_tokens, eos_id=[eos] * len(prompts), on_round=on_round, **options)
    if streamer is not None:
        streamer.end()
    recorder.add(reports)
    width = max(map(len, out.tokens))
    # pad is None only without an EOS: then every row has the same length and no padding.
    # Built on the host and copied once: a copy per row costs a transfer each on a GPU.
    new = torch.full((len(prompts), width), -1 if pad is None else pad, dtype=input_ids.dtype)
    for b, tokens in enumerate(out.tokens):
        new[b, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    sequences = torch.cat([input_ids, new.to(input_ids.device)], 1)
    if not return_dict_in_generate:
        return sequences
    return GenerateOutput(sequences, out.metrics, dict(recorder.fired))


generate.cache = DecoderCache(keep=4)


def _drafter_at_tp(drafter: Any, model: nn.Module, local: nn.Module, group) -> Any:
    """A drafter for the local shards `local` of a tp_plan="auto" `model`: one holding `model`'s
    modules (a DFlash draft's embedding and lm_head, an EAGLE-3 head's embedding) as a copy holding
    the local copy's (`follow`), its own layers sharded as the target's are (`shard`), or replicated
    where a size does not split (warned). Any other (a standalone draft) as it is: replicated."""
    if not isinstance(drafter, nn.Module) or (held := follow(drafter, model, local)) is drafter:
        return drafter
    try:
        return shard(held, group)  # shard_plan's check raises before anything is changed
    except ValueError as exc:
        warn(f"the drafter runs whole on every rank ({exc})")
        return held


def _new_slots(need: int, models: tuple[Any, Any]) -> int:
    """A new Decoder's cache length for `need` slots: rounded up to 5/8, 6/8, 7/8 or 8/8 of the next
    power of two, so that a few lengths serve every prompt while attention, which reads every slot,
    reads at most a quarter more than needed (the next power of two itself: up to twice); a multiple
    of 16 (the split-KV kernel's aligned mask rows), within the models' position tables (a learned
    one has no row past them)."""
    limits = [getattr(getattr(m, "config", None), "max_position_embeddings", None) for m in models]
    step = max(16, 1 << max(0, (need - 1).bit_length() - 3))
    slots = -(-need // step) * step
    bound = min((limit for limit in limits if isinstance(limit, int)), default=slots)
    return max(aligned(need), min(slots, bound // 16 * 16))


def _prompts(input_ids: Tensor, attention_mask: Tensor | None) -> list[list[int]]:
    """[B, P] left-padded ids and mask -> each row's prompt (the ids where the mask is 1)."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise TypeError(f"input_ids must be a [batch, length] tensor of token ids, got {_describe(input_ids)}")
    if attention_mask is None:
        return input_ids.tolist()
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {list(attention_mask.shape)} must have input_ids' shape "
                         f"{list(input_ids.shape)}")
    input_ids, mask = input_ids.cpu(), attention_mask.cpu().bool()  # one transfer each, not a sync per check and row
    if not (mask[:, :-1] <= mask[:, 1:]).all() or not mask[:, -1].all():
        raise ValueError("attention_mask must be left padding (zeros, then ones to the end of each row, at least "
                         "one): pad prompts on the left, as transformers' generate expects "
                         "(tokenizer.padding_side = 'left')")
    return [row[m].tolist() for row, m in zip(input_ids, mask)]


def _streaming(streamer: Any, input_ids: Tensor) -> Callable[[State], None]:
    """transformers' streamer protocol: the prompt first (`put(input_ids)`, which a `TextStreamer` with
    skip_prompt=True skips) once the prefill ran, then the first token and each round's new tokens
    [1, n] as the round lands; `generate` calls `end()`. One request, as transformers' streamers take."""
    if not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
        raise TypeError(f"streamer is a {type(streamer).__name__}, which lacks put() and end(): pass a transformers "
                        "streamer (TextStreamer, TextIteratorStreamer) or an object with both")
    if input_ids.shape[0] != 1:
        raise ValueError(f"streamer= takes one request (batch size 1), as transformers' streamers do; got "
                         f"{input_ids.shape[0]}: stream each request in a call of its own")
    sent = -1  # the prompt not yet handed over

    def on_round(state: State) -> None:
        nonlocal sent
        if sent < 0:
            streamer.put(input_ids.cpu())
            sent = 0
        count = int(state.count[0])  # the round's one more host sync
        if count > sent:
            streamer.put(state.out[:1, sent:count].to("cpu", input_ids.dtype))
            sent = count

    return on_round


def _stopping(stop_strings: str | list[str], tokenizer: Any, input_ids: Tensor,
              eos: list[int]) -> Callable[[State], None]:
    """transformers' stop strings: a request stops after the token that completes one of them
    (`StopStringCriteria`, which reads the end of input_ids: the padded prompt, then the new tokens),
    that token kept. After each round, every new position of every request is checked in order.
    With EOS ids, the first position that completes a stop string cuts the request's count there and
    marks it done (transformers pads after it). Without, transformers pads nothing: every request
    goes on until all have stopped, and the call ends at the last one's stop; so each request's
    budget becomes that position once all have one. The tokens up to there are plain decoding's;
    what the rounds emitted past it is dropped."""
    from transformers.generation.stopping_criteria import StopStringCriteria

    if tokenizer is None:
        raise ValueError("stop_strings needs the model's tokenizer: pass tokenizer= (as model.generate asks)")
    criteria = StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)
    rows = input_ids.cpu()
    checked = [0] * len(rows)  # new tokens checked so far, per request
    stops: list[int | None] = [None] * len(rows)  # the tokens up to each request's first stop

    def cut(state: State, b: int, at: int, count: int) -> None:
        if count >= at:
            state.count[b], state.done[b] = at, True
        else:
            state.limit[b] = at

    def on_round(state: State) -> None:
        counts = state.count[: len(rows)].tolist()
        if counts == checked or all(s is not None for s in stops):
            return
        out = state.out[: len(rows), : max(counts)].cpu()
        for b, count in enumerate(counts):
            for i in range(checked[b], count if stops[b] is None else 0):
                if bool(criteria(torch.cat([rows[b], out[b, : i + 1]])[None], None)[0]):
                    stops[b] = i + 1
                    if eos:
                        cut(state, b, i + 1, count)
                    break
            checked[b] = count
        if not eos and all(s is not None for s in stops):
            for b, count in enumerate(counts):
                cut(state, b, max(stops), count)

    return on_round


def _in_order(*calls: Callable[[State], None] | None) -> Callable[[State], None] | None:
    """One on_round callback that runs the given ones (None: none) in order."""
    calls = [call for call in calls if call is not None]
    if len(calls) <= 1:
        return calls[0] if calls else None

    def on_round(state: State) -> None:
        for call in calls:
            call(state)

    return on_round


# Fields of a generation config that change no token of a call specpass runs: what is returned,
# the cache, the length cap that max_new_tokens overrides, the assistant's own schedule; and the
# ones it reads. Any other field set away from its default is refused by name.
_READ = {"eos_token_id", "pad_token_id", "do_sample", "temperature", "top_k", "top_p", "stop_strings", *PROCESSORS}
_NO_EFFECT = {"_from_model_config", "transformers_version", "bos_token_id", "decoder_start_token_id", "max_length",
              "max_new_tokens", "use_cache", "cache_implementation", "cache_config", "max_cache_len",
              "compile_config", "disable_compile", "return_dict_in_generate", "output_attentions",
              "output_hidden_states", "output_scores", "output_logits", "num_assistant_tokens",
              "num_assistant_tokens_schedule", "assistant_confidence_threshold", "is_assistant", "low_memory",
              "prefill_chunk_size"}


def _generation_config(model: nn.Module, given: Any) -> Any:
    """The generation config `model.generate` would read (`given`, else the model's), checked: a field
    that changes tokens and that specpass does not apply is refused by name."""
    config = given if given is not None else model.generation_config
    if not hasattr(config, "to_diff_dict"):
        raise TypeError(f"generation_config is a {type(config).__name__}, not a transformers GenerationConfig")
    unapplied = sorted(set(config.to_diff_dict()) - _READ - _NO_EFFECT)
    if unapplied:
        where = "generation_config" if given is not None else "the model's generation_config"
        values = ", ".join(f"{name}={getattr(config, name)!r}" for name in unapplied)
        raise ValueError(f"{where} sets {values}, which specpass.generate does not apply (its tokens would not be "
                         "model.generate's): pass a generation_config without it, or set it back to its default "
                         "on model.generation_config")
    return config


def _eos(config: Any, eos_token_id: Any) -> list[int]:
    """The EOS ids, any of which stops a request (transformers': the argument, None included, else
    the generation config's; an int or a list)."""
    eos = eos_token_id if eos_token_id is not FROM_CONFIG else config.eos_token_id
    if eos is None:
        return []
    ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id must be a token id (an int >= 0) or a list of them, got {eos!r}")
    return ids


def _sampling(config: Any, do_sample: bool, sampling: dict[str, Any]) -> dict[str, Any]:
    """The sampling keywords for `Decoder.generate`; {} for greedy decoding. Unset ones are the
    generation_config's (transformers' defaults: temperature 1, top_k 50, top_p 1)."""
    unknown = sorted(set(sampling) - set(SAMPLING))
    unapplied = [name for name in unknown if hasattr(config, name) or name in _generate_parameters()]
    if unapplied:
        raise ValueError(f"specpass.generate does not apply {', '.join(unapplied)} (model.generate's "
                         f"generation options it takes: eos_token_id, pad_token_id, do_sample, {', '.join(SAMPLING)}, "
                         f"{', '.join(PROCESSORS)}, logits_processor, stop_strings, max_new_tokens, streamer, "
                         "generation_config)")
    if unknown:
        raise TypeError(f"generate() got unexpected keyword arguments {unknown}")
    if not do_sample:
        if any(sampling.get(name) is not None for name in ("temperature", "top_k", "top_p")):
            raise ValueError("temperature, top_k and top_p take effect with do_sample=True (as in transformers' "
                             "generate); without it decoding is greedy")
        return {}
    chosen = {name: sampling[name] if sampling.get(name) is not None else getattr(config, name, None)
              for name in ("temperature", "top_k", "top_p")}
    return {name: value for name, value in {**chosen, "seed": sampling.get("seed")}.items() if value is not None}


def _processors(config: Any, given: dict[str, Any], input_ids: Tensor, prompts: list[list[int]]) -> dict[str, Any]:
    """The logits processors `model.generate` would add for these options (the argument, else the
    generation config's), as `Decoder.generate` takes them (and checks them): min_length counts the
    padded prompt's columns (input_ids' width), min_new_tokens the new tokens only; the repetition
    penalty reads the prompt, its left padding too where the installed transformers does."""
    chosen = {name: given[name] if given.get(name) is not None else getattr(config, name, None) for name in PROCESSORS}
    options: dict[str, Any] = {}
    min_new, min_length = chosen["min_new_tokens"] or 0, chosen["min_length"] or 0
    if min_length:  # the one option Decoder.generate does not take: checked here
        if not isinstance(min_length, int) or isinstance(min_length, bool) or min_length < 0:
            raise ValueError(f"min_length must be an int >= 0, got {min_length!r}")
        if isinstance(min_new, int):  # else Decoder.generate names it
            min_new = max(min_new, min_length - input_ids.shape[1])
    if min_new:
        options["min_new_tokens"] = min_new
    penalty = chosen["repetition_penalty"]
    if penalty is not None and penalty != 1.0:
        options["repetition_penalty"] = penalty
        options["penalty_context"] = prompts if _penalty_skips_padding() else input_ids.tolist()
    if chosen["no_repeat_ngram_size"]:  # it reads input_ids whole, padding included
        options["no_repeat_ngram_size"] = chosen["no_repeat_ngram_size"]
        options["prefix_context"] = input_ids.tolist()
    return options


@functools.cache
def _penalty_skips_padding() -> bool:
    """Whether transformers' repetition penalty leaves a left-padded prompt's padding out: `generate`
    passes each row's padding length as `prompt_ignore_length` where the processor takes one per row
    (newer transformers); an older one reads input_ids whole, padding included."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    try:
        RepetitionPenaltyLogitsProcessor(2.0, prompt_ignore_length=torch.tensor([1]))
    except (TypeError, ValueError):
        return False
    return True


def _generate_parameters() -> set[str]:
    """The named parameters of transformers' `model.generate` (logits_processor, stopping_criteria, ...)."""
    from transformers.generation.utils import GenerationMixin

    return set(inspect.signature(GenerationMixin.generate).parameters) - {"self", "kwargs"}


def _describe(x: Any) -> str:
    return f"a tensor of shape {list(x.shape)}" if isinstance(x, Tensor) else f"a {type(x).__name__}"


class _Recorder:
    """Per compiled step, the rewrites specpass reported for a kept Decoder's graphs (compiled, or
    loaded with the saved steps), a pass that failed and a step compiled without rewrites among them."""

    def __init__(self) -> None:
        self.fired: dict[str, list[str]] = {}

    def add(self, reports: list[tuple[str, Report]]) -> None:
        for step, report in reports:
            lines = [f"[error] {error}" for error in report.errors]
            lines += [f"[fallback] {report.fallback}"] if report.fallback else map(str, report.rewrites)
            self.fired.setdefault(step, []).extend(lines)

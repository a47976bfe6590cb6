"""Loading a public EAGLE-3, P-EAGLE or DFlash checkpoint folder as a drafter for a given target.

    drafter = load_drafter("eagle3-dir", model)          # a transformers PreTrainedModel or the zoo's Llama
    out = specpass.generate(model, ids, assistant_model=drafter, max_new_tokens=64)

The folder: `config.json` with `architectures: ["LlamaForCausalLMEagle3"]` (vLLM's alias
`Eagle3LlamaForCausalLM` too), `draft_vocab_size`, `num_hidden_layers`, optional
`target_hidden_size` and `head_dim`, `rope_scaling` (default or llama3), and for P-EAGLE
`parallel_drafting: true` + `mask_token_id`; the weights in `model.safetensors`, shards with an
index, or `pytorch_model.bin`. Tensor names: one layer as `midlayer.*` or `layers.0.*`, deeper heads
as vLLM's `layers.N.*`; `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t` (draft id -> offset to
the target id), `t2d` (target ids the draft covers), `mask_hidden`. `d2t` may be left out when the
draft vocabulary is the target's, `t2d` always (it follows from `d2t`). An `embed_tokens.weight` in
the file is used; without one the head shares the target's input embedding by reference.

A DFlash folder (z-lab's layout): `architectures: ["DFlashDraftModel"]`, `dflash_config` with
`target_layer_ids` and `mask_token_id` (optionally `input_embedding_scale`, `output_multiplier`,
`final_logit_softcapping`; `block_size` there or at the top), Qwen3 layer fields; tensors `fc`,
`hidden_norm`, `layers.N.*` (with `self_attn.q_norm`, `k_norm`) and `norm`, with or without a
`model.` prefix. It has no embedding or lm_head: it uses the target's, by reference. DFlash2's
convolutions and candidate selector are refused, named.

Everything is checked before a tensor is read: the config against the target (vocabulary, hidden
sizes), the tensor names and shapes against the config. Every problem is named in one
`CheckpointError` with the file and what to do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from specpass.drafters.adapter import DraftAdapter, adapt
from specpass.drafters.dflash import ARCHITECTURES as DFLASH_ARCHITECTURES
from specpass.drafters.dflash import DFLASH2_MODULES, DFlashConfig, DFlashDraft
from specpass.drafters.eagle3 import Eagle3Config, Eagle3Head
from specpass.drafters.files import CONFIG_FILE, CheckpointError, Weights, read_config_json
from specpass.drafters.peagle import ParallelEagle3Config, ParallelEagle3Head

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
HINT = "copy the head's folder (config.json and its weights) there"
EMBEDDING = "embed_tokens.weight"


def load_drafter(directory: str | Path, target: nn.Module, *, device=None, dtype: torch.dtype | None = None
                 ) -> DraftAdapter | DFlashDraft:
    """The EAGLE-3, P-EAGLE or DFlash head in `directory` as a drafter for `target`, on `device` in
    `dtype` (default: the target's input embedding's). P-EAGLE and DFlash draft in parallel
    (`draft_parallel`: one forward makes a round's K drafts)."""
    directory = Path(directory)
    raw = read_config_json(directory, HINT)
    if is_dflash(raw):
        return load_dflash(directory, raw, target, device, dtype)
    embedding, target_hidden, target_vocab = target_facts(target)
    config = read_head_config(directory, raw)
    weights = Weights(directory, HINT)
    names, problems = head_names(weights.specs, config.num_hidden_layers)
    own_embedding = EMBEDDING in names.values()
    problems += fit_problems(config, target_vocab, target_hidden, own_embedding)
    shape = [config.vocab_size, config.hidden_size]
    if not own_embedding and list(embedding.weight.shape) != shape and not problems:
        problems.append(f"the target's input embedding is {list(embedding.weight.shape)}, the head reads it as "
                        f"{shape} (vocab_size, hidden_size): use a head made for this target")
    cls = ParallelEagle3Head if isinstance(config, ParallelEagle3Config) else Eagle3Head
    with torch.device("meta"):
        head = cls(config)
    optional = {EMBEDDING, "t2d"} | ({"d2t"} if config.draft_vocab_size == config.vocab_size else set())
    problems += layout_problems(expected_tensors(head), optional, weights, names,
                                f"{config.num_hidden_layers} layer(s), hidden_size {config.hidden_size}, "
                                f"draft_vocab_size {config.draft_vocab_size}")
    if problems:
        raise CheckpointError(f"cannot load {directory} as an EAGLE-3 head for this {type(target).__name__}:\n  "
                              + "\n  ".join(problems))

    device = embedding.weight.device if device is None else torch.device(device)
    dtype = embedding.weight.dtype if dtype is None else dtype
    stored = weights.read(names)
    state = {names[name]: _cast(t, device, dtype) for name, t in stored.items()}
    _vocabulary_maps(state, config, weights.where, device)
    if not own_embedding:
        state[EMBEDDING] = _cast(embedding.weight.detach(), device, dtype)
    head.load_state_dict(state, strict=True, assign=True)
    if not own_embedding and state[EMBEDDING].data_ptr() == embedding.weight.data_ptr() \
            and state[EMBEDDING].dtype == embedding.weight.dtype:
        head.embed_tokens.weight = embedding.weight  # the target's, by reference (device and dtype match)
    return adapt(head.eval())


def target_facts(target: nn.Module) -> tuple[nn.Embedding, int, int]:
    """(input embedding, hidden size, vocabulary size) of a transformers model or the zoo's Llama."""
    config = getattr(target, "config", None)
    if not callable(getattr(target, "get_input_embeddings", None)) or config is None:
        raise TypeError(f"target must be a transformers PreTrainedModel or the zoo's Llama (a module with "
                        f"get_input_embeddings() and config.hidden_size / config.vocab_size), got "
                        f"{type(target).__name__}")
    text = text_config(target)
    return target.get_input_embeddings(), text.hidden_size, text.vocab_size


def text_config(target: nn.Module) -> Any:
    """The config of a target's language model (a multimodal transformers model's text part)."""
    config = target.config
    return config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config


def read_config(path: Path, raw: dict[str, Any], architectures: tuple[str, ...], cls: type, what: str,
                otherwise: str):
    """config.json (`raw`, read from `path`) as `cls`, once its architectures are among `architectures`;
    a value the config refuses is named with the file. what: the draft's kind, in words; otherwise: what
    to do when the file describes another architecture."""
    found = raw.get("architectures")
    if not (isinstance(found, list) and set(found) & set(architectures)):
        raise CheckpointError(f"{path} describes architectures {found!r}, not {what} ({' or '.join(architectures)}): "
                              f"{otherwise}")
    try:
        return cls.from_dict(raw)
    except (TypeError, ValueError) as exc:  # a value the config refuses (CheckpointError included)
        raise CheckpointError(f"{path}: {exc}; fix the file or use the draft's original config.json") from exc


def is_dflash(raw: dict[str, Any]) -> bool:
    """Whether a config.json describes a DFlash draft (DFlash2's too, which `load_dflash` refuses)."""
    found = raw.get("architectures")
    return "dflash_config" in raw or isinstance(found, list) and any("DFlash" in str(a) for a in found)


def load_dflash(directory: Path, raw: dict[str, Any], target: nn.Module, device, dtype: torch.dtype | None
                ) -> DFlashDraft:
    """A DFlash folder as a `ParallelDrafter` over `target`'s input embedding and lm_head."""
    embedding, target_hidden, target_vocab = target_facts(target)
    config = read_config(directory / CONFIG_FILE, raw, DFLASH_ARCHITECTURES, DFlashConfig, "a DFlash draft",
                         "DFlash2 and other variants are not modelled; use a DFlash checkpoint")
    lm_head = target.get_output_embeddings() if callable(getattr(target, "get_output_embeddings", None)) else None
    lm_head = lm_head if lm_head is not None else getattr(target, "lm_head", None)
    if not isinstance(lm_head, nn.Module):
        raise TypeError(f"a DFlash draft scores its drafts with the target's lm_head, and this "
                        f"{type(target).__name__} has none (get_output_embeddings() or .lm_head)")
    layers = text_config(target).num_hidden_layers
    problems = []
    if config.hidden_size != target_hidden:
        problems.append(f"hidden_size {config.hidden_size} != the target's hidden_size {target_hidden} (the draft "
                        "reads the target's embedding and feeds its lm_head); use a draft made for this target")
    if config.vocab_size != target_vocab:
        problems.append(f"vocab_size: the target has {target_vocab} tokens, the draft {config.vocab_size}; use a "
                        "draft made for this target")
    outside = [i for i in config.target_layer_ids if not 0 <= i < layers]
    if outside:
        problems.append(f"target_layer_ids {outside} are outside the target's {layers} layers (0..{layers - 1}); "
                        "use a draft made for this target")
    weights = Weights(directory, HINT)
    names = {name: name.removeprefix("model.") for name in weights.specs}
    dflash2 = sorted({part for name in names.values() for part in name.split(".") if part in DFLASH2_MODULES})
    if dflash2:
        problems.append(f"the weights hold DFlash2's {dflash2}, which are not modelled; use a DFlash checkpoint")
    with torch.device("meta"):
        head = DFlashDraft(config, embedding, lm_head)
    shared = ("embed_tokens.", "lm_head.")
    expected = {name: spec for name, spec in expected_tensors(head).items() if not name.startswith(shared)}
    problems += layout_problems(expected, set(), weights, names,
                                f"{config.num_hidden_layers} layer(s), hidden_size {config.hidden_size}, "
                                f"{len(config.target_layer_ids)} target layers")
    if problems:
        raise CheckpointError(f"cannot load {directory} as a DFlash draft for this {type(target).__name__}:\n  "
                              + "\n  ".join(problems))
    weight = lm_head.weight
    asked = None if device is None else torch.device(device)
    index = None if asked is None else weight.device.index if asked.index is None else asked.index
    elsewhere = asked is not None and (asked.type, index) != (weight.device.type, weight.device.index)
    if elsewhere or (dtype is not None and dtype != weight.dtype):
        raise ValueError(f"a DFlash draft runs on the target's lm_head ({weight.dtype} on {weight.device}), so in its "
                         f"dtype and on its device: leave device and dtype unset (got {device}, {dtype})")
    state = {names[name]: _cast(t, weight.device, weight.dtype) for name, t in weights.read(names).items()}
    missing, unexpected = head.load_state_dict(state, strict=False, assign=True)
    assert not unexpected and all(name.startswith(shared) for name in missing), (missing, unexpected)
    return head.eval()


def read_head_config(directory: Path, raw: dict[str, Any]) -> Eagle3Config:
    """config.json as an `Eagle3Config` (a `ParallelEagle3Config` with `parallel_drafting`)."""
    cls = ParallelEagle3Config if raw.get("parallel_drafting") else Eagle3Config
    return read_config(directory / CONFIG_FILE, raw, ARCHITECTURES, cls, "a Llama EAGLE-3 head",
                       "pass an EAGLE-3 head's folder (the target's own folder is loaded by transformers)")


def head_names(specs: dict[str, Any], layers: int) -> tuple[dict[str, str], list[str]]:
    """({name in the file: the head's name}, problems): `midlayer.*` and `layers.0.*` are the same
    layer, the head's `midlayer` with one layer and its `layers.0` with more."""
    names, problems, seen = {}, [], {}
    for name in specs:
        prefix, _, rest = name.partition(".")
        index, _, tail = rest.partition(".")
        if prefix == "midlayer":
            index, tail = "0", rest
        elif not (prefix == "layers" and index.isdigit()):
            names[name] = name
            continue
        ours = f"midlayer.{tail}" if index == "0" and layers == 1 else f"layers.{int(index)}.{tail}"
        if ours in seen:
            problems.append(f"{seen[ours]} and {name} are the same tensor of layer 0: keep one of them")
        seen[ours] = name
        names[name] = ours
    return names, problems


def fit_problems(config: Eagle3Config, vocab_size: int, hidden_size: int, own_embedding: bool = False) -> list[str]:
    """What keeps an EAGLE-3 head from running against a target of this vocabulary and hidden size."""
    problems = []
    if config.vocab_size != vocab_size:
        problems.append(f"vocabulary: the target has {vocab_size} tokens, the EAGLE-3 head {config.vocab_size} "
                        "(vocab_size: it reads the target's ids and maps its drafts into them); use a head made "
                        "for this target")
    if config.target_hidden_size != hidden_size:
        problems.append(f"EAGLE-3 target_hidden_size {config.target_hidden_size} != the target's hidden_size "
                        f"{hidden_size} (fc reads three of the target's hidden states); use a head made for this "
                        "target")
    if not own_embedding and config.hidden_size != hidden_size:
        problems.append(f"EAGLE-3 hidden_size {config.hidden_size} != the target's hidden_size {hidden_size} "
                        f"(the head uses the target's embedding: the file has no {EMBEDDING})")
    return problems


def expected_tensors(head: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in head.state_dict().items()}


def layout_problems(expected: dict[str, tuple[tuple[int, ...], torch.dtype]], optional: set[str], weights: Weights,
                    names: dict[str, str], described: str) -> list[str]:
    """The file's tensors against the head config.json describes (`described`, in words): missing,
    unexpected, shapes, dtypes."""
    stored = {ours: (name, *weights.specs[name]) for name, ours in names.items()}
    missing = [name for name in expected if name not in stored and name not in optional]
    unexpected = [name for name, ours in names.items() if ours not in expected]
    wrong = []
    for ours, (name, shape, dtype) in stored.items():
        if ours not in expected:
            continue
        want_shape, want_dtype = expected[ours]
        if shape != want_shape:
            wrong.append(f"{name}: {CONFIG_FILE} gives {list(want_shape)}, the file holds {list(shape)}")
        kind = _kind(want_dtype)
        if _kind(dtype) != kind and not (kind == "bool" and _kind(dtype) == "integer"):
            wrong.append(f"{name} is {str(dtype).removeprefix('torch.')}, not {kind}")
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {missing}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {unexpected}")
    if wrong:
        problems.append(f"wrong tensors ({len(wrong)}): " + "; ".join(wrong))
    if missing or unexpected or wrong:
        problems.append(f"{weights.where} does not hold the head {weights.directory / CONFIG_FILE} describes "
                        f"({described}): check config.json against the weights, or copy the folder again")
    return problems


def _vocabulary_maps(state: dict[str, torch.Tensor], config: Eagle3Config, where: Path, device) -> None:
    """d2t as int64 (zeros: the target's own ids), t2d as bool (from d2t); every draft id must map
    to a target id."""
    d2t = state.get("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64, device=device)).long()
    ids = torch.arange(config.draft_vocab_size, device=device) + d2t
    outside = ids[(ids < 0) | (ids >= config.vocab_size)]
    if len(outside):
        raise CheckpointError(f"{where}: d2t maps {len(outside)} draft ids outside the target's {config.vocab_size} "
                              f"ids (e.g. {outside[:3].tolist()}): d2t[i] is the offset from draft id i to its "
                              "target id; use the head's original weights")
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool, device=device)
    t2d[ids] = True
    state["d2t"] = d2t
    state["t2d"] = state["t2d"].bool() if "t2d" in state else t2d


def _kind(dtype: torch.dtype) -> str:
    return "bool" if dtype == torch.bool else "floating-point" if dtype.is_floating_point else "integer"


def _cast(t: torch.Tensor, device, dtype: torch.dtype) -> torch.Tensor:
    return t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device=device)

"""Hugging Face-format checkpoint folders: `config.json` + `model.safetensors`.

    save(model, model.config, "ckpt/")              # or save(state_dict, config, dir)
    save(model, model.config, "ckpt/", max_shard_bytes=15 * 2**20)  # sharded, with an index
    model = load(Llama, "ckpt/", device="cuda", dtype=torch.bfloat16)
    head = load(Eagle3Head, "head/", shared={"embed_tokens.weight": target.model.embed_tokens.weight})

Saving is all-or-nothing too: the files are written into a staging folder beside `directory` and
renamed into place at the end, so a failure midway leaves an existing checkpoint as it was.

Loading is strict and all-or-nothing: every problem (missing file, missing or unexpected key,
wrong shape, wrong dtype) is collected and raised in one `CheckpointError` before any tensor
reaches the model; the model is built on the meta device, so nothing is allocated for it
until the file has been checked. Tied weights (lm_head = embed_tokens) are stored once, as
Hugging Face does. Keys a model lists in `checkpoint_excludes` (the EAGLE-3 head's embedding,
which public EAGLE-3 checkpoints take from the target) are never saved and must be passed to
`load` as `shared=` tensors, which the model then uses by reference.

The files are read with the library's reader (`specpass.drafters.files`: config.json, single or
sharded safetensors, a pytorch_model.bin); `specpass.load_drafter` loads public EAGLE-3 folders
for any target, this module any zoo class, strictly (dtypes included) and with zoo-only layouts.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors.torch import save_file

from specpass.drafters.config import ConfigBase
from specpass.drafters.files import (CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, CheckpointError, Weights,
                                     read_config_json)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors a checkpoint of `model` holds, {tied alias: the key it is stored under})."""
    state = model.state_dict(keep_vars=True)  # persistent buffers only: caches never land here
    excludes = set(getattr(model, "checkpoint_excludes", ()))
    tensors, aliases, first = {}, {}, {}
    for name, tensor in state.items():
        if name in excludes:
            continue
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
            continue
        first[id(tensor)] = name
        tensors[name] = tensor
    return tensors, aliases


def save(model_or_state: nn.Module | dict[str, torch.Tensor], config: ConfigBase, directory: str | Path,
         max_shard_bytes: int | None = None) -> Path:
    """Write `config.json` and `model.safetensors` into `directory` (created if needed).

    Above `max_shard_bytes` of tensor data the weights go to shards `model-00001-of-0000n.safetensors`
    of at most that many bytes each (a bigger tensor gets a shard of its own), named in Hugging
    Face's `model.safetensors.index.json` (`metadata.total_size`, `weight_map`). Other files in
    `directory` are kept; an earlier save's weights are replaced.
    """
    if not isinstance(config, ConfigBase):
        raise TypeError(f"config must be the model's config (a models.checkpoint.ConfigBase, e.g. model.config), "
                        f"got {type(config).__name__}")
    if max_shard_bytes is not None and (not isinstance(max_shard_bytes, int) or max_shard_bytes < 1):
        raise ValueError(f"max_shard_bytes must be a positive int (or None: one file), got {max_shard_bytes!r}")
    if isinstance(model_or_state, nn.Module):
        tensors, _ = checkpoint_tensors(model_or_state)
    else:
        tensors = dict(model_or_state)
    tensors = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    floating = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(floating) > 1:
        raise CheckpointError(f"mixed floating dtypes {sorted(map(str, floating))}; cast the model to one dtype first")
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{directory} is a file, not a folder: pass the folder to save the checkpoint into")
    meta = config.to_dict()
    if floating:
        meta["dtype"] = str(floating.pop()).removeprefix("torch.")
    home = directory.resolve()
    home.parent.mkdir(parents=True, exist_ok=True)
    staging = home.parent / f".{home.name}.partial-{uuid.uuid4().hex[:8]}"  # same file system: renames
    staging.mkdir()
    try:
        written = _write(staging, tensors, meta, max_shard_bytes)
        if not home.exists():
            staging.rename(home)  # the folder appears whole or not at all
            return directory
        for name in written:
            os.replace(staging / name, home / name)
        for stale in (home / WEIGHTS_FILE, home / INDEX_FILE, *home.glob("model-*-of-*.safetensors")):
            if stale.name not in written:  # an earlier save's weights, single or sharded, would be read instead
                stale.unlink(missing_ok=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def _write(directory: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
           max_shard_bytes: int | None) -> list[str]:
    """Write a checkpoint into an empty folder -> the file names, config.json last."""
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        written = [WEIGHTS_FILE]
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(directory / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        index = {"metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        written = sorted(set(weight_map.values())) + [INDEX_FILE]
    (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return written + [CONFIG_FILE]


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most `max_bytes` each (one group when None)."""
    shards, size = [{}], 0
    for name, t in tensors.items():
        if max_bytes is not None and shards[-1] and size + _nbytes(t) > max_bytes:
            shards, size = shards + [{}], 0
        shards[-1][name] = t
        size += _nbytes(t)
    return shards


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_WRITE_ONE = "write one with models.checkpoint.save(model, config, dir) or models.zoo.make_checkpoint(name, dir)"


def read_config(cls, directory: str | Path) -> tuple[ConfigBase, dict[str, Any]]:
    directory = Path(directory)
    raw = read_config_json(directory, _WRITE_ONE)
    path = directory / CONFIG_FILE
    expected = getattr(cls, "architectures", None)
    found = raw.get("architectures")
    if expected and found and not set(found) & set(expected):
        raise CheckpointError(f"{path} describes {found}, not a checkpoint {cls.__name__} loads ({expected})")
    try:
        return cls.config_class.from_dict(raw), raw
    except (TypeError, ValueError) as exc:  # a value the config class refuses (CheckpointError included)
        raise CheckpointError(f"{path}: {exc}; fix the file or write it again with models.checkpoint.save") from exc


def load(cls, directory: str | Path, device=None, dtype: torch.dtype | None = None,
         shared: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """Build `cls(config)` from the folder's config.json and fill it from its safetensors.

    `cls` is a model class (or factory) with a `config_class` attribute. `dtype` casts floating
    tensors after they are checked against the dtype config.json declares. `shared` supplies
    the keys the model leaves out of its checkpoints (`checkpoint_excludes`), used by reference
    when device and dtype already match.
    """
    directory = Path(directory)
    config, raw = read_config(cls, directory)
    with torch.device("meta"):
        model = cls(config)
    expected, aliases = checkpoint_tensors(model)
    declared = raw.get("dtype") or raw.get("torch_dtype")
    declared_dtype = _DTYPES.get(declared) if isinstance(declared, str) else None
    shared = dict(shared or {})

    excludes = list(getattr(model, "checkpoint_excludes", ()))
    problems = []
    unknown_shared = sorted(set(shared) - set(excludes))
    if unknown_shared:
        problems.append(f"shared= names {unknown_shared}, which {cls.__name__} does not take from outside "
                        f"(it takes {excludes})")

    weights = Weights(directory, _WRITE_ONE)
    in_file = weights.specs

    # name -> (where it comes from, shape, dtype); shared= wins over a copy some exporters write
    sources = {name: ("file", *in_file[name]) for name in expected if name in in_file}
    reference = dict(expected)
    for name in excludes:
        reference[name] = model.get_parameter(name) if _is_param(model, name) else model.get_buffer(name)
        if name in shared:
            sources[name] = ("shared", tuple(shared[name].shape), shared[name].dtype)
        elif name in in_file:
            sources[name] = ("file", *in_file[name])
        else:
            problems.append(f"{name} is not in {cls.__name__} checkpoints (it is the target model's): "
                            f"pass it as load(..., shared={{{name!r}: <target tensor>}})")
    missing = [name for name in expected if name not in in_file]
    unexpected = [name for name in in_file if name not in reference]
    if missing:
        problems.append(f"missing keys ({len(missing)}): {missing}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {unexpected}")
    wrong_shape, wrong_dtype = [], []
    for name, (origin, shape, found_dtype) in sources.items():
        want = reference[name]
        if shape != tuple(want.shape):
            wrong_shape.append(f"{name}: expected {list(want.shape)}, found {list(shape)} ({origin})")
        if origin == "shared" and want.is_floating_point():
            continue  # a shared float tensor is cast to the model's dtype below
        floating = want.is_floating_point() and declared_dtype is not None
        want_dtype = declared_dtype if floating else want.dtype
        if found_dtype != want_dtype:
            why = f" ({CONFIG_FILE} declares {declared})" if floating else ""
            wrong_dtype.append(f"{name}: expected {_name(want_dtype)}{why}, found {_name(found_dtype)}")
    if wrong_shape:
        problems.append(f"wrong shapes ({len(wrong_shape)}): " + "; ".join(wrong_shape))
    if wrong_dtype:
        problems.append(f"wrong dtypes ({len(wrong_dtype)}): " + "; ".join(wrong_dtype))
    if missing or unexpected or wrong_shape or wrong_dtype:
        problems.append(f"{weights.where} does not hold the weights {directory / CONFIG_FILE} describes: load the "
                        f"folder with the class and config that wrote it, or save the model into it again")
    if problems:
        raise CheckpointError(f"cannot load {directory} into {cls.__name__}:\n  " + "\n  ".join(problems))

    # Checked: now read, cast and place. Nothing above touched the model's tensors.
    device = torch.device("cpu") if device is None else torch.device(device)
    stored = weights.read([name for name, (origin, *_) in sources.items() if origin == "file"])
    state = {name: _cast(t, device, dtype) for name, t in stored.items()}
    for name, tensor in shared.items():
        state[name] = _cast(tensor.detach(), device, dtype if dtype is not None else declared_dtype)
    for alias, source in aliases.items():
        state[alias] = state[source]
    model.load_state_dict(state, strict=True, assign=True)
    retie(model, aliases)  # assign=True made two Parameters
    return model.eval()


def _cast(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None and t.is_floating_point():
        return t.to(device=device, dtype=dtype)
    return t.to(device=device)


def _is_param(model: nn.Module, name: str) -> bool:
    return name in dict(model.named_parameters(remove_duplicate=False))


def retie(model: nn.Module, aliases: dict[str, str]) -> None:
    """Make each alias the very Parameter it is tied to again (after to_empty or an assign-load)."""
    for alias, source in aliases.items():
        owner, _, leaf = alias.rpartition(".")
        setattr(model.get_submodule(owner), leaf, model.get_parameter(source))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

"""Reading a Hugging Face-format checkpoint folder: `config.json` and the weights, as
`model.safetensors`, shards named in `model.safetensors.index.json`, or a `pytorch_model.bin`.

    raw = read_config_json(directory, hint)      # the config.json object
    weights = Weights(directory, hint)           # names, shapes and dtypes, from the headers only
    tensors = weights.read(names)                # then the tensors, on the CPU

Every problem is a `CheckpointError` naming the file and what to do; `hint` says how to get a
good folder (the zoo writes its own, a user copies a public one). safetensors is imported on
first use, so that `import specpass` needs torch only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # sharded folders written by save_pretrained
BIN_FILE = "pytorch_model.bin"  # read with torch.load(weights_only=True)

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


class CheckpointError(ValueError):
    """A checkpoint folder does not match the model it is loaded into."""


def read_config_json(directory: Path, hint: str) -> dict[str, Any]:
    """The folder's config.json as a dict; a missing folder or file says what to do (`hint`)."""
    if not directory.exists():
        raise CheckpointError(f"checkpoint folder {directory} does not exist: check the path, or {hint}")
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is a file, not a checkpoint folder: pass the folder that holds "
                              f"{CONFIG_FILE} and the weights")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} not found: a checkpoint folder holds {CONFIG_FILE} and {WEIGHTS_FILE}; {hint}")
    return read_json(path)


def read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); it may be truncated: copy or write it "
                              "again") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} holds a JSON {type(raw).__name__}, not an object; copy or write it again")
    return raw


def weight_files(directory: Path, hint: str) -> list[Path]:
    """model.safetensors, else the shards its index names, else pytorch_model.bin."""
    single, index, binary = directory / WEIGHTS_FILE, directory / INDEX_FILE, directory / BIN_FILE
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map (tensor name -> shard file); copy or write it again")
        shards = sorted(set(weight_map.values()))
        absent = [s for s in shards if not (directory / s).is_file()]
        if absent:
            raise CheckpointError(f"{index} names shard files that are not in {directory}: {absent}; copy them "
                                  "there (an incomplete download?) or write the checkpoint again")
        return [directory / s for s in shards]
    if binary.is_file():
        return [binary]
    raise CheckpointError(f"{single} not found (nor a sharded {INDEX_FILE}, nor {BIN_FILE}): a checkpoint folder "
                          f"holds {CONFIG_FILE} and {WEIGHTS_FILE}; {hint}")


def safe_open(path: Path):
    """safetensors' reader of one file (CPU tensors), imported on first use."""
    return _safetensors().safe_open(str(path), framework="pt", device="cpu")


def _safetensors():
    try:
        import safetensors
    except ImportError as exc:
        raise ImportError("reading a .safetensors checkpoint needs the safetensors package: pip install "
                          "safetensors") from exc
    return safetensors


class Weights:
    """The tensors of a folder's weight files: `specs` (name -> (shape, dtype)) read from the
    safetensors headers before any tensor is; `read(names)` then reads those tensors."""

    def __init__(self, directory: Path, hint: str):
        self.directory = directory
        self.files = weight_files(directory, hint)
        self.specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._file_of: dict[str, Path] = {}
        self._loaded: dict[str, torch.Tensor] | None = None  # a .bin is read whole
        for file in self.files:
            for name, spec in self._headers(file).items():
                self.specs[name] = spec
                self._file_of[name] = file

    @property
    def where(self) -> Path:
        """The file to name in a message about the weights: the single file or the index."""
        return self.files[0] if len(self.files) == 1 else self.directory / INDEX_FILE

    def _headers(self, file: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if file.name == BIN_FILE:
            self._loaded = _load_bin(file)
            return {name: (tuple(t.shape), t.dtype) for name, t in self._loaded.items()}
        st = _safetensors()
        specs = {}
        try:
            with safe_open(file) as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    specs[name] = (tuple(sl.get_shape()), _st_dtype(file, name, sl.get_dtype()))
        except st.SafetensorError as exc:  # safe_open checks that the header covers the whole file
            raise CheckpointError(f"{file} is not a readable safetensors file ({exc}); it may be truncated "
                                  "(an interrupted copy or download): copy or write it again") from exc
        return specs

    def read(self, names) -> dict[str, torch.Tensor]:
        """The named tensors, as stored, on the CPU."""
        if self._loaded is not None:
            return {name: self._loaded[name] for name in names}
        out = {}
        for file in self.files:
            wanted = [name for name in names if self._file_of[name] == file]
            if wanted:
                with safe_open(file) as f:
                    out.update((name, f.get_tensor(name)) for name in wanted)
        return out


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load's errors name no common type: unpickling, zip, refused globals
        raise CheckpointError(f"{file} is not a readable PyTorch weights file ({type(exc).__name__}: {exc}); "
                              "copy it again, or convert it to model.safetensors") from exc
    if not (isinstance(state, dict) and all(isinstance(t, torch.Tensor) for t in state.values())):
        raise CheckpointError(f"{file} does not hold a state dict (tensor name -> tensor); copy it again, or "
                              "convert it to model.safetensors")
    return state


def _st_dtype(file: Path, name: str, st_name: str) -> torch.dtype:
    if st_name not in _ST_DTYPES:
        raise CheckpointError(f"{file}: {name} is stored as {st_name}, which is not read here "
                              f"({sorted(_ST_DTYPES)}); convert the checkpoint to one of them")
    return _ST_DTYPES[st_name]

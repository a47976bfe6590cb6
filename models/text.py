"""Bytes as tokens, and the Python standard library's source as a training corpus.

    ids = encode("def f(x):")          # [BOS, 100, 101, 102, ...]
    text = decode(ids)                 # specials dropped
    train, held_out = corpus()         # int16 token streams of this Python's standard library
    prompts = make_prompts()           # code prefixes, each ending in a `def ...:` line, from held-out modules
    texts = load_prompts()             # the prompts shipped beside the trained checkpoints

The vocabulary is the 256 byte values, then BOS and EOS (258 ids). The corpus is every `.py`
file under a standard-library root (`site-packages` skipped), each as BOS + its bytes + EOS, in
the order of the sorted relative paths. The modules in `HELD_OUT` are never trained on: the
evaluation and the prompts come from them. The corpus is whichever standard library `root`
holds: the shipped models were trained on CPython 3.11.7's; another Python gives another corpus
(`HELD_OUT` exists in CPython 3.10 to 3.13).
"""

from __future__ import annotations

import json
import re
import sysconfig
from pathlib import Path

import torch

BOS, EOS = 256, 257
VOCAB = 258

# Relative paths: "pkg/" is a whole package, anything else one module. About 2.8% of 3.11's bytes.
HELD_OUT = ("json/", "email/", "http/", "argparse.py", "csv.py", "heapq.py", "textwrap.py", "fractions.py",
            "statistics.py", "string.py")
PROMPTS_FILE = Path(__file__).resolve().parents[1] / "checkpoints" / "prompts.json"

_DEF_LINE = re.compile(rb"[ \t]*def \w+\(.*\).*:[ \t]*")  # a one-line signature ending the prompt


def encode(text: str) -> list[int]:
    return [BOS, *text.encode("utf-8")]


def decode(ids) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def stdlib_root(root: str | Path | None = None) -> Path:
    return Path(root if root is not None else sysconfig.get_paths()["stdlib"])


def stdlib_files(root: str | Path | None = None) -> list[tuple[str, Path]]:
    """(relative posix path, path) of every `.py` file under `root`, `site-packages` skipped, sorted."""
    root = stdlib_root(root)
    files = ((p.relative_to(root).as_posix(), p) for p in root.rglob("*.py") if p.is_file())
    return sorted((rel, p) for rel, p in files if "site-packages" not in rel.split("/"))


def is_held_out(rel: str) -> bool:
    return any(rel.startswith(h) if h.endswith("/") else rel == h for h in HELD_OUT)


def file_tokens(data: bytes) -> torch.Tensor:
    """BOS + bytes + EOS, int16 `[len(data) + 2]`."""
    ids = torch.empty(len(data) + 2, dtype=torch.int16)
    ids[0], ids[-1] = BOS, EOS
    if data:
        ids[1:-1] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return ids


def corpus(root: str | Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(training tokens, held-out tokens): the files of `stdlib_files(root)` one after another, int16."""
    train, held_out = [], []
    for rel, path in stdlib_files(root):
        (held_out if is_held_out(rel) else train).append(file_tokens(path.read_bytes()))
    if not train or not held_out:
        raise FileNotFoundError(f"{stdlib_root(root)} holds no standard library: {len(train)} training files, "
                                f"{len(held_out)} held-out ones")
    return torch.cat(train), torch.cat(held_out)


def make_prompts(root: str | Path | None = None, n: int = 32, min_bytes: int = 150,
                 max_bytes: int = 400) -> list[dict]:
    """`n` prompts from the held-out modules: whole lines, `min_bytes`..`max_bytes` long, ending with a
    one-line `def ...:` and its newline, so that the continuation is a function body. Picked evenly
    from all candidates in file order: deterministic for a given standard library.
    -> [{"path": relative path, "line": 1-based line of the def, "text": prompt}]"""
    candidates = []
    for rel, path in stdlib_files(root):
        if not is_held_out(rel):
            continue
        lines = path.read_bytes().splitlines(keepends=True)
        for i, line in enumerate(lines):
            if not _DEF_LINE.fullmatch(line.rstrip(b"\r\n")):
                continue
            start, size = i + 1, 0
            while start > 0 and size + len(lines[start - 1]) <= max_bytes:
                start -= 1
                size += len(lines[start])
            if size >= min_bytes:
                text = b"".join(lines[start : i + 1]).decode("utf-8", errors="replace")
                candidates.append({"path": rel, "line": i + 1, "text": text})
    if len(candidates) < n:
        raise ValueError(f"only {len(candidates)} prompt candidates in the held-out modules, {n} asked for")
    return [candidates[i * len(candidates) // n] for i in range(n)]


def load_prompts(path: str | Path = PROMPTS_FILE) -> list[str]:
    """The texts of a prompts file written by examples/train.py (default: the shipped one)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: examples/train.py writes it beside the checkpoints")
    return [p["text"] for p in json.loads(path.read_text())]

"""Repeated blocks compiled once: each decoder layer's forward a `nested_compile_region`.

A model's decoder layers are one code over other weights. Compiled whole, every layer is traced,
rewritten, lowered and code-generated again in every graph. Marked, Dynamo traces the layer into
one body that every call shares (an `invoke_subgraph` call per layer, graph.py), the passes
rewrite that body once (pipeline.py) and Inductor compiles it once. In eager mode a marked
forward runs as it did.

    specpass.mark_repeated_blocks(model)   # before torch.compile; the loop's Decoder does it itself

The rule is structural, not a list of classes: in every `nn.ModuleList` of the model, children of
one class whose parameters and buffers have the same names, shapes and dtypes repeat. Each gets,
as an instance attribute, its class's forward wrapped once per class, so that every call is the
same marked function (Dynamo keeps one body for the calls that trace alike). Inside a marked block
nothing more is marked.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.nn as nn

_REGIONS: dict[Callable, Callable] = {}  # a class's forward -> its marked form, one per function


def mark_repeated_blocks(module: nn.Module) -> int:
    """Mark the repeated blocks of `module` (see above); -> how many blocks are marked now, those
    marked by an earlier call included. A block whose forward is already an instance attribute (the
    user's own wrapper) is left alone."""
    marked = 0
    for blocks in _repeated(module):
        region = _region(type(blocks[0]).forward)
        for block in blocks:
            if "forward" not in block.__dict__:
                block.forward = types.MethodType(region, block)
            marked += getattr(block.__dict__["forward"], "__func__", None) is region
    return marked


def _repeated(module: nn.Module) -> list[list[nn.Module]]:
    """Groups of two or more repeating children of the ModuleLists of `module`, outermost first;
    nothing is looked for inside a block of a group."""
    groups, inside = [], set()
    for name, child in module.named_modules():
        if any(name.startswith(prefix) for prefix in inside) or not isinstance(child, nn.ModuleList):
            continue
        by_structure: dict[Any, list[nn.Module]] = defaultdict(list)
        for block in child:
            by_structure[_structure(block)].append(block)
        for i, block in enumerate(child):
            if len(by_structure[_structure(block)]) >= 2:
                inside.add(f"{name}.{i}." if name else f"{i}.")
        groups += [blocks for blocks in by_structure.values() if len(blocks) >= 2]
    return groups


def _structure(block: nn.Module) -> tuple:
    tensors = [*block.named_parameters(), *block.named_buffers()]
    return type(block), tuple((name, tuple(t.shape), t.dtype) for name, t in tensors if t is not None)


def _region(forward: Callable) -> Callable:
    """The class's forward as one marked function: every block's call goes through it.

    Where Dynamo reuses a body it traced for later calls instead of tracing them (torch 2.13's
    "auto-cache"), it stamps out a module's own buffers wrongly: a second layer that writes
    `self.k_cache` in place wrote the first layer's cache (tests/test_regional.py). Reuse is for
    bodies that return tensors only, so the marked function returns `(out, None)` there and the call
    takes `out`: Dynamo traces each call and keeps one body for the calls that trace alike, as torch
    2.11 does."""
    region = _REGIONS.get(forward)
    if region is None:
        mark = torch.compiler.nested_compile_region
        if "max_reuse_entries" in inspect.signature(mark).parameters:  # a torch that reuses traced bodies
            traced = mark(lambda self, *args, **kwargs: (forward(self, *args, **kwargs), None))
            run = lambda self, *args, **kwargs: traced(self, *args, **kwargs)[0]  # noqa: E731
        else:
            run = mark(forward)

        # Named "forward" (torch names its marked function "inner"): Dynamo saves a block's bound
        # forward by its name (`specpass.loop.saved_steps`).
        @functools.wraps(forward)
        def region(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return run(self, *args, **kwargs)

        _REGIONS[forward] = region
    return region

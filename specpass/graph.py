"""Small FX helpers every pass shares: fake values, node creation with meta["val"], mutation tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten


def val(node: Any) -> Any:
    """The fake value of a node (or the literal itself for non-node arguments)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def fake_mode(graph: fx.Graph) -> FakeTensorMode:
    for node in graph.find_nodes(op="placeholder"):
        v = node.meta.get("val")
        if isinstance(v, torch._subclasses.FakeTensor):
            return v.fake_mode
    raise RuntimeError("graph has no fake placeholders; capture it with specpass.capture")


def emit(graph: fx.Graph, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """Insert `target(*args, **kwargs)` at the graph's insert point, with its meta["val"]."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    fake_args, fake_kwargs = fx.node.map_arg((args, kwargs), val)
    with fake_mode(graph):
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node


def is_mutation(node: fx.Node) -> bool:
    """An in-place op (KV write, `add_`, `copy_`): it changes an existing tensor."""
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target._schema.is_mutable
    )


def tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]

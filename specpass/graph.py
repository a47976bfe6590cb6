"""Small FX helpers every pass shares: fake values, node creation with meta["val"], mutation tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
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


def emit(graph: fx.Graph, target: Any, args: tuple, kwargs: dict | None = None, name: str | None = None) -> fx.Node:
    """Insert `target(*args, **kwargs)` at the graph's insert point, with its meta["val"]."""
    node = graph.call_function(target, args, kwargs or {}, name=name)
    set_val(node)
    return node


def set_val(node: fx.Node) -> None:
    """Compute a call_function node's meta["val"] from its arguments' fake values."""
    fake_args, fake_kwargs = fx.node.map_arg((node.args, node.kwargs), val)
    with fake_mode(node.graph):
        node.meta["val"] = node.target(*fake_args, **fake_kwargs)


def is_mutation(node: fx.Node) -> bool:
    """An in-place op (KV write, `add_`, `copy_`): it changes an existing tensor."""
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target._schema.is_mutable
    )


def tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]


def is_impure(node: fx.Node) -> bool:
    """FX's purity, except that attention without dropout is pure (its `nondeterministic_seeded`
    tag is about dropout), so a replaced attention is removed as dead code."""
    if node.op == "call_function" and node.target is aten.scaled_dot_product_attention.default:
        dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        if dropout == 0.0:
            return False
    return node.is_impure()


def bind(node: fx.Node) -> dict[str, Any]:
    """An ATen node's arguments by schema name, defaults filled in."""
    bound = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        else:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
    return bound


def op_name(target: Any) -> str:
    """A short op name for messages: `softmax` for aten.softmax.int."""
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def storage(node: Any) -> StorageWeakRef | None:
    """The storage a node's fake value lives in: views of one tensor share it."""
    v = val(node)
    return StorageWeakRef(v.untyped_storage()) if isinstance(v, torch.Tensor) else None


def written_storages(node: fx.Node) -> set[StorageWeakRef]:
    """The storages an in-place node writes (its schema's mutable arguments)."""
    out = set()
    for name, arg in bind(node).items():
        schema_arg = next(a for a in node.target._schema.arguments if a.name == name)
        if schema_arg.alias_info is not None and schema_arg.alias_info.is_write:
            out |= {storage(leaf) for leaf in tree_leaves(arg) if storage(leaf) is not None}
    return out


def is_written_in_place(node: fx.Node) -> bool:
    """Does any in-place op of the graph write the node's storage (the node or a view of it)?"""
    s = storage(node)
    return s is not None and any(s in written_storages(n) for n in node.graph.nodes if is_mutation(n))

"""specpass's compile cache: a process that compiles a graph another process already rewrote, with
the same options, loads the rewritten graph and its report instead of capturing and rewriting
again. torch's own caches (AOTAutograd, FX graph) then skip Inductor's work on it.

Where: `$SPECPASS_CACHE_DIR`, else `specpass/` under torch's Inductor cache directory
(`$TORCHINDUCTOR_CACHE_DIR`, default `/tmp/torchinductor_<user>`): clearing torch's cache clears ours.
Off: `SPECPASS_CACHE=0`, or `TORCHINDUCTOR_FORCE_DISABLE_CACHES=1` (which turns torch's off too).

The key is a SHA-256 of everything the rewrite reads: the Dynamo graph (its code, every node's
example value, the contents of its tensor constants, the facts of the custom ops it calls), the
example inputs (shape, stride, dtype, device; symbolic sizes with their hints, ranges and the shape
environment's guards), the options, grad mode, specpass's source (every .py file of the package),
the row rules registered at run time, and torch's version.

An entry is one file per key, written by `torch.save` with plain values and tensors only and read
with `weights_only=True` (no pickled objects): the rewritten graph as a list of nodes (op, name,
target, arguments) in JSON, its tensor constants, a digest of its structure and the report. The
graph is rebuilt node by node (nothing in an entry is run) and must have the stored structure;
a graph an entry cannot hold (a higher-order op's submodule) is not stored. An entry that cannot be read,
was written for another key, fails its digest or does not rebuild the same graph is never used: the
caller warns and rewrites again, and the entry is replaced.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import logging
import os
import pydoc
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_leaves

from specpass.options import Options
from specpass.passes.row_rules.engine import registered_rules
from specpass.pipeline import RewriteResult
from specpass.report import Report

log = logging.getLogger("specpass")

FORMAT = 1  # the entry layout; a new layout must change it, so that old entries are misses


class UnusableEntry(RuntimeError):
    """A cache entry that exists but must not be used (unreadable, foreign, corrupted)."""


def directory() -> Path | None:
    """Where entries live; None when caching is off."""
    if os.environ.get("SPECPASS_CACHE", "1") in ("0", "") or getattr(torch._inductor.config, "force_disable_caches",
                                                                      False):
        return None
    chosen = os.environ.get("SPECPASS_CACHE_DIR")
    if chosen:
        return Path(chosen)
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        return Path(cache_dir()) / "specpass"
    except (ImportError, OSError):  # an older layout of torch's cache helpers
        return Path(tempfile.gettempdir()) / "specpass_cache"


def key(gm: fx.GraphModule, example_inputs: list[Any], options: Options) -> str | None:
    """The entry's key for this Dynamo graph; None when caching is off or the graph holds something
    the key cannot describe (a submodule, a non-tensor attribute): then it is not cached."""
    if directory() is None:
        return None
    digest = hashlib.sha256()

    def add(part: Any) -> None:
        digest.update(repr(part).encode())
        digest.update(b"\0")

    for part in (FORMAT, torch.__version__, torch.version.git_version, specpass_source(), _row_rules(),
                 dataclasses.astuple(options), torch.is_grad_enabled(), gm.code):
        add(part)
    for node in gm.graph.nodes:
        if node.op == "call_module":
            return None
        if node.op == "get_attr":
            value = getattr(gm, node.target, None)
            if not isinstance(value, torch.Tensor):
                return None
            add((node.target, _describe(value), _contents(value)))
        if node.op == "call_function":
            add(_custom_op_facts(node.target))
        add(_describe(node.meta.get("example_value")))
    add([_describe(x) for x in example_inputs])
    add(_symbolic_facts(example_inputs))
    return digest.hexdigest()


def load(entry_key: str) -> RewriteResult | None:
    """The stored rewrite for this key; None when there is none. Raises UnusableEntry for an entry that
    must not be used."""
    path = _path(entry_key)
    if not path.exists():
        return None
    try:
        entry = torch.load(path, weights_only=True)
    except Exception as exc:
        raise UnusableEntry(f"{path} cannot be read ({type(exc).__name__}: {exc})") from exc
    if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != entry_key:
        raise UnusableEntry(f"{path} was not written for this graph and these options (another key or layout)")
    if entry.get("digest") != _digest(entry):
        raise UnusableEntry(f"{path} fails its digest (changed after it was written)")
    try:
        graph_module = _rebuild(entry)
    except Exception as exc:
        raise UnusableEntry(f"{path} holds a graph that does not rebuild ({exc})") from exc
    report = Report.from_json(entry["report"])
    report.notes.append(f"loaded from specpass's compile cache ({path})")
    return RewriteResult(graph_module, report)


def store(entry_key: str, result: RewriteResult) -> bool:
    """Write the rewrite under this key (atomically: a reader sees the old entry or the new one).
    False when the graph holds what an entry cannot (a submodule, an op outside torch.ops)."""
    graph_module = result.graph_module
    try:
        nodes = json.dumps([_node_to_json(n) for n in graph_module.graph.nodes])
    except _NotStorable:
        return False
    constants = {n.target: getattr(graph_module, n.target) for n in graph_module.graph.find_nodes(op="get_attr")}
    if not all(isinstance(c, torch.Tensor) and "." not in name for name, c in constants.items()):
        return False
    tracer = getattr(graph_module, "_tracer_cls", None)
    try:
        tracer = _target_to_json(tracer) if tracer is not None else None
    except _NotStorable:
        return False
    entry = {"format": FORMAT, "key": entry_key, "nodes": nodes,
             "constants": {name: c.detach() for name, c in constants.items()},
             "class_name": type(graph_module).__name__, "tracer": tracer,
             "structure": _structure(graph_module), "report": result.report.to_json()}
    entry["digest"] = _digest(entry)
    try:
        _rebuild(entry)  # what the next process would get: the same structure, or nothing stored
    except Exception:
        return False
    path = _path(entry_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(entry, buffer)
    write_atomically(path, buffer.getvalue())
    return True


def write_atomically(path: Path, data: bytes) -> None:
    """data in a file of its own, then renamed to path: a reader sees the old file or the new one."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def _path(entry_key: str) -> Path:
    directory_ = directory()
    assert directory_ is not None, "a key is made only while caching is on"
    return directory_ / entry_key[:2] / f"{entry_key}.pt"


def _digest(entry: dict[str, Any]) -> str:
    """Of every field but the digest itself: a changed field (not only a torn file) is caught."""
    digest = hashlib.sha256()
    for name in ("format", "key", "nodes", "class_name", "tracer", "structure", "report"):
        digest.update(repr(entry.get(name)).encode())
        digest.update(b"\0")
    for name, constant in sorted(entry.get("constants", {}).items()):
        digest.update(repr((name, _describe(constant), _contents(constant))).encode())
    return digest.hexdigest()


def _rebuild(entry: dict[str, Any]) -> fx.GraphModule:
    """The graph, node by node, with its nodes' names, class name and tracer class: Inductor gets the
    module it got when the entry was written, and torch's caches (keyed on its pickle) hit. Nothing in
    an entry is run: ops are looked up in torch.ops, functions in torch, operator and math only."""
    holder = torch.nn.Module()
    for name, constant in entry["constants"].items():
        holder.register_buffer(name, constant)
    graph: fx.Graph = fx.Graph()
    created: dict[str, fx.Node] = {}
    for op, name, target, args, kwargs in json.loads(entry["nodes"]):
        args, kwargs = _value_from_json(args, created), _value_from_json(kwargs, created)
        created[name] = graph.create_node(op, _target_from_json(target), args, kwargs, name=name)
        if created[name].name != name:
            raise RuntimeError(f"node {name} cannot keep its name")
    rebuilt = fx.GraphModule(holder, graph, class_name=entry["class_name"])
    if entry["tracer"] is not None:
        tracer = _target_from_json(entry["tracer"])
        if not (isinstance(tracer, type) and issubclass(tracer, fx.Tracer)):
            raise RuntimeError(f"{entry['tracer']} is not a tracer class")
        rebuilt._tracer_cls = tracer
    if _structure(rebuilt) != entry["structure"]:
        raise RuntimeError("it differs from the graph stored")
    return rebuilt


class _NotStorable(Exception):
    pass


_FUNCTION_MODULES = ("torch", "operator", "_operator", "math")  # where a stored function may come from


def _node_to_json(node: fx.Node) -> list[Any]:
    return [node.op, node.name, _target_to_json(node.target), _value_to_json(node.args), _value_to_json(node.kwargs)]


def _target_to_json(target: Any) -> str:
    """"name:x" (a placeholder's, get_attr's or output's), "op:aten.linear.default", "fn:operator.getitem"."""
    if isinstance(target, str):
        return f"name:{target}"
    if isinstance(target, torch._ops.OpOverload):
        return f"op:{target.namespace}.{target._opname}.{target._overloadname}"
    name = f"fn:{getattr(target, '__module__', None)}.{getattr(target, '__qualname__', None)}"
    try:
        if _target_from_json(name) is target:
            return name
    except Exception:
        pass
    raise _NotStorable(f"{target!r} cannot be found again by its name")  # a higher-order op, a local function


@functools.cache
def _target_from_json(text: str) -> Any:
    kind, _, name = text.partition(":")
    if kind == "name":
        return name
    if kind == "op":
        namespace, op, overload = name.split(".")
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)
    if kind == "fn" and name.partition(".")[0] in _FUNCTION_MODULES:
        found = pydoc.locate(name)
        if callable(found):
            return found
    raise RuntimeError(f"{text} is not an op of torch.ops nor a function of {', '.join(_FUNCTION_MODULES)}")


def _value_to_json(value: Any) -> Any:
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return {"list" if isinstance(value, list) else "tuple": [_value_to_json(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[k, _value_to_json(v)] for k, v in value.items()]}
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return {"torch": str(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, slice):
        return {"slice": [_value_to_json(value.start), _value_to_json(value.stop), _value_to_json(value.step)]}
    raise _NotStorable(f"a {type(value).__name__} argument")


def _value_from_json(value: Any, created: dict[str, fx.Node]) -> Any:
    if not isinstance(value, dict):
        return value
    (kind, data), = value.items()
    if kind == "node":
        return created[data]
    if kind in ("list", "tuple"):
        items = [_value_from_json(v, created) for v in data]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {k: _value_from_json(v, created) for k, v in data}
    if kind == "torch":
        found = getattr(torch, data.removeprefix("torch."))
        if not isinstance(found, (torch.dtype, torch.layout, torch.memory_format)):
            raise RuntimeError(f"{data} is not a dtype, layout or memory format")
        return found
    if kind == "device":
        return torch.device(data)
    if kind == "slice":
        return slice(*(_value_from_json(v, created) for v in data))
    raise RuntimeError(f"unknown value kind {kind}")


def _structure(gm: fx.GraphModule) -> str:
    """Every node's op, target and arguments (other nodes by position), hashed: names left out."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    lines = []
    for n in gm.graph.nodes:
        arguments = fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{position[a]}")
        lines.append(f"{n.op} {_target_name(n.target)} {arguments!r}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _target_name(target: Any) -> str:
    if isinstance(target, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return f"{getattr(target, '__module__', None)}.{getattr(target, '__qualname__', repr(target))}"


def _describe(value: Any) -> Any:
    """The facts a rewrite reads of a value: a tensor's metadata (not its data), a size's expression
    and hint; nested values leaf by leaf."""
    if isinstance(value, torch.Tensor):
        return (type(value).__name__, tuple(map(str, value.shape)), tuple(map(str, value.stride())),
                str(value.storage_offset()), value.dtype, str(value.device), value.layout, value.requires_grad)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return (type(value).__name__, str(value.node.expr), value.node.hint)
    if isinstance(value, (list, tuple, dict)):
        return [_describe(leaf) for leaf in tree_leaves(value)]
    return repr(value)


def _contents(tensor: torch.Tensor) -> str:
    """A digest of a constant's data: a graph that bakes in another value is another graph."""
    data = tensor.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()


def _custom_op_facts(target: Any) -> Any:
    """An op outside torch's namespaces: its schema and tags (which rules the passes apply)."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return [_custom_op_facts(getattr(target, name)) for name in target.overloads()]
    if isinstance(target, torch._ops.OpOverload) and target.namespace not in ("aten", "prim", "prims"):
        return str(target._schema), sorted(map(str, target.tags))
    return None


def _symbolic_facts(example_inputs: list[Any]) -> Any:
    """With symbolic sizes, what the passes may prove of them: each symbol's hint (which `graph.hint`
    reads) and range, the replacements and guards of the shape environment."""
    fake_mode = detect_fake_mode(example_inputs)
    shape_env = getattr(fake_mode, "shape_env", None)
    sizes = [s for x in example_inputs for s in ([x] if isinstance(x, torch.SymInt) else
                                                 x.shape if isinstance(x, torch.Tensor) else [])]
    symbols = set().union(*[s.node.expr.free_symbols for s in sizes if isinstance(s, torch.SymInt)])
    if shape_env is None or not symbols:
        return None
    hints = getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val  # renamed after torch 2.11
    return (sorted((str(s), str(hints.get(s)), str(shape_env.var_to_range.get(s))) for s in symbols),
            sorted(f"{s} = {r}" for s, r in shape_env.replacements.items()),
            [str(g.expr) for g in shape_env.guards])


@functools.cache
def specpass_source() -> str:
    """A digest of every .py file of the package: any change to specpass is another key."""
    package = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _row_rules() -> list[Any]:
    """The registered row rules, each as its function's name, code and closure (`register_row_rule`'s
    declarations are closures): a rule added at run time changes what live_rows may do."""
    def facts(fn: Any) -> Any:
        code = getattr(fn, "__code__", None)
        cells = [repr(c.cell_contents) for c in (getattr(fn, "__closure__", None) or ())]
        return _target_name(fn), code.co_code.hex() if code is not None else None, cells

    return sorted((str(op), facts(fn)) for op, fn in registered_rules().items())

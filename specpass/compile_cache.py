"""specpass's compile cache: a process that compiles a graph another process already rewrote, with
the same options, loads the rewritten graph and its report instead of capturing and rewriting again
(issue 35). torch's own caches (AOTAutograd, FX graph) then skip Inductor's work on it.

Where: `$SPECPASS_CACHE_DIR`, else `specpass/` under torch's Inductor cache directory
(`$TORCHINDUCTOR_CACHE_DIR`, default `/tmp/torchinductor_<user>`): clearing torch's cache clears ours.
Off: `SPECPASS_CACHE=0`, or `TORCHINDUCTOR_FORCE_DISABLE_CACHES=1` (which turns torch's off too).

The key is a SHA-256 of everything the rewrite reads: the Dynamo graph (its code, every node's
example value, the contents of its tensor constants, the facts of the custom ops it calls), the
example inputs (shape, stride, dtype, device; symbolic sizes with their hints, ranges and the shape
environment's guards), the options, grad mode, specpass's source (every .py file of the package),
the row rules registered at run time, and torch's version.

An entry is one file per key, written by `torch.save` with plain values and tensors only and read
with `weights_only=True` (no pickled objects): the rewritten graph's Python source, its tensor
constants, a digest of its node structure and the report. The graph is rebuilt from its source, as
torch.fx unpickles a GraphModule, and must have the stored structure. An entry that cannot be read,
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
from specpass.report import Finding, Report

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

    for part in (FORMAT, torch.__version__, torch.version.git_version, _specpass_source(), _row_rules(),
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
        graph_module = _rebuild(entry["import_block"], entry["code"], entry["constants"], entry["names"],
                                entry["class_name"], entry["tracer"])
    except Exception as exc:
        raise UnusableEntry(f"{path} holds a graph that does not rebuild ({type(exc).__name__}: {exc})") from exc
    if _structure(graph_module) != entry["structure"]:
        raise UnusableEntry(f"{path} rebuilds a graph other than the one stored")
    report = _report_from_json(entry["report"])
    report.notes.append(f"loaded from specpass's compile cache ({path})")
    return RewriteResult(graph_module, report)


def store(entry_key: str, result: RewriteResult) -> bool:
    """Write the rewrite under this key (atomically: a reader sees the old entry or the new one).
    False when the graph cannot be stored: it would not rebuild from its source as it is."""
    graph_module = result.graph_module
    constants = {n.target: getattr(graph_module, n.target) for n in graph_module.graph.find_nodes(op="get_attr")}
    if not all(isinstance(c, torch.Tensor) and "." not in name for name, c in constants.items()):
        return False
    _, (body, import_block) = graph_module.__reduce__()  # torch.fx's own serialization: source and imports
    code = body.get("_code") or body["code"]
    constants = {name: c.detach() for name, c in constants.items()}
    structure, names = _structure(graph_module), [n.name for n in graph_module.graph.nodes]
    tracer = _target_name(graph_module._tracer_cls) if getattr(graph_module, "_tracer_cls", None) else None
    try:
        rebuilt = _rebuild(import_block, code, constants, names, type(graph_module).__name__, tracer)
        if _structure(rebuilt) != structure:
            return False
    except Exception:
        return False  # ops the source cannot express (a higher-order op's submodule)
    entry = {"format": FORMAT, "key": entry_key, "import_block": import_block, "code": code, "constants": constants,
             "names": names, "class_name": type(graph_module).__name__,
             "tracer": tracer, "structure": structure, "report": _report_to_json(result.report)}
    entry["digest"] = _digest(entry)
    path = _path(entry_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(entry, buffer)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(buffer.getvalue())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    return True


def _path(entry_key: str) -> Path:
    directory_ = directory()
    assert directory_ is not None, "a key is made only while caching is on"
    return directory_ / entry_key[:2] / f"{entry_key}.pt"


def _digest(entry: dict[str, Any]) -> str:
    """Of every field but the digest itself: a changed field (not only a torn file) is caught."""
    digest = hashlib.sha256()
    for name in ("format", "key", "import_block", "code", "names", "class_name", "tracer", "structure",
                 "report"):
        digest.update(repr(entry.get(name)).encode())
        digest.update(b"\0")
    for name, constant in sorted(entry.get("constants", {}).items()):
        digest.update(repr((name, _describe(constant), _contents(constant))).encode())
    return digest.hexdigest()


def _rebuild(import_block: str, code: str, constants: dict[str, torch.Tensor], names: list[str],
             class_name: str, tracer: str | None) -> fx.GraphModule:
    """The graph from its source, as torch.fx unpickles a GraphModule (run the source, trace it), with
    its nodes' own names, class name and tracer class: Inductor then gets the module it got when the
    entry was written, and torch's caches, keyed on its pickle, hit."""
    holder = torch.nn.Module()
    for name, constant in constants.items():
        holder.register_buffer(name, constant)
    traced = fx.graph_module.reduce_graph_module({**holder.__dict__, "_code": code}, import_block)
    if len(traced.graph.nodes) != len(names):
        raise RuntimeError(f"{len(traced.graph.nodes)} nodes traced, {len(names)} stored")
    graph, copies = fx.Graph(), {}
    for node, name in zip(traced.graph.nodes, names):
        copies[node] = graph.create_node(node.op, node.target, fx.node.map_arg(node.args, copies.__getitem__),
                                         fx.node.map_arg(node.kwargs, copies.__getitem__), name=name,
                                         type_expr=node.type)
    if [n.name for n in graph.nodes] != names:
        raise RuntimeError("the stored node names cannot be given back")
    rebuilt = fx.GraphModule(traced, graph, class_name=class_name)
    if tracer is not None:
        rebuilt._tracer_cls = _torch_tracer(tracer)
    return rebuilt


def _torch_tracer(name: str) -> type:
    """A tracer class of torch's, by name; nothing else is imported from an entry."""
    found = pydoc.locate(name) if name.startswith("torch.") else None
    if not (isinstance(found, type) and issubclass(found, fx.Tracer)):
        raise RuntimeError(f"{name} is not a tracer class of torch's")
    return found


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
    return (sorted((str(s), str(shape_env.var_to_val.get(s)), str(shape_env.var_to_range.get(s))) for s in symbols),
            sorted(f"{s} = {r}" for s, r in shape_env.replacements.items()),
            [str(g.expr) for g in shape_env.guards])


@functools.cache
def _specpass_source() -> str:
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


def _report_to_json(report: Report) -> str:
    return json.dumps({"findings": [dataclasses.asdict(f) for f in report.findings], "errors": report.errors,
                       "notes": report.notes, "matmul_flops": report.matmul_flops}, default=str)


def _report_from_json(text: str) -> Report:
    data = json.loads(text)
    pair = lambda v: tuple(v) if v is not None else None  # noqa: E731  (JSON has lists, Finding tuples)
    findings = [Finding(**{**f, "rows": pair(f["rows"]), "matmul_flops": pair(f["matmul_flops"])})
                for f in data["findings"]]
    return Report(findings=findings, errors=data["errors"], notes=data["notes"], matmul_flops=pair(data["matmul_flops"]))

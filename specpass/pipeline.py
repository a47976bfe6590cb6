"""The rewrite pipeline: run each enabled pass on a private copy of the IR, verify, keep or drop.

A pass is `run(gm, options) -> list[Finding]`: it edits `gm` (canonical IR, see capture.py) in
place and returns what it rewrote and what it left alone. The pipeline, not the pass, owns the
invariants: after every pass the graph is linted, dead code is removed, fake tensors are
re-propagated (through what the pass changed, on until the values are as they were) so every
`meta["val"]` is true, and the outputs (count, shapes, dtypes) and the sequence of in-place writes
must be unchanged; no node may get two findings (each candidate
gets one verdict; a pass checks that every candidate got one). A pass that raises or breaks an
invariant is dropped — the graph as it was before that pass goes on — and the report says why.
A pass that leaves the graph as it was (every node the same objects, in order) needs none of it.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import Counter
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.multiprocessing.reductions import StorageWeakRef

from specpass.capture import capture
from specpass.graph import (SCALAR_READS, emit, is_impure, is_mutation, is_region_call, make_local_writes_functional,
                            region_body, region_calls, region_operands, same_shape, storage, written_storages)
from specpass.options import Options
from specpass.passes import argmax, exact, gemv, gqa, live_rows, masks, seams, split_kv, topk_sort
from specpass.report import Finding, Report, graph_matmul_flops

Pass = Callable[[fx.GraphModule, Options], list[Finding]]

# Fixed order; each name is also the Options switch that turns the pass off.
PASSES: list[tuple[str, Pass]] = [
    ("argmax", argmax.run),
    ("live_rows", live_rows.run),
    ("gqa", gqa.run),  # after live_rows: its Q-slice reads attention head by head (gqa.py)
    ("split_kv", split_kv.run),  # after both: the rows live_rows left, the enable_gqa call gqa wrote
    ("topk_sort", topk_sort.run),  # after argmax: the exact top-k it emits
    ("gemv", gemv.run),  # after live_rows: the rows it leaves
    ("exact", exact.run),  # off unless asked; last: it routes what the others emit
]
# On the graph that calls the region bodies, after each is rewritten (`_rewrite_bodies`): they
# regroup the calls of final bodies and what the calls hand them.
AFTER_BODIES: list[tuple[str, Pass]] = [
    ("seams", seams.run),
    ("masks", masks.run),  # after seams: the bodies and calls it leaves are the final ones
]


@dataclasses.dataclass
class RewriteResult:
    graph_module: fx.GraphModule
    report: Report


def rewrite(gm: fx.GraphModule, **options: Any) -> RewriteResult:
    """Run the enabled passes on a copy of `gm` (canonical IR). `gm` itself is not modified."""
    return run_passes(gm, Options.make(**options))


def explain(fn: Callable, *args: Any, **kwargs: Any) -> Report:
    """Capture `fn(*args, **kwargs)`, rewrite it with default options, return the report."""
    return rewrite(capture(fn, *args, **kwargs)).report


def run_passes(gm: fx.GraphModule, options: Options, *, body: bool = False) -> RewriteResult:
    """`body`: `gm` is a region body; the AFTER_BODIES passes run on the graph that calls it."""
    report = Report()
    with report.timed("prepare/copy"):
        current = _copy(gm)
    with report.timed("prepare/diff"):
        as_captured = _snapshot(current)
    with report.timed("prepare/functional"):
        make_local_writes_functional(current)  # the IR: in place only what another tensor sees
    _clean(current, report, "prepare", as_captured)
    dense = [_dense(v) for v in _output_values(current)]
    for name, run in PASSES:
        current = _run_pass(name, run, current, options, report)
    _keep_dense_outputs(current, dense)
    current = _rewrite_bodies(current, options, report)
    for name, run in [] if body else AFTER_BODIES:
        current = _run_pass(name, run, current, options, report)
    with report.timed("report/flops"):
        report.matmul_flops = (graph_matmul_flops(gm), graph_matmul_flops(current))
    with report.timed("report/code"):
        rewritten = fx.GraphModule(current, current.graph, class_name=type(gm).__name__)  # its code, once
    return RewriteResult(rewritten, report)


def _run_pass(name: str, run: Pass, current: fx.GraphModule, options: Options, report: Report) -> fx.GraphModule:
    """`run` on a copy of `current`: the copy if it holds the invariants, else `current` and an error."""
    if not getattr(options, name):
        return current
    with report.timed(f"{name}/copy"):
        candidate = _copy(current)
    with report.timed(f"{name}/checks"):
        fixed = _fixed_sizes(current)
    try:
        with report.timed(f"{name}/diff"):
            as_it_was = _snapshot(candidate)
        with report.timed(f"{name}/rewrite"):
            findings = run(candidate, options)
        with report.timed(f"{name}/diff"):
            edited = list(candidate.graph.nodes) != list(as_it_was) or \
                not all(_as_it_was(candidate, n, as_it_was) for n in candidate.graph.nodes)
        if edited:
            _clean(candidate, report, name, as_it_was)
            with report.timed(f"{name}/checks"):
                _check_invariants(before=current, after=candidate)
        else:  # the graph is as it was: current's checks hold for it
            candidate = current
        with report.timed(f"{name}/checks"):
            _check_no_specialization(candidate, fixed)  # the shape environment is shared: even a refusal may pin
    except Exception as exc:
        report.errors.append(
            f"pass {name} failed ({type(exc).__name__}: {exc}); the graph is kept as it was before {name}"
        )
        return current
    twice = _reported_twice(findings)
    if twice:
        report.errors.append(f"pass {name} reported {twice} twice; the graph is kept as it was before {name}")
        return current
    report.findings.extend(findings)
    return candidate


def _rewrite_bodies(gm: fx.GraphModule, options: Options, report: Report) -> fx.GraphModule:
    """Each distinct region body the graph still calls (a repeated decoder layer), rewritten once by
    the same pipeline, serves every call. After the graph's own passes, so that a call they inlined
    (the live rows of the last layer) was a copy of the body as captured, rewritten with the graph
    around it. A body's findings are named `body.node`, once each, with how many calls run it (`calls`)."""
    calls = region_calls(gm.graph)
    if not calls:
        return gm
    rewritten = _copy(gm)  # the body attributes are set on a copy: `gm` keeps the bodies as captured
    for name, body_calls in calls.items():
        result = run_passes(operator.attrgetter(name)(gm), options, body=True)
        setattr(rewritten, name, result.graph_module)
        report.findings += [dataclasses.replace(f, where=", ".join(f"{name}.{n}" for n in f.nodes),
                                                calls=len(body_calls) * max(f.calls, 1))
                            for f in result.report.findings if f.where != "graph"]  # (notes on the step, not a body)
        report.errors += [f"{name}: {e}" for e in result.report.errors]
        for part, seconds in result.report.seconds.items():
            part = f"bodies/{part.partition('/')[0]}"
            report.seconds[part] = report.seconds.get(part, 0.0) + seconds
    return rewritten


def _reported_twice(findings: list[Finding]) -> list[str]:
    """Nodes named by more than one finding: each candidate gets exactly one verdict."""
    counts = Counter(name for f in findings for name in f.nodes)
    return sorted(name for name, n in counts.items() if n > 1)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    # Shares parameters/constants with `gm`; the graph (and each node's meta dict) is new. Lazy: its
    # Python code is generated where it is read, not at every copy and clean (a fifth of the
    # pipeline's time on a 1,800-node round); the result gets its code once (run_passes).
    return _LazyGraphModule(gm, gm.graph.__deepcopy__(), class_name=type(gm).__name__)


def _clean(gm: fx.GraphModule, report: Report, part: str, before: Snapshot | None = None) -> None:
    with report.timed(f"{part}/clean"):
        gm.graph.eliminate_dead_code(is_impure)  # in-place ops are impure: KV writes survive
        gm.graph.lint()
        gm.recompile()
    with report.timed(f"{part}/propagate"):
        propagate_fake_tensors(gm, before)


Snapshot = dict[fx.Node, tuple[Any, ...]]


def _snapshot(gm: fx.GraphModule) -> Snapshot:
    """Per node, in graph order, what its meta["val"] was computed from: its op, target and
    arguments, the value itself and, for a constant, the tensor it reads."""
    return {n: _inputs_of_value(gm, n) for n in gm.graph.nodes}


def _inputs_of_value(gm: fx.GraphModule, n: fx.Node) -> tuple[Any, ...]:
    # fx gives a node a new args/kwargs tuple on every edit (replace_input_with too): identity tells
    constant = _attribute(gm, n.target) if n.op == "get_attr" else None
    return n.op, n.target, n.args, n.kwargs, n.meta.get("val"), constant


def _as_it_was(gm: fx.GraphModule, n: fx.Node, before: Snapshot) -> bool:
    """The node itself is as the snapshot saw it (the same objects), whatever its inputs hold."""
    was = before.get(n)
    return was is not None and all(a is b for a, b in zip(was, _inputs_of_value(gm, n)))


def _attribute(gm: fx.GraphModule, target: str) -> Any:
    try:
        return operator.attrgetter(target)(gm)  # "a.b": a submodule's constant
    except AttributeError:
        return None


def propagate_fake_tensors(gm: fx.GraphModule, before: Snapshot | None = None) -> None:
    """Recompute every node's meta["val"] from the placeholders' fake tensors. With `before`, the
    snapshot taken before a pass edited the graph, only what the values need: a node as it was whose
    inputs hold their old values keeps its old value, and a node computed again whose value is the old
    one's (`_stands_for`) takes the old object back, so that the nodes after it keep theirs; the
    propagation stops where a pass's edit stops changing values."""
    inputs = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    mode = detect_fake_mode(inputs)
    if mode is None:
        raise RuntimeError("placeholders carry no fake tensors; is this graph from specpass.capture?")
    # Fake ops run as Dynamo and make_fx run them: without the Python dispatcher, torch 2.11's
    # aten.linear kernel reads numel() of symbolic sizes, and fails.
    with enable_python_dispatcher():
        _ConstantsAsFake(gm, mode, before or {}).propagate_dont_convert_inputs(*inputs)


class _ConstantsAsFake(FakeTensorProp):
    def __init__(self, gm: fx.GraphModule, mode: Any, before: Snapshot):
        super().__init__(gm, mode)
        self.before = before
        self.held: set[fx.Node] = set()  # nodes whose meta["val"] is the object the snapshot holds

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        # static: a constant has the sizes it has (a fresh symbol would be one Dynamo never saw)
        return self._mode.from_tensor(value, static_shapes=True) if isinstance(value, torch.Tensor) else value

    def run_node(self, n: fx.Node) -> Any:
        was = self.before.get(n)
        old = None if was is None else was[4]
        if old is not None and n.op not in ("placeholder", "output") and _as_it_was(self.module, n, self.before) \
                and all(i in self.held for i in n.all_input_nodes):
            self.held.add(n)
            return old
        # A scalar read from a tensor (`.item()` of a config float Dynamo made an input) keeps the
        # symbol capture gave it: run again, it would be a fresh unknown with nothing known of it.
        if n.target in SCALAR_READS and isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat)):
            return n.meta["val"]
        value = super().run_node(n)
        if old is not None and (value is old or (n.op == "call_function" and not is_mutation(n) and _stands_for(
                value, old, _input_values(n.args, n.kwargs, lambda i: i.meta.get("val")),
                _input_values(was[2], was[3], lambda i: self.before.get(i, (None,) * 5)[4])))):
            n.meta["val"] = old
            self.held.add(n)
            return old
        return value


def _input_values(args: Any, kwargs: Any, value_of: Callable[[fx.Node], Any]) -> list[Any]:
    nodes = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, fx.Node)]
    return torch.utils._pytree.tree_leaves([value_of(i) for i in nodes])


def _stands_for(new: Any, old: Any, new_inputs: list[Any], old_inputs: list[Any]) -> bool:
    """`new`, just computed, may take `old`'s place: tensors (or a tuple of them) of one dtype, device,
    layout, sizes, strides and offset, without a constant, each in a storage of its own (no input's:
    an alias keeps its input's storage, which the old object does not share)."""
    if isinstance(new, (tuple, list)):
        return type(new) is type(old) and len(new) == len(old) and \
            all(_stands_for(a, b, new_inputs, old_inputs) for a, b in zip(new, old))
    if not (isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor)):
        return False
    if (new.dtype, new.device, new.layout, new.requires_grad) != (old.dtype, old.device, old.layout, old.requires_grad):
        return False
    if getattr(new, "constant", None) is not None or getattr(old, "constant", None) is not None:
        return False
    if not (_same_sizes(new.shape, old.shape) and _same_sizes(new.stride(), old.stride())
            and _same_sizes([new.storage_offset()], [old.storage_offset()])):
        return False
    return _own_storage(new, new_inputs) and _own_storage(old, old_inputs)


def _own_storage(value: torch.Tensor, inputs: list[Any]) -> bool:
    mine = StorageWeakRef(value.untyped_storage())
    return all(mine != StorageWeakRef(i.untyped_storage()) for i in inputs if isinstance(i, torch.Tensor))


def _same_sizes(a: Any, b: Any) -> bool:
    """Sizes equal as expressions (no guard is added: comparing SymInts with == would add one)."""
    def expr(x: Any) -> Any:
        return x.node.expr if isinstance(x, torch.SymInt) else sympy.Integer(x)

    return len(a) == len(b) and all(expr(x) == expr(y) for x, y in zip(a, b))


def _signature(gm: fx.GraphModule) -> tuple[list[Any], list[Any]]:
    """(output shapes/dtypes, ordered in-place writes: op and buffers written): what no pass may
    change."""
    outputs = [_out_sig(a) for a in torch.utils._pytree.tree_leaves(gm.graph.output_node().args[0])]
    return outputs, _written_buffers(gm)


def _written_buffers(gm: fx.GraphModule) -> list[tuple[Any, tuple[str, ...]]]:
    """Each in-place write in order, with the buffers it writes: a graph input's by its name (a view
    of it has the same storage), one the graph makes itself as "?". A region call's are its body's,
    on the operands, so inlining a call keeps them: a buffer its body makes is the body's "?" before
    and the graph's after, under whatever name the copy got."""
    owners: dict[Any, str] = {}
    for node in gm.graph.nodes:
        if storage(node) is not None:
            owners.setdefault(storage(node), node.name if node.op == "placeholder" else "?")
    writes = []
    for n in gm.graph.nodes:
        if is_region_call(n) and is_mutation(n):
            body = region_body(n)
            names = {p.name: owners.get(storage(a), "?") for p, a in
                     zip(body.graph.find_nodes(op="placeholder"), region_operands(n)) if isinstance(a, fx.Node)}
            writes += [(op, tuple(sorted(names.get(b, "?") for b in written)))
                       for op, written in _written_buffers(body)]
        elif is_mutation(n):
            writes.append((n.target, tuple(sorted(owners.get(s, "?") for s in written_storages(n)))))
    return writes


def _out_sig(arg: Any) -> Any:
    value = arg.meta.get("val") if isinstance(arg, fx.Node) else arg
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    return type(value)


def _output_values(gm: fx.GraphModule) -> list[Any]:
    return [a.meta.get("val") if isinstance(a, fx.Node) else a
            for a in torch.utils._pytree.tree_leaves(gm.graph.output_node().args[0])]


def _keep_dense_outputs(gm: fx.GraphModule, dense: list[bool]) -> None:
    """An output the passes left strided where it was dense (a slice of a sorted row, a transposed
    attention output) is copied back to the dense layout: the step that reads it next may be compiled
    for that layout (a saved step checks strides and does not recompile)."""
    out = gm.graph.output_node()
    leaves = torch.utils._pytree.tree_leaves(out.args[0])
    for leaf, was_dense in zip(leaves, dense):
        if was_dense and isinstance(leaf, fx.Node) and isinstance(leaf.meta.get("val"), torch.Tensor) \
                and not _dense(leaf.meta["val"]):
            with gm.graph.inserting_before(out):
                copy = emit(gm.graph, torch.ops.aten.clone.default, (leaf,), {"memory_format": torch.contiguous_format})
            out.replace_input_with(leaf, copy)
    gm.recompile()


def _dense(value: Any) -> bool:
    """A tensor with row-major strides (a dim of size 1 aside), compared as expressions: no guard is added."""
    if not isinstance(value, torch.Tensor):
        return False
    expect: Any = 1
    for size, stride in reversed(list(zip(value.shape, value.stride()))):
        if not (isinstance(size, int) and size == 1) and not _same_sizes([stride], [expect]):
            return False
        expect = expect * size
    return True


def _same_outputs(a: list[Any], b: list[Any]) -> bool:
    def same(x: Any, y: Any) -> bool:
        if isinstance(x, tuple) and isinstance(y, tuple):
            return same_shape(x[0], y[0]) and x[1] == y[1]
        return x == y

    return len(a) == len(b) and all(map(same, a, b))


def _fixed_sizes(gm: fx.GraphModule) -> dict[Any, Any]:
    """The symbolic sizes of the graph's inputs (Dynamo's dynamic dimensions) that the shape
    environment has pinned to one value. (Sizes read from data, `.item()`'s, may be pinned by
    what the graph itself asserts of them: not ours to check.)"""
    inputs = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    mode = detect_fake_mode(inputs)
    if mode is None or mode.shape_env is None:
        return {}
    sizes = [v for x in inputs for v in ([x] if isinstance(x, torch.SymInt) else
                                         getattr(x, "shape", []) if isinstance(x, torch.Tensor) else [])]
    symbols = set().union(*[s.node.expr.free_symbols for s in sizes if isinstance(s, torch.SymInt)])
    return {s: r for s, r in mode.shape_env.replacements.items() if s in symbols and r.is_number}


def _check_no_specialization(gm: fx.GraphModule, before: dict[Any, Any]) -> None:
    """A pass decides only what holds for every size (graph.known), so the compiled graph serves
    every size Dynamo allows. (Running ops on fake values may record guards torch's meta
    functions need, like `Ne(s0, 0)`; those hold for every size, and are fine.)"""
    pinned = {s: r for s, r in _fixed_sizes(gm).items() if s not in before}
    if pinned:
        raise RuntimeError(f"it pinned symbolic sizes to one value ({', '.join(f'{s} = {r}' for s, r in pinned.items())})")


def _check_invariants(before: fx.GraphModule, after: fx.GraphModule) -> None:
    (outs_before, writes_before), (outs_after, writes_after) = _signature(before), _signature(after)
    if not _same_outputs(outs_before, outs_after):
        raise RuntimeError(f"outputs changed: {outs_before} -> {outs_after}")
    if writes_before != writes_after:
        raise RuntimeError(f"the in-place writes changed (op, buffers written): {writes_before} -> {writes_after}")

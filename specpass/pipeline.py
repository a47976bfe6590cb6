"""The rewrite pipeline: run each enabled pass on a private copy of the IR, verify, keep or drop.

A pass is `run(gm, options) -> list[Finding]`: it edits `gm` (canonical IR, see capture.py) in
place and returns what it rewrote and what it left alone. The pipeline, not the pass, owns the
invariants: after every pass the graph is linted, dead code is removed, fake tensors are
re-propagated (through what the pass changed and everything downstream) so every `meta["val"]` is
true, and the outputs (count, shapes, dtypes) and the
sequence of in-place writes must be unchanged; no node may get two findings (each candidate
gets one verdict; a pass checks that every candidate got one). A pass that raises or breaks an
invariant is dropped — the graph as it was before that pass goes on — and the report says why.
A pass that leaves the graph as it was (every node the same objects, in order) needs none of it.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import Counter
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from specpass.capture import capture
from specpass.graph import (SCALAR_READS, is_impure, is_mutation, make_local_writes_functional, same_shape, storage,
                            written_storages)
from specpass.options import Options
from specpass.passes import argmax, gqa, live_rows, split_kv, topk_sort
from specpass.report import Finding, Report, graph_matmul_flops

Pass = Callable[[fx.GraphModule, Options], list[Finding]]

# Fixed order; each name is also the Options switch that turns the pass off.
PASSES: list[tuple[str, Pass]] = [
    ("argmax", argmax.run),
    ("live_rows", live_rows.run),
    ("gqa", gqa.run),  # after live_rows: its Q-slice reads attention head by head (gqa.py)
    ("split_kv", split_kv.run),  # after both: the rows live_rows left, the enable_gqa call gqa wrote
    ("topk_sort", topk_sort.run),  # after argmax: the exact top-k it emits
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


def run_passes(gm: fx.GraphModule, options: Options) -> RewriteResult:
    report = Report()
    with report.timed("prepare/copy"):
        current = _copy(gm)
    with report.timed("prepare/functional"):
        make_local_writes_functional(current)  # the IR: in place only what another tensor sees
    _clean(current, report, "prepare")
    for name, run in PASSES:
        if not getattr(options, name):
            continue
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
                kept = _unchanged_values(candidate, as_it_was)
            if len(kept) < len(candidate.graph.nodes) or list(candidate.graph.nodes) != list(as_it_was):
                _clean(candidate, report, name, kept)
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
            continue
        twice = _reported_twice(findings)
        if twice:
            report.errors.append(f"pass {name} reported {twice} twice; the graph is kept as it was before {name}")
            continue
        report.findings.extend(findings)
        current = candidate
    with report.timed("report/flops"):
        report.matmul_flops = (graph_matmul_flops(gm), graph_matmul_flops(current))
    return RewriteResult(current, report)


def _reported_twice(findings: list[Finding]) -> list[str]:
    """Nodes named by more than one finding: each candidate gets exactly one verdict."""
    counts = Counter(name for f in findings for name in f.nodes)
    return sorted(name for name, n in counts.items() if n > 1)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    # Shares parameters/constants with `gm`; the graph (and each node's meta dict) is new.
    return fx.GraphModule(gm, gm.graph.__deepcopy__(), class_name=type(gm).__name__)


def _clean(gm: fx.GraphModule, report: Report, part: str, kept: frozenset[fx.Node] = frozenset()) -> None:
    with report.timed(f"{part}/clean"):
        gm.graph.eliminate_dead_code(is_impure)  # in-place ops are impure: KV writes survive
        gm.graph.lint()
        gm.recompile()
    with report.timed(f"{part}/propagate"):
        propagate_fake_tensors(gm, kept)


def _snapshot(gm: fx.GraphModule) -> dict[fx.Node, tuple[Any, ...]]:
    """Per node, in graph order, what its meta["val"] was computed from: its op, target and
    arguments, the value itself and, for a constant, the tensor it reads."""
    return {n: _inputs_of_value(gm, n) for n in gm.graph.nodes}


def _inputs_of_value(gm: fx.GraphModule, n: fx.Node) -> tuple[Any, ...]:
    # fx gives a node a new args/kwargs tuple on every edit (replace_input_with too): identity tells
    constant = _attribute(gm, n.target) if n.op == "get_attr" else None
    return n.op, n.target, n.args, n.kwargs, n.meta.get("val"), constant


def _attribute(gm: fx.GraphModule, target: str) -> Any:
    try:
        return operator.attrgetter(target)(gm)  # "a.b": a submodule's constant
    except AttributeError:
        return None


def _unchanged_values(gm: fx.GraphModule, before: dict[fx.Node, tuple[Any, ...]]) -> frozenset[fx.Node]:
    """The nodes whose meta["val"] still holds: each node as it was (the same objects), every
    input of it too (transitively), so a value upstream of a pass's edits is not computed again."""
    kept: set[fx.Node] = set()
    for n in gm.graph.nodes:
        was = before.get(n)
        if was is not None and all(a is b for a, b in zip(was, _inputs_of_value(gm, n))) \
                and all(i in kept for i in n.all_input_nodes):
            kept.add(n)
    return frozenset(kept)


def propagate_fake_tensors(gm: fx.GraphModule, kept: frozenset[fx.Node] = frozenset()) -> None:
    """Recompute every node's meta["val"] from the placeholders' fake tensors, except those of
    the `kept` nodes, whose values (and their inputs') are unchanged."""
    inputs = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    mode = detect_fake_mode(inputs)
    if mode is None:
        raise RuntimeError("placeholders carry no fake tensors; is this graph from specpass.capture?")
    # Fake ops run as Dynamo and make_fx run them: without the Python dispatcher, torch 2.11's
    # aten.linear kernel reads numel() of symbolic sizes, and fails.
    with enable_python_dispatcher():
        _ConstantsAsFake(gm, mode, kept).propagate_dont_convert_inputs(*inputs)


class _ConstantsAsFake(FakeTensorProp):
    def __init__(self, gm: fx.GraphModule, mode: Any, kept: frozenset[fx.Node]):
        super().__init__(gm, mode)
        self.kept = kept

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        # static: a constant has the sizes it has (a fresh symbol would be one Dynamo never saw)
        return self._mode.from_tensor(value, static_shapes=True) if isinstance(value, torch.Tensor) else value

    def run_node(self, n: fx.Node) -> Any:
        if n in self.kept and n.op not in ("placeholder", "output") and "val" in n.meta:
            return n.meta["val"]
        # A scalar read from a tensor (`.item()` of a config float Dynamo made an input) keeps the
        # symbol capture gave it: run again, it would be a fresh unknown with nothing known of it.
        if n.target in SCALAR_READS and isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat)):
            return n.meta["val"]
        return super().run_node(n)



def _signature(gm: fx.GraphModule) -> tuple[list[Any], list[Any]]:
    """(output shapes/dtypes, ordered in-place writes: op and buffers written): what no pass may
    change."""
    outputs = [_out_sig(a) for a in torch.utils._pytree.tree_leaves(gm.graph.output_node().args[0])]
    return outputs, _written_buffers(gm)


def _written_buffers(gm: fx.GraphModule) -> list[tuple[Any, tuple[str, ...]]]:
    """Each in-place write in order, with the buffers it writes: named by the first node holding
    their storage (a graph input's name; a view of it has the same storage)."""
    owners: dict[Any, str] = {}
    for node in gm.graph.nodes:
        if storage(node) is not None:
            owners.setdefault(storage(node), node.name)
    return [(n.target, tuple(sorted(owners.get(s, "?") for s in written_storages(n))))
            for n in gm.graph.nodes if is_mutation(n)]


def _out_sig(arg: Any) -> Any:
    value = arg.meta.get("val") if isinstance(arg, fx.Node) else arg
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    return type(value)


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

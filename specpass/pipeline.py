"""The rewrite pipeline: run each enabled pass on a private copy of the IR, verify, keep or drop.

A pass is `run(gm, options) -> list[Finding]`: it edits `gm` (canonical IR, see capture.py) in
place and returns what it rewrote and what it left alone. The pipeline, not the pass, owns the
invariants: after every pass the graph is linted, dead code is removed, fake tensors are
re-propagated so every `meta["val"]` is true, and the outputs (count, shapes, dtypes) and the
sequence of in-place writes must be unchanged; no node may get two findings (each candidate
gets one verdict; a pass checks that every candidate got one). A pass that raises or breaks an
invariant is dropped — the graph as it was before that pass goes on — and the report says why.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from specpass.capture import capture
from specpass.graph import is_impure, is_mutation
from specpass.options import Options
from specpass.passes import argmax, live_rows
from specpass.report import Finding, Report, graph_matmul_flops

Pass = Callable[[fx.GraphModule, Options], list[Finding]]

# Fixed order; each name is also the Options switch that turns the pass off.
PASSES: list[tuple[str, Pass]] = [
    ("argmax", argmax.run),
    ("live_rows", live_rows.run),
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
    current = _copy(gm)
    _clean(current)
    for name, run in PASSES:
        if not getattr(options, name):
            continue
        candidate = _copy(current)
        try:
            findings = run(candidate, options)
            _clean(candidate)
            _check_invariants(before=current, after=candidate)
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
    report.matmul_flops = (graph_matmul_flops(gm), graph_matmul_flops(current))
    return RewriteResult(current, report)


def _reported_twice(findings: list[Finding]) -> list[str]:
    """Nodes named by more than one finding: each candidate gets exactly one verdict."""
    counts = Counter(name for f in findings for name in f.nodes)
    return sorted(name for name, n in counts.items() if n > 1)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    # Shares parameters/constants with `gm`; the graph (and each node's meta dict) is new.
    return fx.GraphModule(gm, gm.graph.__deepcopy__(), class_name=type(gm).__name__)


def _clean(gm: fx.GraphModule) -> None:
    gm.graph.eliminate_dead_code(is_impure)  # in-place ops are impure: KV writes survive
    gm.graph.lint()
    gm.recompile()
    propagate_fake_tensors(gm)


def propagate_fake_tensors(gm: fx.GraphModule) -> None:
    """Recompute every node's meta["val"] from the placeholders' fake tensors."""
    inputs = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    fake_mode = detect_fake_mode(inputs)
    if fake_mode is None:
        raise RuntimeError("placeholders carry no fake tensors; is this graph from specpass.capture?")
    _ConstantsAsFake(gm, fake_mode).propagate_dont_convert_inputs(*inputs)


class _ConstantsAsFake(FakeTensorProp):
    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        return self._mode.from_tensor(value) if isinstance(value, torch.Tensor) else value


def _signature(gm: fx.GraphModule) -> tuple[list[Any], list[Any]]:
    """(output shapes/dtypes, ordered in-place op targets): what no pass may change."""
    outputs = [_out_sig(a) for a in torch.utils._pytree.tree_leaves(gm.graph.output_node().args[0])]
    writes = [n.target for n in gm.graph.nodes if is_mutation(n)]
    return outputs, writes


def _out_sig(arg: Any) -> Any:
    value = arg.meta.get("val") if isinstance(arg, fx.Node) else arg
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    return type(value)


def _check_invariants(before: fx.GraphModule, after: fx.GraphModule) -> None:
    (outs_before, writes_before), (outs_after, writes_after) = _signature(before), _signature(after)
    if outs_before != outs_after:
        raise RuntimeError(f"outputs changed: {outs_before} -> {outs_after}")
    if writes_before != writes_after:
        raise RuntimeError("the sequence of in-place writes changed")

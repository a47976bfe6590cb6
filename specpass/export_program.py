"""torch.export: a draft step exported, rewritten by the passes, returned as an ExportedProgram
(for AOTInductor, saving, or anything else that takes one).

The program `torch.export.export` returns (training IR) is already the IR the passes take:
undecomposed pre-dispatch ATen whose KV writes are in-place ops on placeholder buffers, in
program order, every node with a fake value. A functional program (after `run_decompositions`)
returns its writes instead, as outputs the graph signature marks `BUFFER_MUTATION` (or
`USER_INPUT_MUTATION`); the passes get them as in-place `copy_`s at the end of the graph (exact:
a functional graph never reads a buffer after writing it), and the rewritten program returns
them again.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, InputKind, OutputKind

from specpass.compile_backend import SpecpassWarning
from specpass.graph import emit, is_mutation
from specpass.options import Options
from specpass.pipeline import run_passes
from specpass.report import Report, log_report

_WRITES = (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION, OutputKind.USER_INPUT_MUTATION)


def export(program: nn.Module | ExportedProgram, args: tuple = (), kwargs: dict[str, Any] | None = None, *,
           dynamic_shapes: Any = None, strict: bool = False, **options: Any) -> ExportedProgram:
    """`torch.export.export(program, args, kwargs, dynamic_shapes=, strict=)`, rewritten by the passes.

    `program` is a module (exported here) or an ExportedProgram (rewritten as it is; no other
    arguments). `options` are specpass's (`specpass.Options`). The result is an ExportedProgram
    with the same inputs, outputs and buffer writes; what the passes did is its `specpass_report`.
    If the passes cannot run on the program, it is returned unrewritten, with a `SpecpassWarning`.
    """
    if "handoff" in options:
        raise TypeError("handoff= is an option of the torch.compile backend; an exported program is compiled "
                        "by whoever loads it (torch._inductor.aoti_compile_and_package)")
    opts = Options.make(**options)
    if isinstance(program, ExportedProgram):
        if args or kwargs or dynamic_shapes is not None:
            raise TypeError("an ExportedProgram is rewritten as it was exported: pass it alone, without "
                            "args, kwargs or dynamic_shapes")
        ep = program
    elif isinstance(program, nn.Module):
        ep = torch.export.export(program, args, kwargs, dynamic_shapes=dynamic_shapes, strict=strict)
    else:
        raise TypeError(f"expected an nn.Module or a torch.export.ExportedProgram, got a {type(program).__name__}: "
                        "torch.export exports modules, so wrap a step function in a module whose forward calls it")

    report, rewritten = Report(), ep
    try:
        with torch.no_grad():  # the step is inference; export's fake values may require grad
            result = run_passes(_in_place(ep), opts)
        report = result.report
        if report.rewrites:
            rewritten = _program(ep, result.graph_module)
    except Exception as exc:  # torch.export's verifier lists every allowed op after its first line
        first_line = next(iter(str(exc).splitlines()), "")
        report.errors.append(f"specpass could not rewrite this program ({type(exc).__name__}: {first_line}); "
                             "it is returned unrewritten")
    for error in report.errors:
        warnings.warn(error, SpecpassWarning, stacklevel=2)
    log_report(report)
    rewritten.specpass_report = report  # type: ignore[attr-defined]
    return rewritten


def _in_place(ep: ExportedProgram) -> fx.GraphModule:
    """The program's graph with each write it returns (a functional program) done in place at the end."""
    gm = fx.GraphModule(ep.graph_module, copy.deepcopy(ep.graph))
    inputs = dict(zip(_targets(ep), gm.graph.find_nodes(op="placeholder"), strict=True))
    output = gm.graph.output_node()
    kept = []
    with gm.graph.inserting_before(output):
        for spec, value in zip(ep.graph_signature.output_specs, output.args[0], strict=True):
            if spec.kind in _WRITES:
                emit(gm.graph, torch.ops.aten.copy_.default, (inputs[spec.target], value))
            else:
                kept.append(value)
    output.args = (tuple(kept),)
    gm.recompile()
    return gm


def _program(ep: ExportedProgram, gm: fx.GraphModule) -> ExportedProgram:
    """The rewritten graph as an ExportedProgram like `ep`: the writes `_in_place` moved into the
    graph are outputs again, and the signature names the new graph's nodes (a copied graph may
    rename one: `input` is a Python builtin)."""
    signature = ep.graph_signature
    output = gm.graph.output_node()
    # the copies `_in_place` added are the last writes: the pipeline keeps every write, in order
    mutations = [n for n in gm.graph.nodes if is_mutation(n)]
    moved = mutations[len(mutations) - sum(spec.kind in _WRITES for spec in signature.output_specs):]
    written, kept = iter([n.args[1] for n in moved]), iter(output.args[0])
    outputs = [next(written) if spec.kind in _WRITES else next(kept) for spec in signature.output_specs]
    for node in moved:
        gm.graph.erase_node(node)
    output.args = (tuple(outputs),)
    gm.recompile()

    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    names = {spec.arg.name: node.name for spec, node in zip(signature.input_specs, placeholders, strict=True)}
    input_specs = [_named(spec, node) for spec, node in zip(signature.input_specs, placeholders)]
    output_specs = [_named(spec, value) for spec, value in zip(signature.output_specs, outputs)]
    output_specs = [dataclasses.replace(spec, target=names[spec.target])
                    if spec.kind == OutputKind.USER_INPUT_MUTATION else spec for spec in output_specs]
    gm.meta.update(ep.graph_module.meta)  # torch.export's own (inline constraints of data-dependent sizes)
    return ExportedProgram(
        root=gm, graph=gm.graph, graph_signature=ExportGraphSignature(input_specs, output_specs),
        state_dict=ep.state_dict, range_constraints=copy.deepcopy(ep.range_constraints),
        module_call_graph=copy.deepcopy(ep.module_call_graph), example_inputs=ep.example_inputs,
        constants=ep.constants, verifiers=ep.verifiers)


def _targets(ep: ExportedProgram) -> list[str]:
    """Each input as a write's output spec names it: a parameter's or buffer's FQN, a user input's name."""
    return [spec.arg.name if spec.kind == InputKind.USER_INPUT else spec.target
            for spec in ep.graph_signature.input_specs]


def _named(spec: Any, node: Any) -> Any:
    """An input or output spec naming `node` (a constant output keeps its spec)."""
    return dataclasses.replace(spec, arg=dataclasses.replace(spec.arg, name=node.name)) \
        if isinstance(node, fx.Node) else spec

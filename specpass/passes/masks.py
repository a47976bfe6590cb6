"""Masks: an attention's boolean mask converted once, not inside every attention call.

SDPA converts a boolean mask into the additive mask its kernel reads (`where(mask, 0, -inf)`, or
cuDNN's finite variant) inside the call, so a decoder converts the one mask its layers share once
per layer. A repeated layer compiled once takes the mask as an input of its body, and Inductor
converts it in every call: one kernel per layer and step, where once a step would do (the pass's
kernels a step: docs/results.md, the masks pass). The rewrite

    o_i = scaled_dot_product_attention(q_i, k_i, v_i, mask, ...)     # each layer, in the graph or a body
->  m = convert(mask)                                                 # once, before the first reader
    o_i = scaled_dot_product_attention(q_i, k_i, v_i, m, ...)

`convert` is not written here: it is what torch's own decomposition of the call does to the mask
alone before the kernel it chose, traced on the call's fake tensors (make_fx: the ops that read
nothing but the mask, up to the one tensor the rest reads). So it is the conversion of this torch,
this device and this call: cuDNN's, the CUDA fused kernels', the CPU kernel's, or the math path's.

Exact, proven per call: the call traced with the converted mask decomposes into the same ops with
the same arguments as the rest of the call traced with the boolean one; the conversion's ops run
once instead of per call on the same, unwritten, mask. Refused, with the reason: a mask written in
place (the converted copy would go stale); a decomposition that converts nothing from the mask alone,
or that differs with the converted mask (another kernel); a mask input of a body that its body reads
other than as an attention's mask (it stays an input). A body is rewritten only with all its calls.
Candidates: attention calls with a boolean mask that another attention call reads too, in the
graph or through the input of a region body it calls (a mask read once is converted once already).
Order: after the bodies and the seams pass (the final calls).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from specpass.graph import (args_match, bind, copy_nodes, fake_mode, free_attr_name, is_mutation, region_body,
                            region_calls, region_operands, same_shape, storage, val, written_storages)
from specpass.options import Options
from specpass.report import Finding

aten = torch.ops.aten
NAME = "masks"
_SDPA = aten.scaled_dot_product_attention.default
_REST = ("dropout_p", "is_causal", "scale", "enable_gqa")  # the call's other arguments, constants to trace
_SIZES = {aten.sym_size.int, aten.sym_numel.default}  # what a decomposition may read of the mask besides its values


class _Refuse(Exception):
    pass


def run(gm: fx.GraphModule, options: Options) -> list[Finding]:
    calls_of = region_calls(gm.graph)
    attention = [n for n in gm.graph.nodes if _attends_under_bool_mask(n)]
    mask_inputs = {name: _mask_inputs(region_body(calls[0])) for name, calls in calls_of.items()}

    def readers(inputs: dict[str, Any]) -> Counter:
        """mask -> the attention calls that read it: in the graph, and through these bodies' inputs."""
        return Counter([bind(n)["attn_mask"] for n in attention] + [
            region_operands(call)[i] for name in inputs for call in calls_of[name] for i in inputs[name]])

    findings: list[Finding] = []
    plans: dict[str, dict[int, _Conversion]] = {}
    every = readers(mask_inputs)
    written = set().union(*(written_storages(n) for n in gm.graph.nodes if is_mutation(n)))  # the pass adds none
    for name, calls in calls_of.items():
        if any(every[region_operands(call)[i]] > 1 for call in calls for i in mask_inputs[name]):
            plans[name] = _plan_body(name, calls, mask_inputs[name], written, findings)
    shared = readers(plans)  # read once, a mask is converted once as it is: not a candidate
    converted: dict[tuple, fx.Node] = {}  # (mask node, conversion) -> the converted mask
    for node in attention:
        mask = bind(node)["attn_mask"]
        if shared[mask] < 2:
            continue
        try:
            _check_unwritten(mask, written)
            conversion = _conversion(node, mask)
            m = _converted(gm.graph, mask, conversion, converted)
            node.update_kwarg("attn_mask", m) if "attn_mask" in node.kwargs else node.update_arg(3, m)
            findings.append(Finding(NAME, node.name, True, f"{_said(conversion)}, shared by the {shared[mask]} "
                                                           f"attention calls that read the mask"))
        except _Refuse as why:
            findings.append(Finding(NAME, node.name, False, str(why)))
    for name, plan in plans.items():
        if plan:
            _convert_before_calls(gm, name, calls_of[name], plan, converted)
    return findings


def _attends_under_bool_mask(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not _SDPA:
        return False
    mask = val(bind(node)["attn_mask"])
    return isinstance(mask, torch.Tensor) and mask.dtype == torch.bool


def _mask_inputs(body: fx.GraphModule) -> dict[int, list[fx.Node]]:
    """A body's inputs that its attention calls read as their boolean masks: {index: those calls}."""
    inputs = list(body.graph.find_nodes(op="placeholder"))
    readers = defaultdict(list)
    for node in body.graph.nodes:
        if _attends_under_bool_mask(node) and bind(node)["attn_mask"] in inputs:
            readers[inputs.index(bind(node)["attn_mask"])].append(node)
    return dict(readers)


def _plan_body(name: str, calls: list[fx.Node], mask_inputs: dict[int, list[fx.Node]], written: set,
               findings: list[Finding]) -> dict[int, "_Conversion"]:
    """{input index: its conversion} for each boolean mask input of the body that its attention
    calls read alone and convert alike, and that no call's operand has written; a finding each."""
    inputs = list(region_body(calls[0]).graph.find_nodes(op="placeholder"))
    plan = {}
    for i, attention in mask_inputs.items():
        p = inputs[i]
        where = f"{name}.{attention[0].name}"
        try:
            if len(attention) != len(p.users):
                other = next(u for u in p.users if u not in attention)
                raise _Refuse(f"the body also reads its mask input {p.name} in {other.name}: it stays an input")
            for call in calls:
                _check_unwritten(region_operands(call)[i], written)
            conversions = {_signature(c): c for c in (_conversion(a, p) for a in attention)}
            if len(conversions) > 1:
                raise _Refuse(f"the body's attention calls convert its mask input {p.name} differently")
            plan[i] = next(iter(conversions.values()))
            calls_said = "its one call" if len(calls) == 1 else f"its {len(calls)} calls"
            findings.append(Finding(NAME, where, True, f"{_said(plan[i])}, outside the body, for {calls_said}"))
        except _Refuse as why:
            findings.append(Finding(NAME, where, False, str(why)))
    return plan


def _convert_before_calls(gm: fx.GraphModule, name: str, calls: list[fx.Node], plan: dict[int, "_Conversion"],
                          converted: dict) -> None:
    """The calls pass the converted masks to a new body that takes them: a copy, not the body
    edited, which the pipeline's graph from before this pass still calls."""
    new_body = _retyped(region_body(calls[0]), plan)
    attr_name = free_attr_name(gm, f"{name}_masks")
    gm.add_submodule(attr_name, new_body)
    graph = gm.graph
    with graph.inserting_before(calls[0]):
        attr = graph.get_attr(attr_name)
    for call in calls:
        operands = list(region_operands(call))
        for i, conversion in plan.items():
            operands[i] = _converted(graph, operands[i], conversion, converted)
        call.args = (attr, f"{call.args[1]}_masks", *operands)
    for node in graph.find_nodes(op="get_attr", target=name):
        if not node.users:
            graph.erase_node(node)


def _retyped(body: fx.GraphModule, plans: dict[int, "_Conversion"]) -> fx.GraphModule:
    """A copy of the body whose mask inputs of `plans` hold the converted masks' values."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(body.graph, env))
    inputs = list(graph.find_nodes(op="placeholder"))
    with fake_mode(body.graph):
        for i, conversion in plans.items():
            v = conversion.value
            inputs[i].meta = {**inputs[i].meta, "val": torch.empty_strided(v.shape, v.stride(), dtype=v.dtype,
                                                                          device=v.device)}
    return fx.GraphModule(body, graph, class_name=type(body).__name__)


@dataclasses.dataclass(frozen=True)
class _Conversion:
    """The ops torch's decomposition of one attention call applies to its mask alone (`nodes`, of a
    traced graph whose mask placeholder is `mask`), ending in `result`."""

    mask: fx.Node
    nodes: list[fx.Node]
    result: fx.Node

    @property
    def value(self) -> torch.Tensor:
        return val(self.result)


def _conversion(node: fx.Node, mask: fx.Node) -> _Conversion:
    """What `node`'s decomposition does to `mask` alone, proven to leave the rest of it unchanged
    when the call reads the converted mask instead."""
    traced = _decomposed(node, val(mask))
    placeholders = list(traced.graph.find_nodes(op="placeholder"))
    m = placeholders[3]
    from_mask = {m}
    for n in traced.graph.nodes:  # the tensors made of the mask and nothing else (constants aside)
        if n.op == "call_function" and isinstance(val(n), torch.Tensor) and \
                any(a in from_mask for a in n.all_input_nodes) and \
                all(a in from_mask or not a.all_input_nodes and a.op == "call_function" for a in n.all_input_nodes):
            from_mask.add(n)
    ops = [n for n in traced.graph.nodes if n in from_mask and n is not m]
    constants = [a for n in ops for a in n.all_input_nodes if a not in from_mask]
    ops = [n for n in traced.graph.nodes if n in set(ops) | set(constants)]
    results = [n for n in ops if n not in constants and any(u not in from_mask for u in n.users)]
    if not results:
        raise _Refuse("SDPA's decomposition here converts nothing from the mask alone (the kernel reads it as "
                      "it is)")
    if len(results) > 1 or storage(results[0]) == storage(m) or not same_shape(val(results[0]).shape, val(m).shape) or \
            any(u not in from_mask and u.target not in _SIZES for u in m.users):
        raise _Refuse("SDPA's decomposition reads the mask other than through one converted tensor of its shape")
    conversion = _Conversion(m, ops, results[0])
    again = _decomposed(node, conversion.value)
    if not _same_rest(traced, conversion, again):
        raise _Refuse("the call decomposes otherwise with the converted mask (another kernel or other "
                      "arguments): left as it is")
    return conversion


def _decomposed(node: fx.Node, mask: torch.Tensor) -> fx.GraphModule:
    """The attention call, with `mask` as its mask, traced down to the kernel torch chooses."""
    args = bind(node)
    rest = {k: args[k] for k in _REST}
    if any(isinstance(a, fx.Node) for a in rest.values()):
        raise _Refuse("an argument of the call besides q, k, v and the mask is computed by the graph")
    qkv = [val(args[k]) for k in ("query", "key", "value")]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return _SDPA(q, k, v, m, rest["dropout_p"], rest["is_causal"], scale=rest["scale"],
                     enable_gqa=rest["enable_gqa"])

    with fake_mode(node.graph):
        return make_fx(attend)(*qkv, mask)


def _same_rest(traced: fx.GraphModule, conversion: _Conversion, again: fx.GraphModule) -> bool:
    """Is `again` (the call traced with the converted mask) the rest of `traced` after the
    conversion, node for node: the same targets on the same arguments?"""
    mine = [n for n in traced.graph.nodes if n.op != "placeholder" and n not in set(conversion.nodes)]
    theirs = [n for n in again.graph.nodes if n.op != "placeholder"]
    if len(mine) != len(theirs):
        return False
    env = dict(zip(traced.graph.find_nodes(op="placeholder"), again.graph.find_nodes(op="placeholder")))
    sizes = {conversion.mask: env[conversion.mask]}  # the converted mask has the boolean one's sizes
    env[conversion.result] = env.pop(conversion.mask)
    for a, b in zip(mine, theirs):
        if a.op != b.op or a.target != b.target or not args_match(
                (a.args, a.kwargs), (b.args, b.kwargs), {**env, **sizes} if a.target in _SIZES else env):
            return False
        env[a] = b
    return True


def _signature(conversion: _Conversion) -> tuple:
    """The conversion's ops and constants, its own nodes numbered: equal signatures, equal conversions."""
    index = {conversion.mask: -1, **{n: i for i, n in enumerate(conversion.nodes)}}
    number = lambda x: ("node", index[x]) if isinstance(x, fx.Node) else x  # noqa: E731
    return tuple((n.target, str(torch.utils._pytree.tree_map(number, (n.args, n.kwargs)))) for n in conversion.nodes)


def _check_unwritten(mask: Any, written: set) -> None:
    """`written`: the storages the graph's in-place ops write."""
    if not isinstance(mask, fx.Node):
        raise _Refuse("the mask is not a tensor of the graph")
    if storage(mask) in written:
        raise _Refuse(f"the mask {mask.name} is written in place: a converted copy would go stale")


def _converted(graph: fx.Graph, mask: fx.Node, conversion: _Conversion, converted: dict) -> fx.Node:
    """The mask converted: once per mask and conversion, right after the mask is made (so before
    every reader)."""
    key = (mask, _signature(conversion))
    if key not in converted:
        made = mask if mask.op != "placeholder" else list(graph.find_nodes(op="placeholder"))[-1]
        env: dict[fx.Node, Any] = {conversion.mask: mask}
        with graph.inserting_before(made.next):
            copy_nodes(graph, conversion.nodes, env)
        converted[key] = env[conversion.result]
    return converted[key]


def _said(conversion: _Conversion) -> str:
    ops = ", ".join(dict.fromkeys(n.target.overloadpacket.__name__ for n in conversion.nodes
                                  if isinstance(n.target, torch._ops.OpOverload)))
    return f"the boolean mask converted once ({ops}) to the {conversion.value.dtype} mask the kernel reads"

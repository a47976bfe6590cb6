"""Exact mode: every op that adds floats runs as a row-invariant kernel (specpass/kernels/exact.py),
so a row's values do not depend on how many rows run with it, nor on which.

    y = linear(x, w, b)                          ->  y = exact_linear(x, w, b)
    y = addmm(b, x, w) / mm(x, w) / matmul(x, w) ->  y = exact_linear(x, w.t(), b)    (w 2-D)
    y = matmul(a, b) / bmm(a, b)                 ->  y = exact_matmul(a, b)           (b batched)
    y = sum / mean (x, dims)                     ->  y = exact_sum(x, dims, keepdim, mean)
    y = rms_norm / layer_norm / softmax / log_softmax / logsumexp  ->  their exact_ twins
    o = scaled_dot_product_attention(q, k, v, mask, scale, is_causal, enable_gqa)  ->  exact_attention
    o = attend_split(q, k, v, mask, scale)       ->  exact_attention on the transposed operands

Why this is enough: every other op the graph may hold computes each output element from its inputs
alone, without an order to choose: pointwise ops (torch's `pointwise` tag; Inductor fuses them, and
exact mode compiles with `emulate_precision_casts`, which rounds every op's result as eager does and
turns off fused multiply-adds, so a fusion changes no bits), views, data movement (cat, index,
gather, scatter without reduce, copies, casts), ops on integers and booleans, and reductions whose
result does not depend on order (max, min, their arg-, topk, sort). The sampling ops of specpass
(`top1_lse`, `sample`, `floor`) read logits and make tokens or probabilities, never a row's logits.

Anything else that adds floats (var, cumsum, conv, a collective, an op this module does not know)
gets a finding that it was left alone, and the backend refuses the graph in exact mode: a graph
that cannot be made exact raises, it never runs inexactly.

A candidate is a node that adds floats: it gets one finding, rewritten or not. Order: last, after
every pass that may emit such ops (argmax's logsumexp, live_rows' gathers); split_kv is off in
exact mode (its kernel splits the slots by the rows' count).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from specpass import kernels  # noqa: F401  (registers torch.ops.specpass.*: attend_split, the exact_ ops)
from specpass.graph import bind, emit, is_region_call, val
from specpass.options import Options
from specpass.passes.op_sets import SAME_VALUES, VIEWS
from specpass.report import Finding

aten = torch.ops.aten
ops = torch.ops.specpass
NAME = "exact"

# Data movement and creation: each output element is an input element (or a constant) moved.
_MOVES = {
    aten.cat.default, aten.stack.default, aten.index.Tensor, aten.index_select.default, aten.gather.default,
    aten.embedding.default, aten.slice_scatter.default, aten.select_scatter.default, aten.copy.default,
    aten.copy_.default, aten.index_copy.default, aten.index_copy_.default, aten.constant_pad_nd.default,
    aten.pad.default, aten.repeat.default, aten.repeat_interleave.self_int, aten.repeat_interleave.Tensor,
    aten.flip.default, aten.roll.default, aten.tril.default, aten.triu.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int, aten.narrow.default,
    aten.expand_as.default, aten.movedim.int, aten.zeros.default, aten.ones.default, aten.full.default,
    aten.empty.memory_format, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
    aten.new_empty.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.empty_like.default, aten.arange.default, aten.arange.start, aten.arange.start_step, aten.eye.default,
    aten.fill_.Scalar, aten.zero_.default, aten.scalar_tensor.default, aten.scatter.src, aten.scatter.value,
    aten.scatter_.src, aten.scatter_.value, aten.masked_scatter.default,
    *SAME_VALUES, *VIEWS,
}
_PUTS = {aten.index_put.default, aten.index_put_.default}  # a move unless accumulate=True
# Pointwise, though torch does not tag them so.
_POINTWISE = {aten.where, aten.masked_fill, aten.floor_divide}  # every overload
# Reductions whose result is one of the inputs, whatever the order.
_ORDER_FREE = {
    aten.max.default, aten.max.dim, aten.min.default, aten.min.dim, aten.amax.default, aten.amin.default,
    aten.argmax.default, aten.argmin.default, aten.topk.default, aten.sort.default, aten.sort.stable,
    aten.aminmax.default,
}
_SAMPLING = {"specpass::top1_lse", "specpass::sample", "specpass::floor"}


def run(gm: fx.GraphModule, options: Options) -> list[Finding]:
    findings = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or is_region_call(node) or not _adds_floats(node):
            continue  # a region body is rewritten on its own (the pipeline runs every pass on it)
        route = _ROUTES.get(node.target)
        why = route(node) if route is not None else f"{_name(node)} adds floats and exact mode has no kernel for it"
        findings.append(Finding(NAME, node.name, why is None,
                                f"{_name(node)} runs as a row-invariant kernel" if why is None else why))
    return findings


def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def _adds_floats(node: fx.Node) -> bool:
    """Could the node's values depend on an order of additions? (False: proven not to.)"""
    if not isinstance(node.target, torch._ops.OpOverload):  # getitem, size arithmetic; an unknown higher-order op
        return isinstance(node.target, torch._ops.HigherOrderOperator)
    if node.target._schema.name in _SAMPLING or node.target in _MOVES or node.target in _ORDER_FREE:
        return False
    if node.target in _PUTS:
        return bool(bind(node)["accumulate"])
    if torch.Tag.pointwise in node.target.tags or node.target.overloadpacket in _POINTWISE:
        return False
    if node.target is aten.dropout.default:  # the identity in eval mode
        return bool(bind(node)["train"]) and bind(node)["p"] != 0
    outputs = val(node) if isinstance(val(node), (tuple, list)) else [val(node)]
    return any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) for t in outputs)


def _replace(node: fx.Node, target, args: tuple, after=None) -> None:
    """Put target(*args) in node's place; `after` maps the new node to what replaces node's uses."""
    graph = node.graph
    with graph.inserting_before(node):
        new = emit(graph, target, args)
        if after is not None:
            new = after(graph, new)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def _transposed(graph: fx.Graph, x: fx.Node) -> fx.Node:
    return emit(graph, aten.t.default, (x,))


def _linear(node: fx.Node) -> str | None:
    a = bind(node)
    _replace(node, ops.exact_linear.default, (a["input"], a["weight"], a["bias"]))
    return None


def _mm(node: fx.Node, bias: fx.Node | None = None) -> str | None:
    a = bind(node)
    x, w = a["mat1"] if "mat1" in a else a["self"], a["other"] if "other" in a else a["mat2"]
    if val(w).dim() != 2:
        return _batched(node, x, w)
    graph = node.graph
    with graph.inserting_before(node):
        weight = _transposed(graph, w)  # [K, N] -> [N, K], a view
    _replace(node, ops.exact_linear.default, (x, weight, bias))
    return None


def _addmm(node: fx.Node) -> str | None:
    a = bind(node)
    if a["beta"] != 1 or a["alpha"] != 1:
        return f"addmm with beta={a['beta']}, alpha={a['alpha']}: exact_linear adds a plain bias"
    if val(a["self"]).dim() != 1:
        return f"addmm's bias is {list(val(a['self']).shape)}, not a vector: exact_linear adds a bias per column"
    return _mm(node, a["self"])


def _batched(node: fx.Node, a: fx.Node, b: fx.Node) -> str | None:
    if val(a).dim() < 2 or val(b).dim() < 2:
        return f"{_name(node)} of a vector: exact_matmul takes matrices (batched)"
    _replace(node, ops.exact_matmul.default, (a, b))
    return None


def _bmm(node: fx.Node) -> str | None:
    a = bind(node)
    return _batched(node, a["self"], a["mat2"])


def _sum(mean: bool):
    def route(node: fx.Node) -> str | None:
        a = bind(node)
        dims = a.get("dim") or []
        _replace(node, ops.exact_sum.default, (a["self"], list(dims), bool(a.get("keepdim")), mean,
                                               a.get("dtype")))
        return None
    return route


def _rms_norm(node: fx.Node) -> str | None:
    a = bind(node)
    _replace(node, ops.exact_rms_norm.default, (a["input"], list(a["normalized_shape"]), a["weight"], a["eps"]))
    return None


def _layer_norm(node: fx.Node) -> str | None:
    a = bind(node)
    _replace(node, ops.exact_layer_norm.default,
             (a["input"], list(a["normalized_shape"]), a["weight"], a["bias"], a["eps"]))
    return None


def _softmax(log: bool, half_to_float: bool = False):
    def route(node: fx.Node) -> str | None:
        a = bind(node)
        dtype = (torch.float32 if a["half_to_float"] else None) if half_to_float else a["dtype"]
        _replace(node, ops.exact_softmax.default, (a["self"], a["dim"], log, dtype))
        return None
    return route


def _logsumexp(node: fx.Node) -> str | None:
    a = bind(node)
    _replace(node, ops.exact_logsumexp.default, (a["self"], list(a["dim"]), a["keepdim"]))
    return None


def _sdpa(node: fx.Node) -> str | None:
    a = bind(node)
    if a["dropout_p"] not in (0, 0.0):
        return f"attention with dropout_p={a['dropout_p']}: a random op, not a decode's"
    _replace(node, ops.exact_attention.default, (a["query"], a["key"], a["value"], a["attn_mask"], a["is_causal"],
                                                 a["scale"], a["enable_gqa"]))
    return None


def _attend_split(node: fx.Node) -> str | None:
    q, k, v, mask, scale = node.args  # [B, T, h, d] each: SDPA's layout transposed
    graph = node.graph
    with graph.inserting_before(node):
        q, k, v = (emit(graph, aten.transpose.int, (x, 1, 2)) for x in (q, k, v))
    _replace(node, ops.exact_attention.default, (q, k, v, mask, False, scale, True),
             after=lambda graph, out: emit(graph, aten.transpose.int, (out, 1, 2)))
    return None


_ROUTES = {
    aten.linear.default: _linear,
    aten.mm.default: _mm,
    aten.matmul.default: _mm,
    aten.addmm.default: _addmm,
    aten.bmm.default: _bmm,
    aten.sum.dim_IntList: _sum(mean=False),
    aten.sum.default: _sum(mean=False),
    aten.mean.dim: _sum(mean=True),
    aten.mean.default: _sum(mean=True),
    aten.rms_norm.default: _rms_norm,
    aten.layer_norm.default: _layer_norm,
    aten.softmax.int: _softmax(log=False),
    aten.log_softmax.int: _softmax(log=True),
    aten._softmax.default: _softmax(log=False, half_to_float=True),
    aten._log_softmax.default: _softmax(log=True, half_to_float=True),
    aten.logsumexp.default: _logsumexp,
    aten.scaled_dot_product_attention.default: _sdpa,
    ops.attend_split.default: _attend_split,
}

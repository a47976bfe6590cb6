"""Arg-max matcher: a softmax's max-like consumers, the rule's preconditions proven, and the plan.

IR (capture.py): undecomposed pre-dispatch ATen. The pass looks for

    p = softmax.int(s, d, dtype?) | _softmax(s, d, half_to_float) | special_softmax(s, d, dtype?)
        (or the log_softmax spellings)
    p' = p, through value-identity ops and float casts (to.dtype, _to_copy, detach, clone, ...)
    max.dim(p', d) -> getitem 0/1 | topk(p', k, d) -> getitem 0/1 | argmax(p', d) | amax(p', [d]) | max(p')
        | gather(p', d, ids)

where the consumer reduces along the softmax's axis `d` (any spelling: -1 and ndim-1 are the
same axis; a full reduction counts when every other axis has size 1). Whatever made `s` (a
temperature of any sign, a tensor, zero) does not matter: the rewrite reads `s` itself.

Each consumer reached gets one verdict: accepted into the plan (plan.py), which records every
choice the lowerings read, or left alone with the reason, in words the tests pin: the smallest
probabilities (they underflow to ties at 0), another axis, a write in place the rewrite would
move, a (values, indices) result used whole, and the indices argmax_ties="eager" cannot reproduce
(eager_ties.py).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import NamedTuple

import torch
import torch.fx as fx

from specpass.graph import bind, is_symbolic, is_written_in_place, known, op_name, same_shape, val
from specpass.options import Options
from specpass.passes.argmax import one_pass
from specpass.passes.argmax.chunks import plan_chunks
from specpass.passes.argmax.plan import HALF, Gather, GatherBy, Plan, Reduction
from specpass.passes.argmax.prologue import fold
from specpass.passes.op_sets import RESHAPES, SAME_VALUES

aten = torch.ops.aten

# target -> is_log; all take (self, dim, ...) first.
_SOFTMAX = {
    aten.softmax.int: False,
    aten._softmax.default: False,
    aten.special_softmax.default: False,
    aten.log_softmax.int: True,
    aten._log_softmax.default: True,
    aten.special_log_softmax.default: True,
}
_MAX_LIKE = {aten.max.dim, aten.max.default, aten.amax.default, aten.argmax.default}
# Reductions of a softmax that are recognised but not rewritten: the smallest probabilities
# underflow to ties at 0, so the input's order does not reproduce the original's choice.
_SMALLEST = {aten.min.dim, aten.min.default, aten.amin.default, aten.argmin.default,
             aten.kthvalue.default}


class Refuse(Exception):
    """A precondition that does not hold; the message is the finding's reason."""


class Match(NamedTuple):
    candidates: list[fx.Node]  # every consumer reached, in program order: one finding each
    plan: Plan | None  # of the accepted ones; None where none is
    refused: dict[fx.Node, str]  # why each other one is left alone


def is_softmax(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _SOFTMAX


def match(sm: fx.Node, options: Options) -> Match:
    """The consumers of softmax `sm` the rule covers, planned, and the reasons for the others."""
    found = _consumers(sm)
    candidates = [consumer for consumer, _, _ in found]
    if not found:
        return Match([], None, {})
    try:
        plan = _softmax(sm, options.argmax_ties == "eager", options.handoff == "eager")
    except Refuse as why:
        return Match(candidates, None, dict.fromkeys(candidates, str(why)))
    accepted: list[Reduction | Gather] = []
    refused: dict[fx.Node, str] = {}
    stats = False
    for consumer, casts, path in found:
        try:
            if any(is_written_in_place(n) for n in path):
                raise Refuse(f"a copy of the softmax output between it and {consumer.name} is written in place")
            dims, k = _check(plan, consumer)
            values, indices = _outputs(consumer)
            written = [n.name for n in values + indices if is_written_in_place(n)]
            if written:  # a write the IR keeps (graph.make_local_writes_functional): rewritten, it would
                # write the new nodes, another tensor
                raise Refuse(f"its result {written[0]} is written in place, and the write stays in place (a "
                             "view of it is taken before the write, or the out-of-place op would change its "
                             "dtype); an out-of-place update (v = v / s) can be rewritten")
        except Refuse as why:
            refused[consumer] = str(why)
            continue
        dtypes = (plan.out_dtype, *casts)
        if consumer.target is aten.gather.default:
            accepted.append(Gather(consumer, dtypes, _gather_by(plan, consumer, accepted)))
        else:
            accepted.append(_reduction(plan, consumer, dtypes, dims, k, values, indices, options.max_probs))
        # m and z: for exact values, and for the indices when ties follow the rounded probabilities
        stats |= bool(values) and options.max_probs == "exact" or bool(indices) and plan.eager_ties
    if not accepted:
        return Match(candidates, None, refused)
    chunks, chunk = plan_chunks(plan.shape, plan.dim, stats)
    plan = dataclasses.replace(plan, with_stats=stats, chunks=chunks, chunk=chunk, consumers=tuple(accepted))
    return Match(candidates, plan, refused)


def _consumers(sm: fx.Node) -> list[tuple[fx.Node, list[torch.dtype], list[fx.Node]]]:
    """Max-like users of `sm`, directly or through float casts / identities on the same device:
    (consumer, the dtypes of those casts, the nodes between sm and the consumer)."""
    out, stack = [], [(sm, [], [])]
    while stack:
        node, casts, path = stack.pop()
        for user in node.users:
            if user.op != "call_function" or user.args[0] is not node:
                continue
            if user.target in SAME_VALUES:
                a, b = val(node), val(user)
                if (isinstance(b, torch.Tensor) and b.is_floating_point() and same_shape(b.shape, a.shape)
                        and b.device == a.device):
                    stack.append((user, casts + [b.dtype], path + [user]))
            elif user.target in _MAX_LIKE or user.target in _SMALLEST or user.target in (aten.topk.default,
                                                                                        aten.gather.default):
                out.append((user, casts, path))
    return sorted(out, key=lambda c: _position(c[0]))


def _position(node: fx.Node) -> int:
    return next(i for i, n in enumerate(node.graph.nodes) if n is node)


def _softmax(sm: fx.Node, eager_ties: bool, run_eagerly: bool) -> Plan:
    """The softmax's part of the plan: what it consumed, in which dtype, and how it is read."""
    args = bind(sm)
    s, out = args["self"], val(sm)
    if not isinstance(s, fx.Node) or not isinstance(val(s), torch.Tensor):
        raise Refuse("the softmax input is not a tensor node")
    if not out.is_floating_point() or not val(s).is_floating_point():
        raise Refuse(f"softmax over a non-floating tensor ({val(s).dtype} -> {out.dtype})")
    if out.dim() == 0:
        raise Refuse("softmax over a 0-d tensor")
    shape, dim = tuple(out.shape), args["dim"] % out.dim()
    if is_written_in_place(sm):
        raise Refuse("the softmax output (or a view of it) is written in place")
    cast_to = args.get("dtype") if args.get("dtype") not in (None, val(s).dtype) else None
    reads_one_pass = one_pass.applies(eager_ties, dim, shape, cast_to or val(s).dtype, out.device)
    prologue, unfolded = fold(s, cast_to) if reads_one_pass else (None, "")
    return Plan(softmax=sm, s=s, is_log=_SOFTMAX[sm.target], dim=dim, shape=shape, out_dtype=out.dtype,
                device=out.device, cast_to=cast_to,
                compute_dtype=torch.float32 if out.dtype in HALF else out.dtype, eager_ties=eager_ties,
                ties_by_op=eager_ties and run_eagerly, one_pass=reads_one_pass, prologue=prologue, unfolded=unfolded)


def _check(plan: Plan, consumer: fx.Node) -> tuple[list[int], int]:
    """The consumer's reduced axes (normalised) and k; refuses what the rule does not cover."""
    target, args = consumer.target, bind(consumer)
    op = op_name(target)
    if target is aten.gather.default:
        if args["dim"] % plan.ndim != plan.dim:
            raise Refuse(f"gather along dim {args['dim'] % plan.ndim}, the softmax is over dim {plan.dim}")
        if is_written_in_place(plan.s):  # the new nodes read s at the gather, after its ids exist
            raise Refuse("the softmax input is written in place; it is read again at the gather")
        return [plan.dim], 1
    if target in _SMALLEST or (target is aten.topk.default and not args["largest"]):
        raise Refuse(f"{op} takes the smallest probabilities; they underflow to ties at 0, "
                     "so the order of the softmax input does not reproduce the original's choice")
    k = args["k"] if target is aten.topk.default else 1
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise Refuse(f"topk with k={k!r}")
    if target is aten.max.default or (target is aten.argmax.default and args["dim"] is None):
        dims = list(range(plan.ndim))
    elif target is aten.amax.default:
        dims = sorted({d % plan.ndim for d in args["dim"]}) or list(range(plan.ndim))
    else:
        dims = [args["dim"] % plan.ndim]
    if plan.dim not in dims:
        raise Refuse(f"axes differ: softmax over dim {plan.dim}, {op} over dim(s) {dims}")
    wider = [d for d in dims if d != plan.dim and not known(plan.shape[d] == 1)]
    if wider:
        raise Refuse(f"{op} also reduces over dim(s) {wider}, not only the softmax's dim {plan.dim}")
    if k > 1 and dims != [plan.dim]:
        raise Refuse("topk over a reshaped axis")
    if plan.eager_ties and _outputs(consumer)[1]:  # the indices are used: the tie rule matters
        if plan.is_log and plan.device.type == "cpu":
            raise Refuse("argmax_ties='eager': ATen's CPU log_softmax rounds otherwise than ATen ops do "
                         "(its log, and in bf16/fp16 every step), so its ties cannot be reproduced")
        if target is aten.topk.default and not _topk_keeps_first(plan, k):
            raise Refuse(f"argmax_ties='eager': topk({k}) orders equal probabilities its own way, not "
                         "first index first; only the probabilities themselves reproduce that order")
    return dims, k


def _topk_keeps_first(plan: Plan, k: int) -> bool:
    """Does torch.topk(k) return the first of equal values, as argmax does? For k = 1: on CUDA
    (radix select takes equal values in index order); on CPU over at least 64 values (a partial
    sort with a strict comparison keeps the first; below 64 · k it uses std::nth_element, and
    zeros(12).topk(1) is index 9). For k > 1 neither (all-NaN rows come out as 1, 0, 2, 3 on CUDA)."""
    vocab = plan.shape[plan.dim]
    return k == 1 and (plan.device.type == "cuda" or plan.device.type == "cpu" and not is_symbolic(vocab)
                       and vocab >= 64)


def _outputs(consumer: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(nodes holding the values, nodes holding the indices) that have users."""
    if consumer.target in (aten.max.default, aten.amax.default, aten.gather.default):
        return ([consumer] if consumer.users else []), []
    if consumer.target is aten.argmax.default:
        return [], ([consumer] if consumer.users else [])
    values, indices = [], []
    for user in consumer.users:
        if user.op != "call_function" or user.target is not operator.getitem or user.args[1] not in (0, 1):
            raise Refuse(f"the (values, indices) result of {consumer.name} is used whole by {user.name}")
        if user.users:
            (values if user.args[1] == 0 else indices).append(user)
    return values, indices


def _reduction(plan: Plan, consumer: fx.Node, dtypes: tuple[torch.dtype, ...], dims: list[int], k: int,
               values: list[fx.Node], indices: list[fx.Node], max_probs: str) -> Reduction:
    """A reduction's plan: which lowering makes each of its used outputs."""
    args = bind(consumer)
    is_topk = consumer.target is aten.topk.default
    reads_one_pass = plan.one_pass and dims == [plan.dim] and k == 1
    if not indices:
        indices_by = None
    elif is_topk and not _topk_keeps_first(plan, k):
        indices_by = "topk"
    elif reads_one_pass:
        indices_by = "one_pass"
    else:
        indices_by = "eager" if plan.eager_ties else "argmax"
    if not values:
        values_by = None
    else:
        values_by = "ones" if max_probs == "ones" else "one_pass" if reads_one_pass else "formula"
    return Reduction(consumer, dtypes, tuple(dims), k, keepdim=is_topk or bool(args.get("keepdim", False)),
                     sorted=args["sorted"] if is_topk else None, values=tuple(values), indices=tuple(indices),
                     indices_by=indices_by, values_by=values_by)


def _gather_by(plan: Plan, gather: fx.Node, earlier: list[Reduction | Gather]) -> GatherBy:
    """top1_lse's own value where the ids are the op's arg-max, one per row in row order: an
    earlier consumer's one-pass indices reached through reshapes only (which keep the row-major
    order), shaped [..., 1]; else the logits at the ids, read by the plan's lowering."""
    if not plan.one_pass:
        return "formula"
    own = {n for c in earlier if isinstance(c, Reduction) and c.indices_by == "one_pass" for n in c.indices}
    ids = bind(gather)["index"]
    if not own or not same_shape(val(ids).shape, (*plan.shape[:-1], 1)):
        return "one_pass"
    while ids not in own:  # the one-pass indices are replaced by the op's index, squeezed at most
        if not (isinstance(ids, fx.Node) and ids.op == "call_function" and ids.target in RESHAPES):
            return "one_pass"
        ids = ids.args[0]
    return "own_index"

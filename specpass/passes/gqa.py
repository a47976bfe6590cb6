"""GQA: attention reads the un-repeated K/V heads (SDPA's enable_gqa) instead of a repeated copy.

A grouped-query model keeps hk K/V heads for H = hk * g query heads. transformers' SDPA path (and
many hand-written ones) repeats them before attention whenever a mask is given:

    K' = k[:, :, None].expand(B, hk, g, S, d).reshape(B, hk * g, S, d)   (repeat_kv)
    out = scaled_dot_product_attention(q, K', V', mask, ...)

a copy of every layer's whole K/V cache per call. SDPA with enable_gqa=True reads query head j
against kv head j // g, which is what K'[:, j] holds, so the pass rewrites

    out = scaled_dot_product_attention(q, k, v, mask, ..., enable_gqa=True)

in place (same node, same position) and the repeat dies unless something else reads it.

What is proven, from the ops' semantics and the fake tensors' sizes, not from names: each op
between k and K' is modelled as a map from K' indices to k indices. An axis of an intermediate is
a row-major list of parts, each a source axis of k (index passed through) or a repeat (index
ignored): `unsqueeze`/`view`/`reshape`/`flatten`/`squeeze` regroup the parts (a reshape that would
split a part is not followed), `expand` of a size-1 axis is a repeat, `repeat(r)` puts a repeat in
front of the axis's parts (tile order: index i reads i % n), `repeat_interleave(r, dim)` after them
(i reads i // r), `stack`/`cat` of one tensor with itself likewise, and value-identities (`clone`,
`contiguous`, a same-dtype `to`, a full slice) change nothing. K' is a head repeat of k when its
head axis (-3) is [k's head axis, repeat g] in that order and every other axis is k's own: then
K'[..., j, :, :] = k[..., j // g, :, :], enable_gqa's mapping. It fires only when K and V are both
such repeats of tensors with the same head count, q has hk * g heads, and nothing writes k (or
the copy) between the repeat and the attention: attention now reads k where it ran, not where
the copy was taken.

Left alone, with the reason in the finding: a repeat along another axis than the heads, a repeat
in tile order (`k.repeat(1, g, 1, 1)`, `cat([k] * g, 1)`: query head j would read kv head
j % hk, not j // g), only one of K and V repeated or different head counts, a repeated K written
in place (or k written before the attention reads it), dropout_p != 0 (random draws not proven
the same), enable_gqa already set, and a torch whose SDPA has no enable_gqa. A scale=
argument is kept as given: GQA changes which kv head a query head reads, not the head dim the
default scale comes from. A repeat with other users (a returned K') stays for them.

Numerics. On CPU (torch 2.13) both spellings run the same kernel
(`_scaled_dot_product_flash_attention_for_cpu`, which takes GQA natively) and are bit-identical:
2,121 cases over fp32 / bf16 / fp16, head dims 16 / 64 / 128, (hk, g) in (2, 2), (2, 3),
(4, 2), (1, 4), (1, 6), T 1..8, S 1..300, masks None / bool / bool per head / additive float /
is_causal, a non-contiguous q and V, an explicit scale; fp64 and a value head dim unlike the
key's; and through Inductor. On CUDA the kernel is chosen per call; where the repeated and the
grouped call get different kernels, the results differ by those kernels' rounding, as SDPA's
own backend choice makes them differ.

Order: after live_rows, so the live-row gather moves as far as it does without this pass, and
this pass rewrites the attention the gather left (Q-sliced or not). A gather of token rows moves
the same in either order (query and mask rows; K/V are read whole). A gather of heads
(`out[:, 2:4]`) moves through the repeat into k while K' is a same-head copy; on the grouped call
the live-row rules would stop at attention (k has fewer heads than its output).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.fx as fx

from specpass.graph import (bind, is_mutation, is_written_in_place, known, op_name, same_shape, set_val, storage, val,
                            written_storages)
from specpass.options import Options
from specpass.passes.op_sets import RESHAPES, SAME_VALUES
from specpass.report import Finding

aten = torch.ops.aten
NAME = "gqa"
_SDPA = aten.scaled_dot_product_attention.default


class _Part(NamedTuple):
    """One factor of an axis, row-major within it: k's axis `axis`, or a repeat (axis None)."""

    axis: int | None
    size: Any


Parts = list[list[_Part]]  # per axis of a tensor


class _Refuse(Exception):
    pass


class _Repeat(NamedTuple):
    """`value` (what attention reads) = `source` through `chain`, index map `parts`."""

    value: fx.Node
    source: fx.Node
    chain: list[fx.Node]
    parts: Parts

    @property
    def repeats(self) -> bool:
        return any(p.axis is None for axis in self.parts for p in axis)


def run(gm: fx.GraphModule, options: Options) -> list[Finding]:
    findings = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        args = bind(node)
        k, v = _trace(args["key"]), _trace(args["value"])
        if not (k.repeats or v.repeats):
            continue  # K and V are not repeats of anything: not a candidate
        try:
            message = _rewrite(node, args, k, v)
        except _Refuse as why:
            findings.append(Finding(NAME, node.name, False, str(why)))
            continue
        findings.append(Finding(NAME, node.name, True, message))
    return findings


def _rewrite(node: fx.Node, args: dict[str, Any], k: _Repeat, v: _Repeat) -> str:
    if "enable_gqa" not in args:
        raise _Refuse("this torch's scaled_dot_product_attention has no enable_gqa (torch >= 2.5)")
    if args["enable_gqa"] is not False:
        raise _Refuse("enable_gqa is already set")
    if not (isinstance(args["dropout_p"], (int, float)) and args["dropout_p"] == 0):
        raise _Refuse(f"dropout_p={args['dropout_p']!r}: attention draws random numbers, and nothing "
                      "shows the grouped call draws the same ones")
    q = val(args["query"])
    rank = q.dim()
    if rank < 3 or val(k.value).dim() != rank or val(v.value).dim() != rank:
        raise _Refuse("query, key and value are not of one rank >= 3")
    head = rank - 3
    (hk, g), (hv, gv) = _groups(k, head, "K"), _groups(v, head, "V")
    if not (known(hk == hv) and known(g == gv)):
        raise _Refuse(f"K repeats {hk} heads {g} times, V {hv} heads {gv} times: one head count for both")
    if not known(q.shape[head] == hk * g):
        raise _Refuse(f"the query has {q.shape[head]} heads, K and V {hk} repeated {g} times")
    for r, name in ((k, "K"), (v, "V")):
        _check_writes(node, r, name)
    _set_arg(node, "key", k.source)
    _set_arg(node, "value", v.source)
    _set_arg(node, "enable_gqa", True)
    set_val(node)
    spelled = ", ".join(op_name(n.target) for n in k.chain)
    kept = sorted({u.name for r in (k, v) for u in r.value.users})
    return (f"reads {k.source.name}, {v.source.name} ({hk} kv heads) with enable_gqa=True instead of their "
            f"{hk * g}-head repeats {k.value.name}, {v.value.name} ({spelled}: query head j reads kv head j // {g})"
            + (f"; the repeats stay for {', '.join(kept)}" if kept else ""))


def _groups(r: _Repeat, head: int, name: str) -> tuple[Any, Any]:
    """(kv heads, group size) where r.value is a head repeat of r.source in interleave order."""
    if not r.repeats:
        raise _Refuse(f"{name} ({r.value.name}) is not a repeat, the other is: "
                      "K and V would have different head counts")
    src = val(r.source).shape
    if len(src) != len(r.parts):
        raise _Refuse(f"{name} ({r.value.name}) is not of the rank of what it repeats ({r.source.name})")
    elsewhere = [i for i, axis in enumerate(r.parts) if i != head and any(p.axis is None for p in axis)]
    if elsewhere:
        raise _Refuse(f"{name} ({r.value.name}) repeats {r.source.name} along axis {elsewhere[0]}, "
                      f"not the head axis {head}")
    own = _identity(val(r.source))
    if not all(_same(r.parts[i], own[i]) for i in range(len(src)) if i != head) or \
            not all(known(a == b) for i, (a, b) in enumerate(zip(src, val(r.value).shape)) if i != head):
        raise _Refuse(f"{name} ({r.value.name}) reorders the axes of {r.source.name}")
    heads, hk = r.parts[head], src[head]
    repeat = [p for p in heads if p.axis is None]
    g = repeat[0].size
    if _same(heads, own[head] + repeat):
        return hk, g
    if _same(heads, repeat + own[head]):
        raise _Refuse(f"{name} ({r.value.name}) repeats the {hk} heads of {r.source.name} in tile order "
                      f"(query head j would read kv head j % {hk}; enable_gqa reads j // {g})")
    raise _Refuse(f"{name} ({r.value.name}) is not a head repeat of {r.source.name}")


def _check_writes(node: fx.Node, r: _Repeat, name: str) -> None:
    """Attention will read r.source at `node`: nothing may write it (or the repeat) in between,
    and a copy the graph writes is not what the source holds."""
    for n in r.chain:
        if storage(n) != storage(r.source) and is_written_in_place(n):
            raise _Refuse(f"{name} ({n.name}) is written in place")
    held = {storage(n) for n in [r.source, *r.chain]}
    nodes = list(node.graph.nodes)
    start = min((nodes.index(n) for n in r.chain), default=nodes.index(node))
    for n in nodes[start:nodes.index(node)]:
        if is_mutation(n) and written_storages(n) & held:
            raise _Refuse(f"{n.name} writes {r.source.name} between the repeat ({name}) and the attention")


def _set_arg(node: fx.Node, name: str, value: Any) -> None:
    positional = [a.name for a in node.target._schema.arguments if not a.kwarg_only]
    i = positional.index(name) if name in positional else len(positional)
    if i < len(node.args):
        node.args = (*node.args[:i], value, *node.args[i + 1:])
    else:
        node.kwargs = {**node.kwargs, name: value}


# ----------------------------------------------------------------------------- index maps


def _trace(value: Any) -> _Repeat:
    """The longest chain of modelled ops that ends in `value`, and its index map."""
    chain = []
    node = value
    while isinstance(node, fx.Node) and _input(node) is not None:
        chain.append(node)
        node = _input(node)
    chain.reverse()
    source, parts, kept = node, _identity(val(node)), []
    for n in chain:
        mapped = _apply(n, parts)
        if mapped is None:  # not followed: the chain starts again from here
            source, parts, kept = n, _identity(val(n)), []
        else:
            parts = mapped
            kept.append(n)
    return _Repeat(value, source, kept, parts)


def _input(node: fx.Node) -> fx.Node | None:
    """The one tensor a modelled op reads (cat/stack: of one tensor with itself)."""
    if node.op != "call_function" or not isinstance(val(node), torch.Tensor):
        return None
    if node.target in (aten.cat.default, aten.stack.default):
        tensors = node.args[0]
        return tensors[0] if len(set(tensors)) == 1 and isinstance(tensors[0], fx.Node) else None
    if node.target in _MODELLED and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def _apply(node: fx.Node, parts: Parts) -> Parts | None:
    """The parts of node's output from those of its input, or None where the op is not a pure
    re-indexing of it."""
    src, out = val(_input(node)), val(node)
    args = bind(node)
    if node.target in RESHAPES:
        return _regroup(parts, out.shape)
    if node.target in SAME_VALUES or node.target is aten.slice.Tensor:  # a slice of its input's shape is all of it
        same = out.dtype == src.dtype and out.device == src.device and same_shape(out.shape, src.shape)
        return parts if same else None
    if node.target is aten.expand.default:
        lead = out.dim() - src.dim()
        new = [[_Part(None, s)] for s in out.shape[:lead]]
        for p, a, b in zip(parts, src.shape, out.shape[lead:]):
            if known(a == b):
                new.append(p)
            elif known(a == 1):
                new.append([_Part(None, b)])
            else:
                return None
        return _normal(new)
    if node.target is aten.repeat.default:  # tile: out[i] = in[i % n]
        reps = [val(r) for r in args["repeats"]]  # sizes: SymInts where a node computes them
        lead = len(reps) - src.dim()
        new = [[_Part(None, r)] for r in reps[:lead]]
        new += [[_Part(None, r), *p] for p, r in zip(parts, reps[lead:])]
        return _normal(new)
    if node.target is aten.repeat_interleave.self_int:  # out[i] = in[i // r]
        if args["dim"] is None:
            return None
        d = args["dim"] % src.dim()
        return _normal([[*p, _Part(None, val(args["repeats"]))] if i == d else p for i, p in enumerate(parts)])
    n = len(args["tensors"])
    if node.target is aten.stack.default:
        d = args["dim"] % out.dim()
        return _normal(parts[:d] + [[_Part(None, n)]] + parts[d:])
    d = args["dim"] % out.dim()  # cat: out[i] = in[i % size], tile
    return _normal([[_Part(None, n), *p] if i == d else p for i, p in enumerate(parts)])


_MODELLED = RESHAPES | SAME_VALUES | {aten.slice.Tensor, aten.expand.default, aten.repeat.default,
                                      aten.repeat_interleave.self_int, aten.cat.default, aten.stack.default}


def _regroup(parts: Parts, shape: Any) -> Parts | None:
    """A reshape: the row-major parts of every axis, regrouped into axes of `shape`; None if an
    axis would split a part."""
    flat = [p for axis in parts for p in axis]
    new, i = [], 0
    for size in shape:
        group, product = [], 1
        while not known(product == size):
            if i == len(flat):
                return None
            group.append(flat[i])
            product = product * flat[i].size
            i += 1
        new.append(group)
    return _normal(new) if i == len(flat) else None


def _normal(parts: Parts) -> Parts:
    """Size-1 parts dropped, neighbouring repeats merged (their indices are ignored alike)."""
    out = []
    for axis in parts:
        merged: list[_Part] = []
        for p in axis:
            if known(p.size == 1):
                continue
            if p.axis is None and merged and merged[-1].axis is None:
                merged[-1] = _Part(None, merged[-1].size * p.size)
            else:
                merged.append(p)
        out.append(merged)
    return out


def _identity(t: torch.Tensor) -> Parts:
    return [[] if known(s == 1) else [_Part(i, s)] for i, s in enumerate(t.shape)]


def _same(a: list[_Part], b: list[_Part]) -> bool:
    return len(a) == len(b) and all(x.axis == y.axis and known(x.size == y.size) for x, y in zip(a, b))

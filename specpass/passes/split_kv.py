"""Split-KV: a grouped-query attention of a few tokens per request runs as the library's split-KV
kernel (`torch.ops.specpass.attend_split`) instead of SDPA.

A verify (or a catch-up) reads the whole cache for T = K + 1 tokens per request. Given enable_gqa
and an explicit mask, SDPA's CUDA kernels read each K/V head once per query head (g times) and
run one program per (request, head) over every slot; the split-KV kernel reads each K/V head once
for its g query heads and all T tokens (T * g rows per program) and splits the slots into
chunks, merged by log-sum-exp (specpass/kernels/triton_attention.py). The rewrite

    out = scaled_dot_product_attention(q, k, v, mask, scale=s, enable_gqa=True)   # q [B, hq, T, d]
->  out = attend_split(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, s).transpose(1, 2)

computes the same attention (query head j against K/V head j // g, softmax over the slots the mask
shows, the same scale: SDPA's default 1 / sqrt(d) is written out) with another kernel, so its
results differ from SDPA's by the two kernels' rounding, as SDPA's own backend choice makes them
differ. A row that sees no slot is 0 in both. The transposes are views: the kernel reads q, k
and v through their strides (the cache's [B, hk, S, d] as [B, S, hk, d]).

When, proven from the fake tensors: CUDA; q, k, v of rank 4, bf16 or fp16; head sizes powers of
two from 16 to 256; g = hq / hk > 1 (enable_gqa set, by the model or by the gqa pass, which runs
first); T static, 1 < T and T * g <= 256 (in programs of 64 rows); a bool mask that is [B, 1, T, S] or broadcasts to it
(expanded, a view); no dropout, no is_causal. Otherwise SDPA stays, with the reason:
- one token per request (a decode or draft step, or a catch-up after the live-row Q-slice): the
  call transformers makes, kept as the zoo keeps it; the kernel's gain is reading the cache once
  for many query rows;
- g = 1: SDPA reads every K/V head once already;
- a float (additive) mask, a mask per head, a symbolic T or more rows (a prefill), other dtypes
  and head sizes: what the kernel does not take.
Not a candidate: attention on another device than CUDA (no finding).

Order: after live_rows (its Q-slice leaves the rows it needs, and this pass then sees the T the
kernel runs) and gqa (its rewrite gives the enable_gqa call this pass takes). The zoo's `attend`
calls the op itself; here transformers models get it from their own SDPA call.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from specpass.graph import bind, emit, known, static_int, val
from specpass.kernels import attend_split_refusal
from specpass.options import Options
from specpass.report import Finding

aten = torch.ops.aten
NAME = "split_kv"
_SDPA = aten.scaled_dot_product_attention.default


class _Refuse(Exception):
    pass


def run(gm: fx.GraphModule, options: Options) -> list[Finding]:
    findings = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        q = val(bind(node)["query"])
        if not (isinstance(q, torch.Tensor) and q.device.type == "cuda"):
            continue  # the kernel is CUDA's: not a candidate
        try:
            message = _rewrite(node)
        except _Refuse as why:
            findings.append(Finding(NAME, node.name, False, str(why)))
            continue
        findings.append(Finding(NAME, node.name, True, message))
    return findings


def _rewrite(node: fx.Node) -> str:
    args = bind(node)
    q, k, v = (val(args[name]) for name in ("query", "key", "value"))
    if not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in (q, k, v)):
        raise _Refuse("query, key and value are not all of rank 4 ([B, heads, T, d])")
    if not (isinstance(args["dropout_p"], (int, float)) and args["dropout_p"] == 0):
        raise _Refuse(f"dropout_p={args['dropout_p']!r}: the kernel draws no random numbers")
    if args["is_causal"] is not False:
        raise _Refuse("is_causal: the kernel reads an explicit mask")
    B, hq, T, d = (static_int(x) for x in q.shape)  # a size pinned to one value is that int
    hk, S = static_int(k.shape[1]), k.shape[2]
    if args.get("enable_gqa") is not True:
        raise _Refuse(f"enable_gqa is not set ({hq} query heads, {hk} K/V heads): with one query head per K/V "
                      "head SDPA reads every K/V head once already")
    if not isinstance(T, int):
        raise _Refuse(f"T = {T} tokens is symbolic (a prefill): the kernel is for a verify's few static rows")
    if T == 1:
        raise _Refuse("one token per request (a decode or draft step): SDPA's own GQA call stays, the kernel's "
                      "gain is reading the cache once for many query rows")
    if isinstance(hq, int) and isinstance(hk, int) and hq == hk:
        raise _Refuse(f"{hq} query heads over as many K/V heads: SDPA reads every K/V head once already")
    mask = val(args["attn_mask"])
    shape = [B, 1, T, S]
    if isinstance(mask, torch.Tensor) and not _broadcasts(mask.shape, shape):
        raise _Refuse(f"the mask is {list(mask.shape)}: not one mask for all heads, [B, 1, T, S] = {shape} "
                      "or a broadcast of it")
    expanded = mask.expand(shape) if isinstance(mask, torch.Tensor) else None
    why = attend_split_refusal(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), expanded)
    if why is not None:
        raise _Refuse(why)
    scale = args["scale"]
    if scale is None:
        scale = 1.0 / math.sqrt(d)  # SDPA's default, computed as it computes it
    elif not isinstance(scale, (int, float)):
        raise _Refuse(f"scale={scale!r} is not a number the graph fixes")
    graph = node.graph
    with graph.inserting_before(node):
        qt, kt, vt = (emit(graph, aten.transpose.int, (args[name], 1, 2)) for name in ("query", "key", "value"))
        m = args["attn_mask"]
        if not all(known(a == b) for a, b in zip(mask.shape, shape)) or mask.dim() != 4:
            m = emit(graph, aten.expand.default, (m, shape))
        out = emit(graph, torch.ops.specpass.attend_split.default, (qt, kt, vt, m, float(scale)), name="attend_split")
        out = emit(graph, aten.transpose.int, (out, 1, 2))
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    g = hq // hk
    return (f"runs as specpass.attend_split (split-KV: {T} tokens x {g} query heads = {T * g} rows per K/V head, "
            f"each of the {hk} K/V heads read once) instead of SDPA")


def _broadcasts(sizes: Any, shape: list[Any]) -> bool:
    """Does a mask of `sizes` broadcast to `shape` ([B, 1, T, S]), axis for axis from the right?"""
    if len(sizes) > len(shape):
        return False
    return all(known(a == 1) or known(a == b) for a, b in zip(reversed(sizes), reversed(shape)))

"""Arg-max: a max / topk / argmax of a softmax only needs the order of the softmax's input.

IR (capture.py): undecomposed pre-dispatch ATen. The pass looks for

    p = softmax.int(s, d, dtype?) | _softmax(s, d, half_to_float) | special_softmax(s, d, dtype?)
        (or the log_softmax spellings)
    p' = p, through value-identity ops and float casts (to.dtype, _to_copy, detach, clone, ...)
    max.dim(p', d) -> getitem 0/1 | topk(p', k, d) -> getitem 0/1 | argmax(p', d) | amax(p', [d]) | max(p')

where the consumer reduces along the softmax's axis `d` (any spelling: -1 and ndim-1 are the
same axis; a full reduction counts when every other axis has size 1). Whatever made `s` (a
temperature of any sign, a tensor, zero) does not matter: the rewrite reads `s` itself.

Rewrite rule, with `s_in` the tensor softmax actually consumed (`s`, cast to `dtype=` if given),
m = amax(s_c, d), z = sum(exp(s_c - m), d), s_c = s_in upcast to f32 if it is f16/bf16 (what
softmax kernels accumulate in):

    indices = where(top < inf, argmax(s_in, d), 0)          k = 1 (max.dim, argmax, topk(1))
              top: m where the values compute it, else s_in at the index (argmax's own max)
            = topk(where(m < inf, s_in, nan), k, d).indices  k > 1, or a topk(1) that does not
                                                             return the first of equal values
    values  = exp(top - m) / z                softmax (times 1 / z on CPU, as ATen's CPU kernel)
            = (top - m) - log(z)              log_softmax
      for k = 1 the top element is m itself; the result is cast to the dtype the original produced
      and through its casts after p, so it rounds where the original rounded.
    max_probs="ones": values = (indices >= 0).to(dtype), all ones, fused into the argmax kernel.
    gather(p', d, ids) = exp(s_c[ids] - m) / z, log_softmax: s_c[ids] - m - log z
      (the probability of given tokens: a verifier reading the draft's tokens, or the
      log-probability of the sampled one), without the full normalised tensor.

On CUDA, a k = 1 consumer and a gather along the last axis read one kernel instead (one_pass):
torch.ops.specpass.top1_lse (specpass/kernels) returns each row's first arg-max (0 where the
max is not finite), its maximum, its log-sum-exp and the value at the arg-max, exp(top - lse) or
top - lse, rounded to the softmax's dtype, in one pass over the row. A gather at that arg-max
(reshaped, one id per row: the sampled token's log-probability) is that value; a gather of other
ids is s_c[ids] - lse (the same functions of the logits, summed in another order). Elsewhere, and
for argmax_ties="eager", topk(k > 1) and float64 inputs (the kernel accumulates in fp32), the
formulation above, which Inductor fuses.

Prologues (one_pass only, `_prologue`): the op reads the logits under what made s, when that is
exact casts (identities, f16/bf16 -> f32, softmax's widening dtype=) around at most one scaling
div(data, t) / mul(data, t) / mul(t, data) by a number or a float tensor of one value per row.
The op computes each element as ATen does (fp32 operands, the result correctly rounded, then
rounded to the scaling's 16-bit dtype), so its s is the graph's s, bit for bit, for a factor of
any sign or value; no positivity is assumed or needed. Left out, with the reason in the finding
("prologue not folded: ..."): a tensor factor whose dtype is neither the result's nor a 16-bit
one under an fp32 result (devices convert it differently), a factor that is not one value per
row, a narrowing cast, and logits or factor written in place anywhere (the op runs after the
softmax).

Non-finite rows: where m is +inf or NaN, softmax gives NaN everywhere and the original's index
is the one its reduction gives an all-NaN row: 0 for max and argmax, topk's own order for topk
(which is why topk's input becomes NaN there); the values come out NaN through m and z.

Ties (docs/passes.md, "Ties"): the original picks among the rounded probabilities, where rounding
can merge distinct inputs into one value (bf16 probabilities merge many). argmax_ties="input"
returns the position of the largest input, the first among exactly equal inputs; that is the
original's index wherever its maximum probability is unique. argmax_ties="eager" returns the
first position whose probability, computed and rounded as the values are, equals the maximum's:

    hits    = (round(exp(s_c - m) / z) == round(exp(m - m) / z)).to(int32)   (16-bit: as bits)
    indices = argmax(hits, d)                    (a NaN row has no hit: index 0, as the original)

one more pass over each row behind m and z (in their kernel on CPU). It leaves alone the indices
it cannot reproduce: of a topk that does not return the first of equal values (any k > 1), and
of a log_softmax on CPU.

Values are computed only where they have users, so an indices-only consumer is one argmax.
`amax, sub, exp, sum(keepdim=True)` over one axis is the pattern Inductor's post-grad pass turns
into a single online-softmax reduction (prepare_softmax_online) on GPU, which fuses with the
argmax over the same input. Few rows over a long last axis are cut into chunks (CHUNK_ROWS
below): stage 1 reduces each chunk (max, sum, argmax; one kernel), stage 2 combines the chunks
per row: m = max(m_c), z = sum(z_c * exp(m_c - m)), index = w * chunk + i_c[w] with w the first
chunk holding the row's maximum (of s, or of hits), so the index is the first position of it,
as argmax's.

New nodes are inserted right after the softmax, so they read `s` at the same program point
the softmax did (a later in-place write to `s` cannot leak in). The softmax, the consumer and
its getitems are left for the pipeline's dead-code elimination; a softmax with other users
stays for them.
"""

from __future__ import annotations

import importlib.util
import math
import operator
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from specpass.graph import bind, emit, is_symbolic, is_written_in_place, known, op_name, same_shape, val
from specpass.options import Options
from specpass.passes.op_sets import RESHAPES, SAME_VALUES
from specpass.report import Finding

aten = torch.ops.aten
NAME = "argmax"

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
_HALF = (torch.float16, torch.bfloat16)

# Few rows over a long axis: Inductor never splits an arg-reduction (one block per row, so
# bs=1 reads a 150K vocabulary with one SM), and it splits any other reduction of fewer than
# 2 x SMs rows longer than 8192 (Hopper), which turns its one-pass online softmax off. So when
# the rows are fewer than CHUNK_ROWS, the softmax axis is cut into chunks of >= CHUNK_MIN
# (a multiple of CHUNK_ALIGN): one kernel computes each chunk's max, arg-max and sum(exp),
# a second, tiny one combines the chunks. With m and z (exact values, or argmax_ties="eager"):
# from 2 chunks; indices only: from 4 (a plain argmax is as fast below that; measured on H100,
# docs/passes.md).
CHUNK_ROWS, CHUNK_MIN, CHUNK_ALIGN = 512, 2048, 128

# Where k = 1 and gathers read torch.ops.specpass.top1_lse: its one-pass Triton kernel beats
# Inductor's formulation at every shape measured (docs/results.md). Tests add "cpu" to check the
# rewrite with the op's torch implementation.
ONE_PASS_DEVICES = {"cuda"}


class _Refuse(Exception):
    pass


def run(gm: fx.GraphModule, options: Options) -> list[Finding]:
    findings: list[Finding] = []
    for sm in list(gm.graph.nodes):
        if sm.op == "call_function" and sm.target in _SOFTMAX:
            findings += _rewrite_softmax(gm.graph, sm, options)
    return findings


def _rewrite_softmax(graph: fx.Graph, sm: fx.Node, options: Options) -> list[Finding]:
    consumers = _consumers(sm)
    if not consumers:
        return []
    try:
        soft = _Softmax(graph, sm, options.argmax_ties)
    except _Refuse as why:
        return [Finding(NAME, f"{sm.name} -> {c.name}", False, str(why)) for c, _, _ in consumers]

    found: dict[fx.Node, Finding] = {}
    accepted, stats = [], False
    for consumer, casts, path in consumers:
        try:
            if any(is_written_in_place(n) for n in path):
                raise _Refuse(f"a copy of the softmax output between it and {consumer.name} is written in place")
            soft.check(consumer)
            values_out, indices_out = _outputs(consumer)
            written = [n.name for n in values_out + indices_out if is_written_in_place(n)]
            if written:  # a write the IR keeps (graph.make_local_writes_functional): rewritten, it would
                # write the new nodes, another tensor
                raise _Refuse(f"its result {written[0]} is written in place, and the write stays in place (a "
                              "view of it is taken before the write, or the out-of-place op would change its "
                              "dtype); an out-of-place update (v = v / s) can be rewritten")
        except _Refuse as why:
            found[consumer] = Finding(NAME, f"{sm.name} -> {consumer.name}", False, str(why))
            continue
        accepted.append((consumer, casts))
        # m and z: for exact values, and for the indices when ties follow the rounded probabilities
        stats |= bool(values_out) and options.max_probs == "exact" or bool(indices_out) and soft.strict
    soft.plan(stats)
    with graph.inserting_before(sm.next):  # new nodes read s where the softmax read it
        for consumer, casts in accepted:
            message = soft.rewrite(consumer, casts, options)
            found[consumer] = Finding(NAME, f"{sm.name} -> {consumer.name}", True, message)
    return [found[c] for c, _, _ in consumers]


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


class _Softmax:
    """One softmax: what it consumed, in which dtype, and the reductions over it, shared by its consumers."""

    def __init__(self, graph: fx.Graph, sm: fx.Node, ties: str):
        self.graph, self.sm, self.is_log = graph, sm, _SOFTMAX[sm.target]
        self.strict = ties == "eager"
        args = bind(sm)
        s, out = args["self"], val(sm)
        if not isinstance(s, fx.Node) or not isinstance(val(s), torch.Tensor):
            raise _Refuse("the softmax input is not a tensor node")
        if not out.is_floating_point() or not val(s).is_floating_point():
            raise _Refuse(f"softmax over a non-floating tensor ({val(s).dtype} -> {out.dtype})")
        if out.dim() == 0:
            raise _Refuse("softmax over a 0-d tensor")
        self.ndim, self.shape = out.dim(), tuple(out.shape)
        self.dim = args["dim"] % self.ndim
        self.out_dtype, self.device = out.dtype, out.device
        if is_written_in_place(sm):
            raise _Refuse("the softmax output (or a view of it) is written in place")
        self.s = s
        self.cast_to = args.get("dtype") if args.get("dtype") not in (None, val(s).dtype) else None
        self.compute_dtype = torch.float32 if out.dtype in _HALF else out.dtype
        self.chunks, self.chunk, self.with_stats = 1, self.shape[self.dim], False
        # the kernel accumulates in fp32: wider inputs keep the formulation in their own dtype
        in_dtype = self.cast_to or val(s).dtype
        self.one_pass = not self.strict and self.dim == self.ndim - 1 and not any(map(is_symbolic, self.shape)) \
            and in_dtype in (torch.float32, *_HALF) and self.device.type in ONE_PASS_DEVICES \
            and (self.device.type != "cuda" or importlib.util.find_spec("triton") is not None)
        self._cache: dict[Any, fx.Node] = {}
        self.prologue, self.unfolded = _prologue(self.s, self.cast_to) if self.one_pass else (None, "")

    def plan(self, stats: bool) -> None:
        """Split the softmax axis into chunks when the rows alone are too few (see CHUNK_ROWS)."""
        self.with_stats = stats
        if any(map(is_symbolic, self.shape)):
            return  # the choice depends on the rows: one plan for every size is the unchunked one
        vocab = self.shape[self.dim]
        rows = math.prod(self.shape) // max(vocab, 1)
        if self.dim != self.ndim - 1 or rows == 0:
            return
        want = min(_ceil_div(CHUNK_ROWS, rows), vocab // CHUNK_MIN)
        if want < 2:
            return
        chunk = _ceil_div(_ceil_div(vocab, want), CHUNK_ALIGN) * CHUNK_ALIGN
        chunks = _ceil_div(vocab, chunk)
        if chunks >= (2 if stats else 4):
            self.chunks, self.chunk = chunks, chunk

    def topk_keeps_first(self, k: int) -> bool:
        """Does torch.topk(k) return the first of equal values, as argmax does? For k = 1: on CUDA
        (radix select takes equal values in index order); on CPU over at least 64 values (a partial
        sort with a strict comparison keeps the first; below 64 · k it uses std::nth_element, and
        zeros(12).topk(1) is index 9). For k > 1 neither (all-NaN rows come out as 1, 0, 2, 3 on CUDA)."""
        vocab = self.shape[self.dim]
        return k == 1 and (self.device.type == "cuda" or self.device.type == "cpu" and not is_symbolic(vocab)
                           and vocab >= 64)

    # -- shared nodes ---------------------------------------------------------------------------

    def _node(self, key: Any, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        if key not in self._cache:
            self._cache[key] = emit(self.graph, target, args, kwargs)
        return self._cache[key]

    def _of_z(self, target: Any, z: fx.Node) -> fx.Node:
        """1 / z or log z, once per z: the values and the probabilities compared share it."""
        return self._node((target, z), target, (z,))

    def s_in(self) -> fx.Node:
        """The tensor softmax reduced: its input, cast to `dtype=` first when one is given."""
        if self.cast_to is None:
            return self.s
        return self._node("s_in", aten.to.dtype, (self.s, self.cast_to))

    def _up(self, node: fx.Node) -> fx.Node:
        if val(node).dtype == self.compute_dtype:
            return node
        return emit(self.graph, aten.to.dtype, (node, self.compute_dtype))

    def _shared_up(self, key: str, node: fx.Node) -> fx.Node:
        if key not in self._cache:
            self._cache[key] = self._up(node)
        return self._cache[key]

    def _chunked(self) -> fx.Node:
        """s_in as [..., chunks, chunk], padded with -inf (never the max, exp(-inf) = 0)."""
        if "xs" not in self._cache:
            x, pad = self.s_in(), self.chunks * self.chunk - self.shape[self.dim]
            if pad:
                x = emit(self.graph, aten.constant_pad_nd.default, (x, [0, pad], float("-inf")))
            self._node("xs", aten.view.default, (x, list(self.shape[:-1]) + [self.chunks, self.chunk]))
        return self._cache["xs"]

    def top1_lse(self) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node]:
        """(softmax's arg-max, max, log-sum-exp, (log-)probability at the arg-max) of each row of
        s_in, [..., 1]: one kernel, one pass (specpass/kernels)."""
        if "top1" not in self._cache:
            import specpass.kernels  # noqa: F401  registers torch.ops.specpass.top1_lse

            # the value comes rounded to the softmax's dtype, where every use of it rounds first
            rounded = self.out_dtype if self.out_dtype != torch.float32 else None
            if self.prologue is None:
                rows = emit(self.graph, aten.reshape.default, (self.s_in(), [-1, self.shape[-1]]))
                args: tuple = (rows, self.is_log, *((rounded,) if rounded else ()))
            else:
                p = self.prologue
                rows = emit(self.graph, aten.reshape.default, (p.logits, [-1, self.shape[-1]]))
                args = (rows, self.is_log, rounded, self._per_row(p.factor) if isinstance(p.factor, fx.Node) else None,
                        1.0 if isinstance(p.factor, fx.Node) else float(p.factor), p.divide, p.rounding)
            both = emit(self.graph, torch.ops.specpass.top1_lse.default, args)
            self._cache["top1"] = tuple(
                emit(self.graph, aten.reshape.default, (emit(self.graph, operator.getitem, (both, i)),
                                                        list(self.shape[:-1]) + [1])) for i in range(4))
        return self._cache["top1"]

    def _per_row(self, factor: fx.Node) -> fx.Node:
        """A factor that broadcasts over the softmax's rows as the op takes it: [rows] (or [1]) fp32."""
        if val(factor).numel() == 1:
            flat = emit(self.graph, aten.reshape.default, (factor, [1]))
        else:
            shape = list(self.shape[:-1]) + [1]
            if not same_shape(val(factor).shape, shape):
                factor = emit(self.graph, aten.expand.default, (factor, shape))
            flat = emit(self.graph, aten.reshape.default, (factor, [-1]))
        return flat if val(flat).dtype == torch.float32 else emit(self.graph, aten.to.dtype, (flat, torch.float32))

    def one_pass_reads(self) -> str:
        """What the one-pass op reads, for the report."""
        if self.prologue is None:
            return self.s_in().name + (f" (prologue not folded: {self.unfolded})" if self.unfolded else "")
        return f"{self.prologue.logits.name}, folding {self.prologue.spelled}"

    def _reads_one_pass(self, dims: list[int], k: int) -> bool:
        return self.one_pass and dims == [self.dim] and k == 1

    def _is_chunked(self, dims: list[int]) -> bool:
        return self.chunks > 1 and dims == [self.dim]

    def stats(self, dims: list[int]) -> tuple[fx.Node, fx.Node]:
        """(m, z) = (max, sum(exp(s - max))) over `dims`, keepdim, in the compute dtype."""
        if self._is_chunked(dims):
            return self._chunk_stats()
        key = tuple(dims)
        if ("z", key) not in self._cache:
            s_c = self._shared_up("s_c", self.s_in())
            # amax, sub, exp, sum(keepdim): Inductor's online-softmax pattern (one pass)
            m = self._node(("m", key), aten.amax.default, (s_c, dims, True))
            e = emit(self.graph, aten.exp.default, (emit(self.graph, aten.sub.Tensor, (s_c, m)),))
            self._node(("z", key), aten.sum.dim_IntList, (e, dims, True))
        return self._cache[("m", key)], self._cache[("z", key)]

    def _chunk_stats(self) -> tuple[fx.Node, fx.Node]:
        if "Z" not in self._cache:
            inner, outer = self.ndim, self.dim  # the chunk axis and the chunk-index axis
            xc = self._shared_up("xs_c", self._chunked())
            m_c = emit(self.graph, aten.amax.default, (xc, [inner], True))
            e = emit(self.graph, aten.exp.default, (emit(self.graph, aten.sub.Tensor, (xc, m_c)),))
            z_c = emit(self.graph, aten.sum.dim_IntList, (e, [inner], True))
            m_c = self._node("m_c", aten.squeeze.dims, (m_c, [inner]))
            z_c = emit(self.graph, aten.squeeze.dims, (z_c, [inner]))
            m = self._node("M", aten.amax.default, (m_c, [outer], True))
            # a chunk of -inf only adds 0 (its own sum is undefined); a row of -inf stays NaN
            z_c = emit(self.graph, aten.masked_fill.Scalar,
                       (z_c, emit(self.graph, aten.eq.Scalar, (m_c, float("-inf"))), 0.0))
            scaled = emit(self.graph, aten.mul.Tensor,
                          (z_c, emit(self.graph, aten.exp.default, (emit(self.graph, aten.sub.Tensor, (m_c, m)),))))
            self._node("Z", aten.sum.dim_IntList, (scaled, [outer], True))
        return self._cache["M"], self._cache["Z"]

    def _chunk_max(self) -> fx.Node:
        """Each chunk's max [..., chunks]: the stats' when they are computed."""
        if self.with_stats:
            self._chunk_stats()
        return self._node("m_c", aten.amax.default, (self._chunked(), [self.ndim]))

    def _chunk_argmax(self, xs: fx.Node, m_c: fx.Node) -> fx.Node:
        """The first position of the maximum of xs [..., chunks, chunk] (m_c: each chunk's), [..., 1]:
        w * chunk + the arg-max in chunk w, w the first chunk holding the maximum."""
        inner, outer = self.ndim, self.dim
        w = emit(self.graph, aten.argmax.default, (m_c, outer, True))
        at = emit(self.graph, aten.gather.default, (emit(self.graph, aten.argmax.default, (xs, inner)), outer, w))
        return emit(self.graph, aten.add.Tensor, (emit(self.graph, aten.mul.Tensor, (w, self.chunk)), at))

    def _round(self, node: fx.Node, dtypes: list[torch.dtype]) -> fx.Node:
        """Cast through `dtypes` (the softmax's, then the casts to the consumer): round where the original rounded."""
        for dtype in dtypes:
            if val(node).dtype != dtype:
                node = emit(self.graph, aten.to.dtype, (node, dtype))
        return node

    def _prob(self, top: fx.Node, m: fx.Node, z: fx.Node) -> fx.Node:
        """exp(top - m) / z (log_softmax: top - m - log z) in the compute dtype, as softmax kernels
        compute it; ATen's CPU kernel multiplies by 1 / z, and so does this on CPU. Over a whole row
        this is recomputed, not shared with z's exp: Inductor would store a shared one."""
        shifted = emit(self.graph, aten.sub.Tensor, (top, m))
        if self.is_log:
            return emit(self.graph, aten.sub.Tensor, (shifted, self._of_z(aten.log.default, z)))
        e = emit(self.graph, aten.exp.default, (shifted,))
        if self.device.type == "cpu":
            return emit(self.graph, aten.mul.Tensor, (e, self._of_z(aten.reciprocal.default, z)))
        return emit(self.graph, aten.div.Tensor, (e, z))

    def _hits(self, dims: list[int], casts: list[torch.dtype]) -> fx.Node:
        """int32, 1 where the probability rounds to the maximum's, as the original rounds both;
        none in a row whose maximum is NaN. (Not int8: Inductor's CPU argmax over int8 returns
        garbage for an all-zero row, torch 2.13.)"""
        key = ("hits", tuple(dims), tuple(casts))
        if key in self._cache:
            return self._cache[key]
        m, z = self.stats(dims)
        if self._is_chunked(dims):
            x = self._shared_up("xs_c", self._chunked())
            m, z = (emit(self.graph, aten.unsqueeze.default, (n, -1)) for n in (m, z))
        else:
            x = self._shared_up("s_c", self.s_in())
        dtypes = [self.out_dtype] + casts
        short = [i for i, dtype in enumerate(dtypes) if dtype in _HALF]
        if short:  # compare the bits of the last 16-bit value (widening it after is exact): Inductor
            dtypes = dtypes[: short[-1] + 1]  # keeps a bf16/fp16 cast inside a kernel unrounded, not a bitcast
        p, top = (self._round(self._prob(n, m, z), dtypes) for n in (x, m))
        if short:
            p, top = (emit(self.graph, aten.view.dtype, (n, torch.int16)) for n in (p, top))
        return self._node(key, aten.to.dtype, (emit(self.graph, aten.eq.Tensor, (p, top)), torch.int32))

    # -- one consumer (every node it returns is new, so no two outputs alias) --------------------

    def indices(self, target: Any, args: dict[str, Any], dims: list[int], k: int,
                casts: list[torch.dtype]) -> fx.Node:
        keepdim = target is aten.topk.default or args.get("keepdim", False)
        if target is aten.topk.default and not self.topk_keeps_first(k):
            return emit(self.graph, operator.getitem, (self.topk(k, args["sorted"]), 1))
        if self._reads_one_pass(dims, k):
            index = self.top1_lse()[0]
            return index if keepdim else emit(self.graph, aten.squeeze.dims, (index, dims))
        x = self._hits(dims, casts) if self.strict else self.s_in()
        if self._is_chunked(dims):
            xs = x if self.strict else self._chunked()
            m_c = emit(self.graph, aten.amax.default, (xs, [self.ndim])) if self.strict else self._chunk_max()
            index = self._chunk_argmax(xs, m_c)
        else:  # along the softmax's axis: the same index wherever the other reduced axes have size 1
            index = emit(self.graph, aten.argmax.default, (x, self.dim, True))
        if not self.strict:
            # where the row holds NaN or +inf, softmax gives NaN everywhere and max's index is 0. The
            # row max tells, where the values need it anyway; else the input at the index (argmax points
            # at a NaN, else at a +inf, when the row has one): an amax beside the argmax would be a
            # second reduction, which Inductor splits off into kernels of its own at few long rows
            top = (self.stats(dims)[0] if self.with_stats
                   else emit(self.graph, aten.gather.default, (self.s_in(), self.dim, index)))
            index = emit(self.graph, aten.where.ScalarOther,
                         (emit(self.graph, aten.lt.Scalar, (top, float("inf"))), index, 0))
        return index if keepdim else emit(self.graph, aten.squeeze.dims, (index, dims))

    def topk(self, k: int, sorted_: bool) -> fx.Node:
        """topk of s_in, with the rows whose max is +inf or NaN all NaN, as the original's
        probabilities there, so topk orders them as it ordered those."""
        if ("topk", k, sorted_) not in self._cache:
            m = (self.stats([self.dim])[0] if self.with_stats
                 else emit(self.graph, aten.amax.default, (self.s_in(), [self.dim], True)))
            finite = emit(self.graph, aten.lt.Scalar, (m, float("inf")))
            x = emit(self.graph, aten.where.ScalarOther, (finite, self.s_in(), float("nan")))
            self._node(("topk", k, sorted_), aten.topk.default, (x, k, self.dim, True, sorted_))
        return self._cache[("topk", k, sorted_)]

    def values(self, target: Any, args: dict[str, Any], dims: list[int], k: int) -> fx.Node:
        """exp(top - m) / z (log_softmax: top - m - log z); for k = 1 the top is m itself."""
        keepdim = target is aten.topk.default or args.get("keepdim", False)
        if self._reads_one_pass(dims, k):
            value = self.top1_lse()[3]
            return value if keepdim else emit(self.graph, aten.squeeze.dims, (value, dims))
        m, z = self.stats(dims)
        if not keepdim:
            m, z = (emit(self.graph, aten.squeeze.dims, (n, dims)) for n in (m, z))
        top = m if k == 1 else self._up(emit(self.graph, operator.getitem, (self.topk(k, args["sorted"]), 0)))
        return self._prob(top, m, z)  # k = 1: 1 / z, or NaN where the max is not finite

    def _given(self, top: fx.Node, lse: fx.Node) -> fx.Node:
        """The probability (log_softmax: log-probability) of logits `top` (f32) in rows of log-sum-exp lse."""
        shifted = emit(self.graph, aten.sub.Tensor, (top, lse))
        return shifted if self.is_log else emit(self.graph, aten.exp.default, (shifted,))

    def _is_own_index(self, ids: Any) -> bool:
        """Is `ids` the one-pass arg-max itself, one per row in row order ([..., 1], reached from it
        through reshapes only, which keep the row-major order)?"""
        if "top1" not in self._cache or not same_shape(val(ids).shape, (*self.shape[:-1], 1)):
            return False
        node = ids
        while node is not self._cache["top1"][0]:
            if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in RESHAPES):
                return False
            node = node.args[0]
        return True

    def gathered(self, consumer: fx.Node, dtypes: list[torch.dtype]) -> fx.Node:
        """The probabilities softmax gives the tokens `ids` of gather(p, d, ids), rounded through `dtypes`."""
        ids = bind(consumer)["index"]
        if self.one_pass:
            lse = self.top1_lse()[2]
        else:
            m, z = self.stats([self.dim])
        with self.graph.inserting_before(consumer):  # after ids: it may be computed from these rows
            top = self._up(emit(self.graph, aten.gather.default, (self.s_in(), self.dim, ids)))
            return self._round(self._given(top, lse) if self.one_pass else self._prob(top, m, z), dtypes)

    def rewrite(self, consumer: fx.Node, casts: list[torch.dtype], options: Options) -> str:
        target, args = consumer.target, bind(consumer)
        kind = "log_softmax" if self.is_log else "softmax"
        if target is aten.gather.default:
            dtypes = [self.out_dtype] + casts
            if self.one_pass and self._is_own_index(args["index"]):  # the sampled token's: the op's own value
                consumer.replace_all_uses_with(self._round(self.top1_lse()[3], dtypes))
                return f"{kind} -> gather along dim {self.dim} at its own arg-max: values = top1_lse value (one pass)"
            consumer.replace_all_uses_with(self.gathered(consumer, dtypes))
            formula = "s[ids] - logsumexp(s)" if self.is_log else "exp(s[ids] - logsumexp(s))"
            return f"{kind} -> gather along dim {self.dim}: values = {formula}" + (
                " (one pass: top1_lse)" if self.one_pass else "")
        dims, k = self.check(consumer)
        values_out, indices_out = _outputs(consumer)
        what = []
        indices = None
        if indices_out:
            indices = self.indices(target, args, dims, k, casts)
            for node in indices_out:
                node.replace_all_uses_with(indices)
            if target is aten.topk.default and not self.topk_keeps_first(k):
                how = f"topk({self.s_in().name}, {k})"
            elif self._reads_one_pass(dims, k):
                how = f"top1_lse({self.one_pass_reads()}) index (one pass)"
            else:
                how = ("first index rounding to the max probability" if self.strict
                       else f"argmax({self.s_in().name}), 0 where the max is not finite")
                if self._is_chunked(dims):
                    how += f", over {self.chunks} chunks of {self.chunk}"
            what.append(f"indices = {how}")
        if values_out:
            dtype = val(values_out[0]).dtype
            if options.max_probs == "ones":
                if indices is not None:  # computed from the indices so it fuses into their kernel
                    ones = emit(self.graph, aten.to.dtype, (emit(self.graph, aten.ge.Scalar, (indices, 0)), dtype))
                else:
                    ones = emit(self.graph, aten.new_ones.default, (self.s_in(), list(val(values_out[0]).shape)),
                                {"dtype": dtype})
                values = ones
                what.append("values = ones (max_probs='ones')")
            elif self._reads_one_pass(dims, k):
                values = self._round(self.values(target, args, dims, k), [self.out_dtype] + casts)
                what.append("values = " + ("top - lse" if self.is_log else "exp(top - lse)") + " (one pass)"
                            + ("" if indices_out else f" of top1_lse({self.one_pass_reads()})"))
            else:
                values = self._round(self.values(target, args, dims, k), [self.out_dtype] + casts)
                what.append("values = " + ("top - max - log(sum(exp(s - max)))" if self.is_log
                                           else "exp(top - max) / sum(exp(s - max))"))
            assert same_shape(val(values).shape, val(values_out[0]).shape), (values, values_out)
            for node in values_out:
                node.replace_all_uses_with(values)
        return f"{kind} -> {op_name(target)} along dim {self.dim}: " + ("; ".join(what) or "outputs unused")

    def check(self, consumer: fx.Node) -> tuple[list[int], int]:
        """The consumer's reduced axes (normalised) and k; refuses what the rule does not cover."""
        target, args = consumer.target, bind(consumer)
        op = op_name(target)
        if target is aten.gather.default:
            if args["dim"] % self.ndim != self.dim:
                raise _Refuse(f"gather along dim {args['dim'] % self.ndim}, the softmax is over dim {self.dim}")
            if is_written_in_place(self.s):  # the new nodes read s at the gather, after its ids exist
                raise _Refuse("the softmax input is written in place; it is read again at the gather")
            return [self.dim], 1
        if target in _SMALLEST or (target is aten.topk.default and not args["largest"]):
            raise _Refuse(f"{op} takes the smallest probabilities; they underflow to ties at 0, "
                          "so the order of the softmax input does not reproduce the original's choice")
        k = args["k"] if target is aten.topk.default else 1
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise _Refuse(f"topk with k={k!r}")
        if target is aten.max.default or (target is aten.argmax.default and args["dim"] is None):
            dims = list(range(self.ndim))
        elif target is aten.amax.default:
            dims = sorted({d % self.ndim for d in args["dim"]}) or list(range(self.ndim))
        else:
            dims = [args["dim"] % self.ndim]
        if self.dim not in dims:
            raise _Refuse(f"axes differ: softmax over dim {self.dim}, {op} over dim(s) {dims}")
        wider = [d for d in dims if d != self.dim and not known(self.shape[d] == 1)]
        if wider:
            raise _Refuse(f"{op} also reduces over dim(s) {wider}, not only the softmax's dim {self.dim}")
        if k > 1 and dims != [self.dim]:
            raise _Refuse("topk over a reshaped axis")
        if self.strict and _outputs(consumer)[1]:  # the indices are used: the tie rule matters
            if self.is_log and self.device.type == "cpu":
                raise _Refuse("argmax_ties='eager': ATen's CPU log_softmax rounds otherwise than ATen ops do "
                              "(its log, and in bf16/fp16 every step), so its ties cannot be reproduced")
            if target is aten.topk.default and not self.topk_keeps_first(k):
                raise _Refuse(f"argmax_ties='eager': topk({k}) orders equal probabilities its own way, not "
                              "first index first; only the probabilities themselves reproduce that order")
        return dims, k


class _Prologue(NamedTuple):
    """s = round(logits ÷ or × factor) as top1_lse computes it (kernels/__init__.py)."""

    logits: fx.Node  # what the op reads: f32, bf16 or f16, the softmax's shape
    factor: fx.Node | float  # a tensor broadcast over the rows, or a number; 1.0: no scaling
    divide: bool
    rounding: torch.dtype | None  # the quotient's 16-bit dtype, where torch rounds it
    spelled: str  # for the report


_SCALINGS = {aten.div.Tensor: True, aten.div.Scalar: True, aten.mul.Tensor: False, aten.mul.Scalar: False}


def _exact_cast(node: Any) -> bool:
    """A cast or identity that keeps every value exactly: to the same dtype, or f16/bf16 -> f32."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in SAME_VALUES):
        return False
    a, b = val(node.args[0]), val(node)
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device == b.device
            and same_shape(a.shape, b.shape) and _widens(a.dtype, b.dtype))


def _widens(a: torch.dtype, b: torch.dtype) -> bool:
    return a == b or (a in _HALF and b == torch.float32)


def _through_exact_casts(node: fx.Node) -> fx.Node:
    while _exact_cast(node):
        node = node.args[0]
    return node


def _prologue(s: fx.Node, cast_to: torch.dtype | None) -> tuple[_Prologue | None, str]:
    """The casts and the temperature that made the softmax's input, folded into top1_lse's read of
    the logits, or None and why not ("" where there is nothing to fold). Exact or nothing: the op
    computes each element as torch computes it (correctly rounded in fp32, then rounded to the
    quotient's 16-bit dtype), whatever the factor's sign or value, so no sign need be proven."""
    if cast_to is not None and not _widens(val(s).dtype, cast_to):
        return None, f"softmax's dtype= {cast_to} rounds its {val(s).dtype} input"
    node = _through_exact_casts(s)
    factor: fx.Node | float = 1.0
    divide, rounding, spelled = False, None, ""
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target in _SCALINGS:
        out = val(node)
        a, b = node.args[:2]
        divide = _SCALINGS[node.target]
        data, factor = (a, b) if divide or _is_full(a, out) else (b, a)
        if not _is_full(data, out):
            return None, f"{node.name} scales a tensor of another shape than the softmax's"
        why = _factor_refusal(factor, out)
        if why:
            return None, f"{node.name}: {why}"
        if not _widens(val(data).dtype, out.dtype):
            return None, f"{node.name} rounds its {val(data).dtype} operand to {out.dtype} first"
        rounding = out.dtype if out.dtype in _HALF else None
        spelled = ("/ " if divide else "* ") + (factor.name if isinstance(factor, fx.Node) else repr(factor))
        node = _through_exact_casts(data)
    if node is s and cast_to is None:
        return None, ""
    if not isinstance(node, fx.Node) or val(node).dtype not in (torch.float32, *_HALF):
        return None, "the logits are not an f32, bf16 or f16 tensor"
    for n in (node, factor):
        if isinstance(n, fx.Node) and is_written_in_place(n):
            return None, f"{n.name} is written in place"
    if val(node).dtype != torch.float32 or cast_to is not None:
        spelled = "the cast" + (" and " if spelled else "") + spelled
    return _Prologue(node, factor, divide, rounding, spelled), ""


def _is_full(node: Any, out: torch.Tensor) -> bool:
    return isinstance(node, fx.Node) and isinstance(val(node), torch.Tensor) and same_shape(val(node).shape, out.shape)


def _factor_refusal(factor: Any, out: torch.Tensor) -> str:
    """Why a factor cannot be the op's per-row scale ("" where it can): a real number, or a float
    tensor of one value per row (broadcast over the last axis), converted to fp32 exactly as torch
    converts it on every device."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float, fx.Node)):
        return f"the factor {factor!r} is not a real number or a tensor"
    if not isinstance(factor, fx.Node):
        return ""
    f = val(factor)
    if not isinstance(f, torch.Tensor) or not f.is_floating_point():
        return f"the factor {factor.name} is not a float tensor"
    if f.device != out.device:
        return f"the factor {factor.name} is on {f.device}"
    padded = [1] * (out.dim() - f.dim()) + list(f.shape)  # broadcasting aligns the last axes
    if f.dim() > out.dim() or not known(padded[-1] == 1) or any(
            not (known(a == 1) or known(a == b)) for a, b in zip(padded[:-1], out.shape[:-1])):
        return f"the factor {factor.name} {list(f.shape)} is not one value per row of {list(out.shape)}"
    if not _widens(f.dtype, out.dtype):  # CPU and CUDA convert such a divisor differently
        return f"the factor {factor.name} is {f.dtype}, the result {out.dtype}"
    return ""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _outputs(consumer: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(nodes holding the values, nodes holding the indices) that have users."""
    if consumer.target in (aten.max.default, aten.amax.default, aten.gather.default):
        return ([consumer] if consumer.users else []), []
    if consumer.target is aten.argmax.default:
        return [], ([consumer] if consumer.users else [])
    values, indices = [], []
    for user in consumer.users:
        if user.op != "call_function" or user.target is not operator.getitem or user.args[1] not in (0, 1):
            raise _Refuse(f"the (values, indices) result of {consumer.name} is used whole by {user.name}")
        if user.users:
            (values if user.args[1] == 0 else indices).append(user)
    return values, indices


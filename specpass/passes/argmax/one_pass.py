"""One pass on CUDA: k = 1 consumers and gathers read torch.ops.specpass.top1_lse.

On CUDA, a k = 1 consumer and a gather along the last axis read one kernel instead (one_pass):
torch.ops.specpass.top1_lse (specpass/kernels) returns each row's first arg-max (0 where the
max is not finite), its maximum, its log-sum-exp and the value at the arg-max, exp(top - lse) or
top - lse, rounded to the softmax's dtype, in one pass over the row. A gather at that arg-max
(reshaped, one id per row: the sampled token's log-probability) is that value; a gather of other
ids is s_c[ids] - lse (the same functions of the logits, summed in another order). Elsewhere, and
for argmax_ties="eager", topk(k > 1) and float64 inputs (the kernel accumulates in fp32), the
formulation of fused.py, which Inductor fuses. The op reads the logits under the prologue that
made s where prologue.py could fold it.
"""

from __future__ import annotations

import importlib.util
import operator

import torch
import torch.fx as fx

from specpass.graph import is_symbolic, same_shape, val
from specpass.passes.argmax.nodes import Nodes
from specpass.passes.argmax.plan import HALF, Reduction

aten = torch.ops.aten

# Where k = 1 and gathers read torch.ops.specpass.top1_lse: its one-pass Triton kernel beats
# Inductor's formulation at every shape measured (docs/results.md). Tests add "cpu" to check the
# rewrite with the op's torch implementation.
ONE_PASS_DEVICES = {"cuda"}


def applies(eager_ties: bool, dim: int, shape: tuple, in_dtype: torch.dtype, device: torch.device) -> bool:
    """Can a softmax over `dim` of `shape`, reducing `in_dtype`, read top1_lse? Along the last axis of
    static sizes, not under eager ties, on a device that has the kernel; the kernel accumulates in
    fp32: wider inputs keep the formulation in their own dtype."""
    return (not eager_ties and dim == len(shape) - 1 and not any(map(is_symbolic, shape))
            and in_dtype in (torch.float32, *HALF) and device.type in ONE_PASS_DEVICES
            and (device.type != "cuda" or importlib.util.find_spec("triton") is not None))


def top1_lse(nodes: Nodes) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node]:
    """(softmax's arg-max, max, log-sum-exp, (log-)probability at the arg-max) of each row of
    s_in, [..., 1]: one kernel, one pass (specpass/kernels)."""
    plan = nodes.plan

    def build() -> tuple[fx.Node, ...]:
        import specpass.kernels  # noqa: F401  registers torch.ops.specpass.top1_lse

        # the value comes rounded to the softmax's dtype, where every use of it rounds first
        rounded = plan.out_dtype if plan.out_dtype != torch.float32 else None
        p = plan.prologue
        if p is None:
            rows = nodes.emit(aten.reshape.default, (nodes.s_in(), [-1, plan.shape[-1]]))
            args: tuple = (rows, plan.is_log, *((rounded,) if rounded else ()))
        else:
            rows = nodes.emit(aten.reshape.default, (p.logits, [-1, plan.shape[-1]]))
            tensor = isinstance(p.factor, fx.Node)
            args = (rows, plan.is_log, rounded, _per_row(nodes, p.factor) if tensor else None,
                    1.0 if tensor else float(p.factor), p.divide, p.rounding)
        both = nodes.emit(torch.ops.specpass.top1_lse.default, args)
        return tuple(nodes.emit(aten.reshape.default, (nodes.emit(operator.getitem, (both, i)),
                                                       list(plan.shape[:-1]) + [1])) for i in range(4))

    return nodes.once("top1", build)


def _per_row(nodes: Nodes, factor: fx.Node) -> fx.Node:
    """A factor that broadcasts over the softmax's rows as the op takes it: [rows] (or [1]) fp32."""
    if val(factor).numel() == 1:
        flat = nodes.emit(aten.reshape.default, (factor, [1]))
    else:
        shape = list(nodes.plan.shape[:-1]) + [1]
        if not same_shape(val(factor).shape, shape):
            factor = nodes.emit(aten.expand.default, (factor, shape))
        flat = nodes.emit(aten.reshape.default, (factor, [-1]))
    return flat if val(flat).dtype == torch.float32 else nodes.emit(aten.to.dtype, (flat, torch.float32))


def indices(nodes: Nodes, c: Reduction) -> fx.Node:
    """The op's arg-max."""
    return nodes.reduced(top1_lse(nodes)[0], c)


def values(nodes: Nodes, c: Reduction) -> fx.Node:
    """The op's value at its arg-max: exp(top - lse), log_softmax: top - lse."""
    return nodes.reduced(top1_lse(nodes)[3], c)


def given(nodes: Nodes, top: fx.Node, lse: fx.Node) -> fx.Node:
    """The probability (log_softmax: log-probability) of logits `top` (f32) in rows of log-sum-exp lse."""
    shifted = nodes.emit(aten.sub.Tensor, (top, lse))
    return shifted if nodes.plan.is_log else nodes.emit(aten.exp.default, (shifted,))

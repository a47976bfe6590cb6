"""Prologues: the casts and the temperature that made the softmax's input, folded into top1_lse's read.

One-pass lowering only (one_pass.py): the op reads the logits under what made s, when that is
exact casts (identities, f16/bf16 -> f32, softmax's widening dtype=) around at most one scaling
div(data, t) / mul(data, t) / mul(t, data) by a number or a float tensor of one value per row.
The op computes each element as ATen does (fp32 operands, the result correctly rounded, then
rounded to the scaling's 16-bit dtype), so its s is the graph's s, bit for bit, for a factor of
any sign or value; no positivity is assumed or needed. Left out, with the reason in the finding
("prologue not folded: ..."): a tensor factor whose dtype is neither the result's nor a 16-bit
one under an fp32 result (devices convert it differently), a factor that is not one value per
row, a narrowing cast, and logits or factor written in place anywhere (the op runs after the
softmax).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from specpass.graph import is_written_in_place, known, same_shape, val
from specpass.passes.argmax.plan import HALF, Prologue
from specpass.passes.op_sets import SAME_VALUES

aten = torch.ops.aten

_SCALINGS = {aten.div.Tensor: True, aten.div.Scalar: True, aten.mul.Tensor: False, aten.mul.Scalar: False}


def fold(s: fx.Node, cast_to: torch.dtype | None) -> tuple[Prologue | None, str]:
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
        rounding = out.dtype if out.dtype in HALF else None
        spelled = ("/ " if divide else "* ") + (factor.name if isinstance(factor, fx.Node) else repr(factor))
        node = _through_exact_casts(data)
    if node is s and cast_to is None:
        return None, ""
    if not isinstance(node, fx.Node) or val(node).dtype not in (torch.float32, *HALF):
        return None, "the logits are not an f32, bf16 or f16 tensor"
    for n in (node, factor):
        if isinstance(n, fx.Node) and is_written_in_place(n):
            return None, f"{n.name} is written in place"
    if not spelled or val(node).dtype != torch.float32 or cast_to is not None:  # a cast, if only fp32 -> fp32
        spelled = "the cast" + (" and " if spelled else "") + spelled
    return Prologue(node, factor, divide, rounding, spelled), ""


def _widens(a: torch.dtype, b: torch.dtype) -> bool:
    """Does a cast from `a` to `b` keep every value? (the same dtype, or f16/bf16 -> f32)"""
    return a == b or (a in HALF and b == torch.float32)


def _exact_cast(node: Any) -> bool:
    """A cast or identity that keeps every value exactly: to the same dtype, or f16/bf16 -> f32."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in SAME_VALUES):
        return False
    a, b = val(node.args[0]), val(node)
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device == b.device
            and same_shape(a.shape, b.shape) and _widens(a.dtype, b.dtype))


def _through_exact_casts(node: fx.Node) -> fx.Node:
    while _exact_cast(node):
        node = node.args[0]
    return node


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

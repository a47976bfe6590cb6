"""Test helpers: a normalised, shape-annotated print of the IR, for `assertExpectedInline`
graph-diff tests, and `full_row_matmuls` for checks of the live-row ideal.

    x: f32[2, 4, 32]
    linear: f32[2, 4, 32] = linear(x, q_proj_weight)
    select: f32[2, 64] = select.int(linear_4, 1, -1)
    return (select,)

Op names drop the `torch.ops.aten.` prefix and the `.default` overload; every node shows the
shape and dtype of its `meta["val"]`, so a test pins the row counts a rewrite produces.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from specpass.graph import is_mutation

_DTYPES = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "b8",
}


def graph_str(gm: fx.GraphModule) -> str:
    lines = []
    for node in gm.graph.nodes:
        if node.op == "output":
            lines.append(f"return {_arg(node.args[0])}")
            continue
        head = node.name
        value = _value(node.meta.get("val"))
        if value:
            head += f": {value}"
        if node.op == "placeholder":
            lines.append(head)
        elif node.op == "get_attr":
            lines.append(f"{head} = self.{node.target}")
        else:
            args = [_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
            lines.append(f"{head} = {op_name(node.target)}({', '.join(args)})")
    return "\n".join(lines)


def op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        packet = target.overloadpacket
        ns = "" if packet._qualified_op_name.startswith("aten::") else packet._qualified_op_name.split("::")[0] + "."
        overload = "" if target._overloadname == "default" else f".{target._overloadname}"
        return f"{ns}{packet.__name__}{overload}"
    return getattr(target, "__name__", str(target))


def _value(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return f"{_DTYPES.get(val.dtype, str(val.dtype))}{list(val.shape)}"
    if isinstance(val, (tuple, list)):
        parts = [_value(v) for v in val]
        return f"({', '.join(parts)})" if any(parts) else ""
    return ""


def _arg(a: Any) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (tuple, list)):
        inner = ", ".join(_arg(x) for x in a)
        return f"({inner},)" if isinstance(a, tuple) and len(a) == 1 else (
            f"({inner})" if isinstance(a, tuple) else f"[{inner}]")
    if isinstance(a, torch.dtype):
        return _DTYPES.get(a, str(a))
    if isinstance(a, torch.device):
        return a.type  # cpu and cuda graphs print alike
    return repr(a)


_MATMULS = {torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.matmul.default, torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default,
            torch.ops.aten.einsum.default}


def full_row_matmuls(gm: fx.GraphModule, row_sizes: set[int]) -> list[str]:
    """Matmuls of `gm` that still run on every token row (an output axis other than the last has
    one of `row_sizes`: T, or B * T flattened) and feed no in-place (KV) write: the live-row ideal
    is that there are none."""
    return [n.name for n in gm.graph.nodes if n.target in _MATMULS and isinstance(n.meta.get("val"), torch.Tensor)
            and any(isinstance(s, int) and s in row_sizes for s in n.meta["val"].shape[:-1])
            and not _feeds_a_write(n)]


def _feeds_a_write(node: fx.Node) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if is_mutation(n):
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.users)
    return False

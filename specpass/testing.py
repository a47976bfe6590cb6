"""Test helpers: a normalised, shape-annotated print of the IR, for `assertExpectedInline`
graph-diff tests, `fake_ir` (a function's IR traced on fake tensors of given shapes),
`full_row_matmuls` for checks of the live-row ideal, and `Recorder`, a backend that keeps the
graphs it compiled.

    x: f32[2, 4, 32]
    linear: f32[2, 4, 32] = linear(x, q_proj_weight)
    select: f32[2, 64] = select.int(linear_4, 1, -1)
    return (select,)

Op names drop the `torch.ops.aten.` prefix and the `.default` overload; every node shows the
shape and dtype of its `meta["val"]`, so a test pins the row counts a rewrite produces.
"""

from __future__ import annotations

import re

from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from specpass.compile_backend import backend
from specpass.graph import is_mutation

_DTYPES = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "b8",
}


def fake_ir(fn: Any, *shapes: Any, device: str = "cpu", dtype: torch.dtype = torch.float32,
            dtypes: tuple[torch.dtype | None, ...] = ()) -> fx.GraphModule:
    """fn's IR (make_fx, pre-dispatch, as `specpass.capture` traces it) on fake tensors of these
    shapes, of `dtype` or of dtypes[i] for the i-th where it is given, on `device`, which this
    machine need not have (a pass that fires on CUDA graphs, tested on a CPU)."""
    kinds = [*dtypes, *[None] * len(shapes)]
    with FakeTensorMode():
        args = [torch.empty(shape, device=device, dtype=kind or dtype) for shape, kind in zip(shapes, kinds)]
        return make_fx(fn, pre_dispatch=True)(*args)


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
    one of `row_sizes`: T, or B * T flattened) although no exact rewrite needs them there: the
    live-row ideal is that there are none. Needed on every row: what feeds an in-place (KV)
    write, or the keys and values of an attention — SDPA's, or a matmul's second operand, whose
    rows it contracts (a model that keeps no cache reads its K/V from the new rows themselves)."""
    return [n.name for n in gm.graph.nodes if n.target in _MATMULS and isinstance(n.meta.get("val"), torch.Tensor)
            and any(isinstance(s, int) and s in row_sizes for s in n.meta["val"].shape[:-1])
            and not _needed_on_every_row(n)]


def _needed_on_every_row(node: fx.Node) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if is_mutation(n):
            return True
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if any(user.args[i] is n for i in _CONTRACTED.get(user.target, ())):
                return True
            todo.append(user)
    return False


_CONTRACTED = {  # op -> the operands whose every row it reads for each output row
    torch.ops.aten.scaled_dot_product_attention.default: (1, 2), torch.ops.aten.mm.default: (1,),
    torch.ops.aten.bmm.default: (1,), torch.ops.aten.matmul.default: (1,), torch.ops.aten.baddbmm.default: (2,),
}


def calls_rewritten(lines: list[str]) -> int:
    """How many calls the printed findings cover: one each, a region body's the calls that run it."""
    return sum(int(m.group(1)) if (m := re.search(r"a region body: (\d+) calls? run it", line)) else 1 for line in lines)


class Recorder:
    """specpass's backend, the rewritten graph run as it is (handoff="eager"), keeping what Dynamo
    handed it (`dynamo`) and what the passes returned (`rewritten`), one per graph compiled."""

    def __init__(self, **options: Any):
        self.dynamo: list[fx.GraphModule] = []
        self.rewritten: list[fx.GraphModule] = []
        self.inner = backend(handoff="eager", **options)

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
        self.dynamo.append(gm)
        compiled = self.inner(gm, example_inputs, **kwargs)
        self.rewritten.append(compiled)
        return compiled

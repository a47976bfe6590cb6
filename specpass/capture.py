"""The canonical IR every pass sees, and how a Dynamo graph becomes it.

IR: undecomposed pre-dispatch ATen, traced with `make_fx(pre_dispatch=True)` inside Dynamo's
own fake mode, with the sizes Dynamo gave the inputs: static, or symbolic (`dynamic=True`,
`mark_dynamic`; the symbolic sizes are graph inputs or `sym_size` of one). It keeps `aten.linear`, `aten.softmax.int`,
`aten.scaled_dot_product_attention`, `aten.select.int`, and KV writes as in-place ops
(`index_copy_`, `index_put_`, `copy_` into a slice) on placeholder buffers, in program order
(the pipeline then makes in-place ops on the graph's own unshared tensors functional). Every tensor-valued node carries a fake tensor in `meta["val"]`. Placeholders are named after
Dynamo's graph inputs (`x`, `q_proj_weight`, `k_cache`) so graphs and reports are readable.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._guards import HopDispatchSetCache, TracingContext, detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from specpass.graph import known, set_val


class CaptureError(RuntimeError):
    """The graph cannot be brought into the IR; the backend compiles it unrewritten."""


def to_aten_ir(gm: fx.GraphModule, example_inputs: list[Any]) -> fx.GraphModule:
    """Dynamo graph (torch-level FX) -> canonical IR (see module docstring)."""
    dynamo_inputs = list(gm.graph.find_nodes(op="placeholder"))
    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode()
    with fake_mode, _own_region_traces():
        aten_gm = make_fx(gm, pre_dispatch=True)(*[_fake(fake_mode, x) for x in example_inputs])
    unknown = [n.target for n in aten_gm.graph.find_nodes(op="get_attr")
               if isinstance(getattr(aten_gm, n.target, None), FakeTensor)]
    if unknown:  # a tensor the program makes from data while tracing, baked in as a fake constant
        raise CaptureError(f"the traced graph would hold constants whose values are only known at run time "
                           f"({', '.join(sorted(set(unknown))[:3])})")
    aten_inputs = list(aten_gm.graph.find_nodes(op="placeholder"))
    if len(aten_inputs) == len(dynamo_inputs):
        for dynamo_node, aten_node in zip(dynamo_inputs, aten_inputs):
            aten_node._rename(_input_name(dynamo_node.name))
            aten_node.target = aten_node.name
        aten_gm.recompile()
    _scalar_constants_made_in_bodies(aten_gm)
    _cats_of_one_tensor_made_contiguous(aten_gm)
    return aten_gm


def _cats_of_one_tensor_made_contiguous(gm: fx.GraphModule) -> None:
    """`cat([x, empty])` (a rotary split whose pass-through part is empty) as the copy of x it is,
    laid out as the IR's cat is: contiguous. Inductor's decomposition drops the empty inputs and
    clones x keeping its strides, while the IR's trace saw a contiguous result and recorded no
    `.contiguous()` after it: a later `view` that relied on it fails in AOTAutograd's trace."""
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        graph, changed = module.graph, False
        for node in list(graph.find_nodes(op="call_function", target=torch.ops.aten.cat.default)):
            tensors = node.args[0]
            kept = [t for t in tensors if not known(t.meta["val"].numel() == 0)]
            if len(tensors) < 2 or len(kept) != 1 or not node.meta["val"].is_contiguous():
                continue
            changed = True
            with graph.inserting_before(node):
                copy = graph.call_function(torch.ops.aten.clone.default, (kept[0],),
                                           dict(memory_format=torch.contiguous_format))
            copy.meta = dict(node.meta)
            node.replace_all_uses_with(copy)
            graph.erase_node(node)
        if changed:
            module.recompile()


def _scalar_constants_made_in_bodies(gm: fx.GraphModule) -> None:
    """Each 0-d tensor constant of a nested body (a region's: `torch.tensor(finfo.min)` in a layer)
    made by `aten.full` where it is read. AOTAutograd's trace of a body with a constant attribute
    fails in some torch versions ("Attempting to use FunctionalTensor on its own"), and `full` is
    the same value, freshly made as `lift_fresh_copy` would copy it."""
    for body in gm.modules():
        if body is gm or not isinstance(body, fx.GraphModule):
            continue
        changed = False
        for node in list(body.graph.find_nodes(op="get_attr")):
            value = getattr(body, node.target, None)
            if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor) or value.dim() != 0:
                continue
            with body.graph.inserting_before(node):
                made = body.graph.call_function(torch.ops.aten.full.default, ([], value.item()),
                                                dict(dtype=value.dtype, device=value.device))
            set_val(made)
            for user in list(node.users):
                if user.target is torch.ops.aten.lift_fresh_copy.default:
                    user.replace_all_uses_with(made)
                    body.graph.erase_node(user)
            node.replace_all_uses_with(made)
            body.graph.erase_node(node)
            delattr(body, node.target)
            changed = True
        if changed:
            body.recompile()


@contextlib.contextmanager
def _own_region_traces() -> Iterator[None]:
    """Torch keeps each region body it traces in the compile's tracing context, by the region's
    name, and a later trace of a call of that name takes the kept body instead of the one the call
    holds. Our pre-dispatch bodies kept there would stand in, undecomposed and unrewritten, for the
    rewritten ones when AOTAutograd traces the graph for Inductor: this trace keeps its own."""
    context = TracingContext.try_get()
    if context is None:
        yield
        return
    kept, context.hop_dispatch_set_cache = context.hop_dispatch_set_cache, HopDispatchSetCache()
    try:
        yield
    finally:
        context.hop_dispatch_set_cache = kept


def adopt_dynamo_inputs(dynamo_gm: fx.GraphModule, aten_gm: fx.GraphModule) -> None:
    """Give an IR graph Dynamo's metadata about its inputs (their sources, which are static
    buffers). AOTAutograd reads it to keep parameters and KV caches as static inputs, so that
    CUDA graphs (mode="reduce-overhead") accept their in-place writes instead of skipping."""
    dynamo_inputs = list(dynamo_gm.graph.find_nodes(op="placeholder"))
    aten_inputs = list(aten_gm.graph.find_nodes(op="placeholder"))
    constants = [name for name, _ in aten_gm.named_buffers()]
    if len(dynamo_inputs) != len(aten_inputs) or any("." in name for name in constants) \
            or any(True for _ in aten_gm.named_parameters()):
        return  # not 1:1: compile without it (CUDA graphs may then skip mutated inputs)
    # make_fx's lifted constants (the -1 of `x[:, 0] = -1`) become plain attributes: AOTAutograd
    # keeps those as constants, but lifts buffers into inputs ahead of Dynamo's, and the static
    # input indices it reads from Dynamo's metadata would then name the wrong inputs.
    for name in constants:
        object.__setattr__(aten_gm, name, aten_gm._buffers.pop(name))
    aten_gm.meta.update(dynamo_gm.meta)
    if hasattr(dynamo_gm, "_param_name_to_source"):
        aten_gm._param_name_to_source = dynamo_gm._param_name_to_source
    for dynamo_node, aten_node in zip(dynamo_inputs, aten_inputs):
        aten_node._dynamo_source = getattr(dynamo_node, "_dynamo_source", None)
        if "tensor_dict" in dynamo_node.meta:
            aten_node.meta["tensor_dict"] = dynamo_node.meta["tensor_dict"]


def capture(fn: Callable, *args: Any, dynamic: bool = False, **kwargs: Any) -> fx.GraphModule:
    """Trace `fn(*args, **kwargs)` into the IR the backend compiles, without running it.

    `fn` is a module or a function; it must compile to one graph (`fullgraph=True`): a graph break
    raises `CaptureError` with Dynamo's reason and where it broke.
    Buffers it mutates (KV caches) are left untouched. `dynamic=True` captures with symbolic
    sizes, as `torch.compile(fn, dynamic=True)` does.
    """
    if not callable(fn):
        raise TypeError(f"expected an nn.Module or a function to trace (the draft step), got a "
                        f"{type(fn).__name__}: pass the model or its step function first, then its example inputs")
    compiled = torch.compile(fn, backend=_stop_after_capture, fullgraph=True, dynamic=dynamic)
    try:
        with torch._dynamo.config.patch(suppress_errors=False):
            compiled(*args, **kwargs)
    except Exception as exc:  # Dynamo wraps what the backend raises; dig ours out
        captured = find_cause(exc, _Captured)
        if captured is not None:
            return captured.graph_module
        name = getattr(fn, "__qualname__", type(fn).__name__)
        if isinstance(exc, torch._dynamo.exc.Unsupported):
            raise CaptureError(
                f"{name} must compile to one graph, but Dynamo breaks it{_where(exc)}: {_reason(exc)}. "
                "Make the step one graph: no print, .item() or tensor-valued if/while inside it (torch.where "
                "or torch.cond instead), or capture only the part that is one graph") from exc
        if isinstance(exc, torch._dynamo.exc.TorchRuntimeError):
            raise CaptureError(
                f"{name} fails on these inputs{_where(exc)}: {_reason(exc)}. Check that it runs on them "
                "without torch.compile (shapes, dtypes, devices)") from exc
        raise
    raise CaptureError("Dynamo did not compile a graph for this call (cached or skipped frame)")


def _where(exc: Exception) -> str:
    frame = getattr(exc, "innermost_user_frame_summary", None)
    return f" at {frame.filename}:{frame.lineno} ({(frame.line or '').strip()})" if frame else ""


def _reason(exc: Exception) -> str:
    """Dynamo's reason in one line: its message's title and the first line of its explanation."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    explanation = next((line.removeprefix("Explanation:").strip().rstrip(".") for line in lines
                        if line.startswith("Explanation:")), "")
    return f"{lines[0]} ({explanation})" if lines and explanation else (lines[0] if lines else type(exc).__name__)


class _Captured(Exception):
    def __init__(self, graph_module: fx.GraphModule):
        super().__init__("captured")
        self.graph_module = graph_module


def _stop_after_capture(gm: fx.GraphModule, example_inputs: list[Any], **_: Any):
    raise _Captured(to_aten_ir(gm, example_inputs))


def find_cause(exc: BaseException | None, kind: type) -> Any:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return None


def _fake(fake_mode: FakeTensorMode, x: Any) -> Any:
    """An input as Dynamo saw it: with the symbolic sizes Dynamo gave it (its symbolic context in
    the tracing context), static otherwise (parameters, buffers, graphs compiled static)."""
    if not isinstance(x, torch.Tensor):
        return x  # ints, and the SymInts of dynamic sizes
    if isinstance(x, FakeTensor):
        return x if x.fake_mode is fake_mode else fake_mode.from_tensor(x)
    context = TracingContext.try_get()
    symbolic = context.tensor_to_context.get(x) if context is not None else None
    if symbolic is None:
        return fake_mode.from_tensor(x, static_shapes=True)
    return fake_mode.from_tensor(x, symbolic_context=symbolic, source=symbolic.tensor_source, trace=False)


def _input_name(dynamo_name: str) -> str:
    # l_self_modules_layers_modules_0_modules_q_proj_parameters_weight_ -> layers_0_q_proj_weight
    name = re.sub(r"^[lg]_", "", dynamo_name.lower()).rstrip("_")  # locals, globals
    name = re.sub(r"^self_(modules|parameters|buffers)_", "", name)
    name = re.sub(r"_(modules|parameters|buffers)_", "_", name)
    return name or "input"

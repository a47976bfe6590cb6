"""Small FX helpers every pass shares: fake values, node creation with meta["val"], mutation tests."""

from __future__ import annotations

import operator
import weakref
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

aten = torch.ops.aten


# Ops that read a tensor's value into a Python scalar on the host (`.item()`, `.tolist()`).
SCALAR_READS = {aten.item.default, aten._local_scalar_dense.default}


def device_reads_to_host(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of gm and of the bodies it holds that read a CUDA tensor's value to the host (ATen's
    `item`, or Dynamo's `.item()` / `.tolist()` before capture): a CUDA graph cannot capture them."""
    def on_cuda(node: Any) -> bool:
        value = node.meta.get("val", node.meta.get("example_value")) if isinstance(node, fx.Node) else None
        return isinstance(value, torch.Tensor) and value.device.type == "cuda"

    return [n for module in gm.modules() if isinstance(module, fx.GraphModule) for n in module.graph.nodes
            if ((n.op == "call_function" and n.target in SCALAR_READS)
                or (n.op == "call_method" and n.target in ("item", "tolist"))) and on_cuda(n.args[0])]


def val(node: Any) -> Any:
    """The fake value of a node (or the literal itself for non-node arguments)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def fake_mode(graph: fx.Graph) -> FakeTensorMode:
    for node in graph.find_nodes(op="placeholder"):
        v = node.meta.get("val")
        if isinstance(v, torch._subclasses.FakeTensor):
            return v.fake_mode
    raise RuntimeError("graph has no fake placeholders; capture it with specpass.capture")


def emit(graph: fx.Graph, target: Any, args: tuple, kwargs: dict | None = None, name: str | None = None) -> fx.Node:
    """Insert `target(*args, **kwargs)` at the graph's insert point, with its meta["val"]. Symbolic
    sizes among the arguments become nodes that compute them (`size_args`)."""
    args, kwargs = size_args(graph, (args, kwargs or {}))
    node = graph.call_function(target, args, kwargs, name=name)
    set_val(node)
    return node


# ----------------------------------------------------------------------------- symbolic sizes
# With dynamic shapes a size is a SymInt (`s0`, `4*s0`). The passes decide only what holds for
# every value a size may take — `known` never adds a guard, so a rewrite never specializes the
# graph — and a size that goes into a new node's arguments is computed by nodes of the graph
# (`sym_size(x, 0) * 4`), never baked in.


def known(condition: Any) -> bool:
    """Does a condition on sizes (a bool, or a SymBool) hold for every size the graph allows?"""
    return statically_known_true(condition)


def hint(size: Any) -> int | None:
    """A size's value in the call that was captured (None if data-dependent): input to a heuristic
    (is a rewrite worth it), never to a decision on correctness."""
    return size.node.hint if isinstance(size, torch.SymInt) else size


def same_shape(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(known(x == y) for x, y in zip(a, b))


def is_symbolic(value: Any) -> bool:
    return isinstance(value, torch.SymInt) and not value.node.expr.is_number


def to_the_end(end: Any) -> bool:
    """A slice end that means "to the end of the axis": None, or `x[a:]`'s sys.maxsize (a
    symbolic size has no upper bound to compare it with)."""
    return end is None or (isinstance(end, int) and end >= 2**62)


def size_key(sizes: Any) -> Any:
    """Sizes as a hashable key: symbolic ones as their expressions (hashing a SymInt fails)."""
    return tree_map(lambda v: v.node.expr if isinstance(v, torch.SymInt) else v, sizes)


def static_int(value: Any) -> Any:
    """A size as a Python int where it is one (`s1 - (s1 - 1)` is 1), else the SymInt."""
    return int(value.node.expr) if isinstance(value, torch.SymInt) and not is_symbolic(value) else value


def size_args(graph: fx.Graph, tree: Any) -> Any:
    """`tree` with each symbolic size replaced by a node of `graph` that computes it."""
    def convert(v: Any) -> Any:
        if isinstance(v, torch.SymInt):
            return _size_node(graph, v.node.expr) if is_symbolic(v) else int(v.node.expr)
        return v

    return tree_map(convert, tree)


_SIZE_NODES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {expr: node}
_ARITHMETIC = {sympy.Add: operator.add, sympy.Mul: operator.mul}


def _size_node(graph: fx.Graph, expr: sympy.Expr) -> Any:
    nodes = _SIZE_NODES.setdefault(graph, {})
    node = nodes.get(expr)
    if node is not None and node.graph is graph and not node._erased:
        return node
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        node = _symbol_source(graph, expr)
    elif type(expr) in _ARITHMETIC:
        terms = [_size_node(graph, t) for t in expr.args]
        node = terms[0]
        for term in terms[1:]:
            node = _emit_after_inputs(graph, _ARITHMETIC[type(expr)], (node, term))
    elif type(expr).__name__ == "FloorDiv":
        node = _emit_after_inputs(graph, operator.floordiv, tuple(_size_node(graph, t) for t in expr.args))
    else:
        raise ValueError(f"no node of the graph computes the symbolic size {expr}")
    nodes[expr] = node
    return node


def _symbol_source(graph: fx.Graph, symbol: sympy.Symbol) -> fx.Node:
    """A SymInt input that is `symbol`, or `sym_size` of the first input with an axis of that size."""
    inputs = list(graph.find_nodes(op="placeholder"))
    for p in inputs:
        if isinstance(val(p), torch.SymInt) and val(p).node.expr == symbol:
            return p
    for p in inputs:
        v = val(p)
        if isinstance(v, torch.Tensor):
            for d, size in enumerate(v.shape):
                if isinstance(size, torch.SymInt) and size.node.expr == symbol:
                    return _emit_after_inputs(graph, aten.sym_size.int, (p, d))
    raise ValueError(f"no input of the graph has the symbolic size {symbol}")


def _emit_after_inputs(graph: fx.Graph, target: Any, args: tuple) -> fx.Node:
    """A size computation placed right after the inputs and the size nodes it reads, so that it
    exists wherever a node that needs it is inserted."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = max([*graph.find_nodes(op="placeholder"), *(a for a in args if isinstance(a, fx.Node))],
                 key=order.__getitem__)
    with graph.inserting_after(anchor):
        node = graph.call_function(target, args)
    set_val(node)
    return node


def set_val(node: fx.Node) -> None:
    """Compute a call_function node's meta["val"] from its arguments' fake values."""
    fake_args, fake_kwargs = fx.node.map_arg((node.args, node.kwargs), val)
    if is_region_call(node):  # the body, not the get_attr node naming it
        fake_args = (region_body(node), *fake_args[1:])
    with fake_mode(node.graph), enable_python_dispatcher():  # as propagate_fake_tensors
        node.meta["val"] = node.target(*fake_args, **fake_kwargs)


def is_mutation(node: fx.Node) -> bool:
    """An in-place op (KV write, `add_`, `copy_`): it changes an existing tensor. A region call
    whose body writes one of its inputs is one too (it writes that operand)."""
    if is_region_call(node):
        return bool(region_written_operands(node))
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target._schema.is_mutable
    )


def tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]


def is_impure(node: fx.Node) -> bool:
    """FX's purity, except that attention without dropout is pure (its `nondeterministic_seeded`
    tag is about dropout), so a replaced attention is removed as dead code."""
    if node.op == "call_function" and node.target is aten.scaled_dot_product_attention.default:
        dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        if dropout == 0.0:
            return False
    if is_region_call(node) and is_mutation(node):
        return True  # FX calls every invoke_subgraph pure: one that writes a KV cache is not
    return node.is_impure()


def bind(node: fx.Node) -> dict[str, Any]:
    """An ATen node's arguments by schema name, defaults filled in."""
    bound = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        else:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
    return bound


def op_name(target: Any) -> str:
    """A short op name for messages: `softmax` for aten.softmax.int."""
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def storage(node: Any) -> StorageWeakRef | None:
    """The storage a node's fake value lives in: views of one tensor share it."""
    v = val(node)
    return StorageWeakRef(v.untyped_storage()) if isinstance(v, torch.Tensor) else None


def written_storages(node: fx.Node) -> set[StorageWeakRef]:
    """The storages an in-place node writes (its schema's mutable arguments; a region call's
    operands that its body writes)."""
    if is_region_call(node):
        return {storage(a) for a in region_written_operands(node) if storage(a) is not None}
    out = set()
    for name, arg in bind(node).items():
        schema_arg = next(a for a in node.target._schema.arguments if a.name == name)
        if schema_arg.alias_info is not None and schema_arg.alias_info.is_write:
            out |= {storage(leaf) for leaf in tree_leaves(arg) if storage(leaf) is not None}
    return out


def is_written_in_place(node: fx.Node) -> bool:
    """Does any in-place op of the graph write the node's storage (the node or a view of it)?"""
    s = storage(node)
    return s is not None and any(s in written_storages(n) for n in node.graph.nodes if is_mutation(n))


# ----------------------------------------------------------------------------- region calls
# `torch.compiler.nested_compile_region` code (a decoder layer marked by
# `specpass.mark_repeated_blocks`) is traced once into a body that every call shares:
#
#     %body = get_attr[target=repeated_subgraph0]
#     %call = invoke_subgraph(%body, "subgraph_0", %x, %q_proj_weight, ..., %k_cache, ...)
#     %out = getitem(%call, 0)
#
# The body is an IR graph of its own (placeholders with fake values, KV writes in place on them):
# the pipeline rewrites each distinct body once and Inductor compiles it once. A body's in-place
# write of its placeholder i writes the call's operand i.

REGION = torch.ops.higher_order.invoke_subgraph
_OPERANDS = 2  # invoke_subgraph(body, identifier, *operands)


def is_region_call(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is REGION


def region_body(node: fx.Node) -> fx.GraphModule:
    """The body a region call runs: the submodule of its graph's module that its first argument names."""
    attr, owner = node.args[0], node.graph.owning_module
    if owner is None or not isinstance(attr, fx.Node) or attr.op != "get_attr":
        raise ValueError(f"{node.name} names no body of its graph module")
    return operator.attrgetter(attr.target)(owner)


def region_calls(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    """The graph's region calls by the body they run (its attribute name), in graph order."""
    calls: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if is_region_call(node):
            calls.setdefault(node.args[0].target, []).append(node)
    return calls


def region_operands(node: fx.Node) -> tuple:
    return node.args[_OPERANDS:]


_WRITTEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # body graph -> written placeholder indices


def region_written_inputs(body: fx.GraphModule) -> frozenset[int]:
    """The indices of a body's placeholders that it writes in place (a view of one shares its
    storage), read once per body graph."""
    written = _WRITTEN.get(body.graph)
    if written is None:
        storages = set().union(*[written_storages(n) for n in body.graph.nodes if is_mutation(n)])
        written = frozenset(i for i, p in enumerate(body.graph.find_nodes(op="placeholder"))
                            if storage(p) is not None and storage(p) in storages)
        _WRITTEN[body.graph] = written
    return written


def region_written_operands(node: fx.Node) -> list[fx.Node]:
    written = region_written_inputs(region_body(node))
    return [a for i, a in enumerate(region_operands(node)) if i in written and isinstance(a, fx.Node)]


def args_match(mine: Any, theirs: Any, env: dict[fx.Node, Any], free: Any = ()) -> bool:
    """Do two argument trees match, leaf for leaf: constants equal (and of one type), a node of `mine`
    mapped by `env` to the node in its place? A node of `free` that `env` does not map yet is mapped to
    the node in its place (`env` grows)."""
    (leaves, spec), (other_leaves, other_spec) = tree_flatten(mine), tree_flatten(theirs)
    if spec != other_spec:
        return False
    for a, b in zip(leaves, other_leaves):
        if isinstance(a, fx.Node):
            if a not in env and a in free and isinstance(b, fx.Node):
                env[a] = b
            if a not in env or env[a] is not b:
                return False
        elif isinstance(b, fx.Node) or type(a) is not type(b) or a != b:
            return False
    return True


def free_attr_name(gm: fx.GraphModule, base: str) -> str:
    """`base`, or `base_1`, `base_2`, ..., the first that names no attribute of `gm` (a new body)."""
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def copy_nodes(graph: fx.Graph, nodes: list[fx.Node], env: dict[fx.Node, Any]) -> None:
    """Copy `nodes` of another graph into `graph` at its insert point, their inputs read through `env`,
    which gains the copies. Each copy's value is computed from its inputs' (a copied value would be of
    the other graph's tensors)."""
    for n in nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
        env[n].meta = {k: v for k, v in n.meta.items() if k != "val"}
        set_val(env[n])


def inline_region(node: fx.Node) -> bool:
    """Replace a region call by a copy of its body, in place, each copied node's value computed from
    the call's operands (the body's values are of its own placeholders, whose storages are not the
    operands'). False, and nothing changed, where the body reads attributes of its own (constants,
    nested bodies) that the graph does not hold, or the call is read other than by getitem."""
    body = region_body(node)
    if body.graph.find_nodes(op="get_attr") or any(u.target is not operator.getitem for u in node.users):
        return False
    graph = node.graph
    env: dict[fx.Node, Any] = dict(zip(body.graph.find_nodes(op="placeholder"), region_operands(node)))
    with graph.inserting_before(node):
        copy_nodes(graph, [n for n in body.graph.nodes if n.op not in ("placeholder", "output")], env)
    results = fx.node.map_arg(body.graph.output_node().args[0], env.__getitem__)
    for user in list(node.users):
        user.replace_all_uses_with(results[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)
    return True


# ----------------------------------------------------------------------------- local writes
# An in-place op on a tensor the graph made itself, which no view shares, is only a way of
# naming a new value: `h.add_(w)` is `h2 = h + w` with every later read of h reading h2. Made
# functional, it is an op the row rules know; written in place, every pass must keep it on
# every row. A view taken after the last write sees no write (`top /= s; top.reshape(-1)`): it
# is a view of the last value. Writes to the graph's inputs (KV caches), to views, and to a
# tensor a view of which was taken before a write stay in place: their order against reads is
# semantics.


def functional_variant(node: fx.Node) -> Any:
    """aten.foo.overload for an in-place aten.foo_.overload that writes only its first argument
    (torch's naming), or None."""
    if not is_mutation(node) or not node.target.__name__.split(".")[0].endswith("_"):
        return None
    written = [a for a in node.target._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if [a.name for a in written] != [node.target._schema.arguments[0].name]:
        return None
    packet = getattr(torch.ops.aten, node.target.__name__.split(".")[0][:-1], None)
    functional = getattr(packet, node.target._overloadname, None) if packet is not None else None
    return None if functional is None or functional._schema.is_mutable else functional


def make_local_writes_functional(gm: fx.GraphModule) -> None:
    """Each in-place op on a local tensor (see above) becomes its functional op, where that keeps
    the tensor's shape and dtype; later reads read the new value. Other writes are left alone."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    holders: dict[StorageWeakRef, list[fx.Node]] = {}  # storage -> nodes whose value lives in it
    for n in graph.nodes:
        s = storage(n)
        if s is not None:
            holders.setdefault(s, []).append(n)
    for base, *later in holders.values():
        writes = _own_writes(base, later)
        if writes is None:
            continue  # an input, a view, a write that is not one of base's own, a view taken before one
        values = _functional_values(graph, base, writes)
        if values is None:
            continue
        order.update(zip(values[1:], map(order.get, writes)))
        group = {base, *writes}
        readers = {user for member in group for user in member.users} - group - set(values)
        for node in readers:  # a read of the tensor reads the value of the last write before it
            latest = values[sum(order[w] < order[node] for w in writes)]
            node.args, node.kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: latest if a in group else a)
        for write in reversed(writes):
            graph.erase_node(write)
    gm.recompile()


def _functional_values(graph: fx.Graph, base: fx.Node, writes: list[fx.Node]) -> list[fx.Node] | None:
    """[base, the value after each write], each functional node inserted at its write; None (and
    nothing inserted) where one would not keep base's shape and dtype (torch would promote or
    broadcast) or cannot run on the fake values."""
    values = [base]
    try:
        for write in writes:
            with graph.inserting_before(write):
                values.append(graph.call_function(functional_variant(write), (values[-1], *write.args[1:]),
                                                  write.kwargs))
            set_val(values[-1])
        if all(same_shape(val(v).shape, val(base).shape) and val(v).dtype == val(base).dtype for v in values[1:]):
            return values
    except Exception:  # the functional op refuses these fake values: keep the writes
        pass
    for new in reversed(values[1:]):
        graph.erase_node(new)
    return None


def _own_writes(base: fx.Node, later: list[fx.Node]) -> list[fx.Node] | None:
    """The in-place writes of the tensor `base` made, where the nodes after it in its storage
    (`later`) are these writes, each of base or of the write before it, then only views taken
    after the last one; else None."""
    if base.op != "call_function" or is_mutation(base):
        return None
    writes = later[:1 + max((i for i, n in enumerate(later) if is_mutation(n)), default=-1)]
    if not writes or not all(_local_write(w, [base, *writes][:i + 1]) for i, w in enumerate(writes)):
        return None
    return writes


def _local_write(node: fx.Node, before: list[fx.Node]) -> bool:
    return functional_variant(node) is not None and node.args[0] in before

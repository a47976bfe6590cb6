"""Seams: the next layer's head moved into each layer's body, so that Inductor fuses across the seam.

A repeated layer compiled once is a region call whose body Inductor compiles apart; no kernel spans
two bodies. A decoder layer ends with its residual add and the next one starts with a norm of that
sum: two kernels at every seam where a layer compiled inline has one (a step of the shipped target:
19 kernels more, docs/results.md). The layers' order is rotated instead:

    h1 = layer(h0, w0); h2 = layer(h1, w1); h3 = layer(h2, w2)
->  n0 = head(h0, w0)                                 # inline, before the first call
    h1, n1 = rest+head(h0, n0, w0, next=w1)           # one body R for every call:
    h2, n2 = rest+head(h1, n1, w1, next=w2)           #   the layer without its head,
    h3, n3 = rest+head(h2, n2, w2, next=w_final)      #   then the head on its result

The head is what the body computes from the input the previous call hands it (`h`) before any
matmul-like op: the maximal set of pure aten ops (no matmul, attention, write, random op, custom or
collective op) whose inputs are that input, the head's own nodes, or other inputs of the body (the
next layer's norm weight, read from the next call's operands). What the rest reads of the head (its
frontier: the normed rows) becomes inputs of R. After the last call, where the graph computes the
same head again on its result (a model's final norm: the same ops and constants, its own weight), that
head moves into the last body too; else the last call computes one on its own weights that nothing
reads: no second body to compile.

Exact: the same ops on the same values; only the body each runs in changes. A head operand of the
next call must exist before this call (a weight, an input) and nothing between the two calls, this
call included, may write what it reads; the frontier must be fresh tensors. Every call of the body
must be part of such a chain, or the body is left as it is: a rotated and an unrotated body would be
two bodies to compile. Candidate: a body one of whose calls hands a result to the next.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from specpass.graph import (REGION, args_match, copy_nodes, fake_mode, free_attr_name, is_mutation, region_body,
                            region_calls, region_operands, region_written_inputs, set_val, storage, val, written_storages)
from specpass.options import Options
from specpass.report import Finding, node_matmul_flops

NAME = "seams"


def run(gm: fx.GraphModule, options: Options) -> list[Finding]:
    findings = []
    for name, calls in region_calls(gm.graph).items():
        links = {call: _next_call(call, calls) for call in calls}
        if not any(links.values()):
            continue  # no call hands its result to the next: not a candidate
        where = ", ".join(c.name for c in calls)
        plan = _plan(gm, calls, links)
        if isinstance(plan, str):
            findings.append(Finding(NAME, where, False, plan))
            continue
        findings.append(Finding(NAME, where, True, _rewrite(gm, name, calls, links, *plan)))
    return findings


def _next_call(call: fx.Node, calls: list[fx.Node]) -> tuple[fx.Node, dict[int, int]] | None:
    """The call of the same body that reads this call's results as operands, with which operand
    reads which result ({operand index: result index}); None if none or several do."""
    readers = []
    for other in calls:
        carried = {j: a.args[1] for j, a in enumerate(region_operands(other)) if isinstance(a, fx.Node)
                   and a.target is operator.getitem and a.args[0] is call}
        if carried:
            readers.append((other, carried))
    return readers[0] if len(readers) == 1 else None


def _plan(gm: fx.GraphModule, calls: list[fx.Node], links: dict) -> tuple | str:
    """(carried {operand: result}, head nodes, frontier, head operand indices), or why not."""
    body = region_body(calls[0])
    carries = {tuple(sorted(link[1].items())) for link in links.values() if link}
    if len(carries) > 1:
        return f"its calls hand different results on to the next ({sorted(carries)}): no one rotation serves them all"
    carried = dict(carries.pop())
    inputs = list(body.graph.find_nodes(op="placeholder"))
    out = body.graph.output_node().args[0]
    if not isinstance(out, (tuple, list)) or any(u.target is not operator.getitem for c in calls for u in c.users):
        return "the body does not return a tuple read item by item"
    head = _head(body, {inputs[j] for j in carried}, region_written_inputs(body))
    if not head:
        first = next((n for n in inputs[min(carried)].users), None)
        return (f"the body computes nothing fusible from the input the previous call hands it before a matmul-like "
                f"or opaque op ({first.target if first is not None else 'none'})")
    in_head = set(head)
    frontier = [n for n in head if any(u not in in_head for u in n.users)]
    whose = {storage(p) for p in inputs} - {None}
    for n in frontier:
        if not isinstance(val(n), torch.Tensor) or storage(n) in whose or \
                sum(storage(f) == storage(n) for f in frontier) > 1:
            return f"the head's result {n.name} is not a fresh tensor (a view of an input, or not a tensor)"
    head_inputs = sorted({inputs.index(a) for n in head for a in n.all_input_nodes
                          if a.op == "placeholder" and inputs.index(a) not in carried})
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    mutations = [n for n in gm.graph.nodes if is_mutation(n)]
    for call in calls:
        link = links[call]
        if link is None:
            continue
        nxt = link[0]
        operands = [region_operands(nxt)[j] for j in head_inputs]
        late = [a for a in operands if isinstance(a, fx.Node) and order[a] > order[call]]
        if late:
            return (f"{nxt.name}'s head reads {late[0].name}, made after {call.name}: the head cannot move into "
                    f"{call.name}'s body")
        read = {storage(a) for a in operands if isinstance(a, fx.Node)} - {None}
        written = [n for n in mutations if order[call] <= order[n] < order[nxt] and written_storages(n) & read]
        if written:
            return f"{written[0].name} writes what {nxt.name}'s head reads, before {nxt.name}: the head cannot move"
    return carried, head, frontier, head_inputs


def _head(body: fx.GraphModule, carried: set[fx.Node], written: frozenset[int]) -> list[fx.Node]:
    """The body's nodes, in order, computed only from the carried inputs, the head itself and other
    inputs the body does not write, by pure aten ops that are not matmul-like; each reads the carried
    inputs or the head."""
    inputs = list(body.graph.find_nodes(op="placeholder"))
    reach = set(carried)
    head = []
    for n in body.graph.nodes:
        if n.op != "call_function" or not any(a in reach for a in n.all_input_nodes):
            continue
        if all((a in reach) or (a.op == "placeholder" and inputs.index(a) not in written) for a in n.all_input_nodes) \
                and _movable(n):
            reach.add(n)
            head.append(n)
    return head


def _movable(n: fx.Node) -> bool:
    target = n.target
    if target is operator.getitem:
        return isinstance(val(n), torch.Tensor)
    return (isinstance(target, torch._ops.OpOverload) and target.namespace == "aten"
            and not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags
            and node_matmul_flops(n) == 0 and n.target is not torch.ops.aten.scaled_dot_product_attention.default
            and isinstance(val(n), (torch.Tensor, tuple)))


def _rewrite(gm: fx.GraphModule, name: str, calls: list[fx.Node], links: dict, carried: dict[int, int],
             head: list[fx.Node], frontier: list[fx.Node], head_inputs: list[int]) -> str:
    body = region_body(calls[0])
    rotated = _rotated(body, carried, head, frontier, head_inputs)
    new_name = free_attr_name(gm, f"{name}_seams")
    gm.add_submodule(new_name, rotated)
    identifier = f"{calls[0].args[1]}_seams"
    graph = gm.graph
    results = len(body.graph.output_node().args[0])
    starts = [c for c in calls if not any(link and link[0] is c for link in links.values())]
    with graph.inserting_before(calls[0]):
        attr = graph.get_attr(new_name)
    last_heads = 0  # chains whose last call took the head after it
    for start in starts:
        heads = _inline_head(graph, body, start, head, frontier)
        call = start
        while call is not None:
            link = links[call]
            if link:
                operands, after = [region_operands(link[0])[j] for j in head_inputs], []
            else:  # the last: the same head after it (a final norm) in its body, else one on its own weights
                operands, after = _head_after(call, body, carried, head, frontier, head_inputs) or (
                    [region_operands(call)[j] for j in head_inputs], [])
                last_heads += bool(after)
            with graph.inserting_before(call):
                new = graph.call_function(REGION, (attr, identifier, *region_operands(call), *heads, *operands))
            new.meta = {k: v for k, v in call.meta.items() if k != "val"}
            set_val(new)  # (torch's FakeTensorProp leaves a body's first call without one)
            for user in list(call.users):
                user.replace_input_with(call, new)
            with graph.inserting_after(new):
                heads = [graph.call_function(operator.getitem, (new, results + i)) for i in range(len(frontier))]
            for n in heads:
                set_val(n)
            for n, head_value in zip(after, heads):
                n.replace_all_uses_with(head_value)
            graph.erase_node(call)
            call = link[0] if link else None
    for attr in graph.find_nodes(op="get_attr", target=name):
        if not attr.users:
            graph.erase_node(attr)
    shown = ", ".join(n.name for n in head[:4]) + ("..." if len(head) > 4 else "")
    after = f"; the same {shown} after the last call moved into it" if last_heads else ""
    return f"{len(calls)} calls of one body: each also computes the next call's {shown}, fused with its own end{after}"


def _head_after(call: fx.Node, body: fx.GraphModule, carried: dict[int, int], head: list[fx.Node],
                frontier: list[fx.Node], head_inputs: list[int]) -> tuple[list, list[fx.Node]] | None:
    """Where the graph computes the head again on what the last call hands on (a model's final norm:
    the same ops and constants, other weights), (its head operands, its frontier's nodes); else None.
    Its operands must exist before the call, and nothing up to it may write them or the call's result."""
    graph = call.graph
    inputs = list(body.graph.find_nodes(op="placeholder"))
    env: dict[fx.Node, fx.Node] = {}
    for j, k in carried.items():
        items = [u for u in call.users if u.args[1] == k]
        if len(items) != 1:
            return None
        env[inputs[j]] = items[0]
    for n in head:
        anchor = next(a for a in n.all_input_nodes if a in env)
        for candidate in env[anchor].users:
            trial = dict(env)
            if candidate not in env.values() and _same_call(n, candidate, trial, inputs):
                env = {**trial, n: candidate}
                break
        else:
            return None
    operands = [env[inputs[j]] for j in head_inputs]
    order = {n: i for i, n in enumerate(graph.nodes)}
    if any(not isinstance(a, fx.Node) or order[a] > order[call] for a in operands):
        return None
    read = {storage(a) for a in [*operands, *(env[inputs[j]] for j in carried)]} - {None}
    end = max(order[env[n]] for n in head)
    if any(order[call] <= order[n] <= end and is_mutation(n) and written_storages(n) & read for n in graph.nodes):
        return None
    return operands, [env[n] for n in frontier]


def _same_call(n: fx.Node, other: fx.Node, env: dict[fx.Node, fx.Node], inputs: list[fx.Node]) -> bool:
    """`other` computes `n` on the nodes `env` maps `n`'s inputs to; a body input not yet mapped is
    bound to `other`'s argument in its place (extends `env`)."""
    return other.op == "call_function" and other.target == n.target and \
        args_match((n.args, n.kwargs), (other.args, other.kwargs), env, inputs)


def _inline_head(graph: fx.Graph, body: fx.GraphModule, call: fx.Node, head: list[fx.Node],
                 frontier: list[fx.Node]) -> list[fx.Node]:
    """The head of the first call of a chain, copied into the graph before it: its frontier's nodes."""
    env = dict(zip(body.graph.find_nodes(op="placeholder"), region_operands(call)))
    with graph.inserting_before(call):
        copy_nodes(graph, head, env)
    return [env[n] for n in frontier]


def _rotated(body: fx.GraphModule, carried: dict[int, int], head: list[fx.Node], frontier: list[fx.Node],
             head_inputs: list[int]) -> fx.GraphModule:
    """R: the body without its head (the frontier as inputs), then the head on the body's carried
    results and the next call's head operands; returns the body's results, then the head's frontier."""
    graph = fx.Graph()
    inputs = list(body.graph.find_nodes(op="placeholder"))
    env: dict[fx.Node, fx.Node] = {}
    for p in inputs:
        env[p] = graph.placeholder(p.name)
        env[p].meta = dict(p.meta)
    for n in frontier:
        env[n] = graph.placeholder(f"{n.name}_in")
        env[n].meta = dict(n.meta)
    mode = fake_mode(body.graph)
    nxt = {}
    for j in head_inputs:
        p = inputs[j]
        nxt[p] = graph.placeholder(f"next_{p.name}")
        v = val(p)
        if isinstance(v, torch.Tensor):  # its own storage: not an alias of this layer's operand
            with mode:
                v = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
        nxt[p].meta = {**p.meta, "val": v}
    in_head = set(head)
    for n in body.graph.nodes:
        if n.op not in ("placeholder", "output") and n not in in_head:
            env[n] = graph.node_copy(n, env.__getitem__)
    results = fx.node.map_arg(body.graph.output_node().args[0], env.__getitem__)
    head_env = {**nxt, **{inputs[j]: results[k] for j, k in carried.items()}}
    copy_nodes(graph, head, head_env)
    graph.output((*results, *(head_env[n] for n in frontier)))
    return fx.GraphModule(body, graph, class_name=type(body).__name__)

"""Live rows: a row gather at the end of a draft graph moves up to right after the KV write.

IR: the canonical pre-dispatch ATen of `specpass.capture` (static shapes, in-place KV writes in
program order, `meta["val"]` on every node).

A draft's catch-up step computes T rows per request and keeps one: `logits[:, -1]`,
`h[arange(B), live]`, `h.index_select(0, last)`. Every op that is *row-local* along the gathered
axes commutes with the gather, gather(op(x, y)) = op(gather(x), gather(y)), so the gather can
run first and the op on the live rows only.

Design: global liveness, one module per step, by rate of change.
1. gathers.py reads every gather (select, slice, narrow, index, index_select, gather) as a row
   selection on its source — rows.py: `Static`, `PerBatch`, `Flat`.
2. liveness.py, backward: a node whose users all need the same selection and whose op is
   row-local for it (the rules of row_rules/) is pulled; its operands need the
   selection mapped onto their axes (through reshapes: reshape.py).
3. split.py: a fused projection whose column blocks have different needs (K/V on every row, Q
   on the live rows) is cut into one matmul per block, and liveness runs again.
4. emission.py, forward: each pulled node is rewritten in place on gathered operands.
program.py holds the graph under rewrite: program order, in-place writes, index arithmetic.
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict

import torch
import torch.fx as fx

from specpass.graph import SCALAR_READS, inline_region, is_region_call, known, val
from specpass.options import Options
from specpass.passes.live_rows.emission import emit_live_rows
from specpass.passes.live_rows.gathers import Candidate, read_gather
from specpass.passes.live_rows.liveness import FULL, Liveness, analyse
from specpass.passes.live_rows.program import Program
from specpass.passes.live_rows.rows import keeps_less
from specpass.passes.live_rows.split import Split, split_fused
from specpass.passes.op_sets import VIEWS
from specpass.passes.row_rules import Gather, Stop, out_shape_of, shape_of
from specpass.report import Finding, node_matmul_flops

NAME = "live_rows"


def run(gm: fx.GraphModule, options: Options) -> list[Finding]:
    """Move every row gather as far up as it is exact; report what moved and what stayed."""
    work = gm.graph.__deepcopy__()  # left unused (and gm untouched) if nothing fires
    work.owning_module = gm  # where region calls find their bodies
    prog = Program(work)
    candidates: dict[fx.Node, Candidate] = {}
    findings: list[Finding] = []
    for node in list(work.nodes):
        try:
            candidate = read_gather(prog, node)
        except Stop as stop:
            findings.append(Finding(NAME, node.name, False, str(stop)))
            continue
        if candidate is not None and _selects_rows(node, candidate):
            candidates[node] = candidate
    prog.refresh()
    live = analyse(prog, candidates, options)
    while _inline_calls_reached(live):  # the selection reaches a region's output: into its body
        prog.refresh()
        candidates = {node: c for node in candidates if (c := read_gather(prog, node))}  # sources may be inlined
        live = analyse(prog, candidates, options)
    splits = []
    while options.split_projections:
        cut = split_fused(prog, live, candidates, options)
        if not cut:
            break
        splits += cut
        live = analyse(prog, candidates, options)
    before = {n: (node_matmul_flops(n), out_shape_of(n)) for n in live.plans}
    emit_live_rows(prog, live, candidates)
    findings += _findings(live, candidates, before) + [_split_finding(s) for s in splits]
    outputs = [val(a) for a in work.output_node().all_input_nodes]
    if not findings and any(isinstance(v, torch.Tensor) and v.dim() >= 3 for v in outputs):
        findings.append(Finding(NAME, "graph", False, "no row gather at the outputs: the graph returns every "
                                "row. Compile the step that slices (logits[:, -1] inside the compiled function) "
                                "or pass logits_to_keep=1 to Hugging Face models"))
    missing = sorted({n.name for n in candidates} - {name for f in findings for name in f.nodes})
    if missing:
        raise RuntimeError(f"row gathers without a finding: {missing}")
    if live.plans or splits:
        gm.graph = work
        gm.recompile()
    return findings


def _inline_calls_reached(live: Liveness) -> bool:
    """Inline each region call (a repeated layer compiled once) whose outputs are asked for on
    selected rows only: the body is shared by every call, so the selection can move into this
    call's copy alone (the last layer's, up to its KV write). -> whether any was inlined."""
    calls = {n.args[0] if n.target is operator.getitem else n for n, spec in live.asked.items() if spec != FULL}
    return any([inline_region(c) for c in calls if isinstance(c, fx.Node) and is_region_call(c)])


def _selects_rows(gather: fx.Node, candidate: Candidate) -> bool:
    """A row gather worth a verdict: it keeps fewer elements (a permutation saves nothing), on
    some axis other than the feature axis — the last axis of a rank >= 3 tensor ([B, T, H],
    [B, T, heads, d]: RoPE's halves, a vocabulary slice; in [B, T] the last axis may be the
    tokens) — of a value computed in the graph (a weight or a view of one, like one expert of a
    stacked MoE weight, has nothing above it to move past), and read as a tensor (one read into a
    Python number, `counts[e].item()` for a split size, is control data, no row)."""
    if all(user.target in SCALAR_READS for user in gather.users) or known(candidate.spec.rows == 0):
        return False  # (an empty selection, `h[:, :-1]` of one token, has no rows to run on either)
    source = shape_of(candidate.source)
    feature = len(source) - 1 if len(source) >= 3 else None
    root = candidate.source
    while root.op == "call_function" and root.target in VIEWS:
        root = root.args[0]
    return keeps_less((candidate.spec, source)) and any(a != feature for a in candidate.spec.axes) \
        and root.op == "call_function"


def _findings(live: Liveness, candidates: dict[fx.Node, Candidate],
              before: dict[fx.Node, tuple[int, list[int]]]) -> list[Finding]:
    # Pulled nodes linked through gathered operands form one moved gather; outputs that select
    # the same rows share it.
    parent = {n: n for n in live.plans}

    def root(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            n = parent[n]
        return n

    for node, plan in live.plans.items():
        for operand, action in plan.items():
            if operand in parent and isinstance(action, Gather):
                parent[root(operand)] = root(node)
    findings = []
    fired: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node, candidate in candidates.items():
        source = candidate.source
        if live.fired(candidate) and live.need.get(node) == FULL:
            fired[root(source)].append(node)
        elif node not in live.plans:  # a pulled gather is reported with the group it moved in
            findings.append(Finding(NAME, node.name, False, f"{source.name}: {live.why[source]}"))
    for group, gathers in fired.items():
        members = [n for n in live.plans if root(n) is group]
        landed = {}
        for n in members:
            for operand, action in live.plans[n].items():
                if isinstance(action, Gather) and operand not in live.plans:
                    landed.setdefault(operand.name, live.why[operand])
        source, spec = candidates[gathers[0]].source, candidates[gathers[0]].spec
        last = max(spec.axes)
        shape = before[source][1]
        rows = (math.prod(shape[: last + 1]), math.prod(spec.gathered_shape(shape)[: last + 1]))
        flops = (sum(before[n][0] for n in members), sum(node_matmul_flops(n) for n in members))
        computed = sum(1 for n in members if n.target not in VIEWS and n.target is not operator.getitem)
        where = "; ".join(f"{name} ({why})" for name, why in landed.items())
        gathers += [n for n in members if n in candidates and n not in gathers]
        findings.append(Finding(NAME, ", ".join(n.name for n in gathers), True,
                                f"{computed} ops run on the selected rows only; gathered after {where}",
                                rows=rows, matmul_flops=flops))
    return findings


def _split_finding(split: Split) -> Finding:
    blocks = ", ".join(f"{start}:{stop} on {'every row' if need == FULL else 'the selected rows'}"
                       for start, stop, _, need in split.blocks)
    after = sum(node_matmul_flops(block) for _, _, block, _ in split.blocks)
    return Finding(NAME, split.name, True, f"fused projection split by the needs of its columns: {blocks}",
                   matmul_flops=(split.matmul_flops, after))

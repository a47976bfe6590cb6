"""Arg-max: a max / topk / argmax of a softmax only needs the order of the softmax's input.

IR (capture.py): undecomposed pre-dispatch ATen, `meta["val"]` on every node. The pass reads each
softmax / log_softmax (any spelling) and the reductions and gathers over it (matcher.py).

One job per module:
    matcher.py     finds a softmax's max-like consumers, proves the rule's preconditions and
                   plans the rewrite, or says why a consumer is left alone
    plan.py        the plan: an immutable record of every choice a lowering reads
    prologue.py    the casts and the temperature before the softmax, folded into top1_lse's read
    lowering.py    rewrites the plan's consumers, each output by the lowering the plan chose:
      fused.py       the formulation Inductor fuses (m, z, the input's arg-max or topk, the values)
      chunks.py      few long rows cut into chunks: stats and arg-max in two stages
      eager_ties.py  argmax_ties="eager": the first position rounding to the max probability
      one_pass.py    torch.ops.specpass.top1_lse, one pass over each row (CUDA)
    nodes.py       the new nodes, each shared one built once
    messages.py    the words of a rewrite's finding, from its plan
"""

from __future__ import annotations

import torch.fx as fx

from specpass.options import Options
from specpass.passes.argmax.lowering import lower
from specpass.passes.argmax.matcher import is_softmax, match
from specpass.report import Finding

NAME = "argmax"


def run(gm: fx.GraphModule, options: Options) -> list[Finding]:
    """Rewrite the max-like consumers of every softmax where the rule is exact; one finding per consumer."""
    findings: list[Finding] = []
    for sm in list(gm.graph.nodes):
        if is_softmax(sm):
            findings += _rewrite(gm.graph, sm, options)
    return findings


def _rewrite(graph: fx.Graph, sm: fx.Node, options: Options) -> list[Finding]:
    matched = match(sm, options)
    said = {node: (False, why) for node, why in matched.refused.items()}
    if matched.plan is not None:
        said |= {node: (True, message) for node, message in lower(matched.plan, graph).items()}
    return [Finding(NAME, f"{sm.name} -> {c.name}", *said[c]) for c in matched.candidates]

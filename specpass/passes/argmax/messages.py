"""The words of a rewritten consumer's finding, from its plan (tests pin them)."""

from __future__ import annotations

from specpass.graph import op_name
from specpass.passes.argmax.plan import Gather, Plan, Reduction


def message(plan: Plan, consumer: Reduction | Gather, s_in: str | None) -> str:
    """What the rewrite of `consumer` computes. `s_in`: the name of the tensor the softmax reduced,
    as the rewrite reads it (None where the rewrite built no cast of it and names none)."""
    kind = "log_softmax" if plan.is_log else "softmax"
    if isinstance(consumer, Gather):
        if consumer.by == "own_index":
            return f"{kind} -> gather along dim {plan.dim} at its own arg-max: values = top1_lse value (one pass)"
        formula = "s[ids] - logsumexp(s)" if plan.is_log else "exp(s[ids] - logsumexp(s))"
        return f"{kind} -> gather along dim {plan.dim}: values = {formula}" + (
            " (one pass: top1_lse)" if consumer.by == "one_pass" else "")
    what = []
    if consumer.indices_by == "topk":
        what.append(f"indices = topk({s_in}, {consumer.k})")
    elif consumer.indices_by == "one_pass":
        what.append(f"indices = top1_lse({_one_pass_reads(plan, s_in)}) index (one pass)")
    elif consumer.indices_by is not None:
        how = ("first index rounding to the max probability" if consumer.indices_by == "eager"
               else f"argmax({s_in}), 0 where the max is not finite")
        if plan.cuts(consumer.dims):
            how += f", over {plan.chunks} chunks of {plan.chunk}"
        what.append(f"indices = {how}")
    if consumer.values_by == "ones":
        what.append("values = ones (max_probs='ones')")
    elif consumer.values_by == "one_pass":
        what.append("values = " + ("top - lse" if plan.is_log else "exp(top - lse)") + " (one pass)"
                    + ("" if consumer.indices else f" of top1_lse({_one_pass_reads(plan, s_in)})"))
    elif consumer.values_by == "formula":
        what.append("values = " + ("top - max - log(sum(exp(s - max)))" if plan.is_log
                                   else "exp(top - max) / sum(exp(s - max))"))
    return f"{kind} -> {op_name(consumer.node.target)} along dim {plan.dim}: " + ("; ".join(what) or "outputs unused")


def _one_pass_reads(plan: Plan, s_in: str | None) -> str:
    """What the one-pass op reads."""
    if plan.prologue is None:
        return f"{s_in}" + (f" (prologue not folded: {plan.unfolded})" if plan.unfolded else "")
    return f"{plan.prologue.logits.name}, folding {plan.prologue.spelled}"

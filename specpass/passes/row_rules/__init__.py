"""Row rules: how each op's output rows relate to its operands' rows (read by the live-row pass).

An op is *row-local* for a selection when gathering its output equals running it on gathered
operands. A rule says, for one node and one selection of its output, which operand axes carry
each output axis (`Rule`: for every output axis, the operand's axis — in the operand's frame
aligned to the output's rank, for broadcasting ops — or None where the operand has no such axis,
a weight's rows, K/V's query axis), or raises `Stop(reason)`. Supporting a new op is one rule in
the module of its family:

    @rule(aten.my_op.default)
    def _my_op(node, spec, options):
        return Rule([same_axes(node.args[0], rank(node))])   # or raise Stop("why not")

Most ops need no rule of their own; they are classified from torch's own metadata, in this order:
1. a registered rule (`@rule`): the ops whose axis mapping is structural — linear/matmul/einsum,
   embedding, index/gather/scatter, attention, cat/stack, norms, softmax, topk/sort, scans,
   collectives — and the custom ops an engine declares with `register_row_rule`;
2. `torch.Tag.reduction` with the schema's `dim` / `keepdim` (sum, std, nansum, aminmax, ...);
3. `torch.Tag.pointwise` (broadcasting elementwise ops);
4. an op with a decomposition (CompositeImplicitAutograd, or torch._decomp's table — dropout,
   type_as, nanmean, glu, ...): traced on the node's fake values and analysed op by op; the
   original op is kept, run on the gathered operands.
Anything else is assumed to mix rows. Ops that draw random numbers never move (on fewer rows
they would draw different ones).

One job per module:
    engine.py       the registry, the lookup (rules, tags, decompositions), an operand's plan
    layout.py       casts and copies, `*_like`, expand, permute, transpose, select, cat, stack
    along_axis.py   softmax, scans, topk / sort, flip, split / slice / index_select, norms
    products.py     linear, matmul and its batched and bias-adding forms, einsum
    indexing.py     embedding, advanced indexing, gather, scatter
    attention.py    scaled_dot_product_attention (the Q-slice)
    collectives.py  the functional collectives of a tensor-parallel step
    custom_ops.py   `register_row_rule`, for an engine's own ops
Importing the package registers every rule.
"""

# imported for their @rule registrations
from specpass.passes.row_rules import along_axis, attention, collectives, indexing, layout, products  # noqa: F401
from specpass.passes.row_rules.custom_ops import register_row_rule
from specpass.passes.row_rules.engine import (Gather, Keep, Operand, Rule, Selection, Stop, out_shape_of, plan_operands,
                                              rank, rule, rule_for, same_axes, shape_of)

__all__ = ["Gather", "Keep", "Operand", "Rule", "Selection", "Stop", "out_shape_of", "plan_operands", "rank",
           "register_row_rule", "rule", "rule_for", "same_axes", "shape_of"]

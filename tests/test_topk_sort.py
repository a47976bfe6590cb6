"""The topk-as-sort pass: a topk over a short static row becomes a stable sort and a slice on CUDA
graphs (Inductor lowers that sort to one Triton kernel). On CPU the graphs are traced with fake
CUDA tensors (the pass reads only fake tensors) and the rewritten graphs then run on real CPU
tensors against torch.topk; the refusals, each with its reason."""

import expecttest
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import specpass
from specpass.loop.tree_math import expand
from specpass.testing import graph_str


def traced(fn, *shapes, device="cuda", dtype=torch.bfloat16, **options):
    """fn's IR (make_fx, as specpass.capture traces it) on fake tensors of these shapes, rewritten."""
    mode = FakeTensorMode()
    with mode:
        args = [torch.empty(shape, device=device, dtype=dtype) for shape in shapes]
        gm = make_fx(fn, pre_dispatch=True)(*args)
    return specpass.rewrite(gm, **options)


def verdicts(result):
    return "\n".join(str(f) for f in result.report.of("topk_sort"))


class TestGraphs(expecttest.TestCase):
    def test_tree_draft_step(self):
        """The tree draft's `expand` (log_softmax -> topk) over a 258-token vocabulary: the arg-max
        pass makes it a top-k of the logits plus a log-sum-exp, this pass that top-k a sort."""
        result = traced(lambda logits: expand(logits, 4), (8, 258))
        self.assertExpectedInline(graph_str(result.graph_module), """\
logits_1: bf16[8, 258]
to: f32[8, 258] = to.dtype(logits_1, f32)
amax_default: f32[8, 1] = amax(to, [1], True)
sub_tensor: f32[8, 258] = sub.Tensor(to, amax_default)
exp_default: f32[8, 258] = exp(sub_tensor)
sum_dim_int_list: f32[8, 1] = sum.dim_IntList(exp_default, [1], True)
lt_scalar: b8[8, 1] = lt.Scalar(amax_default, inf)
where_scalar_other: f32[8, 258] = where.ScalarOther(lt_scalar, to, nan)
sort_stable: (f32[8, 258], i64[8, 258]) = sort.stable(where_scalar_other, stable=True, dim=1, descending=True)
getitem: f32[8, 258] = getitem(sort_stable, 0)
slice_tensor: f32[8, 4] = slice.Tensor(getitem, 1, 0, 4)
getitem_4: i64[8, 258] = getitem(sort_stable, 1)
slice_tensor_1: i64[8, 4] = slice.Tensor(getitem_4, 1, 0, 4)
sub_tensor_1: f32[8, 4] = sub.Tensor(slice_tensor, amax_default)
log_default: f32[8, 1] = log(sum_dim_int_list)
sub_tensor_2: f32[8, 4] = sub.Tensor(sub_tensor_1, log_default)
clone_default: i64[8, 4] = clone(slice_tensor_1, memory_format=torch.contiguous_format)
return (sub_tensor_2, clone_default)""")
        self.assertExpectedInline(verdicts(result), """[topk_sort] rewrote topk_default: topk(4) of rows of 258 runs as a stable sort and a slice (one Triton kernel under Inductor instead of ATen's select and sort)""")
        assert [f.fired for f in result.report.of("argmax")] == [True]

    def test_re_rank_of_candidates(self):
        """The frontier's re-rank: the best 4 of 16 cumulative scores, and a smallest-k on dim 0."""
        def fn(scores):
            return scores.topk(4, -1), torch.topk(scores, 2, dim=0, largest=False, sorted=False)

        result = traced(fn, (3, 16), dtype=torch.float32)
        self.assertExpectedInline(graph_str(result.graph_module), """\
scores_1: f32[3, 16]
sort_stable: (f32[3, 16], i64[3, 16]) = sort.stable(scores_1, stable=True, dim=1, descending=True)
getitem_4: f32[3, 16] = getitem(sort_stable, 0)
slice_tensor: f32[3, 4] = slice.Tensor(getitem_4, 1, 0, 4)
getitem_5: i64[3, 16] = getitem(sort_stable, 1)
slice_tensor_1: i64[3, 4] = slice.Tensor(getitem_5, 1, 0, 4)
sort_stable_1: (f32[3, 16], i64[3, 16]) = sort.stable(scores_1, stable=True, dim=0, descending=False)
getitem_6: f32[3, 16] = getitem(sort_stable_1, 0)
slice_tensor_2: f32[2, 16] = slice.Tensor(getitem_6, 0, 0, 2)
getitem_7: i64[3, 16] = getitem(sort_stable_1, 1)
slice_tensor_3: i64[2, 16] = slice.Tensor(getitem_7, 0, 0, 2)
clone_default: f32[3, 4] = clone(slice_tensor, memory_format=torch.contiguous_format)
clone_default_1: i64[3, 4] = clone(slice_tensor_1, memory_format=torch.contiguous_format)
return ((clone_default, clone_default_1), (slice_tensor_2, slice_tensor_3))""")
        assert [f.fired for f in result.report.of("topk_sort")] == [True, True]


def test_rewritten_graph_equals_topk():
    """The rewritten graph run on real tensors: the values and indices torch.topk gives (no ties),
    over a row of 512, largest and smallest, dim 0 and -1; and on ties, the first index."""
    def fn(x):
        return x.topk(5, -1), x.topk(3, 0, largest=False), x.topk(1, -1, sorted=False)

    result = traced(fn, (6, 512), dtype=torch.float32)
    assert [f.fired for f in result.report.of("topk_sort")] == [True] * 3, verdicts(result)
    assert not result.graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.topk.default)
    gen = torch.Generator().manual_seed(0)
    x = torch.randperm(6 * 512, generator=gen).float().view(6, 512)  # distinct values
    for got, want in zip(result.graph_module(x), fn(x)):
        torch.testing.assert_close(got[0], want.values, rtol=0, atol=0)
        assert torch.equal(got[1], want.indices)
        assert [t.stride() for t in got] == [t.stride() for t in want]  # topk's layout: a next step compiled for it
    ties = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, float("nan")]]).expand(6, 6).contiguous()
    values, indices = traced(lambda x: x.topk(3, -1), (6, 6), dtype=torch.float32).graph_module(ties)
    assert indices.tolist() == [[5, 1, 2]] * 6  # NaN the largest, as topk; then equal values by index
    torch.testing.assert_close(values, ties.topk(3, -1).values, rtol=0, atol=0, equal_nan=True)  # (CPU topk: 5, 1, 4)


@pytest.mark.parametrize("case", ["long_row", "written", "cpu"])
def test_left_alone(case):
    if case == "long_row":  # a 32000-token vocabulary: Inductor would sort it with ATen's sort
        result = traced(lambda x: x.topk(4, -1), (2, 32000))
        assert verdicts(result) == ("[topk_sort] left alone topk: a row of 32000 > 512: Inductor sorts longer "
                                    "rows with ATen's sort, slower than topk's select")
    elif case == "written":
        def fn(x):
            values, _ = x.topk(2, -1)
            view = values.narrow(1, 0, 1)
            view.mul_(2)  # a write through a view: the topk's output stays the buffer written
            return values, view

        result = traced(fn, (2, 16), dtype=torch.float32)
        assert "an output is written in place" in verdicts(result)
    else:
        result = traced(lambda x: x.topk(4, -1), (2, 16), device="cpu")
        assert result.report.of("topk_sort") == []
    assert len(result.graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.topk.default)) == 1


def test_option_off():
    result = traced(lambda x: x.topk(4, -1), (2, 16), topk_sort=False)
    assert result.report.of("topk_sort") == []
    assert result.graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.topk.default)

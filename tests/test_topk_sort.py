"""The topk-as-sort pass: a topk over a short static row becomes a stable sort and a slice on CUDA
graphs (Inductor lowers that sort to one Triton kernel). On CPU the graphs are traced with fake
CUDA tensors (the pass reads only fake tensors) and the rewritten graphs then run on real CPU
tensors against torch.topk; the refusals, each with its reason."""

import expecttest
import pytest
import torch

import specpass
from specpass.loop.tree_math import expand
from specpass.testing import fake_ir, graph_str


def traced(fn, *shapes, device="cuda", dtype=torch.bfloat16, dtypes=(), **options):
    """fn's IR on fake tensors of these shapes (CUDA by default), rewritten."""
    return specpass.rewrite(fake_ir(fn, *shapes, device=device, dtype=dtype, dtypes=dtypes), **options)


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
eq_scalar: b8[8, 258] = eq.Scalar(where_scalar_other, 0)
where_scalar_self: f32[8, 258] = where.ScalarSelf(eq_scalar, 0.0, where_scalar_other)
view_dtype: i32[8, 258] = view.dtype(where_scalar_self, i32)
bitwise_xor_scalar: i32[8, 258] = bitwise_xor.Scalar(view_dtype, 2147483647)
lt_scalar_1: b8[8, 258] = lt.Scalar(view_dtype, 0)
where_self: i32[8, 258] = where.self(lt_scalar_1, bitwise_xor_scalar, view_dtype)
isnan_default: b8[8, 258] = isnan(where_scalar_self)
where_scalar_self_1: i32[8, 258] = where.ScalarSelf(isnan_default, 2147483647, where_self)
arange_start: i64[258] = arange.start(0, 258, dtype=i64, device=cuda)
view_default: i64[1, 258] = view(arange_start, [1, 258])
rsub_scalar: i64[1, 258] = rsub.Scalar(view_default, 257)
_to_copy_default: i64[8, 258] = _to_copy(where_scalar_self_1, dtype=i64)
mul_tensor: i64[8, 258] = mul.Tensor(_to_copy_default, 4294967296)
add_tensor: i64[8, 258] = add.Tensor(mul_tensor, rsub_scalar)
amax_default_1: i64[8, 1] = amax(add_tensor, [1], True)
lt_tensor: b8[8, 258] = lt.Tensor(add_tensor, amax_default_1)
where_scalar_other_1: i64[8, 258] = where.ScalarOther(lt_tensor, add_tensor, -9223372036854775808)
amax_default_2: i64[8, 1] = amax(where_scalar_other_1, [1], True)
lt_tensor_1: b8[8, 258] = lt.Tensor(add_tensor, amax_default_2)
where_scalar_other_2: i64[8, 258] = where.ScalarOther(lt_tensor_1, add_tensor, -9223372036854775808)
amax_default_3: i64[8, 1] = amax(where_scalar_other_2, [1], True)
lt_tensor_2: b8[8, 258] = lt.Tensor(add_tensor, amax_default_3)
where_scalar_other_3: i64[8, 258] = where.ScalarOther(lt_tensor_2, add_tensor, -9223372036854775808)
amax_default_4: i64[8, 1] = amax(where_scalar_other_3, [1], True)
cat_default: i64[8, 4] = cat([amax_default_1, amax_default_2, amax_default_3, amax_default_4], 1)
bitwise_and_scalar: i64[8, 4] = bitwise_and.Scalar(cat_default, 4294967295)
rsub_scalar_1: i64[8, 4] = rsub.Scalar(bitwise_and_scalar, 257)
gather_default: f32[8, 4] = gather(where_scalar_other, 1, rsub_scalar_1)
sub_tensor_1: f32[8, 4] = sub.Tensor(gather_default, amax_default)
log_default: f32[8, 1] = log(sum_dim_int_list)
sub_tensor_2: f32[8, 4] = sub.Tensor(sub_tensor_1, log_default)
return (sub_tensor_2, rsub_scalar_1)""")
        self.assertExpectedInline(verdicts(result), """[topk_sort] rewrote topk_default: topk(4) of rows of 258 runs as 4 rounds of selection (one Triton kernel under Inductor instead of ATen's select and sort)""")
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


class TestSortForm(expecttest.TestCase):
    def test_sorts_past_selection(self):
        """Rows the selection would take but for k past SELECT_MAX_K, or an integer row (no float
        key), or a row of 256 (the sort measured faster): a stable sort and a slice."""
        def fn(scores, ids, short):
            return scores.topk(10, -1), ids.topk(2, -1), short.topk(4, -1)

        result = traced(fn, (3, 300), (3, 300), (3, 256), dtype=torch.float32, dtypes=(None, torch.int64))
        self.assertExpectedInline(graph_str(result.graph_module), """\
scores_1: f32[3, 300]
ids_1: i64[3, 300]
short_1: f32[3, 256]
sort_stable: (f32[3, 300], i64[3, 300]) = sort.stable(scores_1, stable=True, dim=1, descending=True)
getitem_6: f32[3, 300] = getitem(sort_stable, 0)
slice_tensor: f32[3, 10] = slice.Tensor(getitem_6, 1, 0, 10)
getitem_7: i64[3, 300] = getitem(sort_stable, 1)
slice_tensor_1: i64[3, 10] = slice.Tensor(getitem_7, 1, 0, 10)
sort_stable_1: (i64[3, 300], i64[3, 300]) = sort.stable(ids_1, stable=True, dim=1, descending=True)
getitem_8: i64[3, 300] = getitem(sort_stable_1, 0)
slice_tensor_2: i64[3, 2] = slice.Tensor(getitem_8, 1, 0, 2)
getitem_9: i64[3, 300] = getitem(sort_stable_1, 1)
slice_tensor_3: i64[3, 2] = slice.Tensor(getitem_9, 1, 0, 2)
sort_stable_2: (f32[3, 256], i64[3, 256]) = sort.stable(short_1, stable=True, dim=1, descending=True)
getitem_10: f32[3, 256] = getitem(sort_stable_2, 0)
slice_tensor_4: f32[3, 4] = slice.Tensor(getitem_10, 1, 0, 4)
getitem_11: i64[3, 256] = getitem(sort_stable_2, 1)
slice_tensor_5: i64[3, 4] = slice.Tensor(getitem_11, 1, 0, 4)
clone_default: f32[3, 10] = clone(slice_tensor, memory_format=torch.contiguous_format)
clone_default_1: i64[3, 10] = clone(slice_tensor_1, memory_format=torch.contiguous_format)
clone_default_2: i64[3, 2] = clone(slice_tensor_2, memory_format=torch.contiguous_format)
clone_default_3: i64[3, 2] = clone(slice_tensor_3, memory_format=torch.contiguous_format)
clone_default_4: f32[3, 4] = clone(slice_tensor_4, memory_format=torch.contiguous_format)
clone_default_5: i64[3, 4] = clone(slice_tensor_5, memory_format=torch.contiguous_format)
return ((clone_default, clone_default_1), (clone_default_2, clone_default_3), (clone_default_4, clone_default_5))""")
        self.assertExpectedInline(verdicts(result), """\
[topk_sort] rewrote topk: topk(10) of rows of 300 runs as a stable sort and a slice (one Triton kernel under Inductor instead of ATen's select and sort)
[topk_sort] rewrote topk_1: topk(2) of rows of 300 runs as a stable sort and a slice (one Triton kernel under Inductor instead of ATen's select and sort)
[topk_sort] rewrote topk_2: topk(4) of rows of 256 runs as a stable sort and a slice (one Triton kernel under Inductor instead of ATen's select and sort)""")


def on_cpu(gm):
    """The rewritten CUDA graph with its device constants (the selection's index) moved to the CPU."""
    for node in gm.graph.nodes:
        if isinstance(node.kwargs.get("device"), torch.device):
            node.kwargs = {**node.kwargs, "device": torch.device("cpu")}
    gm.recompile()
    return gm


def test_rewritten_graph_equals_topk():
    """The rewritten graph run on real tensors: the values and indices torch.topk gives (no ties),
    over a row of 512, largest and smallest, dim 0 and -1, each form; on ties, the first index."""
    def fn(x):
        return x.topk(5, -1), x.topk(3, 0, largest=False), x.topk(1, -1, sorted=False), x.topk(12, -1)

    result = traced(fn, (6, 512), dtype=torch.float32)
    assert [f.message.split(" runs as ")[1].split(" (")[0] for f in result.report.of("topk_sort")] == \
        ["5 rounds of selection", "a stable sort and a slice", "1 rounds of selection", "a stable sort and a slice"]
    assert not result.graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.topk.default)
    gen = torch.Generator().manual_seed(0)
    x = torch.randperm(6 * 512, generator=gen).float().view(6, 512)  # distinct values
    for got, want in zip(on_cpu(result.graph_module)(x), fn(x)):
        torch.testing.assert_close(got[0], want.values, rtol=0, atol=0)
        assert torch.equal(got[1], want.indices)
        assert [t.stride() for t in got] == [t.stride() for t in want]  # topk's layout: a next step compiled for it
    ties = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, float("nan")]]).expand(6, 6).contiguous()
    values, indices = on_cpu(traced(lambda x: x.topk(3, -1), (6, 6), dtype=torch.float32).graph_module)(ties)
    assert indices.tolist() == [[5, 1, 2]] * 6  # NaN the largest, as topk; then equal values by index
    torch.testing.assert_close(values, ties.topk(3, -1).values, rtol=0, atol=0, equal_nan=True)  # (CPU topk: 5, 1, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("largest", [True, False])
def test_selection_equals_stable_sort(dtype, largest):
    """Rows full of ties, NaNs, infinities and both zeros: every k of either form takes the first k
    of the stable sort (the order topk's values have, equal values by index), along either dim."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(-3, 4, (9, 300), generator=gen).to(dtype)  # few distinct values: ties everywhere
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 65504.0, -1e-8], dtype=dtype)
    where = torch.rand(9, 300, generator=gen) < 0.3
    x[where] = specials[torch.randint(0, len(specials), (int(where.sum()),), generator=gen)]
    x[0] = -float("inf")  # a row with no finite value
    x[1, :] = float("nan")
    for dim, x in ((1, x), (0, x.t().contiguous())):  # rows of 300: the selection up to k 8, then the sort
        for k in (1, 2, 8, 9):
            result = traced(lambda t: t.topk(k, dim, largest=largest), tuple(x.shape), dtype=dtype)
            [finding] = result.report.of("topk_sort")
            assert finding.fired and ("rounds of selection" in finding.message) == (k <= 8), finding
            values, indices = on_cpu(result.graph_module)(x)
            want = torch.sort(x, dim=dim, descending=largest, stable=True)
            assert torch.equal(indices, want.indices.narrow(dim, 0, k)), (dim, k)
            want_values = want.values.narrow(dim, 0, k)
            assert torch.equal(values.isnan(), want_values.isnan()), (dim, k)
            bits = torch.int32 if dtype == torch.float32 else torch.int16  # the same elements: -0.0 where it was
            assert torch.equal(values.nan_to_num(0).view(bits), want_values.nan_to_num(0).contiguous().view(bits)), (dim, k)


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

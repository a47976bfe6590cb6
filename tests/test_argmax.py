"""The arg-max pass: graph diffs for each form, refusals, numerics against eager, ties, a greedy loop."""

import warnings

import expecttest
import pytest
import torch
import torch.nn.functional as F

import specpass
from models.toy import ToyDraft
from specpass.loop import tree_math
from specpass.passes import argmax as argmax_pass
from specpass.passes.argmax import chunks as argmax_chunks
from specpass.passes.argmax import matcher as argmax_matcher
from specpass.passes.argmax import one_pass as argmax_one_pass
from specpass.testing import graph_str


def rewrite(fn, *args, **options):
    """(captured graph, RewriteResult) with only the arg-max pass."""
    gm = specpass.capture(fn, *args)
    return gm, specpass.rewrite(gm, live_rows=False, **options)


def findings(result):
    return [str(f) for f in result.report.of("argmax")]


X = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
W = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))  # >= 64 values: topk(1) keeps the first of ties


class TestForms(expecttest.TestCase):
    def test_max_of_softmax_with_temperature(self):
        gm, result = rewrite(lambda x: torch.max(torch.softmax(x / 0.7, -1), -1), X)
        self.assertExpectedInline(graph_str(gm), """\
x: f32[3, 50]
div: f32[3, 50] = div.Tensor(x, 0.7)
softmax: f32[3, 50] = softmax.int(div, -1)
max_1: (f32[3], i64[3]) = max.dim(softmax, -1)
getitem: f32[3] = getitem(max_1, 0)
getitem_1: i64[3] = getitem(max_1, 1)
return (getitem, getitem_1)""")
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[3, 50]
div: f32[3, 50] = div.Tensor(x, 0.7)
argmax_default: i64[3, 1] = argmax(div, 1, True)
amax_default: f32[3, 1] = amax(div, [1], True)
sub_tensor: f32[3, 50] = sub.Tensor(div, amax_default)
exp_default: f32[3, 50] = exp(sub_tensor)
sum_dim_int_list: f32[3, 1] = sum.dim_IntList(exp_default, [1], True)
lt_scalar: b8[3, 1] = lt.Scalar(amax_default, inf)
where_scalar_other: i64[3, 1] = where.ScalarOther(lt_scalar, argmax_default, 0)
squeeze_dims: i64[3] = squeeze.dims(where_scalar_other, [1])
squeeze_dims_1: f32[3] = squeeze.dims(amax_default, [1])
squeeze_dims_2: f32[3] = squeeze.dims(sum_dim_int_list, [1])
sub_tensor_1: f32[3] = sub.Tensor(squeeze_dims_1, squeeze_dims_1)
exp_default_1: f32[3] = exp(sub_tensor_1)
reciprocal_default: f32[3] = reciprocal(squeeze_dims_2)
mul_tensor: f32[3] = mul.Tensor(exp_default_1, reciprocal_default)
return (mul_tensor, squeeze_dims)""")
        self.assertExpectedInline("\n".join(findings(result)), """[argmax] rewrote softmax -> max_1: softmax -> max along dim 1: indices = argmax(div), 0 where the max is not finite; values = exp(top - max) / sum(exp(s - max))""")

    def test_topk1_of_upcast_bf16(self):
        _, result = rewrite(lambda x: F.softmax(x.float(), dim=-1).topk(1), W.bfloat16())
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: bf16[3, 128]
to: f32[3, 128] = to.dtype(x, f32)
argmax_default: i64[3, 1] = argmax(to, 1, True)
amax_default: f32[3, 1] = amax(to, [1], True)
sub_tensor: f32[3, 128] = sub.Tensor(to, amax_default)
exp_default: f32[3, 128] = exp(sub_tensor)
sum_dim_int_list: f32[3, 1] = sum.dim_IntList(exp_default, [1], True)
lt_scalar: b8[3, 1] = lt.Scalar(amax_default, inf)
where_scalar_other: i64[3, 1] = where.ScalarOther(lt_scalar, argmax_default, 0)
sub_tensor_1: f32[3, 1] = sub.Tensor(amax_default, amax_default)
exp_default_1: f32[3, 1] = exp(sub_tensor_1)
reciprocal_default: f32[3, 1] = reciprocal(sum_dim_int_list)
mul_tensor: f32[3, 1] = mul.Tensor(exp_default_1, reciprocal_default)
return (mul_tensor, where_scalar_other)""")

    def test_argmax_of_log_softmax_needs_no_logsumexp(self):
        _, result = rewrite(lambda x: x.log_softmax(-1).argmax(-1), X)
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[3, 50]
argmax_default: i64[3, 1] = argmax(x, 1, True)
gather_default: f32[3, 1] = gather(x, 1, argmax_default)
lt_scalar: b8[3, 1] = lt.Scalar(gather_default, inf)
where_scalar_other: i64[3, 1] = where.ScalarOther(lt_scalar, argmax_default, 0)
squeeze_dims: i64[3] = squeeze.dims(where_scalar_other, [1])
return (squeeze_dims,)""")

    def test_indices_only_max_needs_no_logsumexp(self):
        _, result = rewrite(lambda x: torch.softmax(x * 2.0, 1).max(-1).indices, X)
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[3, 50]
mul: f32[3, 50] = mul.Tensor(x, 2.0)
argmax_default: i64[3, 1] = argmax(mul, 1, True)
gather_default: f32[3, 1] = gather(mul, 1, argmax_default)
lt_scalar: b8[3, 1] = lt.Scalar(gather_default, inf)
where_scalar_other: i64[3, 1] = where.ScalarOther(lt_scalar, argmax_default, 0)
squeeze_dims: i64[3] = squeeze.dims(where_scalar_other, [1])
return (squeeze_dims,)""")

    def test_topk4(self):
        _, result = rewrite(lambda x: torch.softmax(x, -1).topk(4), X)
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[3, 50]
amax_default: f32[3, 1] = amax(x, [1], True)
sub_tensor: f32[3, 50] = sub.Tensor(x, amax_default)
exp_default: f32[3, 50] = exp(sub_tensor)
sum_dim_int_list: f32[3, 1] = sum.dim_IntList(exp_default, [1], True)
lt_scalar: b8[3, 1] = lt.Scalar(amax_default, inf)
where_scalar_other: f32[3, 50] = where.ScalarOther(lt_scalar, x, nan)
topk_default: (f32[3, 4], i64[3, 4]) = topk(where_scalar_other, 4, 1, True, True)
getitem_2: i64[3, 4] = getitem(topk_default, 1)
getitem_3: f32[3, 4] = getitem(topk_default, 0)
sub_tensor_1: f32[3, 4] = sub.Tensor(getitem_3, amax_default)
exp_default_1: f32[3, 4] = exp(sub_tensor_1)
reciprocal_default: f32[3, 1] = reciprocal(sum_dim_int_list)
mul_tensor: f32[3, 4] = mul.Tensor(exp_default_1, reciprocal_default)
return (mul_tensor, getitem_2)""")

    def test_log_softmax_topk_values(self):
        _, result = rewrite(lambda x: torch.log_softmax(x, 1).topk(2, sorted=False), X)
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[3, 50]
amax_default: f32[3, 1] = amax(x, [1], True)
sub_tensor: f32[3, 50] = sub.Tensor(x, amax_default)
exp_default: f32[3, 50] = exp(sub_tensor)
sum_dim_int_list: f32[3, 1] = sum.dim_IntList(exp_default, [1], True)
lt_scalar: b8[3, 1] = lt.Scalar(amax_default, inf)
where_scalar_other: f32[3, 50] = where.ScalarOther(lt_scalar, x, nan)
topk_default: (f32[3, 2], i64[3, 2]) = topk(where_scalar_other, 2, 1, True, False)
getitem_2: i64[3, 2] = getitem(topk_default, 1)
getitem_3: f32[3, 2] = getitem(topk_default, 0)
sub_tensor_1: f32[3, 2] = sub.Tensor(getitem_3, amax_default)
log_default: f32[3, 1] = log(sum_dim_int_list)
sub_tensor_2: f32[3, 2] = sub.Tensor(sub_tensor_1, log_default)
return (sub_tensor_2, getitem_2)""")

    def test_softmax_with_a_second_consumer_stays_for_it(self):
        def fn(x):
            probs = torch.softmax(x, -1)
            return probs, probs.argmax(-1)

        _, result = rewrite(fn, X)
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[3, 50]
softmax: f32[3, 50] = softmax.int(x, -1)
argmax_default: i64[3, 1] = argmax(x, 1, True)
gather_default: f32[3, 1] = gather(x, 1, argmax_default)
lt_scalar: b8[3, 1] = lt.Scalar(gather_default, inf)
where_scalar_other: i64[3, 1] = where.ScalarOther(lt_scalar, argmax_default, 0)
squeeze_dims: i64[3] = squeeze.dims(where_scalar_other, [1])
return (softmax, squeeze_dims)""")

    def test_half_softmax_values_in_the_dtype_it_produced(self):
        # softmax of f16 computes in f32 and rounds to f16 once; so does the rewrite
        _, result = rewrite(lambda x: torch.softmax(x.half(), -1).max(-1, keepdim=True), X)
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[3, 50]
to: f16[3, 50] = to.dtype(x, f16)
argmax_default: i64[3, 1] = argmax(to, 1, True)
to_dtype: f32[3, 50] = to.dtype(to, f32)
amax_default: f32[3, 1] = amax(to_dtype, [1], True)
sub_tensor: f32[3, 50] = sub.Tensor(to_dtype, amax_default)
exp_default: f32[3, 50] = exp(sub_tensor)
sum_dim_int_list: f32[3, 1] = sum.dim_IntList(exp_default, [1], True)
lt_scalar: b8[3, 1] = lt.Scalar(amax_default, inf)
where_scalar_other: i64[3, 1] = where.ScalarOther(lt_scalar, argmax_default, 0)
sub_tensor_1: f32[3, 1] = sub.Tensor(amax_default, amax_default)
exp_default_1: f32[3, 1] = exp(sub_tensor_1)
reciprocal_default: f32[3, 1] = reciprocal(sum_dim_int_list)
mul_tensor: f32[3, 1] = mul.Tensor(exp_default_1, reciprocal_default)
to_dtype_1: f16[3, 1] = to.dtype(mul_tensor, f16)
return (to_dtype_1, where_scalar_other)""")

    def test_dtype_argument_and_casts_after_the_softmax(self):
        # indices from the tensor softmax reduced (x cast to f64); values rounded through bf16 as the original
        _, result = rewrite(lambda x: torch.softmax(x, 1, dtype=torch.float64).to(torch.bfloat16).float().amax(-1), X)
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[3, 50]
to_dtype: f64[3, 50] = to.dtype(x, f64)
amax_default: f64[3, 1] = amax(to_dtype, [1], True)
sub_tensor: f64[3, 50] = sub.Tensor(to_dtype, amax_default)
exp_default: f64[3, 50] = exp(sub_tensor)
sum_dim_int_list: f64[3, 1] = sum.dim_IntList(exp_default, [1], True)
squeeze_dims: f64[3] = squeeze.dims(amax_default, [1])
squeeze_dims_1: f64[3] = squeeze.dims(sum_dim_int_list, [1])
sub_tensor_1: f64[3] = sub.Tensor(squeeze_dims, squeeze_dims)
exp_default_1: f64[3] = exp(sub_tensor_1)
reciprocal_default: f64[3] = reciprocal(squeeze_dims_1)
mul_tensor: f64[3] = mul.Tensor(exp_default_1, reciprocal_default)
to_dtype_1: bf16[3] = to.dtype(mul_tensor, bf16)
to_dtype_2: f32[3] = to.dtype(to_dtype_1, f32)
return (to_dtype_2,)""")

    def test_max_probs_ones(self):
        _, result = rewrite(lambda x: torch.softmax(x, -1).topk(1), W, max_probs="ones")
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[3, 128]
argmax_default: i64[3, 1] = argmax(x, 1, True)
gather_default: f32[3, 1] = gather(x, 1, argmax_default)
lt_scalar: b8[3, 1] = lt.Scalar(gather_default, inf)
where_scalar_other: i64[3, 1] = where.ScalarOther(lt_scalar, argmax_default, 0)
ge_scalar: b8[3, 1] = ge.Scalar(where_scalar_other, 0)
to_dtype: f32[3, 1] = to.dtype(ge_scalar, f32)
return (to_dtype, where_scalar_other)""")

    def test_topk1_over_fewer_than_64_values_keeps_topks_own_order(self):
        # CPU topk below 64 values does not return the first of equal values; topk of the input does as it did
        _, result = rewrite(lambda x: torch.softmax(x, -1).topk(1).indices, X)
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[3, 50]
amax_default: f32[3, 1] = amax(x, [1], True)
lt_scalar: b8[3, 1] = lt.Scalar(amax_default, inf)
where_scalar_other: f32[3, 50] = where.ScalarOther(lt_scalar, x, nan)
topk_default: (f32[3, 1], i64[3, 1]) = topk(where_scalar_other, 1, 1, True, True)
getitem: i64[3, 1] = getitem(topk_default, 1)
return (getitem,)""")

    def test_tensor_temperature(self):
        # the rewrite reads the softmax's input: the temperature's sign, value or kind does not matter
        _, result = rewrite(lambda x, t: torch.softmax(x / t, -1).max(-1).indices, X, torch.tensor(-0.7))
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[3, 50]
t: f32[]
div: f32[3, 50] = div.Tensor(x, t)
argmax_default: i64[3, 1] = argmax(div, 1, True)
gather_default: f32[3, 1] = gather(div, 1, argmax_default)
lt_scalar: b8[3, 1] = lt.Scalar(gather_default, inf)
where_scalar_other: i64[3, 1] = where.ScalarOther(lt_scalar, argmax_default, 0)
squeeze_dims: i64[3] = squeeze.dims(where_scalar_other, [1])
return (squeeze_dims,)""")

    def test_eager_ties_compare_rounded_probabilities(self):
        _, result = rewrite(lambda x: torch.softmax(x.bfloat16(), -1).max(-1), X, argmax_ties="eager")
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[3, 50]
to: bf16[3, 50] = to.dtype(x, bf16)
to_dtype: f32[3, 50] = to.dtype(to, f32)
amax_default: f32[3, 1] = amax(to_dtype, [1], True)
sub_tensor: f32[3, 50] = sub.Tensor(to_dtype, amax_default)
exp_default: f32[3, 50] = exp(sub_tensor)
sum_dim_int_list: f32[3, 1] = sum.dim_IntList(exp_default, [1], True)
sub_tensor_1: f32[3, 50] = sub.Tensor(to_dtype, amax_default)
exp_default_1: f32[3, 50] = exp(sub_tensor_1)
reciprocal_default: f32[3, 1] = reciprocal(sum_dim_int_list)
mul_tensor: f32[3, 50] = mul.Tensor(exp_default_1, reciprocal_default)
to_dtype_1: bf16[3, 50] = to.dtype(mul_tensor, bf16)
sub_tensor_2: f32[3, 1] = sub.Tensor(amax_default, amax_default)
exp_default_2: f32[3, 1] = exp(sub_tensor_2)
mul_tensor_1: f32[3, 1] = mul.Tensor(exp_default_2, reciprocal_default)
to_dtype_2: bf16[3, 1] = to.dtype(mul_tensor_1, bf16)
view_dtype: i16[3, 50] = view.dtype(to_dtype_1, i16)
view_dtype_1: i16[3, 1] = view.dtype(to_dtype_2, i16)
eq_tensor: b8[3, 50] = eq.Tensor(view_dtype, view_dtype_1)
to_dtype_3: i32[3, 50] = to.dtype(eq_tensor, i32)
argmax_default: i64[3, 1] = argmax(to_dtype_3, 1, True)
squeeze_dims: i64[3] = squeeze.dims(argmax_default, [1])
squeeze_dims_1: f32[3] = squeeze.dims(amax_default, [1])
squeeze_dims_2: f32[3] = squeeze.dims(sum_dim_int_list, [1])
sub_tensor_3: f32[3] = sub.Tensor(squeeze_dims_1, squeeze_dims_1)
exp_default_3: f32[3] = exp(sub_tensor_3)
reciprocal_default_1: f32[3] = reciprocal(squeeze_dims_2)
mul_tensor_2: f32[3] = mul.Tensor(exp_default_3, reciprocal_default_1)
to_dtype_4: bf16[3] = to.dtype(mul_tensor_2, bf16)
return (to_dtype_4, squeeze_dims)""")
        self.assertExpectedInline("\n".join(findings(result)), """[argmax] rewrote softmax -> max_1: softmax -> max along dim 1: indices = first index rounding to the max probability; values = exp(top - max) / sum(exp(s - max))""")

    def test_eager_ties_in_chunks(self):
        _, result = rewrite(lambda x: torch.softmax(x, -1).argmax(-1), torch.randn(2, 32000), argmax_ties="eager")
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[2, 32000]
constant_pad_nd_default: f32[2, 32640] = constant_pad_nd(x, [0, 640], -inf)
view_default: f32[2, 15, 2176] = view(constant_pad_nd_default, [2, 15, 2176])
amax_default: f32[2, 15, 1] = amax(view_default, [2], True)
sub_tensor: f32[2, 15, 2176] = sub.Tensor(view_default, amax_default)
exp_default: f32[2, 15, 2176] = exp(sub_tensor)
sum_dim_int_list: f32[2, 15, 1] = sum.dim_IntList(exp_default, [2], True)
squeeze_dims: f32[2, 15] = squeeze.dims(amax_default, [2])
squeeze_dims_1: f32[2, 15] = squeeze.dims(sum_dim_int_list, [2])
amax_default_1: f32[2, 1] = amax(squeeze_dims, [1], True)
eq_scalar: b8[2, 15] = eq.Scalar(squeeze_dims, -inf)
masked_fill_scalar: f32[2, 15] = masked_fill.Scalar(squeeze_dims_1, eq_scalar, 0.0)
sub_tensor_1: f32[2, 15] = sub.Tensor(squeeze_dims, amax_default_1)
exp_default_1: f32[2, 15] = exp(sub_tensor_1)
mul_tensor: f32[2, 15] = mul.Tensor(masked_fill_scalar, exp_default_1)
sum_dim_int_list_1: f32[2, 1] = sum.dim_IntList(mul_tensor, [1], True)
unsqueeze_default: f32[2, 1, 1] = unsqueeze(amax_default_1, -1)
unsqueeze_default_1: f32[2, 1, 1] = unsqueeze(sum_dim_int_list_1, -1)
sub_tensor_2: f32[2, 15, 2176] = sub.Tensor(view_default, unsqueeze_default)
exp_default_2: f32[2, 15, 2176] = exp(sub_tensor_2)
reciprocal_default: f32[2, 1, 1] = reciprocal(unsqueeze_default_1)
mul_tensor_1: f32[2, 15, 2176] = mul.Tensor(exp_default_2, reciprocal_default)
sub_tensor_3: f32[2, 1, 1] = sub.Tensor(unsqueeze_default, unsqueeze_default)
exp_default_3: f32[2, 1, 1] = exp(sub_tensor_3)
mul_tensor_2: f32[2, 1, 1] = mul.Tensor(exp_default_3, reciprocal_default)
eq_tensor: b8[2, 15, 2176] = eq.Tensor(mul_tensor_1, mul_tensor_2)
to_dtype: i32[2, 15, 2176] = to.dtype(eq_tensor, i32)
amax_default_2: i32[2, 15] = amax(to_dtype, [2])
argmax_default: i64[2, 1] = argmax(amax_default_2, 1, True)
argmax_default_1: i64[2, 15] = argmax(to_dtype, 2)
gather_default: i64[2, 1] = gather(argmax_default_1, 1, argmax_default)
mul_tensor_3: i64[2, 1] = mul.Tensor(argmax_default, 2176)
add_tensor: i64[2, 1] = add.Tensor(mul_tensor_3, gather_default)
squeeze_dims_2: i64[2] = squeeze.dims(add_tensor, [1])
return (squeeze_dims_2,)""")

    def test_few_rows_over_a_long_vocabulary_reduce_in_chunks(self):
        # 2 rows x 32000: 15 chunks of 2176 (the tail padded with -inf); stage 1 per chunk, stage 2 per row
        x = torch.randn(2, 32000)
        _, result = rewrite(lambda x: torch.softmax(x, -1).max(-1), x)
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[2, 32000]
constant_pad_nd_default: f32[2, 32640] = constant_pad_nd(x, [0, 640], -inf)
view_default: f32[2, 15, 2176] = view(constant_pad_nd_default, [2, 15, 2176])
amax_default: f32[2, 15, 1] = amax(view_default, [2], True)
sub_tensor: f32[2, 15, 2176] = sub.Tensor(view_default, amax_default)
exp_default: f32[2, 15, 2176] = exp(sub_tensor)
sum_dim_int_list: f32[2, 15, 1] = sum.dim_IntList(exp_default, [2], True)
squeeze_dims: f32[2, 15] = squeeze.dims(amax_default, [2])
squeeze_dims_1: f32[2, 15] = squeeze.dims(sum_dim_int_list, [2])
amax_default_1: f32[2, 1] = amax(squeeze_dims, [1], True)
eq_scalar: b8[2, 15] = eq.Scalar(squeeze_dims, -inf)
masked_fill_scalar: f32[2, 15] = masked_fill.Scalar(squeeze_dims_1, eq_scalar, 0.0)
sub_tensor_1: f32[2, 15] = sub.Tensor(squeeze_dims, amax_default_1)
exp_default_1: f32[2, 15] = exp(sub_tensor_1)
mul_tensor: f32[2, 15] = mul.Tensor(masked_fill_scalar, exp_default_1)
sum_dim_int_list_1: f32[2, 1] = sum.dim_IntList(mul_tensor, [1], True)
argmax_default: i64[2, 1] = argmax(squeeze_dims, 1, True)
argmax_default_1: i64[2, 15] = argmax(view_default, 2)
gather_default: i64[2, 1] = gather(argmax_default_1, 1, argmax_default)
mul_tensor_1: i64[2, 1] = mul.Tensor(argmax_default, 2176)
add_tensor: i64[2, 1] = add.Tensor(mul_tensor_1, gather_default)
lt_scalar: b8[2, 1] = lt.Scalar(amax_default_1, inf)
where_scalar_other: i64[2, 1] = where.ScalarOther(lt_scalar, add_tensor, 0)
squeeze_dims_2: i64[2] = squeeze.dims(where_scalar_other, [1])
squeeze_dims_3: f32[2] = squeeze.dims(amax_default_1, [1])
squeeze_dims_4: f32[2] = squeeze.dims(sum_dim_int_list_1, [1])
sub_tensor_2: f32[2] = sub.Tensor(squeeze_dims_3, squeeze_dims_3)
exp_default_2: f32[2] = exp(sub_tensor_2)
reciprocal_default: f32[2] = reciprocal(squeeze_dims_4)
mul_tensor_2: f32[2] = mul.Tensor(exp_default_2, reciprocal_default)
return (mul_tensor_2, squeeze_dims_2)""")

    def test_many_rows_reduce_whole(self):
        _, result = rewrite(lambda x: torch.softmax(x, -1).argmax(-1), torch.randn(256, 4096))
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[256, 4096]
argmax_default: i64[256, 1] = argmax(x, 1, True)
gather_default: f32[256, 1] = gather(x, 1, argmax_default)
lt_scalar: b8[256, 1] = lt.Scalar(gather_default, inf)
where_scalar_other: i64[256, 1] = where.ScalarOther(lt_scalar, argmax_default, 0)
squeeze_dims: i64[256] = squeeze.dims(where_scalar_other, [1])
return (squeeze_dims,)""")


class TestRefusals(expecttest.TestCase):
    def assertLeftAlone(self, fn, *args, reason, **options):
        gm, result = rewrite(fn, *args, **options)
        self.assertEqual(graph_str(result.graph_module), graph_str(gm))
        self.assertEqual(result.report.rewrites, [])
        self.assertTrue(any(reason in f for f in findings(result)), findings(result))
        return gm, result

    def test_mismatched_axes(self):
        gm, result = self.assertLeftAlone(lambda x: torch.softmax(x, 0).max(-1), X, reason="axes differ")
        self.assertExpectedInline("\n".join(findings(result)), """[argmax] left alone softmax -> max_1: axes differ: softmax over dim 0, max over dim(s) [1]""")

    def test_smallest_probabilities(self):
        self.assertLeftAlone(lambda x: torch.softmax(x, -1).topk(3, largest=False), X, reason="smallest probabilities")
        self.assertLeftAlone(lambda x: torch.softmax(x, -1).min(-1), X, reason="smallest probabilities")
        self.assertLeftAlone(lambda x: torch.softmax(x, -1).argmin(-1), X, reason="smallest probabilities")

    def test_reduction_over_more_than_the_softmax_axis(self):
        self.assertLeftAlone(lambda x: torch.softmax(x, -1).max(), X, reason="also reduces over dim(s) [0]")
        self.assertLeftAlone(lambda x: torch.softmax(x, -1).argmax(), X, reason="also reduces over dim(s) [0]")

    def test_softmax_output_written_in_place(self):
        def fn(x):
            probs = torch.softmax(x, -1)
            probs[:, :4].zero_()
            return probs.max(-1)

        self.assertLeftAlone(fn, X, reason="written in place")

        def through_a_copy(x):
            probs = torch.softmax(x, -1).clone()
            probs[:, :4].zero_()
            return probs.max(-1)

        self.assertLeftAlone(through_a_copy, X, reason="a copy of the softmax output between it and max_1 is written")

    def test_eager_ties_where_they_cannot_be_reproduced(self):
        _, result = self.assertLeftAlone(lambda x: torch.softmax(x, -1).topk(2), W, argmax_ties="eager",
                                         reason="topk(2) orders equal probabilities its own way")
        self.assertExpectedInline("\n".join(findings(result)), """[argmax] left alone softmax -> topk: argmax_ties='eager': topk(2) orders equal probabilities its own way, not first index first; only the probabilities themselves reproduce that order""")
        self.assertLeftAlone(lambda x: torch.softmax(x, -1).topk(1), X, argmax_ties="eager",
                             reason="topk(1) orders equal probabilities its own way")
        _, result = self.assertLeftAlone(lambda x: torch.log_softmax(x, -1).argmax(-1), X, argmax_ties="eager",
                                         reason="CPU log_softmax rounds otherwise")
        self.assertExpectedInline("\n".join(findings(result)), """[argmax] left alone log_softmax -> argmax: argmax_ties='eager': ATen's CPU log_softmax rounds otherwise than ATen ops do (its log, and in bf16/fp16 every step), so its ties cannot be reproduced""")
        # without indices the tie rule does not matter
        _, result = rewrite(lambda x: torch.log_softmax(x, -1).topk(2).values, X, argmax_ties="eager")
        self.assertTrue(result.report.rewrites)

    def test_non_floating_softmax_input(self):
        gm = specpass.capture(lambda x: torch.softmax(x, -1).max(-1), X)
        softmax = next(n for n in gm.graph.nodes if n.name == "softmax")
        softmax.meta["val"] = softmax.meta["val"].to(torch.int64)  # what no real graph can spell
        findings = argmax_pass.run(gm, specpass.Options())
        self.assertIn("non-floating", str(findings[0]))
        self.assertFalse(findings[0].fired)


class TestNumerics:
    """fp32 on CPU against eager: indices equal, values within 1e-6 relative, shapes and dtypes equal."""

    FORMS = {
        "max_temperature": lambda x: torch.max(torch.softmax(x / 0.7, -1), -1),
        "topk1_float": lambda x: F.softmax(x.float(), dim=-1).topk(1),
        "log_softmax_argmax": lambda x: x.log_softmax(-1).argmax(-1),
        "topk4": lambda x: torch.softmax(x, -1).topk(4),
        "log_softmax_topk4": lambda x: torch.log_softmax(x * 1.5, dim=1).topk(4, dim=1),
        "max_keepdim_positive_dim": lambda x: torch.softmax(x, x.dim() - 1).max(dim=-1, keepdim=True),
        "amax": lambda x: torch.softmax(x, -1).amax(-1),
        "second_consumer": lambda x: (torch.softmax(x, -1), torch.softmax(x, -1).max(-1)),
        "dtype_arg": lambda x: torch.softmax(x, -1, dtype=torch.float64).max(-1),
        "log_softmax_max": lambda x: F.log_softmax(x, -1).max(-1),
        "three_d": lambda x: torch.softmax(x.view(x.shape[0], 2, -1), -1).topk(1),
        "negative_temperature": lambda x: torch.softmax(x / -0.7, -1).max(-1),
        "zero_temperature": lambda x: torch.softmax(x * 0.0, -1).topk(1),  # all ties: topk's own order
        "division_by_zero": lambda x: torch.softmax(x / 0.0, -1).max(-1),  # +-inf and NaN rows
        "negated_mask": lambda x: torch.log_softmax(-x.masked_fill(x > 1, float("-inf")), -1).topk(3),  # +inf
    }

    @staticmethod
    def check(got, expected, rtol=1e-6):
        got = torch.utils._pytree.tree_leaves(got)
        expected = torch.utils._pytree.tree_leaves(expected)
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert g.shape == e.shape and g.dtype == e.dtype, (g.shape, e.shape, g.dtype, e.dtype)
            if e.dtype == torch.int64:
                assert torch.equal(g, e), (g, e)
            else:
                torch.testing.assert_close(g, e, rtol=rtol, atol=0, equal_nan=True)

    @pytest.mark.parametrize("shape", [(3, 50), (2, 32000)])  # whole rows; chunked rows
    @pytest.mark.parametrize("form", list(FORMS))
    def test_eager_handoff(self, form, shape):
        fn = self.FORMS[form]
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        compiled = torch.compile(fn, backend=specpass.backend(handoff="eager"), dynamic=False)
        self.check(compiled(x), fn(x))
        assert specpass.explain(fn, x).rewrites

    @pytest.mark.parametrize("shape", [(3, 50), (2, 32000)])
    @pytest.mark.parametrize("form", list(FORMS))
    def test_eager_ties(self, form, shape):
        # the same results as eager; forms the strict rule cannot reproduce are left as they are
        fn = self.FORMS[form]
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        compiled = torch.compile(fn, backend=specpass.backend(handoff="eager", argmax_ties="eager"), dynamic=False)
        self.check(compiled(x), fn(x))

    @pytest.mark.parametrize("t", [-0.7, 0.0, 0.7, float("inf")])
    def test_tensor_temperature(self, t):
        def fn(x, t):
            return torch.softmax(x / t, -1).max(-1)

        x, t = torch.randn(3, 50), torch.tensor(t)
        compiled = torch.compile(fn, backend=specpass.backend(handoff="eager"), dynamic=False)
        self.check(compiled(x, t), fn(x, t))
        assert specpass.explain(fn, x, t).rewrites

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_half_inputs_cast_to_float(self, dtype):
        def fn(x):
            return torch.softmax(x.float() / 0.8, dim=-1).topk(1)

        x = torch.randn(4, 3000).to(dtype)
        x[torch.arange(4), torch.tensor([5, 700, 2999, 0])] = 6.0  # tie-free maxima in the low precision
        compiled = torch.compile(fn, backend=specpass.backend(handoff="eager"), dynamic=False)
        self.check(compiled(x), fn(x))

    def test_inductor_handoff(self):
        fn = self.FORMS["max_temperature"]
        x = torch.randn(4, 5000, generator=torch.Generator().manual_seed(2))
        self.check(torch.compile(fn, backend=specpass, dynamic=False)(x), fn(x))

    def test_ones(self):
        def fn(x):
            return torch.softmax(x, -1).topk(1)

        x = torch.randn(3, 50)
        values, indices = torch.compile(fn, backend=specpass.backend(handoff="eager", max_probs="ones"))(x)
        assert torch.equal(indices, fn(x).indices)
        assert torch.equal(values, torch.ones(3, 1))

    def test_input_written_after_the_softmax(self):
        def fn(x):
            y = x / 0.5
            probs = torch.softmax(y, -1)
            y.add_(torch.arange(50.0))  # after the softmax read it: must not change the arg-max
            return probs.max(-1), y

        x = torch.randn(3, 50)
        compiled = torch.compile(fn, backend=specpass.backend(handoff="eager"), dynamic=False)
        self.check(compiled(x), fn(x))
        assert specpass.explain(fn, x).rewrites

    def test_non_finite_rows(self):
        # a row of -inf: NaN probability, index 0, as in eager; a chunk of -inf adds nothing
        for shape in [(2, 50), (2, 32000)]:
            x = torch.randn(*shape)
            x[0] = float("-inf")
            x[1, : shape[1] // 2] = float("-inf")
            fn = self.FORMS["max_temperature"]
            got = torch.compile(fn, backend=specpass.backend(handoff="eager"), dynamic=False)(x)
            expected = fn(x)
            assert torch.equal(got[1], expected[1])
            torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=0, equal_nan=True)
            torch._dynamo.reset()


class TestNonFinite:
    """Rows holding NaN or +inf: softmax gives NaN everywhere and the original's index is what its
    reduction gives an all-NaN row (0 for max and argmax; topk's own order); all -inf rows: the same."""

    @staticmethod
    def fn(x):
        p, lp = torch.softmax(x, -1), torch.log_softmax(x, -1)
        return (p.max(-1), p.argmax(-1), p.topk(1), p.topk(3), p.amax(-1), lp.max(-1), lp.topk(3))

    @staticmethod
    def logits(shape, dtype):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
        v = shape[1]
        x[0, [5, v - 3]] = float("nan")
        x[1, [5, v - 3]] = float("inf")
        x[2] = float("-inf")
        x[3, : v // 2] = float("-inf")  # finite: a chunk of -inf adds nothing
        x[4, v - 3] = float("inf")
        x[4, 5] = float("nan")
        x[3:, [v - 1, v // 2, 1]] = torch.tensor([9.0, 8.0, 7.0])  # finite rows: a top 3 without ties
        return x.to(dtype)

    @pytest.mark.parametrize("ties", ["input", "eager"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("shape", [(6, 50), (6, 128), (6, 32000)])  # topk(1) by topk; by argmax; in chunks
    def test_as_eager(self, shape, dtype, ties):
        x = self.logits(shape, dtype)
        compiled = torch.compile(self.fn, backend=specpass.backend(handoff="eager", argmax_ties=ties), dynamic=False)
        TestNumerics.check(compiled(x), self.fn(x), rtol=1e-6 if dtype == torch.float32 else 1e-2)
        rewrites = specpass.rewrite(specpass.capture(self.fn, x), live_rows=False, argmax_ties=ties).report.rewrites
        assert len(rewrites) == 7 if ties == "input" else len(rewrites) >= 3  # "eager" leaves some forms alone

    def test_nan_logit(self):
        logits = torch.randn(1, 128)
        logits[0, 5] = float("nan")
        fn = lambda x: torch.softmax(x, -1).max(-1).indices  # noqa: E731
        assert torch.compile(fn, backend=specpass.backend(handoff="eager"))(logits).item() == 0 == fn(logits).item()

    @pytest.mark.parametrize("ties, shape, dtype", [("input", (6, 128), torch.float32),
                                                   ("eager", (6, 32000), torch.bfloat16)])
    def test_under_inductor(self, ties, shape, dtype):
        x = self.logits(shape, dtype)
        compiled = torch.compile(self.fn, backend=specpass.backend(argmax_ties=ties), dynamic=False)
        TestNumerics.check(compiled(x), self.fn(x), rtol=1e-6 if dtype == torch.float32 else 1e-2)


class TestTies(expecttest.TestCase):
    def test_rounding_tie_goes_to_the_largest_input(self):
        # exp(-1e-8) rounds to 1.0 in fp32, so softmax gives x[0] and x[1] the same probability and
        # eager's max returns the first; the rewrite returns the position of the largest input.
        x = torch.tensor([[0.0, 1e-8, -3.0]])
        probs = torch.softmax(x, -1)
        self.assertEqual(probs[0, 0].item(), probs[0, 1].item())
        self.assertEqual(probs.max(-1).indices.item(), 0)
        fn = lambda x: torch.softmax(x, -1).max(-1)  # noqa: E731
        values, indices = torch.compile(fn, backend=specpass.backend(handoff="eager"))(x)
        self.assertEqual(indices.item(), 1)
        self.assertEqual(values.item(), probs[0, 1].item())

    def test_rounding_tie_under_eager_ties_goes_to_the_first(self):
        x = torch.tensor([[0.0, 1e-8, -3.0]])
        fn = lambda x: torch.softmax(x, -1).max(-1)  # noqa: E731
        values, indices = torch.compile(fn, backend=specpass.backend(handoff="eager", argmax_ties="eager"))(x)
        self.assertEqual(indices.item(), 0)
        self.assertEqual(values.item(), fn(x).values.item())

    def test_exact_input_tie_goes_to_the_first(self):
        x = torch.tensor([[1.0, 3.0, 3.0, 2.0]])
        for fn in (lambda x: torch.softmax(x, -1).max(-1).indices, lambda x: torch.softmax(x, -1).topk(1).indices):
            self.assertEqual(torch.compile(fn, backend=specpass.backend(handoff="eager"))(x).flatten().item(), 1)
            torch._dynamo.reset()

    def test_exact_input_tie_across_chunks_goes_to_the_first(self):
        x = torch.randn(1, 32000)
        x[0, [31999, 2176, 2175]] = 10.0  # in the last, second and first chunk
        fn = lambda x: torch.softmax(x, -1).argmax(-1)  # noqa: E731
        self.assertEqual(torch.compile(fn, backend=specpass.backend(handoff="eager"))(x).item(), 2175)


def near_ties(rows, vocab, dtype, seed):
    """Logits spread around a common value by 1e-8 to 1 (per row): many probabilities merge when rounded."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, 1, generator=g) * 2
    spread = 10 ** (torch.rand(rows, 1, generator=g) * 8 - 8)
    return (base + torch.randn(rows, vocab, generator=g) * spread).to(dtype)


def index_of(out):
    return (out[1] if isinstance(out, tuple) else out).flatten()


class TestTieRules:
    """argmax_ties="input": eager's index wherever eager's maximum probability is unique, else the
    largest input's (the first among equal inputs); "eager": eager's index. Checked row by row on
    4,000 rows of near ties per case."""

    PROBS = {
        "softmax": lambda x: torch.softmax(x, -1),
        "rounded_after": lambda x: torch.softmax(x.float(), -1).to(x.dtype),
        "log_softmax": lambda x: torch.log_softmax(x, -1),
    }
    FORMS = {  # name -> (probabilities, reduction)
        "max": ("softmax", lambda p: p.max(-1)),
        "topk1": ("softmax", lambda p: p.topk(1)),
        "rounded_after_max": ("rounded_after", lambda p: p.max(-1)),
        "log_softmax_argmax": ("log_softmax", lambda p: p.argmax(-1)),
    }
    TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-6}

    def run(self, form, dtype, ties, backend="eager"):
        probs, reduce = self.PROBS[self.FORMS[form][0]], self.FORMS[form][1]
        fn = lambda x: reduce(probs(x))  # noqa: E731
        x = near_ties(4000, 96, dtype, seed=1)
        options = {"handoff": "eager"} if backend == "eager" else {}
        got = torch.compile(fn, backend=specpass.backend(argmax_ties=ties, **options), dynamic=False)(x)
        p = probs(x)
        unique = (p == p.amax(-1, keepdim=True)).sum(-1) == 1
        assert (~unique).sum() > 100  # the rows reach ties
        return x, got, fn(x), unique

    @pytest.mark.parametrize("form", list(FORMS))
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    def test_input(self, dtype, form):
        x, got, expected, unique = self.run(form, dtype, "input")
        assert torch.equal(index_of(got)[unique], index_of(expected)[unique])
        assert torch.equal(index_of(got), x.argmax(-1))  # the largest input, the first among equal
        assert not torch.equal(index_of(got), index_of(expected))  # rounding ties do go the other way
        if isinstance(got, tuple):
            torch.testing.assert_close(got[0], expected[0], rtol=self.TOLERANCE[dtype], atol=0)

    @pytest.mark.parametrize("form", list(FORMS))
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    def test_eager(self, dtype, form):
        _, got, expected, _ = self.run(form, dtype, "eager")
        assert torch.equal(index_of(got), index_of(expected))

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
    def test_eager_under_inductor(self, dtype):
        # the rounded probabilities are compared as bits: Inductor does not round a bf16 cast inside a kernel
        _, got, expected, _ = self.run("rounded_after_max", dtype, "eager", backend="inductor")
        assert torch.equal(index_of(got), index_of(expected))

    REPROS = {  # issue 14: (fn, logits, index under argmax_ties="input", under "eager" = eager's)
        "bf16_softmax": (lambda x: torch.softmax(x.to(torch.bfloat16), -1).max(-1).indices,
                         torch.tensor([[0.0, 1e-4, 2e-4]]), [2], [0]),
        "bf16_probabilities_0.1328": (lambda x: torch.softmax(x.to(torch.bfloat16), -1).max(-1).indices,
                                      torch.tensor([[0.0593, 0.0616] + [-0.02] * 6]), [1], [0]),
        "fp32_softmax": (lambda x: torch.softmax(x, -1).max(-1).indices, torch.tensor([[0.0, 1e-8, 2e-8]]), [2], [0]),
        # topk over 12 values (CPU): std::nth_element's order among equal values, from the input as from eager
        "topk1_all_equal": (lambda x: torch.softmax(x / 0.7, -1).topk(1).indices.flatten(), torch.zeros(2, 12),
                            [9, 9], [9, 9]),
        "topk1_all_equal_128": (lambda x: torch.softmax(x / 0.7, -1).topk(1).indices.flatten(), torch.zeros(2, 128),
                                [0, 0], [0, 0]),
    }

    @pytest.mark.parametrize("ties", ["input", "eager"])
    @pytest.mark.parametrize("repro", list(REPROS))
    def test_issue_repros(self, repro, ties):
        fn, x, by_input, by_eager = self.REPROS[repro]
        assert fn(x).tolist() == by_eager
        compiled = torch.compile(fn, backend=specpass.backend(handoff="eager", argmax_ties=ties))
        assert compiled(x).tolist() == (by_input if ties == "input" else by_eager)


def test_argmax_ties_option():
    with pytest.raises(ValueError, match=r"argmax_ties= must be one of \['input', 'eager'\]"):
        specpass.backend(argmax_ties="first")


def test_greedy_decoding_gives_the_same_tokens():
    """A toy greedy draft loop (softmax -> topk(1), KV cache written in place) with and without the pass."""
    torch.manual_seed(0)
    model = ToyDraft(batch=2).eval()

    def step(tokens, positions):
        probs = torch.softmax(model(tokens, positions) / 0.8, dim=-1)
        return probs.topk(1, dim=-1)

    def decode(fn, steps=6):
        model.k_cache.zero_()
        model.v_cache.zero_()
        tokens, out, scores = torch.tensor([[3], [7]]), [], []
        with torch.no_grad():
            for t in range(steps):
                p, tokens = fn(tokens, torch.tensor([t]))
                out.append(tokens)
                scores.append(p)
        return torch.cat(out, 1), torch.cat(scores, 1)

    expected_tokens, expected_scores = decode(step)
    for backend in (specpass.backend(handoff="eager"), specpass):
        torch._dynamo.reset()
        tokens, scores = decode(torch.compile(step, backend=backend, dynamic=False))
        assert torch.equal(tokens, expected_tokens)
        torch.testing.assert_close(scores, expected_scores, rtol=1e-5, atol=1e-6)
    assert specpass.explain(step, torch.tensor([[3], [7]]), torch.tensor([0])).rewrites


def verify(logits, ids):
    """A verifier's read: the log-probability the target gives each drafted token."""
    return torch.log_softmax(logits, -1).gather(-1, ids)


def sampled_logprob(logits):
    """The sampled token and its log-probability, as engines return them."""
    logprobs = torch.log_softmax(logits, -1)
    token = logprobs.argmax(-1)
    return token, logprobs.gather(-1, token[:, None])


FORMS = {
    "max": lambda x: torch.softmax(x, -1).max(-1),
    "argmax": lambda x: torch.softmax(x, -1).argmax(-1),
    "topk1": lambda x: torch.softmax(x.float(), -1).topk(1),
    "amax": lambda x: torch.log_softmax(x, -1).amax(-1),
    "sampled_logprob": sampled_logprob,
    "verify": lambda x: verify(x, torch.arange(6).view(3, 2) * 7),
    "verify_softmax": lambda x: torch.softmax(x, -1).gather(-1, torch.arange(3)[:, None]),
}


def rewrite_one_pass(fn, *args):
    """rewrite() on the CUDA path, run here with the op's torch implementation."""
    argmax_one_pass.ONE_PASS_DEVICES.add("cpu")
    try:
        return rewrite(fn, *args)
    finally:
        argmax_one_pass.ONE_PASS_DEVICES.discard("cpu")


class TestOnePass(expecttest.TestCase):
    def test_sampled_token_and_its_logprob_read_one_kernel(self):
        """The log-probability gathered at the op's own arg-max is the op's value: no gather."""
        gm, result = rewrite_one_pass(sampled_logprob, X)
        self.assertExpectedInline(graph_str(result.graph_module), """\
logits: f32[3, 50]
reshape_default: f32[3, 50] = reshape(logits, [-1, 50])
top1_lse_default: (i64[3], f32[3], f32[3], f32[3]) = specpass.top1_lse(reshape_default, True)
getitem: i64[3] = getitem(top1_lse_default, 0)
reshape_default_1: i64[3, 1] = reshape(getitem, [3, 1])
getitem_3: f32[3] = getitem(top1_lse_default, 3)
reshape_default_4: f32[3, 1] = reshape(getitem_3, [3, 1])
squeeze_dims: i64[3] = squeeze.dims(reshape_default_1, [1])
return (squeeze_dims, reshape_default_4)""")
        self.assertExpectedInline("\n".join(findings(result)), """\
[argmax] rewrote log_softmax -> argmax: log_softmax -> argmax along dim 1: indices = top1_lse(logits) index (one pass)
[argmax] rewrote log_softmax -> gather: log_softmax -> gather along dim 1 at its own arg-max: values = top1_lse value (one pass)""")

    def test_a_16_bit_value_comes_rounded_from_the_op(self):
        """softmax of bf16 logits gives bf16 probabilities: the op rounds its value to bf16 itself,
        so the token and its probability need no kernel after it."""
        _, result = rewrite_one_pass(lambda x: torch.softmax(x, -1).topk(1), W.bfloat16())
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: bf16[3, 128]
reshape_default: bf16[3, 128] = reshape(x, [-1, 128])
top1_lse_default: (i64[3], f32[3], f32[3], bf16[3]) = specpass.top1_lse(reshape_default, False, bf16)
getitem_2: i64[3] = getitem(top1_lse_default, 0)
reshape_default_1: i64[3, 1] = reshape(getitem_2, [3, 1])
getitem_5: bf16[3] = getitem(top1_lse_default, 3)
reshape_default_4: bf16[3, 1] = reshape(getitem_5, [3, 1])
return (reshape_default_4, reshape_default_1)""")


OTHER_TOKENS = {  # gathers at ids that are not the op's own arg-max, row for row
    "reversed": lambda lp, y: lp.argmax(-1).flip(0)[:, None],
    "shifted": lambda lp, y: (lp.argmax(-1) + 1).clamp(max=49)[:, None],
    "expanded": lambda lp, y: lp.argmax(-1)[:, None].expand(3, 2),
    "another softmax's": lambda lp, y: torch.log_softmax(y, -1).argmax(-1)[:, None],
}


@pytest.mark.parametrize("ids", OTHER_TOKENS)
def test_a_gather_at_other_tokens_reads_the_logits(monkeypatch, ids):
    def fn(x, y):
        logprobs = torch.log_softmax(x, -1)
        return logprobs.argmax(-1), logprobs.gather(-1, OTHER_TOKENS[ids](logprobs, y))

    monkeypatch.setattr(argmax_one_pass, "ONE_PASS_DEVICES", {"cpu", "cuda"})
    x, y = X, torch.randn(3, 50, generator=torch.Generator().manual_seed(5))
    _, result = rewrite(fn, x, y)
    assert "gather(x, 1" in graph_str(result.graph_module) and "own arg-max" not in "".join(findings(result))
    got = torch.compile(fn, backend=specpass.backend(handoff="eager", live_rows=False))(x, y)
    want = fn(x, y)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=2e-6, atol=2e-6)


def test_float64_keeps_the_formulation(monkeypatch):
    """The op accumulates in fp32: a float64 softmax is rewritten in float64, exactly as before."""
    monkeypatch.setattr(argmax_one_pass, "ONE_PASS_DEVICES", {"cpu", "cuda"})
    fn = lambda x: torch.softmax(x, -1).max(-1)  # noqa: E731
    x = X.double()
    _, result = rewrite(fn, x)
    assert result.report.rewrites and "top1_lse" not in graph_str(result.graph_module)
    got = torch.compile(fn, backend=specpass.backend(handoff="eager", live_rows=False))(x)
    assert torch.equal(got[1], fn(x)[1]) and got[0].dtype == torch.float64
    torch.testing.assert_close(got[0], fn(x)[0], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("one_pass", [True, False])
def test_every_form_matches_eager(monkeypatch, form, dtype, one_pass):
    """Indices equal eager's; values within a rounding of the output dtype; on the one-pass kernel's
    path and on Inductor's formulation; non-finite rows included."""
    if one_pass:
        monkeypatch.setattr(argmax_one_pass, "ONE_PASS_DEVICES", {"cpu", "cuda"})
    x = (torch.randn(3, 200, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    x[1, 17] = float("inf")
    fn = FORMS[form]
    _, result = rewrite(fn, x)
    assert result.report.rewrites and all(f.fired for f in result.report.of("argmax")), findings(result)
    assert ("top1_lse" in graph_str(result.graph_module)) == one_pass
    want = fn(x)
    got = torch.compile(fn, backend=specpass.backend(handoff="eager", live_rows=False))(x)
    tolerance = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
        if w.is_floating_point():
            torch.testing.assert_close(g, w, rtol=tolerance, atol=tolerance, equal_nan=True)
        else:
            assert torch.equal(g, w), (g, w)


def test_gather_along_another_axis_is_left_alone():
    _, result = rewrite(lambda x: torch.log_softmax(x, 0).gather(1, torch.zeros(3, 1, dtype=torch.long)), X)
    assert [f.fired for f in result.report.of("argmax")] == [False]
    assert "the softmax is over dim 0" in findings(result)[0]


T3 = torch.tensor([0.7, 1.3, 0.05])  # a temperature per request


class TestFoldedPrologues(expecttest.TestCase):
    """The casts and temperature before a softmax are read by the one-pass op, not written out."""

    def test_softmax_of_upcast_logits(self):
        _, result = rewrite_one_pass(lambda x: torch.softmax(x.float(), -1).topk(1), W.bfloat16())
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: bf16[3, 128]
reshape_default: bf16[3, 128] = reshape(x, [-1, 128])
top1_lse_default: (i64[3], f32[3], f32[3], f32[3]) = specpass.top1_lse(reshape_default, False, None, None, 1.0, False, None)
getitem_2: i64[3] = getitem(top1_lse_default, 0)
reshape_default_1: i64[3, 1] = reshape(getitem_2, [3, 1])
getitem_5: f32[3] = getitem(top1_lse_default, 3)
reshape_default_4: f32[3, 1] = reshape(getitem_5, [3, 1])
return (reshape_default_4, reshape_default_1)""")
        self.assertExpectedInline("\n".join(findings(result)), """[argmax] rewrote softmax -> topk: softmax -> topk along dim 1: indices = top1_lse(x, folding the cast) index (one pass); values = exp(top - lse) (one pass)""")

    def test_an_identity_cast_is_named_in_the_finding(self):
        # x.float() of fp32 logits folds nothing but the cast: the finding says so, not "folding " alone
        _, result = rewrite_one_pass(lambda x: torch.log_softmax(x.float(), -1).max(-1), W.float())
        (finding,) = findings(result)
        assert "top1_lse(x, folding the cast)" in finding, finding

    def test_bf16_division_is_rounded_to_bf16_in_the_op(self):
        _, result = rewrite_one_pass(lambda x: (x / 0.7).softmax(-1).max(-1), W.bfloat16())
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: bf16[3, 128]
reshape_default: bf16[3, 128] = reshape(x, [-1, 128])
top1_lse_default: (i64[3], f32[3], f32[3], bf16[3]) = specpass.top1_lse(reshape_default, False, bf16, None, 0.7, True, bf16)
getitem_2: i64[3] = getitem(top1_lse_default, 0)
reshape_default_1: i64[3, 1] = reshape(getitem_2, [3, 1])
getitem_5: bf16[3] = getitem(top1_lse_default, 3)
reshape_default_4: bf16[3, 1] = reshape(getitem_5, [3, 1])
squeeze_dims: i64[3] = squeeze.dims(reshape_default_1, [1])
squeeze_dims_1: bf16[3] = squeeze.dims(reshape_default_4, [1])
return (squeeze_dims_1, squeeze_dims)""")

    def test_per_request_temperature(self):
        fn = lambda x, t: torch.softmax(x.float() / t[:, None], -1).max(-1)  # noqa: E731
        _, result = rewrite_one_pass(fn, W.bfloat16(), T3)
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: bf16[3, 128]
t: f32[3]
unsqueeze: f32[3, 1] = unsqueeze(t, 1)
reshape_default: bf16[3, 128] = reshape(x, [-1, 128])
reshape_default_1: f32[3] = reshape(unsqueeze, [-1])
top1_lse_default: (i64[3], f32[3], f32[3], f32[3]) = specpass.top1_lse(reshape_default, False, None, reshape_default_1, 1.0, True, None)
getitem_2: i64[3] = getitem(top1_lse_default, 0)
reshape_default_2: i64[3, 1] = reshape(getitem_2, [3, 1])
getitem_5: f32[3] = getitem(top1_lse_default, 3)
reshape_default_5: f32[3, 1] = reshape(getitem_5, [3, 1])
squeeze_dims: i64[3] = squeeze.dims(reshape_default_2, [1])
squeeze_dims_1: f32[3] = squeeze.dims(reshape_default_5, [1])
return (squeeze_dims_1, squeeze_dims)""")

    def test_sampled_token_of_upcast_log_softmax(self):
        def fn(x):
            logprobs = torch.log_softmax(x.float(), -1)
            token = logprobs.argmax(-1)
            return token, logprobs.gather(-1, token[:, None])

        _, result = rewrite_one_pass(fn, W.bfloat16())
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: bf16[3, 128]
reshape_default: bf16[3, 128] = reshape(x, [-1, 128])
top1_lse_default: (i64[3], f32[3], f32[3], f32[3]) = specpass.top1_lse(reshape_default, True, None, None, 1.0, False, None)
getitem: i64[3] = getitem(top1_lse_default, 0)
reshape_default_1: i64[3, 1] = reshape(getitem, [3, 1])
getitem_3: f32[3] = getitem(top1_lse_default, 3)
reshape_default_4: f32[3, 1] = reshape(getitem_3, [3, 1])
squeeze_dims: i64[3] = squeeze.dims(reshape_default_1, [1])
return (squeeze_dims, reshape_default_4)""")

    def test_multiplication_by_a_tensor_of_one_value(self):
        fn = lambda x, c: torch.softmax(c * x, -1).argmax(-1)  # noqa: E731
        _, result = rewrite_one_pass(fn, W, torch.tensor([[1.5]]))
        self.assertExpectedInline(graph_str(result.graph_module), """\
c: f32[1, 1]
x: f32[3, 128]
reshape_default: f32[3, 128] = reshape(x, [-1, 128])
reshape_default_1: f32[1] = reshape(c, [1])
top1_lse_default: (i64[3], f32[3], f32[3], f32[3]) = specpass.top1_lse(reshape_default, False, None, reshape_default_1, 1.0, False, None)
getitem: i64[3] = getitem(top1_lse_default, 0)
reshape_default_2: i64[3, 1] = reshape(getitem, [3, 1])
squeeze_dims: i64[3] = squeeze.dims(reshape_default_2, [1])
return (squeeze_dims,)""")


FOLDED = {  # name -> (fn, extra inputs): spellings whose prologue the op reads
    "upcast_topk1": (lambda x: torch.softmax(x.float(), -1).topk(1), ()),
    "divide_max": (lambda x: (x / 0.7).softmax(-1).max(-1), ()),
    "multiply_max": (lambda x: (x * 1.7).softmax(-1).max(-1), ()),
    "negative_temperature": (lambda x: torch.softmax(x.float() / -0.7, -1).max(-1), ()),
    "per_request": (lambda x, t: torch.softmax(x.float() / t[:, None], -1).max(-1), (T3,)),
    "per_request_zero_and_negative": (lambda x, t: torch.softmax(x.float() / t[:, None], -1).max(-1),
                                      (torch.tensor([0.0, -0.5, 2.0]),)),
    "per_request_same_dtype": (lambda x, t: torch.log_softmax(x / t[:, None].to(x.dtype), -1).max(-1), (T3,)),
    "upcast_log_softmax_sampled": (sampled_logprob_of_float := lambda x: (
        lambda lp: (lp.argmax(-1), lp.gather(-1, lp.argmax(-1)[:, None])))(torch.log_softmax(x.float(), -1)), ()),
    "greedy_loop": (lambda x: torch.softmax(x.float(), -1).max(-1).indices, ()),
    "dtype_argument": (lambda x: torch.softmax(x / 0.9, -1, dtype=torch.float32).amax(-1), ()),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", FOLDED)
def test_folded_prologue_matches_eager(monkeypatch, form, dtype):
    """Indices equal eager's on logits with ties and non-finite rows, values within rounding: the op
    computes each x / t as torch does (in the quotient's dtype), so the rounded ties fall the same way."""
    monkeypatch.setattr(argmax_one_pass, "ONE_PASS_DEVICES", {"cpu", "cuda"})
    fn, extra = FOLDED[form]
    x = (torch.randn(3, 300, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    x[0, [7, 250]] = x[0].amax() + 0.01  # near ties: the quotient's rounding decides between them
    x[1, 17] = float("inf")
    _, result = rewrite(fn, x, *extra)
    graph = graph_str(result.graph_module)
    assert "folding" in "".join(findings(result)), findings(result)
    assert "div.Tensor" not in graph and "mul.Tensor" not in graph and ": f32[3, 300] = to" not in graph, graph
    want = fn(x, *extra)
    got = torch.compile(fn, backend=specpass.backend(handoff="eager", live_rows=False))(x, *extra)
    tolerance = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        if w.is_floating_point():
            torch.testing.assert_close(g, w, rtol=tolerance, atol=tolerance, equal_nan=True)
        else:
            assert torch.equal(g, w), (g, w)


UNFOLDED = {  # name -> (fn, inputs, reason): the op reads the prologue's output, as before
    "divisor_of_another_dtype": (lambda x, t: torch.softmax(x / t, -1).max(-1),
                                 (W.bfloat16(), torch.tensor(0.7)), "is torch.float32, the result torch.bfloat16"),
    "per_column_factor": (lambda x, w: torch.softmax(x * w, -1).max(-1), (W, torch.rand(128)),
                          "is not one value per row"),
    "per_element_factor": (lambda x, w: torch.softmax(x / w, -1).max(-1), (W, torch.rand(3, 128) + 1),
                           "is not one value per row"),
    "narrowing_dtype_argument": (lambda x: torch.softmax(x, -1, dtype=torch.bfloat16).max(-1), (W,), "rounds its"),
    "divided_by_the_logits": (lambda x, t: torch.softmax(t / x, -1).max(-1), (W, torch.tensor([[0.7]])),
                              "scales a tensor of another shape"),
}


@pytest.mark.parametrize("form", UNFOLDED)
def test_prologues_that_cannot_be_folded(monkeypatch, form):
    """Still rewritten to the op, which reads the softmax's input as computed: the reason is reported."""
    monkeypatch.setattr(argmax_one_pass, "ONE_PASS_DEVICES", {"cpu", "cuda"})
    fn, args, reason = UNFOLDED[form]
    _, result = rewrite(fn, *args)
    assert result.report.rewrites and "prologue not folded" in findings(result)[0] and reason in findings(result)[0], \
        findings(result)
    want, got = fn(*args), torch.compile(fn, backend=specpass.backend(handoff="eager", live_rows=False))(*args)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=8e-3, atol=1e-6)


def test_logits_written_in_place_after_the_cast_are_not_read_again(monkeypatch):
    """The op would read x after the write: the cast's copy stays and the op reads it."""
    monkeypatch.setattr(argmax_one_pass, "ONE_PASS_DEVICES", {"cpu", "cuda"})

    def fn(x):
        y = x.float()
        x.mul_(-1)
        return torch.softmax(y, -1).max(-1)

    x = W.bfloat16()
    _, result = rewrite(fn, x.clone())
    assert "prologue not folded: x is written in place" in findings(result)[0], findings(result)
    want = fn(x.clone())
    got = torch.compile(fn, backend=specpass.backend(handoff="eager", live_rows=False))(x.clone())
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["divide_max", "multiply_max", "per_request_same_dtype"])
def test_folding_changes_no_index_on_near_ties(monkeypatch, form, dtype):
    """On 4,000 rows of near ties (many quotients round together) the folded op returns the index
    the unfolded rewrite returns (the first arg-max of the quotient as torch computes it), row for row."""
    fn, extra = FOLDED[form]
    extra = tuple(t.repeat(1334)[:4000] for t in extra)
    x = near_ties(4000, 96, dtype, seed=4)
    unfolded = torch.compile(fn, backend=specpass.backend(handoff="eager", live_rows=False))(x, *extra)
    torch._dynamo.reset()
    monkeypatch.setattr(argmax_one_pass, "ONE_PASS_DEVICES", {"cpu", "cuda"})
    folded = torch.compile(fn, backend=specpass.backend(handoff="eager", live_rows=False))(x, *extra)
    assert "folding" in "".join(findings(rewrite(fn, x, *extra)[1]))
    assert torch.equal(folded[1], unfolded[1])
    assert not torch.equal(folded[1], x.argmax(-1))  # the quotient's rounding decides on some rows


# --- a tree draft step's expansion (issue 33): each row's top-k tokens and their log-probabilities


def tree_logits(rows, vocab, seed=0):
    """bf16 logits whose top 4 of each row are 0.5 apart and above the rest: eager's order is unambiguous."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    places = torch.rand(rows, vocab, generator=g).argsort(-1)[:, :4]  # [rows, 4] distinct
    x.scatter_(1, places, x.amax(-1, keepdim=True) + torch.tensor([2.0, 1.5, 1.0, 0.5]))
    return x.bfloat16()


def softmax_then_log(x):  # SGLang's spelling: probabilities, then the log of the top ones
    top = torch.softmax(x.float(), -1).topk(4, -1)
    return top.values.log(), top.indices


class TestTreeExpansion(expecttest.TestCase):
    """expand's top-k with values reads an exact top-k of the logits and a logsumexp: no [.., V]
    softmax or log_softmax is left, and the scores and tokens are eager's."""

    def rewritten(self, fn):
        """The rewritten graph of fn over [3, 128] logits, after checking, there and over [4, 32000]
        (rows in chunks), that no softmax is left and that specpass gives eager's results."""
        graphs = []
        for x in (tree_logits(3, 128), tree_logits(4, 32000, seed=1)):
            gm, result = rewrite(fn, x)
            assert [n for n in gm.graph.nodes if argmax_matcher.is_softmax(n)], graph_str(gm)
            graphs.append(graph_str(result.graph_module))
            assert not [n for n in result.graph_module.graph.nodes if argmax_matcher.is_softmax(n)], graphs[-1]
            got = torch.compile(fn, backend=specpass.backend(handoff="eager", live_rows=False), dynamic=False)(x)
            TestNumerics.check(got, fn(x), rtol=1e-5)
            torch._dynamo.reset()
        return graphs[0]

    def test_expand(self):
        self.assertExpectedInline(self.rewritten(lambda x: tree_math.expand(x, 4)), """\
x: bf16[3, 128]
to: f32[3, 128] = to.dtype(x, f32)
amax_default: f32[3, 1] = amax(to, [1], True)
sub_tensor: f32[3, 128] = sub.Tensor(to, amax_default)
exp_default: f32[3, 128] = exp(sub_tensor)
sum_dim_int_list: f32[3, 1] = sum.dim_IntList(exp_default, [1], True)
lt_scalar: b8[3, 1] = lt.Scalar(amax_default, inf)
where_scalar_other: f32[3, 128] = where.ScalarOther(lt_scalar, to, nan)
topk_default: (f32[3, 4], i64[3, 4]) = topk(where_scalar_other, 4, 1, True, True)
getitem_2: i64[3, 4] = getitem(topk_default, 1)
getitem_3: f32[3, 4] = getitem(topk_default, 0)
sub_tensor_1: f32[3, 4] = sub.Tensor(getitem_3, amax_default)
log_default: f32[3, 1] = log(sum_dim_int_list)
sub_tensor_2: f32[3, 4] = sub.Tensor(sub_tensor_1, log_default)
return (sub_tensor_2, getitem_2)""")

    def test_softmax_then_log(self):
        self.assertExpectedInline(self.rewritten(softmax_then_log), """\
x: bf16[3, 128]
to: f32[3, 128] = to.dtype(x, f32)
amax_default: f32[3, 1] = amax(to, [1], True)
sub_tensor: f32[3, 128] = sub.Tensor(to, amax_default)
exp_default: f32[3, 128] = exp(sub_tensor)
sum_dim_int_list: f32[3, 1] = sum.dim_IntList(exp_default, [1], True)
lt_scalar: b8[3, 1] = lt.Scalar(amax_default, inf)
where_scalar_other: f32[3, 128] = where.ScalarOther(lt_scalar, to, nan)
topk_default: (f32[3, 4], i64[3, 4]) = topk(where_scalar_other, 4, 1, True, True)
getitem_2: i64[3, 4] = getitem(topk_default, 1)
getitem_3: f32[3, 4] = getitem(topk_default, 0)
sub_tensor_1: f32[3, 4] = sub.Tensor(getitem_3, amax_default)
exp_default_1: f32[3, 4] = exp(sub_tensor_1)
reciprocal_default: f32[3, 1] = reciprocal(sum_dim_int_list)
mul_tensor: f32[3, 4] = mul.Tensor(exp_default_1, reciprocal_default)
log: f32[3, 4] = log(mul_tensor)
return (log, getitem_2)""")

    def test_temperature(self):
        self.assertExpectedInline(self.rewritten(lambda x: torch.log_softmax(x.float() / 0.7, -1).topk(4, -1)), """\
x: bf16[3, 128]
to: f32[3, 128] = to.dtype(x, f32)
div: f32[3, 128] = div.Tensor(to, 0.7)
amax_default: f32[3, 1] = amax(div, [1], True)
sub_tensor: f32[3, 128] = sub.Tensor(div, amax_default)
exp_default: f32[3, 128] = exp(sub_tensor)
sum_dim_int_list: f32[3, 1] = sum.dim_IntList(exp_default, [1], True)
lt_scalar: b8[3, 1] = lt.Scalar(amax_default, inf)
where_scalar_other: f32[3, 128] = where.ScalarOther(lt_scalar, div, nan)
topk_default: (f32[3, 4], i64[3, 4]) = topk(where_scalar_other, 4, 1, True, True)
getitem_2: i64[3, 4] = getitem(topk_default, 1)
getitem_3: f32[3, 4] = getitem(topk_default, 0)
sub_tensor_1: f32[3, 4] = sub.Tensor(getitem_3, amax_default)
log_default: f32[3, 1] = log(sum_dim_int_list)
sub_tensor_2: f32[3, 4] = sub.Tensor(sub_tensor_1, log_default)
return (sub_tensor_2, getitem_2)""")

    def test_explain_names_the_rewrite(self):
        report = specpass.explain(lambda x: tree_math.expand(x, 4), tree_logits(3, 128))
        self.assertExpectedInline(str(report), """\
specpass: 1 rewrite(s), 0 left alone; graph matmul FLOPs 0 -> 0
  [argmax] rewrote log_softmax -> topk: log_softmax -> topk along dim 1: indices = topk(to, 4); values = top - max - log(sum(exp(s - max)))""")


# --- an MoE router: softmax -> topk, the top values normalised in place (Mixtral, HunYuan-MoE)


def router_divides(x):  # Mixtral: `top /= top.sum(...)`, then reshaped where the experts read it
    top, experts = torch.softmax(x, -1, dtype=torch.float).topk(2, dim=-1)
    top /= top.sum(dim=-1, keepdim=True)
    return top.reshape(-1), experts.reshape(-1)


def router_div_(x):  # `.div_`, then a cast to the dtype it has (HunYuan-MoE: an alias, not a copy)
    top, experts = torch.topk(F.softmax(x, dim=1, dtype=torch.float), 2, dim=-1)
    top.div_(top.sum(dim=-1, keepdim=True))
    return top.to(x.dtype), experts


ROUTERS = {"divides": router_divides, "div_": router_div_}
EXPERT_LOGITS = torch.randn(12, 8, generator=torch.Generator().manual_seed(2))


class TestRouterNormalisedInPlace(expecttest.TestCase):
    def test_the_write_becomes_a_division_and_the_topk_is_rewritten(self):
        """The write is on the topk's own values, and what reads them after it (a reshape, a cast
        to their own dtype: views) is taken after it: the write is a new value, the pass is kept."""
        _, result = rewrite(router_divides, EXPERT_LOGITS)
        self.assertEqual(result.report.errors, [])
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[12, 8]
amax_default: f32[12, 1] = amax(x, [1], True)
sub_tensor: f32[12, 8] = sub.Tensor(x, amax_default)
exp_default: f32[12, 8] = exp(sub_tensor)
sum_dim_int_list: f32[12, 1] = sum.dim_IntList(exp_default, [1], True)
lt_scalar: b8[12, 1] = lt.Scalar(amax_default, inf)
where_scalar_other: f32[12, 8] = where.ScalarOther(lt_scalar, x, nan)
topk_default: (f32[12, 2], i64[12, 2]) = topk(where_scalar_other, 2, 1, True, True)
getitem_2: i64[12, 2] = getitem(topk_default, 1)
getitem_3: f32[12, 2] = getitem(topk_default, 0)
sub_tensor_1: f32[12, 2] = sub.Tensor(getitem_3, amax_default)
exp_default_1: f32[12, 2] = exp(sub_tensor_1)
reciprocal_default: f32[12, 1] = reciprocal(sum_dim_int_list)
mul_tensor: f32[12, 2] = mul.Tensor(exp_default_1, reciprocal_default)
sum_1: f32[12, 1] = sum.dim_IntList(mul_tensor, [-1], True)
div_tensor: f32[12, 2] = div.Tensor(mul_tensor, sum_1)
reshape: f32[24] = reshape(div_tensor, [-1])
reshape_1: i64[24] = reshape(getitem_2, [-1])
return (reshape, reshape_1)""")
        self.assertExpectedInline("\n".join(findings(result)), """[argmax] rewrote softmax -> topk: softmax -> topk along dim 1: indices = topk(x, 2); values = exp(top - max) / sum(exp(s - max))""")


@pytest.mark.parametrize("router", ROUTERS)
def test_router_matches_eager(router):
    fn = ROUTERS[router]
    _, result = rewrite(fn, EXPERT_LOGITS)
    assert result.report.errors == [] and len(result.report.rewrites) == 1, str(result.report)
    with warnings.catch_warnings():
        warnings.simplefilter("error", specpass.SpecpassWarning)  # a dropped pass warns
        got = torch.compile(fn, backend=specpass.backend(handoff="eager"), dynamic=False)(EXPERT_LOGITS)
    TestNumerics.check(got, fn(EXPERT_LOGITS))


def test_router_values_read_through_an_earlier_view_are_left_alone():
    """A view taken before the write sees it: the write stays in place, and the topk is left alone
    with the reason (rewritten, the write would go to the new values), not the pass dropped: the
    other softmax is still rewritten."""
    def fn(x):
        top, experts = torch.softmax(x, -1).topk(2, dim=-1)
        flat = top.view(-1)
        top /= top.sum(dim=-1, keepdim=True)
        return flat, experts, torch.softmax(x * 2, -1).argmax(-1)

    _, result = rewrite(fn, EXPERT_LOGITS)
    assert result.report.errors == [], result.report.errors
    found = findings(result)
    assert len(found) == 2 and "rewrote softmax_1 -> argmax" in found[1], found
    assert "left alone softmax -> topk" in found[0] and "written in place" in found[0], found
    assert any(n.target is torch.ops.aten.div_.Tensor for n in result.graph_module.graph.nodes)
    got = torch.compile(fn, backend=specpass.backend(handoff="eager"), dynamic=False)(EXPERT_LOGITS)
    TestNumerics.check(got, fn(EXPERT_LOGITS))


def plan_of(fn, *args, **options):
    """The matcher's verdict on the first softmax of fn's captured graph."""
    gm = specpass.capture(fn, *args)
    softmax = next(n for n in gm.graph.nodes if argmax_matcher.is_softmax(n))
    return argmax_matcher.match(softmax, specpass.Options(**options))


class TestPlan:
    """The plan the matcher hands the lowerings: each output's lowering, chosen once."""

    def test_each_output_names_its_lowering(self):
        fn = lambda x: torch.max(torch.softmax(x / 0.7, -1), -1)  # noqa: E731
        plan = plan_of(fn, X).plan
        (max_,) = plan.consumers
        assert (plan.dim, plan.one_pass, plan.with_stats, plan.chunks) == (1, False, True, 1)
        assert (max_.dims, max_.k, max_.keepdim, max_.dtypes) == ((1,), 1, False, (torch.float32,))
        assert (max_.indices_by, max_.values_by) == ("argmax", "formula")
        eager = plan_of(fn, X, argmax_ties="eager").plan.consumers[0]
        assert (eager.indices_by, eager.values_by) == ("eager", "formula")
        ones = plan_of(fn, X, max_probs="ones").plan
        assert (ones.consumers[0].indices_by, ones.consumers[0].values_by, ones.with_stats) == ("argmax", "ones", False)
        topk = plan_of(lambda x: torch.softmax(x, -1).topk(1).indices, X).plan.consumers[0]  # 50 < 64 values
        assert (topk.indices_by, topk.values_by, topk.sorted) == ("topk", None, True)

    def test_a_gather_at_the_ops_own_index_reads_its_value(self, monkeypatch):
        monkeypatch.setattr(argmax_one_pass, "ONE_PASS_DEVICES", {"cpu", "cuda"})
        token, gather = plan_of(sampled_logprob, X).plan.consumers
        assert (token.indices_by, gather.by) == ("one_pass", "own_index")
        def flipped(x):  # the op's index, not row for row
            logprobs = torch.log_softmax(x, -1)
            return logprobs.gather(-1, logprobs.argmax(-1).flip(0)[:, None])

        token, gather = plan_of(flipped, X).plan.consumers
        assert (token.indices_by, gather.by) == ("one_pass", "one_pass")
        monkeypatch.setattr(argmax_one_pass, "ONE_PASS_DEVICES", {"cuda"})
        assert plan_of(sampled_logprob, X).plan.consumers[1].by == "formula"

    def test_refusals_leave_no_plan(self):
        matched = plan_of(lambda x: torch.softmax(x, -1).min(-1), X)
        assert matched.plan is None and list(matched.refused) == matched.candidates
        assert "underflow to ties at 0" in matched.refused[matched.candidates[0]]

    @pytest.mark.parametrize("shape, dim, stats, want", [
        ((1, 40000), 1, True, (19, 2176)),  # 19 chunks: ceil(40000 / 19) = 2106, to a multiple of 128
        ((1, 40000), 1, False, (19, 2176)),
        ((1, 5000), 1, True, (2, 2560)),  # 5000 // 2048 = 2 chunks at most
        ((1, 5000), 1, False, (1, 0)),  # indices only: from 4 chunks
        ((4, 8192), 1, False, (4, 2048)),
        ((600, 40000), 1, True, (1, 0)),  # rows enough
        ((40000, 1), 0, True, (1, 0)),  # only the last axis is cut
    ])
    def test_chunks(self, shape, dim, stats, want):
        assert argmax_chunks.plan_chunks(shape, dim, stats) == want

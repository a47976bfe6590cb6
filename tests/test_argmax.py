"""The arg-max pass: graph diffs for each form, refusals, numerics against eager, ties, a greedy loop."""

import expecttest
import pytest
import torch
import torch.nn.functional as F

import specpass
from models.toy import ToyDraft
from specpass.passes import argmax as argmax_pass
from specpass.testing import graph_str


def rewrite(fn, *args, **options):
    """(captured graph, RewriteResult) with only the arg-max pass."""
    gm = specpass.capture(fn, *args)
    return gm, specpass.rewrite(gm, live_rows=False, **options)


def findings(result):
    return [str(f) for f in result.report.of("argmax")]


X = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))


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
argmax_default: i64[3] = argmax(div, -1, False)
amax_default: f32[3, 1] = amax(div, [1], True)
sub_tensor: f32[3, 50] = sub.Tensor(div, amax_default)
exp_default: f32[3, 50] = exp(sub_tensor)
sum_dim_int_list: f32[3, 1] = sum.dim_IntList(exp_default, [1], True)
squeeze_dims: f32[3] = squeeze.dims(amax_default, [1])
squeeze_dims_1: f32[3] = squeeze.dims(sum_dim_int_list, [1])
sub_tensor_1: f32[3] = sub.Tensor(squeeze_dims, squeeze_dims)
exp_default_1: f32[3] = exp(sub_tensor_1)
div_tensor: f32[3] = div.Tensor(exp_default_1, squeeze_dims_1)
return (div_tensor, argmax_default)""")
        self.assertExpectedInline("\n".join(findings(result)), """[argmax] rewrote softmax -> max_1: softmax -> max along dim 1: indices = argmax(div); values = exp(top - max) / sum(exp(s - max))""")

    def test_topk1_of_upcast_bf16(self):
        _, result = rewrite(lambda x: F.softmax(x.float(), dim=-1).topk(1), X.bfloat16())
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: bf16[3, 50]
to: f32[3, 50] = to.dtype(x, f32)
argmax_default: i64[3, 1] = argmax(to, -1, True)
amax_default: f32[3, 1] = amax(to, [1], True)
sub_tensor: f32[3, 50] = sub.Tensor(to, amax_default)
exp_default: f32[3, 50] = exp(sub_tensor)
sum_dim_int_list: f32[3, 1] = sum.dim_IntList(exp_default, [1], True)
sub_tensor_1: f32[3, 1] = sub.Tensor(amax_default, amax_default)
exp_default_1: f32[3, 1] = exp(sub_tensor_1)
div_tensor: f32[3, 1] = div.Tensor(exp_default_1, sum_dim_int_list)
return (div_tensor, argmax_default)""")

    def test_argmax_of_log_softmax_needs_no_logsumexp(self):
        _, result = rewrite(lambda x: x.log_softmax(-1).argmax(-1), X)
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[3, 50]
argmax_default: i64[3] = argmax(x, -1, False)
return (argmax_default,)""")

    def test_indices_only_max_needs_no_logsumexp(self):
        _, result = rewrite(lambda x: torch.softmax(x * 2.0, 1).max(-1).indices, X)
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[3, 50]
mul: f32[3, 50] = mul.Tensor(x, 2.0)
argmax_default: i64[3] = argmax(mul, -1, False)
return (argmax_default,)""")

    def test_topk4(self):
        _, result = rewrite(lambda x: torch.softmax(x, -1).topk(4), X)
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[3, 50]
topk_default: (f32[3, 4], i64[3, 4]) = topk(x, 4, 1, True, True)
getitem_2: i64[3, 4] = getitem(topk_default, 1)
amax_default: f32[3, 1] = amax(x, [1], True)
sub_tensor: f32[3, 50] = sub.Tensor(x, amax_default)
exp_default: f32[3, 50] = exp(sub_tensor)
sum_dim_int_list: f32[3, 1] = sum.dim_IntList(exp_default, [1], True)
getitem_3: f32[3, 4] = getitem(topk_default, 0)
sub_tensor_1: f32[3, 4] = sub.Tensor(getitem_3, amax_default)
exp_default_1: f32[3, 4] = exp(sub_tensor_1)
div_tensor: f32[3, 4] = div.Tensor(exp_default_1, sum_dim_int_list)
return (div_tensor, getitem_2)""")

    def test_log_softmax_topk_values(self):
        _, result = rewrite(lambda x: torch.log_softmax(x, 1).topk(2, sorted=False), X)
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[3, 50]
topk_default: (f32[3, 2], i64[3, 2]) = topk(x, 2, 1, True, False)
getitem_2: i64[3, 2] = getitem(topk_default, 1)
amax_default: f32[3, 1] = amax(x, [1], True)
sub_tensor: f32[3, 50] = sub.Tensor(x, amax_default)
exp_default: f32[3, 50] = exp(sub_tensor)
sum_dim_int_list: f32[3, 1] = sum.dim_IntList(exp_default, [1], True)
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
argmax_default: i64[3] = argmax(x, -1, False)
return (softmax, argmax_default)""")

    def test_half_softmax_values_in_the_dtype_it_produced(self):
        # softmax of f16 computes in f32 and rounds to f16 once; so does the rewrite
        _, result = rewrite(lambda x: torch.softmax(x.half(), -1).max(-1, keepdim=True), X)
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[3, 50]
to: f16[3, 50] = to.dtype(x, f16)
argmax_default: i64[3, 1] = argmax(to, -1, True)
to_dtype: f32[3, 50] = to.dtype(to, f32)
amax_default: f32[3, 1] = amax(to_dtype, [1], True)
sub_tensor: f32[3, 50] = sub.Tensor(to_dtype, amax_default)
exp_default: f32[3, 50] = exp(sub_tensor)
sum_dim_int_list: f32[3, 1] = sum.dim_IntList(exp_default, [1], True)
sub_tensor_1: f32[3, 1] = sub.Tensor(amax_default, amax_default)
exp_default_1: f32[3, 1] = exp(sub_tensor_1)
div_tensor: f32[3, 1] = div.Tensor(exp_default_1, sum_dim_int_list)
to_dtype_1: f16[3, 1] = to.dtype(div_tensor, f16)
return (to_dtype_1, argmax_default)""")

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
div_tensor: f64[3] = div.Tensor(exp_default_1, squeeze_dims_1)
to_dtype_1: bf16[3] = to.dtype(div_tensor, bf16)
to_dtype_2: f32[3] = to.dtype(to_dtype_1, f32)
return (to_dtype_2,)""")

    def test_max_probs_ones(self):
        _, result = rewrite(lambda x: torch.softmax(x, -1).topk(1), X, max_probs="ones")
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[3, 50]
argmax_default: i64[3, 1] = argmax(x, -1, True)
ge_scalar: b8[3, 1] = ge.Scalar(argmax_default, 0)
to_dtype: f32[3, 1] = to.dtype(ge_scalar, f32)
return (to_dtype, argmax_default)""")

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
argmax_default: i64[2, 15] = argmax(view_default, 2)
argmax_default_1: i64[2, 1] = argmax(squeeze_dims, 1, True)
mul_tensor_1: i64[2, 1] = mul.Tensor(argmax_default_1, 2176)
gather_default: i64[2, 1] = gather(argmax_default, 1, argmax_default_1)
squeeze_dims_2: i64[2] = squeeze.dims(mul_tensor_1, [1])
squeeze_dims_3: i64[2] = squeeze.dims(gather_default, [1])
add_tensor: i64[2] = add.Tensor(squeeze_dims_2, squeeze_dims_3)
squeeze_dims_4: f32[2] = squeeze.dims(amax_default_1, [1])
squeeze_dims_5: f32[2] = squeeze.dims(sum_dim_int_list_1, [1])
sub_tensor_2: f32[2] = sub.Tensor(squeeze_dims_4, squeeze_dims_4)
exp_default_2: f32[2] = exp(sub_tensor_2)
div_tensor: f32[2] = div.Tensor(exp_default_2, squeeze_dims_5)
return (div_tensor, add_tensor)""")

    def test_many_rows_reduce_whole(self):
        _, result = rewrite(lambda x: torch.softmax(x, -1).argmax(-1), torch.randn(256, 4096))
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[256, 4096]
argmax_default: i64[256] = argmax(x, -1, False)
return (argmax_default,)""")


class TestRefusals(expecttest.TestCase):
    def assertLeftAlone(self, fn, *args, reason):
        gm, result = rewrite(fn, *args)
        self.assertEqual(graph_str(result.graph_module), graph_str(gm))
        self.assertEqual(result.report.rewrites, [])
        self.assertTrue(any(reason in f for f in findings(result)), findings(result))
        return gm, result

    def test_mismatched_axes(self):
        gm, result = self.assertLeftAlone(lambda x: torch.softmax(x, 0).max(-1), X, reason="axes differ")
        self.assertExpectedInline("\n".join(findings(result)), """[argmax] left alone softmax -> max_1: axes differ: softmax over dim 0, max over dim(s) [1]""")

    def test_negative_temperature(self):
        _, result = self.assertLeftAlone(lambda x: torch.softmax(x / -0.7, -1).max(-1), X, reason="not positive")
        self.assertExpectedInline("\n".join(findings(result)), """[argmax] left alone softmax -> max_1: temperature -0.7 in div is not positive and finite; it does not preserve the order""")

    def test_zero_and_infinite_temperatures(self):
        self.assertLeftAlone(lambda x: torch.softmax(x * 0.0, -1).argmax(-1), X, reason="temperature 0.0 in mul is not positive")
        self.assertLeftAlone(lambda x: torch.softmax(x / float("inf"), -1).argmax(-1), X, reason="temperature inf in div")

    def test_temperature_of_unknown_sign(self):
        _, result = self.assertLeftAlone(lambda x, t: torch.softmax(x / t, -1).max(-1), X, torch.tensor(0.7),
                                         reason="is a tensor; its sign is unknown")
        self.assertExpectedInline("\n".join(findings(result)), """[argmax] left alone softmax -> max_1: temperature in div (div) is a tensor; its sign is unknown""")
        # a negative factor hidden under a positive one and a cast is still found
        self.assertLeftAlone(lambda x: torch.softmax((x * -2.0).float() / 0.5, -1).argmax(-1), X,
                             reason="temperature -2.0")

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
    }

    @staticmethod
    def check(got, expected, rtol=1e-6):
        got = torch.utils._pytree.tree_leaves(got)
        expected = torch.utils._pytree.tree_leaves(expected)
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert g.shape == e.shape and g.dtype == e.dtype, (g.shape, e.shape, g.dtype, e.dtype)
            if e.dtype == torch.int64:
                assert torch.equal(g, e)
            else:
                torch.testing.assert_close(g, e, rtol=rtol, atol=0)

    @pytest.mark.parametrize("shape", [(3, 50), (2, 32000)])  # whole rows; chunked rows
    @pytest.mark.parametrize("form", list(FORMS))
    def test_eager_handoff(self, form, shape):
        fn = self.FORMS[form]
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        compiled = torch.compile(fn, backend=specpass.backend(handoff="eager"), dynamic=False)
        self.check(compiled(x), fn(x))
        assert specpass.explain(fn, x).rewrites

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

"""The GEMV pass: a linear of one row (up to 4 of a small weight) on CUDA runs as `torch.ops.specpass.gemv`. On
CPU the graphs are traced with fake CUDA tensors (the pass reads only fake tensors) and the
rewritten graphs then run on real CPU tensors (the op's CPU implementation) against the original;
the refusals, each with its reason. The Triton kernel: tests/test_kernels.py, on a GPU."""

import re

import expecttest
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import specpass
from specpass.options import Options
from specpass.passes import gemv
from specpass.testing import fake_ir, graph_str


def traced(fn, *shapes, device="cuda", dtype=torch.bfloat16, **options):
    """fn's IR on fake tensors of these shapes (CUDA by default), rewritten with the pass on."""
    return specpass.rewrite(fake_ir(fn, *shapes, device=device, dtype=dtype), gemv=True, **options)


def verdicts(result):
    return "\n".join(str(f) for f in result.report.of("gemv"))


def mlp(h, norm_w, gate_up, down):
    """A layer's MLP: a norm, a fused gate-up projection, the residual add."""
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w
    gate, up = F.linear(x, gate_up).chunk(2, -1)
    return h + F.linear(F.silu(gate) * up, down)


def mlp_and_head(h, norm_w, gate_up, down, lm_head):
    """... and the head of the last row, lm_head as x @ w.t() (a draft or decode step)."""
    return mlp(h, norm_w, gate_up, down).select(1, -1) @ lm_head.t()


def mlp_and_heads(h, norm_w, gate_up, down, lm_head):
    """... the head of every row (a verify)."""
    return mlp(h, norm_w, gate_up, down) @ lm_head.t()


SHAPES = [(1, 1, 64), (64,), (256, 64), (64, 128), (258, 64)]


class TestGraphs(expecttest.TestCase):
    def test_decode_step(self):
        result = traced(mlp_and_head, *SHAPES)
        self.assertExpectedInline(graph_str(result.graph_module), """\
h_1: bf16[1, 1, 64]
norm_w_1: bf16[64]
gate_up_1: bf16[256, 64]
down_1: bf16[64, 128]
lm_head_1: bf16[258, 64]
pow_1: bf16[1, 1, 64] = pow.Tensor_Scalar(h_1, 2)
mean: bf16[1, 1, 1] = mean.dim(pow_1, [-1], True)
add: bf16[1, 1, 1] = add.Tensor(mean, 1e-06)
rsqrt: bf16[1, 1, 1] = rsqrt(add)
mul: bf16[1, 1, 64] = mul.Tensor(h_1, rsqrt)
mul_1: bf16[1, 1, 64] = mul.Tensor(mul, norm_w_1)
gemv: bf16[1, 1, 256] = specpass.gemv(mul_1, gate_up_1, None)
chunk: (bf16[1, 1, 128], bf16[1, 1, 128]) = chunk(gemv, 2, -1)
getitem: bf16[1, 1, 128] = getitem(chunk, 0)
getitem_1: bf16[1, 1, 128] = getitem(chunk, 1)
silu: bf16[1, 1, 128] = silu(getitem)
mul_2: bf16[1, 1, 128] = mul.Tensor(silu, getitem_1)
gemv_1: bf16[1, 1, 64] = specpass.gemv(mul_2, down_1, None)
add_1: bf16[1, 1, 64] = add.Tensor(h_1, gemv_1)
select: bf16[1, 64] = select.int(add_1, 1, -1)
gemv_2: bf16[1, 258] = specpass.gemv(select, lm_head_1, None)
return gemv_2""")
        self.assertExpectedInline(verdicts(result), """\
[gemv] rewrote linear: runs as specpass.gemv (1 row against a 256 x 64 weight, one pass over it) instead of cuBLAS
[gemv] rewrote linear_1: runs as specpass.gemv (1 row against a 64 x 128 weight, one pass over it) instead of cuBLAS
[gemv] rewrote matmul: runs as specpass.gemv (1 row against a 258 x 64 weight, one pass over it) instead of cuBLAS""")

    def test_verify_rows(self):
        """Five rows a request, every one scored (a K 4 verify): the GEMM reads the weight once for
        all of them. Only the last row scored (a draft step): the live-row pass leaves one row, and
        the linears after its gather run as GEMVs."""
        result = traced(mlp_and_heads, (1, 5, 64), *SHAPES[1:])
        self.assertExpectedInline(verdicts(result), """\
[gemv] left alone linear: 5 rows > 4 against a 256 x 64 weight: the kernel takes up to 4 rows of a small weight and one of a larger one (kernels.gemv.kernel_rows); a GEMM is faster past that
[gemv] left alone linear_1: 5 rows > 4 against a 64 x 128 weight: the kernel takes up to 4 rows of a small weight and one of a larger one (kernels.gemv.kernel_rows); a GEMM is faster past that
[gemv] left alone matmul: 5 rows > 4 against a 258 x 64 weight: the kernel takes up to 4 rows of a small weight and one of a larger one (kernels.gemv.kernel_rows); a GEMM is faster past that""")
        result = traced(mlp_and_head, (1, 5, 64), *SHAPES[1:])
        self.assertExpectedInline(verdicts(result), """\
[gemv] rewrote linear: runs as specpass.gemv (1 row against a 256 x 64 weight, one pass over it) instead of cuBLAS
[gemv] rewrote linear_1: runs as specpass.gemv (1 row against a 64 x 128 weight, one pass over it) instead of cuBLAS
[gemv] rewrote matmul: runs as specpass.gemv (1 row against a 258 x 64 weight, one pass over it) instead of cuBLAS""")


def test_rewritten_graph_equals_the_original():
    """The rewritten graph on real CPU tensors: the op's operands are the linear's (the weight, its
    transpose, the bias) wherever it came from."""
    result = traced(mlp_and_head, *SHAPES, dtype=torch.float32)
    assert [f.fired for f in result.report.of("gemv")] == [True, True, True]
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(shape, generator=g) for shape in SHAPES]
    torch.testing.assert_close(result.graph_module(*args), mlp_and_head(*args), rtol=1e-5, atol=1e-5)

    def biased(x, w, b):
        return F.linear(x, w, b)

    result = traced(biased, (2, 1, 32), (48, 32), (48,), dtype=torch.float32)
    assert [f.fired for f in result.report.of("gemv")] == [True]
    args = [torch.randn(shape, generator=g) for shape in [(2, 1, 32), (48, 32), (48,)]]
    torch.testing.assert_close(result.graph_module(*args), biased(*args), rtol=1e-5, atol=1e-5)


def attention_and_mlp_inputs(h, wq, wk, wv, gate, up, down):
    """A layer's projections kept apart, as transformers' Llama keeps them: q, k and v of one input;
    gate and up of another; down alone."""
    q, k, v = F.linear(h, wq), F.linear(h, wk), F.linear(h, wv)
    x = h + (q + k.repeat(1, 1, 4) + v.repeat(1, 1, 4))
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


GROUP_SHAPES = [(1, 1, 64), (64, 64), (16, 64), (16, 64), (128, 64), (128, 64), (64, 128)]


class TestGroups(expecttest.TestCase):
    def test_siblings_run_in_one_launch(self):
        result = traced(attention_and_mlp_inputs, *GROUP_SHAPES, gemv_group=True)
        self.assertExpectedInline(graph_str(result.graph_module), """\
h_1: bf16[1, 1, 64]
wq_1: bf16[64, 64]
wk_1: bf16[16, 64]
wv_1: bf16[16, 64]
gate_1: bf16[128, 64]
up_1: bf16[128, 64]
down_1: bf16[64, 128]
gemv_group: bf16[1, 1, 96] = specpass.gemv_group(h_1, [wq_1, wk_1, wv_1], [])
split_with_sizes_default: (bf16[1, 1, 64], bf16[1, 1, 16], bf16[1, 1, 16]) = split_with_sizes(gemv_group, [64, 16, 16], -1)
getitem: bf16[1, 1, 64] = getitem(split_with_sizes_default, 0)
getitem_1: bf16[1, 1, 16] = getitem(split_with_sizes_default, 1)
getitem_2: bf16[1, 1, 16] = getitem(split_with_sizes_default, 2)
repeat: bf16[1, 1, 64] = repeat(getitem_1, [1, 1, 4])
add: bf16[1, 1, 64] = add.Tensor(getitem, repeat)
repeat_1: bf16[1, 1, 64] = repeat(getitem_2, [1, 1, 4])
add_1: bf16[1, 1, 64] = add.Tensor(add, repeat_1)
add_2: bf16[1, 1, 64] = add.Tensor(h_1, add_1)
gemv_group_1: bf16[1, 1, 256] = specpass.gemv_group(add_2, [gate_1, up_1], [])
split_with_sizes_default_1: (bf16[1, 1, 128], bf16[1, 1, 128]) = split_with_sizes(gemv_group_1, [128, 128], -1)
getitem_3: bf16[1, 1, 128] = getitem(split_with_sizes_default_1, 0)
getitem_4: bf16[1, 1, 128] = getitem(split_with_sizes_default_1, 1)
silu: bf16[1, 1, 128] = silu(getitem_3)
mul: bf16[1, 1, 128] = mul.Tensor(silu, getitem_4)
gemv: bf16[1, 1, 64] = specpass.gemv(mul, down_1, None)
return gemv""")
        self.assertExpectedInline(verdicts(result), """\
[gemv] rewrote linear: runs in specpass.gemv_group with linear_1, linear_2 (1 row against 3 weights, 96 x 64 in all, one launch) instead of cuBLAS
[gemv] rewrote linear_1: runs in specpass.gemv_group with linear, linear_2 (1 row against 3 weights, 96 x 64 in all, one launch) instead of cuBLAS
[gemv] rewrote linear_2: runs in specpass.gemv_group with linear, linear_1 (1 row against 3 weights, 96 x 64 in all, one launch) instead of cuBLAS
[gemv] rewrote linear_3: runs in specpass.gemv_group with linear_4 (1 row against 2 weights, 256 x 64 in all, one launch) instead of cuBLAS
[gemv] rewrote linear_4: runs in specpass.gemv_group with linear_3 (1 row against 2 weights, 256 x 64 in all, one launch) instead of cuBLAS
[gemv] rewrote linear_5: runs as specpass.gemv (1 row against a 64 x 128 weight, one pass over it) instead of cuBLAS""")

    def test_why_a_sibling_runs_alone(self):
        def later_weight(h, wq, wk):  # wk computed between the two linears
            q = F.linear(h, wq)
            return q + F.linear(h, wk * q.sum())

        def strided_user(h, wq, wk):  # q's user views it across its rows
            return F.linear(h, wq).view(-1) + F.linear(h, wk).sum()

        def returned(h, wq, wk):  # the graph's outputs stay dense
            return F.linear(h, wq), F.linear(h, wk) + 1

        def one_biased(h, wq, wk, b):
            return F.linear(h, wq, b) + F.linear(h, wk)

        def five(h, w1, w2, w3, w4, w5):
            return sum(F.linear(h, w) for w in (w1, w2, w3, w4, w5))

        w = (16, 64)
        self.assertExpectedInline(verdicts(traced(later_weight, (1, 64), w, w, gemv_group=True)), """\
[gemv] rewrote linear: runs as specpass.gemv (1 row against a 16 x 64 weight, one pass over it) instead of cuBLAS; alone: no sibling could join its group
[gemv] rewrote linear_1: runs as specpass.gemv (1 row against a 16 x 64 weight, one pass over it) instead of cuBLAS; alone: its weight or bias is computed after linear, where the group runs""")
        self.assertExpectedInline(verdicts(traced(strided_user, (2, 64), w, w, gemv_group=True)), """\
[gemv] rewrote linear: runs as specpass.gemv (2 rows against a 16 x 64 weight, one pass over it) instead of cuBLAS; alone: its user view needs it contiguous, not a group's columns
[gemv] rewrote linear_1: runs as specpass.gemv (2 rows against a 16 x 64 weight, one pass over it) instead of cuBLAS; alone: no sibling could join its group""")
        self.assertExpectedInline(verdicts(traced(returned, (1, 64), w, w, gemv_group=True)), """\
[gemv] rewrote linear: runs as specpass.gemv (1 row against a 16 x 64 weight, one pass over it) instead of cuBLAS; alone: its value is the graph's output, which stays dense
[gemv] rewrote linear_1: runs as specpass.gemv (1 row against a 16 x 64 weight, one pass over it) instead of cuBLAS; alone: no sibling could join its group""")
        self.assertExpectedInline(verdicts(traced(one_biased, (1, 64), w, w, (16,), gemv_group=True)), """\
[gemv] rewrote linear: runs as specpass.gemv (1 row against a 16 x 64 weight, one pass over it) instead of cuBLAS; alone: its siblings differ in dtype or in having a bias
[gemv] rewrote linear_1: runs as specpass.gemv (1 row against a 16 x 64 weight, one pass over it) instead of cuBLAS; alone: its siblings differ in dtype or in having a bias""")
        self.assertExpectedInline(verdicts(traced(five, (1, 64), *[w] * 5, gemv_group=True)), """\
[gemv] rewrote linear: runs in specpass.gemv_group with linear_1, linear_2 (1 row against 3 weights, 48 x 64 in all, one launch) instead of cuBLAS
[gemv] rewrote linear_1: runs in specpass.gemv_group with linear, linear_2 (1 row against 3 weights, 48 x 64 in all, one launch) instead of cuBLAS
[gemv] rewrote linear_2: runs in specpass.gemv_group with linear, linear_1 (1 row against 3 weights, 48 x 64 in all, one launch) instead of cuBLAS
[gemv] rewrote linear_3: runs in specpass.gemv_group with linear_4 (1 row against 2 weights, 32 x 64 in all, one launch) instead of cuBLAS
[gemv] rewrote linear_4: runs in specpass.gemv_group with linear_3 (1 row against 2 weights, 32 x 64 in all, one launch) instead of cuBLAS""")


def test_grouped_graph_equals_the_original():
    """The grouped linears on real CPU tensors, with and without biases."""
    result = traced(attention_and_mlp_inputs, *GROUP_SHAPES, dtype=torch.float32, gemv_group=True)
    assert result.graph_module.graph.find_nodes(op="call_function", target=torch.ops.specpass.gemv_group.default)
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(shape, generator=g) for shape in GROUP_SHAPES]
    torch.testing.assert_close(result.graph_module(*args), attention_and_mlp_inputs(*args), rtol=1e-5, atol=1e-5)

    def biased(x, w1, w2, b1, b2):
        return F.linear(x, w1, b1) * F.linear(x, w2, b2)

    shapes = [(3, 32), (48, 32), (48, 32), (48,), (48,)]
    result = traced(biased, *shapes, dtype=torch.float32, gemv_group=True)
    assert [f.message.startswith("runs in specpass.gemv_group") for f in result.report.of("gemv")] == [True, True]
    args = [torch.randn(shape, generator=g) for shape in shapes]
    torch.testing.assert_close(result.graph_module(*args), biased(*args), rtol=1e-5, atol=1e-5)


def test_transposed_siblings_group():
    """x @ w.t() siblings, each transpose made just before its matmul: the group reads the weights as
    stored, which come before the first."""
    result = traced(lambda x, w1, w2: (x @ w1.t()) * (x @ w2.t()), (1, 64), (32, 64), (32, 64), gemv_group=True)
    assert [f.message.startswith("runs in specpass.gemv_group") for f in result.report.of("gemv")] == [True, True]
    [group] = result.graph_module.graph.find_nodes(op="call_function", target=torch.ops.specpass.gemv_group.default)
    assert all(w.op == "placeholder" for w in group.args[1])


def test_symbolic_siblings_run_alone():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    rows = env.create_symintnode(env.create_symbol(2, ConstantSource("rows")), hint=2)
    x, w1, _ = fakes(FakeTensorMode(shape_env=env), (rows, 64), (32, 64))
    gm = _linear_graph(x, w1)
    first = next(iter(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)))
    with gm.graph.inserting_after(first):
        second = gm.graph.call_function(torch.ops.aten.linear.default, first.args)
        second.meta["val"] = first.meta["val"]
    gm.graph.output((first, second))
    gm.graph.erase_node(next(n for n in gm.graph.nodes if n.op == "output"))
    findings = gemv.run(gm, Options(gemv=True, gemv_group=True))
    assert [f.fired for f in findings] == [True, True]
    assert all("alone: a group runs at static rows only" in f.message for f in findings), findings


def _linear_graph(x, w, b=None, target=torch.ops.aten.linear.default):
    """One linear over placeholders carrying these fake tensors, built by hand where tracing fake
    CUDA tensors cannot make them (symbolic sizes)."""
    graph = fx.Graph()
    nodes = []
    for name, value in (("x", x), ("w", w), ("b", b)):
        if value is not None:
            nodes.append(graph.placeholder(name))
            nodes[-1].meta["val"] = value
    node = graph.call_function(target, tuple(nodes))
    with FakeTensorMode(allow_non_fake_inputs=True):
        node.meta["val"] = F.linear(x, w, b) if target is torch.ops.aten.linear.default else x @ w
    graph.output(node)
    return fx.GraphModule(torch.nn.Module(), graph)


def refusal(x, w, b=None, target=torch.ops.aten.linear.default):
    gm = _linear_graph(x, w, b, target)
    (finding,) = gemv.run(gm, Options(gemv=True))
    assert not finding.fired
    assert any(n.target is target for n in gm.graph.nodes)
    return finding.message


def fakes(mode, x_shape, w_shape, dtype=torch.bfloat16, b_shape=None):
    with mode:
        return (torch.empty(x_shape, device="cuda", dtype=dtype), torch.empty(w_shape, device="cuda", dtype=dtype),
                None if b_shape is None else torch.empty(b_shape, device="cuda", dtype=dtype))


class TestRefusals(expecttest.TestCase):
    def test_rows(self):
        self.assertExpectedInline(refusal(*fakes(FakeTensorMode(), (5, 64), (32, 64))), """5 rows > 4 against a 32 x 64 weight: the kernel takes up to 4 rows of a small weight and one of a larger one (kernels.gemv.kernel_rows); a GEMM is faster past that""")
        self.assertExpectedInline(refusal(*fakes(FakeTensorMode(), (2, 4096), (1024, 4096))), """2 rows > 1 against a 1024 x 4096 weight: the kernel takes up to 4 rows of a small weight and one of a larger one (kernels.gemv.kernel_rows); a GEMM is faster past that""")  # 8 MiB

    def test_dtype(self):
        self.assertExpectedInline(refusal(*fakes(FakeTensorMode(), (1, 64), (32, 64), torch.float64)), """torch.float64: the kernel takes one dtype for x, the weight and the bias, bf16, fp16 or fp32""")

    def test_weight_not_stored_as_rows(self):
        x, w, _ = fakes(FakeTensorMode(), (1, 64), (64, 32))
        self.assertExpectedInline(refusal(x, w.t()), """the weight's strides are [1, 32], not a contiguous [N, K] weight: the kernel reads the weight's rows, and a copy each call would cost more than the kernel saves""")  # a [32, 64] view of a [64, 32] tensor
        self.assertExpectedInline(refusal(x, w, target=torch.ops.aten.mm.default), """the weight's strides are [32, 1], not x @ w.t() of a contiguous [N, K] w: the kernel reads the weight's rows, and a copy each call would cost more than the kernel saves""")  # x @ w of a [K, N] w

    def test_bias_broadcast(self):
        self.assertExpectedInline(refusal(*fakes(FakeTensorMode(), (1, 64), (32, 64), b_shape=(1,))), """the bias is [1], not [32]: the kernel adds one value per output column""")


def test_small_weight_rows_fire():
    """Up to 4 rows of a weight of at most 2 MiB: the kernel's time there is its launch's."""
    for rows, w_shape in [(4, (32, 64)), (2, (1024, 1024))]:  # 2 MiB in bf16
        gm = _linear_graph(*fakes(FakeTensorMode(), (rows, w_shape[1]), w_shape))
        (finding,) = gemv.run(gm, Options(gemv=True))
        assert finding.fired, finding.message


def test_symbolic_rows_are_the_op_s_to_settle():
    """A batch compiled once for every size: the op runs the kernel at up to 4 rows a call of a small
    weight and cuBLAS above, so the pass fires, without a guard on the rows. A symbolic size is at
    least 2 (Dynamo specializes 0 and 1), so a larger weight's linear is cuBLAS's at every size."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    rows = env.create_symintnode(env.create_symbol(2, ConstantSource("rows")), hint=2)
    gm = _linear_graph(*fakes(FakeTensorMode(shape_env=env), (rows, 64), (32, 64)))
    (finding,) = gemv.run(gm, Options(gemv=True))
    message = re.sub(r"\bs\d+\b", "sN", finding.message)  # the symbol's number depends on what ran before
    assert finding.fired and message == ("runs as specpass.gemv (sN rows, symbolic, against a 32 x 64 weight): one "
                                         "pass over it at up to 4 rows a call, cuBLAS above"), message
    assert gm.graph.find_nodes(op="call_function", target=torch.ops.specpass.gemv.default) and not env.guards
    gm = _linear_graph(*fakes(FakeTensorMode(shape_env=env), (rows, 4096), (1024, 4096)))
    (finding,) = gemv.run(gm, Options(gemv=True))
    assert not finding.fired and "rows > 1 against a 1024 x 4096 weight" in finding.message


@pytest.mark.parametrize("case", ["cpu", "batched"])
def test_not_a_candidate(case):
    if case == "cpu":
        result = traced(lambda x, w: F.linear(x, w), (1, 64), (32, 64), device="cpu")
    else:  # attention's scores: a matmul of two activations
        result = traced(lambda q, k: q @ k.transpose(-1, -2), (1, 2, 1, 16), (1, 2, 8, 16))
    assert result.report.of("gemv") == []
    assert not result.graph_module.graph.find_nodes(op="call_function", target=torch.ops.specpass.gemv.default)


def test_on_by_default_and_off_in_exact_mode():
    def fired(**options):
        result = specpass.rewrite(fake_ir(mlp_and_head, *SHAPES, device="cuda", dtype=torch.bfloat16), **options)
        return [f.fired for f in result.report.of("gemv")]

    assert fired() == [True] * 3
    assert fired(gemv=False) == [] and fired(exact=True) == []
    for switch in ("gemv", "gemv_group"):
        with pytest.raises(ValueError, match=f"exact=True and {switch}=True"):
            Options.make(exact=True, **{switch: True})
    assert not Options.make(exact=True).gemv_group
    grouped = traced(attention_and_mlp_inputs, *GROUP_SHAPES).graph_module.graph  # siblings grouped by default
    assert len(grouped.find_nodes(op="call_function", target=torch.ops.specpass.gemv_group.default)) == 2


def test_gemv_group_bad_input():
    x, w = torch.randn(1, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="1 to 4 weights and a bias for each or none; got 2 weights and 1 biases"):
        torch.ops.specpass.gemv_group(x, [w, w], [torch.randn(4)])
    with pytest.raises(ValueError, match="got 5 weights"):
        torch.ops.specpass.gemv_group(x, [w] * 5, [])
    torch.testing.assert_close(torch.ops.specpass.gemv_group(x, [w, 2 * w], []), torch.cat([x @ w.t(), 2 * x @ w.t()], -1))

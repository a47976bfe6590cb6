"""Exact mode: the row-invariant kernels give a row the same bits at M = 1, 5, 17 and 64 rows
(torch.equal, fp32 on CPU); the exact pass routes every op that adds floats to them and refuses a
graph it cannot make exact; and then plain and speculative decoding give the same tokens, for every
round shape, apart and fused, bs 1 and ragged, zoo and transformers targets, in bf16."""

import expecttest
import pytest
import torch
import torch.nn.functional as F

import specpass
from models import zoo
from models.drafters import ZooDrafter, adapt
from specpass import ExactModeError
from specpass.loop import Decoder, TreeShape
from specpass.testing import fake_ir, graph_str
from tests.test_hf_generate import build as hf_build, eagle3_head

ops = torch.ops.specpass
ROWS = (1, 5, 17, 64)


def same_rows(op, x, *args, row_dim=0):
    """op on the first m rows of x, for each m in ROWS: each row's bits as in the 64-row call."""
    full = op(x, *args)
    return all(torch.equal(op(x.narrow(row_dim, 0, m), *args), full.narrow(row_dim, 0, m)) for m in ROWS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_gives_a_row_the_same_bits_at_any_row_count(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 96, generator=g).to(dtype)  # rows, then a second axis a row carries
    w, b, w2 = (torch.randn(s, generator=g).to(dtype) for s in ((80, 96), (80,), (96,)))
    assert same_rows(ops.exact_linear, x, w, b) and same_rows(ops.exact_linear, x, w, None)
    assert same_rows(ops.exact_matmul, x, torch.randn(96, 7, generator=g).to(dtype))
    for dims, keepdim, mean in (([-1], False, False), ([1, 2], True, True), ([2], False, True)):
        assert same_rows(ops.exact_sum, x, dims, keepdim, mean)
    assert same_rows(ops.exact_rms_norm, x, [96], w2, 1e-6)
    assert same_rows(ops.exact_layer_norm, x, [3, 96], None, None, 1e-5)
    assert same_rows(ops.exact_softmax, x, -1, False, None) and same_rows(ops.exact_softmax, x, 2, True, torch.float32)
    assert same_rows(ops.exact_logsumexp, x, [-1], True)
    # attention: query rows [B, h, M, d] against 40 slots, each row seeing the slots up to its position
    q, k, v = (torch.randn(s, generator=g).to(dtype) for s in ((2, 4, 64, 16), (2, 2, 40, 16), (2, 2, 40, 8)))
    mask = torch.arange(40)[None, None, None, :] <= torch.arange(64)[None, None, :, None] % 40
    attend = lambda q, mask: ops.exact_attention(q, k, v, mask, False, 0.25, True)  # noqa: E731
    assert all(torch.equal(attend(q[:, :, :m], mask[:, :, :m]), attend(q, mask)[:, :, :m]) for m in ROWS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_compute_what_torch_computes(dtype):
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(9, 5, 48, generator=g), torch.randn(32, 48, generator=g), torch.randn(32, generator=g)
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    pairs = [
        (ops.exact_linear(x, w, b), F.linear(x, w, b)),
        (ops.exact_matmul(x, w.t()), x @ w.t()),
        (ops.exact_sum(x, [0, 2], False, True), x.mean((0, 2))),
        (ops.exact_rms_norm(x, [48], w[0], 1e-6), F.rms_norm(x, [48], w[0], 1e-6)),
        (ops.exact_layer_norm(x, [48], w[0], b[:1].expand(48), 1e-5), F.layer_norm(x, [48], w[0], b[:1].expand(48))),
        (ops.exact_softmax(x, 1, True, None), x.log_softmax(1)),
        (ops.exact_logsumexp(x, [-1], False), x.logsumexp(-1)),
    ]
    q = x.view(9, 5, 3, 16).transpose(1, 2)  # [B, h, T, d]
    k, v = torch.randn(9, 1, 16, 16, generator=g).to(dtype), torch.randn(9, 1, 16, 8, generator=g).to(dtype)
    mask = torch.rand(9, 1, 5, 16, generator=g) > 0.3
    pairs.append((ops.exact_attention(q, k.expand(9, 3, 16, 16), k.expand(9, 3, 16, 16), mask, False, None, False),
                  F.scaled_dot_product_attention(q, k.expand(9, 3, 16, 16), k.expand(9, 3, 16, 16), attn_mask=mask)))
    pairs.append((ops.exact_attention(q, k, v, None, True, 0.5, True),
                  F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5, enable_gqa=True)))
    for ours, theirs in pairs:
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, **tol)


def test_fake_kernels_give_the_real_shapes_dtypes_and_strides():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 3, 8, generator=g).transpose(0, 1), torch.randn(6, 8, generator=g)  # a strided input
    q, k = torch.randn(2, 4, 3, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    calls = [(ops.exact_linear, (x, w, w[0, :6])), (ops.exact_matmul, (x, w.t())), (ops.exact_sum, (x, [0, 2], True, True)),
             (ops.exact_rms_norm, (x, [8], None, None)), (ops.exact_layer_norm, (x, [3, 8], None, None, 1e-5)),
             (ops.exact_softmax, (x, 1, True, torch.bfloat16)), (ops.exact_logsumexp, (x, [1], False)),
             (ops.exact_attention, (q, k, k, None, True, None, True))]
    for op, args in calls:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_attention_adds_the_slots_a_mask_hides_as_nothing_wherever_they_sit():
    """A tree's node sees its path among masked siblings; it gets the bits the same keys give in a
    row of consecutive slots (a chain's), and a row that sees no slot is 0."""
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 6, 16, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    spread = torch.tensor([True, False, True, False, False, True])  # the path at slots 0, 2, 5
    packed_k, packed_v = k[:, :, spread], v[:, :, spread]
    tree = ops.exact_attention(q, k, v, spread[None, None, None], False, None, False)
    chain = ops.exact_attention(q, packed_k, packed_v, None, False, None, False)
    assert torch.equal(tree, chain)
    blind = ops.exact_attention(q, k, v, torch.zeros(1, 1, 1, 6, dtype=torch.bool), False, None, False)
    assert torch.equal(blind, torch.zeros_like(blind))


def traced(fn, *shapes, dtype=torch.float32, **options):
    return specpass.rewrite(fake_ir(fn, *shapes, dtype=dtype), **options)


def layer(x, w, norm, q, k, v):
    """A decoder layer's ops that add: norms, projections, attention, softmax, a mean."""
    h = F.rms_norm(x, [x.shape[-1]], norm, 1e-6)
    h = F.linear(h, w) + torch.addmm(norm[:8], h.flatten(0, 1), w.t()[:, :8]).view_as(h)[..., :8].sum(-1, True)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    probs = torch.softmax(h.float(), -1).to(h.dtype)
    return F.layer_norm(probs, [probs.shape[-1]]), attn.mean(1), torch.logsumexp(h, -1)


class TestPass(expecttest.TestCase):
    def test_every_sum_is_routed(self):
        result = traced(layer, (2, 3, 8), (8, 8), (8,), (2, 4, 3, 16), (2, 2, 3, 16), (2, 2, 3, 16), exact=True)
        self.assertExpectedInline(graph_str(result.graph_module), """\
x_1: f32[2, 3, 8]
w_1: f32[8, 8]
norm_1: f32[8]
q_1: f32[2, 4, 3, 16]
k_1: f32[2, 2, 3, 16]
v_1: f32[2, 2, 3, 16]
exact_rms_norm_default: f32[2, 3, 8] = specpass.exact_rms_norm(x_1, [8], norm_1, 1e-06)
exact_linear_default: f32[2, 3, 8] = specpass.exact_linear(exact_rms_norm_default, w_1, None)
slice_1: f32[8] = slice.Tensor(norm_1, 0, 0, 8)
flatten: f32[6, 8] = flatten.using_ints(exact_rms_norm_default, 0, 1)
t: f32[8, 8] = t(w_1)
alias: f32[8, 8] = alias(t)
t_default: f32[8, 8] = t(alias)
exact_linear_default_1: f32[6, 8] = specpass.exact_linear(flatten, t_default, slice_1)
view_as: f32[2, 3, 8] = view_as(exact_linear_default_1, exact_rms_norm_default)
alias_1: f32[2, 3, 8] = alias(view_as)
exact_sum_default: f32[2, 3, 1] = specpass.exact_sum(alias_1, [-1], True, False, None)
add: f32[2, 3, 8] = add.Tensor(exact_linear_default, exact_sum_default)
exact_attention_default: f32[2, 4, 3, 16] = specpass.exact_attention(q_1, k_1, v_1, None, True, None, True)
to: f32[2, 3, 8] = to.dtype(add, f32)
exact_softmax_default: f32[2, 3, 8] = specpass.exact_softmax(to, -1, False, None)
to_1: f32[2, 3, 8] = to.dtype(exact_softmax_default, f32)
exact_layer_norm_default: f32[2, 3, 8] = specpass.exact_layer_norm(to_1, [8], None, None, 1e-05)
exact_sum_default_1: f32[2, 3, 16] = specpass.exact_sum(exact_attention_default, [1], False, True, None)
exact_logsumexp_default: f32[2, 3] = specpass.exact_logsumexp(to, [-1], False)
return (exact_layer_norm_default, exact_sum_default_1, exact_logsumexp_default)""")
        fired = [f for f in result.report.of("exact")]
        assert len(fired) == 9 and all(f.fired for f in fired)

    def test_off_by_default_and_split_kv_is_off_in_exact_mode(self):
        result = traced(layer, (2, 3, 8), (8, 8), (8,), (2, 4, 3, 16), (2, 2, 3, 16), (2, 2, 3, 16))
        assert not result.report.of("exact") and "exact_" not in graph_str(result.graph_module)
        assert not specpass.Options.make(exact=True).split_kv
        with pytest.raises(ValueError, match="exact=True and split_kv=True"):
            specpass.Options.make(exact=True, split_kv=True)

    def test_an_op_without_an_exact_kernel_is_left_with_its_reason_and_the_backend_refuses_the_graph(self):
        def fn(x):
            return x.cumsum(-1) + torch.var(x, -1, keepdim=True)

        result = traced(fn, (4, 8), exact=True)
        self.assertExpectedInline("\n".join(str(f) for f in result.report.of("exact")), """\
[exact] left alone cumsum: cumsum.default adds floats and exact mode has no kernel for it
[exact] left alone var: var.dim adds floats and exact mode has no kernel for it""")
        compiled = torch.compile(fn, backend=specpass.backend(exact=True, handoff="eager"), fullgraph=True)
        with pytest.raises(Exception, match="exact mode cannot make fn row-invariant: cumsum.default adds floats") as exc:
            compiled(torch.randn(4, 8))
        assert isinstance(exc.value.__cause__ or exc.value.inner_exception, ExactModeError)


PROMPTS = [[3, 14, 15], [9, 2, 6, 5, 35, 89, 79, 32, 38], [46]]  # ragged: 3, 9 and 1 tokens
NEW = 16
EXACT_EAGER = specpass.backend(exact=True, handoff="eager")  # the rewrite without Inductor: exact kernels, fast


@pytest.fixture(scope="module")
def zoo_target():
    return zoo.build("tiny-llama", seed=0, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def zoo_plain(zoo_target):
    dec = Decoder(zoo_target, None, max_batch=3, max_len=64, compile=EXACT_EAGER, exact=True)
    return dec.generate(PROMPTS, NEW).tokens


def zoo_drafter(shape, target):
    dtype = torch.bfloat16
    if shape == "block":
        return zoo.build("tiny-llama-dflash", seed=4, target=target, dtype=dtype), 4
    if shape == "parallel":
        return adapt(zoo.build("tiny-llama-peagle3", seed=3, dtype=dtype)), 3
    head = ZooDrafter(zoo.build("tiny-llama-eagle3", seed=3, dtype=dtype))
    return head, (TreeShape(2, 3, 6) if shape == "tree" else 4)


@pytest.mark.parametrize("shape,fused", [("chain", False), ("chain", True), ("tree", True), ("parallel", True),
                                         ("block", True)], ids=["chain-apart", "chain", "tree", "parallel", "block"])
def test_exact_speculative_equals_exact_plain_zoo(zoo_target, zoo_plain, shape, fused):
    drafter, k = zoo_drafter(shape, zoo_target)
    dec = Decoder(zoo_target, drafter, k=k, max_batch=3, max_len=64, compile=EXACT_EAGER, exact=True, fused_round=fused)
    assert dec.generate(PROMPTS, NEW).tokens == zoo_plain
    if fused:
        assert dec.generate(PROMPTS[1:2], NEW).tokens == zoo_plain[1:2]  # bs 1


def test_exact_mode_under_inductor(zoo_target, zoo_plain):
    """compile="specpass": the rewritten steps through Inductor (emulated precision casts), fused chain."""
    drafter, k = zoo_drafter("chain", zoo_target)
    dec = Decoder(zoo_target, drafter, k=k, max_batch=3, max_len=64, exact=True, fused_round=True)
    assert dec.generate(PROMPTS, NEW).tokens == zoo_plain


def test_exact_speculative_equals_exact_plain_transformers():
    """An EAGLE-3 head's tree rounds on a transformers Llama, left-padded ragged prompts."""
    model = hf_build("llama").to(torch.bfloat16)
    ids = torch.tensor([[0, 0, 0, 5, 9, 2, 7], [3, 14, 15, 9, 26, 5, 35]])
    mask = (ids != 0) | (torch.arange(7) >= 3)
    run = dict(attention_mask=mask, max_new_tokens=NEW, compile=EXACT_EAGER, exact=True)
    plain = specpass.generate(model, ids, **run)
    tree = specpass.generate(model, ids, assistant_model=eagle3_head(model).to(torch.bfloat16),
                             num_assistant_tokens=TreeShape(2, 3, 6), **run)
    assert torch.equal(tree, plain)


def test_exact_mode_makes_the_rows_bits_independent_of_the_row_count():
    """fp32, where CPU matmuls of 1 row and of 12 round differently: the target's logits for a
    prompt's tokens one at a time (a decode step each) against all at once (a prefill, a verify)."""
    target = zoo.build("tiny-llama", seed=0)
    target.setup_caches(2, 32)
    prompt = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12).expand(2, 12)

    def rows_alike(**options):
        step = torch.compile(target.forward, backend=specpass.backend(handoff="eager", **options), dynamic=False)
        with torch.no_grad():
            whole = step(prompt, positions)
            return [torch.equal(whole[:, i], step(prompt[:, i:i + 1], positions[:, i:i + 1])[:, 0]) for i in range(12)]

    assert all(rows_alike(exact=True))
    assert not all(rows_alike())  # the default mode's rows differ: what exact mode buys


def test_bad_exact_settings_are_refused_with_the_reason(zoo_target):
    kw = dict(max_batch=3, max_len=64)
    for compile in ("eager", "inductor"):
        with pytest.raises(ValueError, match="exact=True needs compile='specpass'"):
            Decoder(zoo_target, None, compile=compile, exact=True, **kw)
    with pytest.raises(ValueError, match="exact must be True or False"):
        Decoder(zoo_target, None, exact="yes", **kw)
    with pytest.raises(ValueError, match="needs the prefill compiled"):
        Decoder(zoo_target, None, exact=True, compile_prefill=False, **kw)
    with pytest.raises(ValueError, match="exact=True with group= .tensor parallel. is not supported: the all-reduce"):
        Decoder(zoo_target, None, exact=True, group=object(), **kw)
    with pytest.raises(ValueError, match="exact=True runs on CPU and CUDA, not on meta"):
        Decoder(zoo.build("tiny-llama").to("meta"), None, exact=True, **kw)

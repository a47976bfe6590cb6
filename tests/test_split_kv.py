"""The split-KV pass: SDPA of a few tokens per request with enable_gqa becomes
`torch.ops.specpass.attend_split` on CUDA graphs. On CPU the graphs are traced with fake CUDA
tensors (the pass reads only fake tensors), the zoo's verify step among them (its attention is
plain SDPA: the kernel is the pass's choice); the refusals, each with its reason; the op's CPU
implementation against SDPA. On a GPU (through the device machine): a compiled transformers
Llama's verify step and `specpass.generate` with the pass, against the same compile without it."""

import expecttest
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import specpass
from models import zoo
from specpass.kernels import attend_split_refusal
from specpass.options import Options
from specpass.passes import split_kv
from specpass.pipeline import propagate_fake_tensors
from specpass.testing import graph_str

B, HK, G, T, S, D = 2, 2, 3, 5, 40, 64  # 2 kv heads, 6 query heads, a verify of 5 tokens


def repeat_kv(x, g=G):
    """transformers' repeat_kv (unsqueeze for its `[:, :, None]`: fake CUDA tensors take no Python indexing)."""
    b, hk, s, d = x.shape
    return x.unsqueeze(2).expand(b, hk, g, s, d).reshape(b, hk * g, s, d)


def fakes(mode, t=T, g=G, d=D, dtype=torch.bfloat16, mask_shape=None, mask_dtype=torch.bool, device="cuda"):
    with mode:
        q = torch.empty(B, HK * g, t, d, device=device, dtype=dtype)  # [B, hq, T, d], transformers' layout
        k, v = (torch.empty(B, HK, S, d, device=device, dtype=dtype) for _ in range(2))
        mask = torch.empty(mask_shape or (B, 1, t, S), device=device, dtype=mask_dtype)
    return q, k, v, mask


def traced(fn, *args, **options):
    """fn's IR (make_fx, as specpass.capture traces it) on fake tensors, and specpass.rewrite of it."""
    with args[0].fake_mode:
        gm = make_fx(fn, pre_dispatch=True)(*args)
    return gm, specpass.rewrite(gm, **options)


def verdicts(result):
    return "\n".join(str(f) for f in result.report.of("split_kv"))


def transformers_attention(q, k, v, mask):
    """transformers' SDPA path with a mask: K/V repeated, then attention."""
    return F.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), attn_mask=mask, scale=0.125)


class TestGraphs(expecttest.TestCase):
    def test_after_the_gqa_rewrite(self):
        gm, result = traced(transformers_attention, *fakes(FakeTensorMode()))
        self.assertExpectedInline(graph_str(result.graph_module), """\
q_1: bf16[2, 6, 5, 64]
k_1: bf16[2, 2, 40, 64]
v_1: bf16[2, 2, 40, 64]
mask_1: b8[2, 1, 5, 40]
transpose_int: bf16[2, 5, 6, 64] = transpose.int(q_1, 1, 2)
transpose_int_1: bf16[2, 40, 2, 64] = transpose.int(k_1, 1, 2)
transpose_int_2: bf16[2, 40, 2, 64] = transpose.int(v_1, 1, 2)
attend_split: bf16[2, 5, 6, 64] = specpass.attend_split(transpose_int, transpose_int_1, transpose_int_2, mask_1, 0.125)
transpose_int_3: bf16[2, 6, 5, 64] = transpose.int(attend_split, 1, 2)
clone_default: bf16[2, 6, 5, 64] = clone(transpose_int_3, memory_format=torch.contiguous_format)
return clone_default""")
        self.assertExpectedInline(verdicts(result), """[split_kv] rewrote scaled_dot_product_attention: runs as specpass.attend_split (split-KV: 5 tokens x 3 query heads = 15 rows per K/V head, each of the 2 K/V heads read once) instead of SDPA""")
        assert [f.fired for f in result.report.of("gqa")] == [True]
        assert result.report.matmul_flops[0] == result.report.matmul_flops[1] > 0  # the same attention

    def test_default_scale_and_a_broadcast_mask(self):
        """enable_gqa as the model wrote it; a [T, S] mask is expanded (a view) to [B, 1, T, S];
        SDPA's default scale 1 / sqrt(64) is written out."""
        def fn(q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        _, result = traced(fn, *fakes(FakeTensorMode(), mask_shape=(T, S)))
        self.assertExpectedInline(graph_str(result.graph_module), """\
q_1: bf16[2, 6, 5, 64]
k_1: bf16[2, 2, 40, 64]
v_1: bf16[2, 2, 40, 64]
mask_1: b8[5, 40]
transpose_int: bf16[2, 5, 6, 64] = transpose.int(q_1, 1, 2)
transpose_int_1: bf16[2, 40, 2, 64] = transpose.int(k_1, 1, 2)
transpose_int_2: bf16[2, 40, 2, 64] = transpose.int(v_1, 1, 2)
expand_default: b8[2, 1, 5, 40] = expand(mask_1, [2, 1, 5, 40])
attend_split: bf16[2, 5, 6, 64] = specpass.attend_split(transpose_int, transpose_int_1, transpose_int_2, expand_default, 0.125)
transpose_int_3: bf16[2, 6, 5, 64] = transpose.int(attend_split, 1, 2)
clone_default: bf16[2, 6, 5, 64] = clone(transpose_int_3, memory_format=torch.contiguous_format)
return clone_default""")

    def test_option_off(self):
        gm, result = traced(transformers_attention, *fakes(FakeTensorMode()), split_kv=False)
        assert result.report.of("split_kv") == []
        (attention,) = result.graph_module.graph.find_nodes(
            op="call_function", target=torch.ops.aten.scaled_dot_product_attention.default)
        assert attention.kwargs["enable_gqa"]

    def test_cpu_graph_is_not_a_candidate(self):
        _, result = traced(transformers_attention, *fakes(FakeTensorMode(), device="cpu"))
        assert result.report.of("split_kv") == [] and [f.fired for f in result.report.of("gqa")] == [True]


def on_fake_cuda(gm):
    """A CPU capture as it would be on CUDA: fake CUDA placeholders and factory calls, every meta["val"]
    propagated again (make_fx cannot trace the zoo's Python indexing on fake CUDA tensors)."""
    mode = FakeTensorMode()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            v = node.meta["val"]
            with mode:
                node.meta["val"] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cuda")
        elif node.kwargs.get("device") is not None:  # arange(..., device=cpu)
            node.kwargs = {**node.kwargs, "device": torch.device("cuda")}
    propagate_fake_tensors(gm)
    return gm


@pytest.mark.parametrize("t", [5, 1])
def test_zoo_verify_step_on_cuda(t):
    """The zoo's Llama target (4 query heads over 2 K/V heads, head size 16), bf16: its verify of 5
    tokens per request runs every layer's attention as the split-KV op; a decode step (1 token)
    keeps SDPA, with the reason."""
    B, S = 2, 40
    model = zoo.build("tiny-llama", dtype=torch.bfloat16)
    model.setup_caches(B, S)
    positions = torch.arange(t) + torch.tensor([[3], [20]])
    gm = on_fake_cuda(specpass.capture(model, torch.zeros(B, t, dtype=torch.long), positions))
    findings = specpass.rewrite(gm).report.of("split_kv")
    assert len(findings) == model.config.num_hidden_layers
    assert all(f.fired == (t > 1) for f in findings), "\n".join(map(str, findings))
    if t > 1:
        expected = "runs as specpass.attend_split (split-KV: 5 tokens x 2 query heads = 10 rows per K/V head"
    else:
        expected = "one token per request (a decode or draft step)"
    assert all(expected in f.message for f in findings), findings[0]


def _sdpa_graph(q, k, v, mask, **kwargs):
    """One SDPA node over placeholders carrying these fake tensors: what the pass sees after gqa,
    built by hand where tracing fake CUDA tensors fails (symbolic sizes, float masks)."""
    graph = fx.Graph()
    nodes = []
    for name, value in zip(("q", "k", "v", "mask"), (q, k, v, mask)):
        nodes.append(graph.placeholder(name))
        nodes[-1].meta["val"] = value
    node = graph.call_function(torch.ops.aten.scaled_dot_product_attention.default, (*nodes[:3], nodes[3]),
                               {"enable_gqa": True, **kwargs})
    node.meta["val"] = q.new_empty(*q.shape[:3], v.shape[-1])
    graph.output(node)
    return fx.GraphModule(torch.nn.Module(), graph)


def refusal(q, k, v, mask, **kwargs):
    gm = _sdpa_graph(q, k, v, mask, **kwargs)
    (finding,) = split_kv.run(gm, Options())
    assert not finding.fired
    assert any(n.target is torch.ops.aten.scaled_dot_product_attention.default for n in gm.graph.nodes)
    return finding.message


class TestRefusals(expecttest.TestCase):
    def test_one_token(self):
        self.assertExpectedInline(refusal(*fakes(FakeTensorMode(), t=1)), """one token per request (a decode or draft step): SDPA's own GQA call stays, the kernel's gain is reading the cache once for many query rows""")

    def test_fp32(self):
        self.assertExpectedInline(refusal(*fakes(FakeTensorMode(), dtype=torch.float32)), """torch.float32 / torch.float32 / torch.float32: the kernel's dots take bf16 or fp16 for q, k and v alike""")

    def test_mask_per_head(self):
        self.assertExpectedInline(refusal(*fakes(FakeTensorMode(), mask_shape=(B, HK * G, T, S))), """the mask is [2, 6, 5, 40]: not one mask for all heads, [B, 1, T, S] = [2, 1, 5, 40] or a broadcast of it""")

    def test_additive_mask(self):
        self.assertExpectedInline(refusal(*fakes(FakeTensorMode(), mask_dtype=torch.bfloat16)), """the mask is torch.bfloat16: the kernel reads a bool mask""")

    def test_no_mask(self):
        q, k, v, _ = fakes(FakeTensorMode())
        self.assertExpectedInline(refusal(q, k, v, None), """the mask is absent: the kernel reads a bool mask""")

    def test_head_size_not_a_power_of_two(self):
        self.assertExpectedInline(refusal(*fakes(FakeTensorMode(), d=48)), """head sizes 48 (q, k), 48 (v): the kernel takes powers of two from 16 to 256, one for q and k""")

    def test_too_many_rows(self):
        self.assertExpectedInline(refusal(*fakes(FakeTensorMode(), t=86)), """T = 86 tokens x 3 query heads per K/V head: more than 256 rows per K/V head (or a symbolic length), a prefill's shape""")

    def test_one_query_head_per_kv_head(self):
        self.assertExpectedInline(refusal(*fakes(FakeTensorMode(), g=1)), """2 query heads over as many K/V heads: SDPA reads every K/V head once already""")

    def test_causal_and_dropout(self):
        self.assertExpectedInline(refusal(*fakes(FakeTensorMode()), is_causal=True), """is_causal: the kernel reads an explicit mask""")
        self.assertExpectedInline(refusal(*fakes(FakeTensorMode()), dropout_p=0.1), """dropout_p=0.1: the kernel draws no random numbers""")

    def test_symbolic_length(self):
        from torch._dynamo.source import ConstantSource
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        env = ShapeEnv()
        t = env.create_symintnode(env.create_symbol(5, ConstantSource("T")), hint=5)
        q, k, v, mask = fakes(FakeTensorMode(shape_env=env), t=t)
        self.assertExpectedInline(refusal(q, k, v, mask), """T = s47 tokens is symbolic (a prefill): the kernel is for a verify's few static rows""")
        # the kernel's own check refuses it too, without a guard
        why = attend_split_refusal(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        assert why is not None and "symbolic" in why and not env.guards


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,g,s", [(5, 3, 40), (2, 4, 300), (9, 1, 17), (1, 6, 64)])
def test_cpu_implementation_is_sdpa(dtype, t, g, s):
    """The op's CPU implementation (the folded SDPA) against SDPA's own GQA on the same mask, with a
    row that sees no slot (0 in both)."""
    gen = torch.Generator().manual_seed(t * s + g)
    q = torch.randn(B, t, HK * g, D, generator=gen).to(dtype)  # the op's layout [B, T, hq, d]
    k, v = (torch.randn(B, s, HK, D, generator=gen).to(dtype) for _ in range(2))
    mask = torch.rand(B, 1, t, s, generator=gen) < 0.6
    mask[..., 0] = True
    mask[1, 0, 0] = False  # request 1's first token sees nothing
    got = torch.ops.specpass.attend_split(q, k, v, mask, 0.3)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                          scale=0.3, enable_gqa=g != 1).transpose(1, 2)
    assert got.shape == want.shape and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got[1, 0], torch.zeros_like(got[1, 0]))


# ----------------------------------------------------------------------------- GPU

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel needs a CUDA GPU and Triton")


def _llama(layers=2, seed=0):
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=384, intermediate_size=512, num_hidden_layers=layers,
                                      num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      initializer_range=0.1, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()


@cuda
def test_transformers_llama_verify_step_on_cuda():
    """A verify step of 5 tokens over a cache of 300 slots through `specpass.generate`'s adapter:
    split_kv fires on every layer (after gqa), and the compiled logits (CUDA graphs) equal eager's
    within what bf16 attention kernels differ by (the unrewritten compile's distance)."""
    from specpass.hf.adapters import HFTarget

    model = _llama()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(3, 256, (4, 5), device="cuda", generator=gen)
    positions = torch.tensor([[40], [100], [7], [250]], device="cuda") + torch.arange(5, device="cuda")
    target = HFTarget(model)
    target.setup_caches(4, 300)
    with torch.no_grad():
        target(tokens, positions)  # the probe allocates the caches
        for layer in target.cache.layers:
            layer.keys.normal_(generator=gen), layer.values.normal_(generator=gen)
        report = specpass.rewrite(specpass.capture(target, tokens, positions)).report
        eager = target(tokens, positions).float()
        outs = {}
        for on in (True, False):
            torch._dynamo.reset()
            step = torch.compile(target, backend=specpass.backend(split_kv=on), mode="reduce-overhead", fullgraph=True)
            for _ in range(3):  # warm-up, capture, replay
                out = step(tokens, positions)
            outs[on] = out.float()
    assert [f.fired for f in report.of("split_kv")] == [True] * 2, str(report)
    assert [f.fired for f in report.of("gqa")] == [True] * 2, str(report)
    err = {on: (outs[on] - eager).abs().max().item() for on in outs}
    assert err[True] <= 2 * err[False] + 0.05, err


@cuda
def test_generate_tokens_with_and_without_the_pass():
    """specpass.generate, bf16, a standalone draft: the same tokens with split_kv as without it
    (the pass changes the kernel, not the attention), and with it the verify graph's rewrites say so."""
    model, draft = _llama(layers=3), _llama(layers=1, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    ids = torch.randint(3, 256, (4, 24), device="cuda", generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    mask[3, :17] = 0
    outs = {}
    for on in (True, False):
        torch._dynamo.reset()
        outs[on] = specpass.generate(model, ids, attention_mask=mask, assistant_model=draft, max_new_tokens=32,
                                     num_assistant_tokens=4, compile=specpass.backend(split_kv=on),
                                     return_dict_in_generate=True)
    fired = [line for lines in outs[True].rewrites.values() for line in lines if line.startswith("[split_kv] rewrote")]
    assert len(fired) >= 3, outs[True].rewrites  # the verify's 3 layers (a fused round holds it)
    assert torch.equal(outs[True].sequences, outs[False].sequences)

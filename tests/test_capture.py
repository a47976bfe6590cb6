"""The canonical IR: what capture keeps, what it never does (run the model), HF interop."""

import expecttest
import torch

import specpass
from models.toy import ToyDraft
from specpass.testing import graph_str

aten = torch.ops.aten


def _toy(batch=2, T=4):
    torch.manual_seed(0)
    model = ToyDraft(batch=batch).eval()
    tokens = torch.randint(0, 64, (batch, T))
    return model, tokens, torch.arange(T)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


class TestCapture(expecttest.TestCase):
    def test_toy_ir_is_undecomposed_aten(self):
        model, tokens, positions = _toy()
        with torch.no_grad():
            gm = specpass.capture(model, tokens, positions)
        self.assertExpectedInline(graph_str(gm), """\
tokens: i64[2, 4]
embed_weight: f32[64, 32]
attn_norm_weight: f32[32]
qkv_weight: f32[96, 32]
k_cache: f32[2, 4, 16, 8]
positions: i64[4]
v_cache: f32[2, 4, 16, 8]
o_proj_weight: f32[32, 32]
mlp_norm_weight: f32[32]
up_weight: f32[64, 32]
down_weight: f32[32, 64]
norm_weight: f32[32]
lm_head_weight: f32[64, 32]
embedding: f32[2, 4, 32] = embedding(embed_weight, tokens)
rms_norm: f32[2, 4, 32] = rms_norm(embedding, [32], attn_norm_weight, 1e-06)
linear: f32[2, 4, 96] = linear(rms_norm, qkv_weight)
view: f32[2, 4, 3, 4, 8] = view(linear, [2, 4, 3, 4, 8])
transpose: f32[2, 4, 3, 4, 8] = transpose.int(view, 1, 3)
unbind: (f32[2, 4, 4, 8], f32[2, 4, 4, 8], f32[2, 4, 4, 8]) = unbind.int(transpose, 2)
getitem: f32[2, 4, 4, 8] = getitem(unbind, 0)
getitem_1: f32[2, 4, 4, 8] = getitem(unbind, 1)
getitem_2: f32[2, 4, 4, 8] = getitem(unbind, 2)
index_copy_: f32[2, 4, 16, 8] = index_copy_(k_cache, 2, positions, getitem_1)
index_copy__1: f32[2, 4, 16, 8] = index_copy_(v_cache, 2, positions, getitem_2)
arange: i64[16] = arange(16, device=cpu, pin_memory=False)
unsqueeze: i64[1, 16] = unsqueeze(arange, 0)
unsqueeze_1: i64[4, 1] = unsqueeze(positions, 1)
le: b8[4, 16] = le.Tensor(unsqueeze, unsqueeze_1)
scaled_dot_product_attention: f32[2, 4, 4, 8] = scaled_dot_product_attention(getitem, index_copy_, index_copy__1, le)
transpose_1: f32[2, 4, 4, 8] = transpose.int(scaled_dot_product_attention, 1, 2)
reshape: f32[2, 4, 32] = reshape(transpose_1, [2, 4, -1])
linear_1: f32[2, 4, 32] = linear(reshape, o_proj_weight)
add: f32[2, 4, 32] = add.Tensor(embedding, linear_1)
rms_norm_1: f32[2, 4, 32] = rms_norm(add, [32], mlp_norm_weight, 1e-06)
linear_2: f32[2, 4, 64] = linear(rms_norm_1, up_weight)
silu: f32[2, 4, 64] = silu(linear_2)
linear_3: f32[2, 4, 32] = linear(silu, down_weight)
add_1: f32[2, 4, 32] = add.Tensor(add, linear_3)
rms_norm_2: f32[2, 4, 32] = rms_norm(add_1, [32], norm_weight, 1e-06)
linear_4: f32[2, 4, 64] = linear(rms_norm_2, lm_head_weight)
select: f32[2, 64] = select.int(linear_4, 1, -1)
return (select,)""")

    def test_every_tensor_node_has_a_fake_value(self):
        model, tokens, positions = _toy()
        gm = specpass.capture(model, tokens, positions)
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "call_function"):
                self.assertIn("val", node.meta, node.name)

    def test_capture_does_not_run_the_model(self):
        model, tokens, positions = _toy()
        specpass.capture(model, tokens, positions)
        self.assertEqual(model.k_cache.abs().sum().item(), 0.0)

    def test_kv_write_spellings_stay_in_place(self):
        cache = torch.zeros(2, 8, 4)

        def step(x, pos, rows):
            cache[:, 1:3] = x  # slice assignment
            cache[rows, pos] = x[:, 0]  # advanced-index assignment
            return torch.softmax(cache.sum(1), -1)

        gm = specpass.capture(step, torch.randn(2, 2, 4), torch.tensor([1, 3]), torch.tensor([0, 1]))
        targets = _targets(gm)
        self.assertIn(aten.index_put_.default, targets)
        copy = next(n for n in gm.graph.nodes if n.target is aten.copy_.default)
        self.assertIs(copy.args[0].target, aten.slice.Tensor)  # a write into a view of the cache
        self.assertEqual(copy.args[0].args[0].name, "cache")
        self.assertIn(aten.softmax.int, targets)

    def test_unsupported_graph_needs_one_graph(self):
        def with_break(x):
            y = x * 2
            torch._dynamo.graph_break()
            return y + 1

        with self.assertRaisesRegex(specpass.CaptureError, "with_break must compile to one graph.*graph_break"):
            specpass.capture(with_break, torch.randn(3))


class TestHuggingFaceCapture(expecttest.TestCase):
    def test_llama_static_cache(self):
        from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        cache = StaticCache(config=config, max_cache_len=16)
        cache.early_initialization(batch_size=2, num_heads=2, head_dim=8, dtype=torch.float32,
                                   device=torch.device("cpu"))

        def step(ids, cache_position):
            out = model(input_ids=ids, past_key_values=cache, cache_position=cache_position, use_cache=True)
            return out.logits[:, -1]

        with torch.no_grad():
            gm = specpass.capture(step, torch.randint(0, 64, (2, 5)), torch.arange(5))
        targets = _targets(gm)
        self.assertEqual(targets.count(aten.index_copy_.default), 4)  # K and V, two layers
        self.assertEqual(targets.count(aten.scaled_dot_product_attention.default), 2)
        self.assertIn(aten.linear.default, targets)
        self.assertEqual(gm.graph.output_node().args[0][0].target, aten.select.int)


def test_a_lifted_constant_keeps_dynamo_s_inputs():
    """A scalar written in place (`y[:, 0] = -1`) is a tensor constant in the IR, which make_fx
    registers as a buffer. AOTAutograd would lift it into an input ahead of Dynamo's, and the
    static-input indices it reads from Dynamo's metadata (parameters, KV caches: what lets CUDA
    graphs accept in-place writes) would name the wrong inputs. The backend keeps the constant a
    plain attribute and every placeholder its Dynamo source; the compiled function is exact."""
    from specpass.capture import adopt_dynamo_inputs, to_aten_ir

    cache = torch.zeros(2, 4)
    adopted = []

    def spy(gm, example_inputs):
        aten_gm = to_aten_ir(gm, example_inputs)
        assert [name for name, _ in aten_gm.named_buffers()] == ["_tensor_constant0"]  # the -1
        adopt_dynamo_inputs(gm, aten_gm)
        adopted.append(aten_gm)
        return aten_gm.forward

    def step(x):
        y = x * 2
        y[:, 0] = -1
        cache.copy_(y)
        return y.sum()

    x = torch.randn(2, 4)
    out = torch.compile(step, backend=spy, fullgraph=True)(x)
    (gm,) = adopted
    assert dict(gm.named_buffers()) == {} and isinstance(gm._tensor_constant0, torch.Tensor)
    sources = [getattr(n, "_dynamo_source", None) for n in gm.graph.find_nodes(op="placeholder")]
    assert len(sources) == 2 and all(s is not None for s in sources), sources  # x and the cache
    want = x * 2
    want[:, 0] = -1
    assert torch.equal(cache, want) and torch.equal(out, want.sum())
    cache.zero_()
    torch._dynamo.reset()
    out = torch.compile(step, backend=specpass.backend(), fullgraph=True)(x)  # through the passes and Inductor
    assert torch.equal(cache, want) and torch.allclose(out, want.sum())


class MaskedBlock(torch.nn.Module):
    """gpt_neo's spelling: the mask value made as a tensor inside the layer, a constant of its body."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        low = torch.tensor(torch.finfo(x.dtype).min, dtype=x.dtype)
        return torch.where(x > 0, self.proj(x), low).clamp(min=-10.0)


def test_a_scalar_constant_of_a_region_body_is_made_where_it_is_read():
    """A 0-d constant in a repeated block's body: made by `aten.full` in the body (AOTAutograd's
    trace of a body holding a constant attribute fails in some torch versions), the value unchanged,
    and through Inductor exact."""
    from specpass.capture import to_aten_ir
    from specpass.graph import region_body, is_region_call

    torch.manual_seed(0)
    stack = torch.nn.ModuleList([MaskedBlock() for _ in range(3)])
    specpass.mark_repeated_blocks(stack)
    captured = []

    def spy(gm, example_inputs):
        captured.append(to_aten_ir(gm, example_inputs))
        return captured[-1].forward  # the IR runs the call

    def run(x):
        for block in stack:
            x = block(x)
        return x

    x = torch.randn(2, 4)
    with torch.no_grad():
        want = run(x)
        got = torch.compile(run, backend=spy, fullgraph=True)(x)
        (gm,) = captured
        bodies = {region_body(n) for n in gm.graph.nodes if is_region_call(n)}
        assert bodies, "the blocks were not captured as a region"
        for body in bodies:
            assert not body.graph.find_nodes(op="get_attr")
            (full,) = [n for n in body.graph.nodes if n.target is aten.full.default]
            assert full.args[1] == torch.finfo(torch.float32).min
        assert torch.equal(got, want)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(run, backend=specpass.backend(), fullgraph=True)(x), want)


def test_reads_of_a_cuda_tensor_to_the_host_are_found_in_bodies_too():
    """What makes the backend compile a step without CUDA graphs: a read of a CUDA tensor's value (ATen's
    `_local_scalar_dense`, Dynamo's `.tolist()`: a MoE's expert sizes), at the top or inside a body;
    a CPU tensor's read is not one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from specpass.graph import device_reads_to_host

    def reads(device):
        with FakeTensorMode():
            value = torch.empty(4, dtype=torch.long, device=device)
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        x.meta["val"] = value
        size = graph.call_function(aten._local_scalar_dense.default, (x,))
        y = graph.placeholder("y")
        y.meta["example_value"] = value  # a Dynamo graph's
        sizes = graph.call_method("tolist", (y,))
        graph.output((size, sizes))
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    for device, found in (("cuda", 2), ("cpu", 0)):
        assert len(device_reads_to_host(reads(device))) == found
        graph = torch.fx.Graph()
        graph.output(graph.get_attr("body"))
        outer = torch.fx.GraphModule({"body": reads(device)}, graph)  # a region's body, say
        assert len(device_reads_to_host(outer)) == found


def test_a_cat_with_an_empty_part_stays_contiguous_through_inductor():
    """gpt-neox-japanese's rotary split with nothing passed through: `cat([rotated, x[..., 16:]])` of a
    permuted tensor, then `.contiguous().view(...)`. The IR's trace records no `.contiguous()` (the cat
    is contiguous); Inductor's decomposition drops the empty part and keeps the permuted strides. The
    IR makes that cat a contiguous copy: compiled with its rewrites, no warning, exact."""
    import warnings

    def heads(qkv):  # [B, T, H * 16] -> [B * H, T, 16]
        b, t = qkv.shape[:2]
        q = qkv.view(b, t, 2, 16).permute(0, 2, 1, 3)
        q = torch.cat((q[..., :16] * 2, q[..., 16:]), dim=-1).contiguous()
        return q.view(b * 2, t, 16).softmax(-1).max(-1)

    x = torch.randn(3, 4, 32)
    want = heads(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", specpass.SpecpassWarning)
        got = torch.compile(heads, backend=specpass.backend(), fullgraph=True)(x)
    assert torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0])

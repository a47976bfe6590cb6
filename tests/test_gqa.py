"""The GQA pass: graph diffs, the spellings of a head repeat it proves, numerics against the
unrewritten graph (bit for bit on CPU), the traps it refuses, and transformers' Llama."""

import expecttest
import pytest
import torch
import torch.nn.functional as F

import specpass
from specpass.testing import calls_rewritten, graph_str

B, HK, G, T, S, D = 2, 2, 3, 4, 10, 8  # 2 kv heads, 6 query heads


def repeat_kv(x, g=G):
    """transformers' repeat_kv."""
    b, hk, s, d = x.shape
    return x[:, :, None, :, :].expand(b, hk, g, s, d).reshape(b, hk * g, s, d)


def inputs(dtype=torch.float32, hk=HK, g=G, t=T, s=S, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, t, hk * g, D, generator=gen).transpose(1, 2).to(dtype)  # [B, H, T, D], as projected
    k, v = (torch.randn(B, hk, s, D, generator=gen).to(dtype) for _ in range(2))
    mask = torch.rand(B, 1, t, s, generator=gen) < 0.7
    mask[..., 0] = True
    return q, k, v, mask


def rewrite(fn, *args, **options):
    gm = specpass.capture(fn, *args)
    return gm, specpass.rewrite(gm, **options)


def findings(result):
    return [str(f) for f in result.report.of("gqa")]


def compiled(fn, *args):
    torch._dynamo.reset()
    return torch.compile(fn, backend=specpass.backend(handoff="eager"), fullgraph=True)(*args)


class Cached(torch.nn.Module):
    """A verify step's attention: K/V written into the cache, then attention over all of it."""

    def __init__(self, hk=HK):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(B, hk, S, D))
        self.register_buffer("v_cache", torch.zeros(B, hk, S, D))

    def forward(self, q, k, v, pos, mask):
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        return F.scaled_dot_product_attention(q, repeat_kv(self.k_cache), repeat_kv(self.v_cache), attn_mask=mask,
                                              scale=0.3)


class TestGraphs(expecttest.TestCase):
    def test_repeat_kv_of_the_cache(self):
        q, k, v, mask = inputs()
        pos = torch.arange(3, 3 + T)
        gm, result = rewrite(Cached(), q, k[:, :, :T], v[:, :, :T], pos, mask)
        self.assertExpectedInline(graph_str(gm), """\
k_cache: f32[2, 2, 10, 8]
pos: i64[4]
k: f32[2, 2, 4, 8]
v_cache: f32[2, 2, 10, 8]
v: f32[2, 2, 4, 8]
q: f32[2, 6, 4, 8]
mask: b8[2, 1, 4, 10]
index_copy_: f32[2, 2, 10, 8] = index_copy_(k_cache, 2, pos, k)
index_copy__1: f32[2, 2, 10, 8] = index_copy_(v_cache, 2, pos, v)
unsqueeze: f32[2, 2, 1, 10, 8] = unsqueeze(index_copy_, 2)
expand: f32[2, 2, 3, 10, 8] = expand(unsqueeze, [2, 2, 3, 10, 8])
reshape: f32[2, 6, 10, 8] = reshape(expand, [2, 6, 10, 8])
unsqueeze_1: f32[2, 2, 1, 10, 8] = unsqueeze(index_copy__1, 2)
expand_1: f32[2, 2, 3, 10, 8] = expand(unsqueeze_1, [2, 2, 3, 10, 8])
reshape_1: f32[2, 6, 10, 8] = reshape(expand_1, [2, 6, 10, 8])
scaled_dot_product_attention: f32[2, 6, 4, 8] = scaled_dot_product_attention(q, reshape, reshape_1, mask, scale=0.3)
return (scaled_dot_product_attention,)""")
        self.assertExpectedInline(graph_str(result.graph_module), """\
k_cache: f32[2, 2, 10, 8]
pos: i64[4]
k: f32[2, 2, 4, 8]
v_cache: f32[2, 2, 10, 8]
v: f32[2, 2, 4, 8]
q: f32[2, 6, 4, 8]
mask: b8[2, 1, 4, 10]
index_copy_: f32[2, 2, 10, 8] = index_copy_(k_cache, 2, pos, k)
index_copy__1: f32[2, 2, 10, 8] = index_copy_(v_cache, 2, pos, v)
scaled_dot_product_attention: f32[2, 6, 4, 8] = scaled_dot_product_attention(q, index_copy_, index_copy__1, mask, scale=0.3, enable_gqa=True)
return (scaled_dot_product_attention,)""")
        self.assertExpectedInline("\n".join(findings(result)), """[gqa] rewrote scaled_dot_product_attention: reads index_copy_, index_copy__1 (2 kv heads) with enable_gqa=True instead of their 6-head repeats reshape, reshape_1 (unsqueeze, expand, reshape: query head j reads kv head j // 3)""")

    def test_repeat_interleave_returned_stays_for_its_other_user(self):
        def fn(q, k, v, mask):
            keys = k.repeat_interleave(G, dim=1)
            return F.scaled_dot_product_attention(q, keys, torch.repeat_interleave(v, G, -3), attn_mask=mask), keys

        _, result = rewrite(fn, *inputs())
        self.assertExpectedInline(graph_str(result.graph_module), """\
k: f32[2, 2, 10, 8]
v: f32[2, 2, 10, 8]
q: f32[2, 6, 4, 8]
mask: b8[2, 1, 4, 10]
repeat_interleave: f32[2, 6, 10, 8] = repeat_interleave.self_int(k, 3, 1)
scaled_dot_product_attention: f32[2, 6, 4, 8] = scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
return (scaled_dot_product_attention, repeat_interleave)""")
        self.assertExpectedInline("\n".join(findings(result)), """[gqa] rewrote scaled_dot_product_attention: reads k, v (2 kv heads) with enable_gqa=True instead of their 6-head repeats repeat_interleave, repeat_interleave_1 (repeat_interleave: query head j reads kv head j // 3); the repeats stay for output""")


def _spellings():
    def mqa(x):  # one kv head, broadcast
        return x.expand(-1, HK * G, -1, -1)

    return {
        "repeat_kv": repeat_kv,
        "repeat_interleave": lambda x: x.repeat_interleave(G, dim=1),
        "repeat_interleave_-3": lambda x: torch.repeat_interleave(x, G, -3),
        "unsqueeze_expand_flatten": lambda x: x.unsqueeze(2).expand(-1, -1, G, -1, -1).flatten(1, 2),
        "unsqueeze_repeat_reshape": lambda x: x[:, :, None].repeat(1, 1, G, 1, 1).reshape(B, HK * G, S, D),
        "stack_reshape": lambda x: torch.stack([x] * G, 2).reshape(B, HK * G, S, D),
        "contiguous_between": lambda x: x[:, :, None].expand(B, HK, G, S, D).contiguous().view(B, HK * G, S, D),
        "mqa": mqa,
    }


MASKS = {
    "none": lambda mask, dtype: {},
    "bool": lambda mask, dtype: {"attn_mask": mask},
    "float": lambda mask, dtype: {"attn_mask": torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, -1e4)},
    "causal": lambda mask, dtype: {"is_causal": True},
    "scale": lambda mask, dtype: {"attn_mask": mask, "scale": 0.17},
}


@pytest.mark.parametrize("spelling", list(_spellings()))
def test_spelling_fires_and_matches_bit_for_bit(spelling):
    repeat = _spellings()[spelling]
    hk = 1 if spelling == "mqa" else HK
    q, k, v, mask = inputs(hk=hk, g=HK * G // hk)

    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, repeat(k), repeat(v), attn_mask=mask)

    _, result = rewrite(fn, q, k, v, mask)
    (finding,) = result.report.of("gqa")
    assert finding.fired, finding
    assert torch.equal(compiled(fn, q, k, v, mask), fn(q, k, v, mask))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masking", list(MASKS))
@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("s", [37, 257])
def test_numerics_equal_the_repeated_attention(dtype, masking, t, s):
    """Bit for bit on CPU: both calls run the same kernel, which takes GQA natively."""
    q, k, v, mask = inputs(dtype, t=t, s=s, seed=t)
    kwargs = MASKS[masking](mask, dtype)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), **kwargs)

    _, result = rewrite(fn, q, k, v)
    assert [f.fired for f in result.report.of("gqa")] == [True]
    assert torch.equal(compiled(fn, q, k, v), fn(q, k, v))


def _grouped_by_sizes(x, q):
    return x.repeat_interleave(q.shape[1] // x.shape[1], 1)  # g from the sizes: symbolic with dynamic=True


@pytest.mark.parametrize("repeat", [lambda x, q: repeat_kv(x), _grouped_by_sizes], ids=["repeat_kv", "sizes"])
def test_symbolic_sizes(repeat):
    q, k, v, mask = inputs()

    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, repeat(k, q), repeat(v, q), attn_mask=mask)

    result = specpass.rewrite(specpass.capture(fn, q, k, v, mask, dynamic=True))
    assert [f.fired for f in result.report.of("gqa")] == [True], str(result.report)
    assert result.report.errors == []
    torch._dynamo.reset()
    got = torch.compile(fn, backend=specpass.backend(handoff="eager"), dynamic=True)(q, k, v, mask)
    assert torch.equal(got, fn(q, k, v, mask))


def test_exported_and_decomposed():
    """torch.export's decomposed reshape of the expanded copy (clone + _unsafe_view) is the same repeat."""
    class Attention(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return F.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), attn_mask=mask)

    args = inputs()
    program = specpass.export(torch.export.export(Attention(), args).run_decompositions({}))
    assert [f.fired for f in program.specpass_report.of("gqa")] == [True], str(program.specpass_report)
    assert "clone, _unsafe_view" in program.specpass_report.of("gqa")[0].message
    assert torch.equal(program.module()(*args), Attention()(*args))


class CachedLayers(torch.nn.Module):
    """Two `Cached` layers in a ModuleList, each attending over its own cache."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Cached(), Cached()])

    def forward(self, q, k, v, pos, mask):
        for layer in self.layers:
            q = layer(q, k, v, pos, mask)
        return q


class TestRegionBody(expecttest.TestCase):
    def test_the_shared_body_is_rewritten_once(self):
        """Marked layers (specpass.mark_repeated_blocks): the outer graph calls one body twice; the pass
        rewrites the body once, and its finding counts both calls. (The masks pass, which would give the
        calls a body of its own taking the converted mask, is off.)"""
        model = CachedLayers()
        specpass.mark_repeated_blocks(model)
        q, k, v, mask = inputs()
        args = (q, k[:, :, :T], v[:, :, :T], torch.arange(3, 3 + T), mask)
        with torch.no_grad():
            _, result = rewrite(model, *args, masks=False)
        self.assertExpectedInline(graph_str(result.graph_module), """\
q: f32[2, 6, 4, 8]
k: f32[2, 2, 4, 8]
v: f32[2, 2, 4, 8]
pos: i64[4]
mask: b8[2, 1, 4, 10]
layers_0_k_cache: f32[2, 2, 10, 8]
layers_0_v_cache: f32[2, 2, 10, 8]
layers_1_k_cache: f32[2, 2, 10, 8]
layers_1_v_cache: f32[2, 2, 10, 8]
repeated_subgraph0 = self.repeated_subgraph0
invoke_subgraph: (f32[2, 6, 4, 8]) = invoke_subgraph(repeated_subgraph0, 'subgraph_0', layers_0_k_cache, pos, k, layers_0_v_cache, v, q, mask)
getitem: f32[2, 6, 4, 8] = getitem(invoke_subgraph, 0)
repeated_subgraph0_1 = self.repeated_subgraph0
invoke_subgraph_1: (f32[2, 6, 4, 8]) = invoke_subgraph(repeated_subgraph0_1, 'subgraph_0', layers_1_k_cache, pos, k, layers_1_v_cache, v, getitem, mask)
getitem_1: f32[2, 6, 4, 8] = getitem(invoke_subgraph_1, 0)
return (getitem_1,)""")
        self.assertExpectedInline(graph_str(result.graph_module.repeated_subgraph0), """\
arg0_1: f32[2, 2, 10, 8]
arg1_1: i64[4]
arg2_1: f32[2, 2, 4, 8]
arg3_1: f32[2, 2, 10, 8]
arg4_1: f32[2, 2, 4, 8]
arg5_1: f32[2, 6, 4, 8]
arg6_1: b8[2, 1, 4, 10]
index_copy_: f32[2, 2, 10, 8] = index_copy_(arg0_1, 2, arg1_1, arg2_1)
index_copy__1: f32[2, 2, 10, 8] = index_copy_(arg3_1, 2, arg1_1, arg4_1)
scaled_dot_product_attention: f32[2, 6, 4, 8] = scaled_dot_product_attention(arg5_1, index_copy_, index_copy__1, arg6_1, scale=0.3, enable_gqa=True)
return (scaled_dot_product_attention,)""")
        self.assertExpectedInline("\n".join(findings(result)), """[gqa] rewrote repeated_subgraph0.scaled_dot_product_attention: reads index_copy_, index_copy__1 (2 kv heads) with enable_gqa=True instead of their 6-head repeats reshape, reshape_1 (unsqueeze, expand, reshape: query head j reads kv head j // 3) (a region body: 2 calls run it)""")
        reference = CachedLayers()
        with torch.no_grad():
            want = reference(*args)
            got = compiled(model, *args)
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(model.buffers(), reference.buffers(), strict=True))


class TestRefusals(expecttest.TestCase):
    def assertLeftAlone(self, fn, *args, reason):
        gm, result = rewrite(fn, *args)
        self.assertEqual(graph_str(result.graph_module), graph_str(gm))
        (finding,) = findings(result)
        self.assertIn("left alone", finding)
        self.assertIn(reason, finding)
        if "dropout" not in reason:  # the refused graph is the original one: compiled, it still runs
            fresh = lambda: [a.clone() for a in args]  # noqa: E731 (a graph may write its inputs)
            self.assertTrue(torch.equal(compiled(fn, *fresh()), fn(*fresh())))
        return finding

    def test_repeat_along_the_wrong_axis(self):
        def fn(q, k, v, mask):  # keys repeated along the sequence axis: 3 * S keys
            keys = k[:, :, :, None].expand(B, HK, S, G, D).reshape(B, HK, S * G, D)
            return F.scaled_dot_product_attention(q[:, :HK], keys, keys)

        finding = self.assertLeftAlone(fn, *inputs(), reason="along axis 2, not the head axis 1")
        self.assertExpectedInline(finding, """[gqa] left alone scaled_dot_product_attention: K (reshape) repeats k along axis 2, not the head axis 1""")

    def test_tile_order(self):
        """k.repeat(1, g, 1, 1) gives query head j kv head j % hk; enable_gqa would read j // g."""
        def fn(q, k, v, mask):
            return F.scaled_dot_product_attention(q, k.repeat(1, G, 1, 1), v.repeat(1, G, 1, 1), attn_mask=mask)

        finding = self.assertLeftAlone(fn, *inputs(), reason="tile order")
        self.assertExpectedInline(finding, """[gqa] left alone scaled_dot_product_attention: K (repeat) repeats the 2 heads of k in tile order (query head j would read kv head j % 2; enable_gqa reads j // 3)""")

        def cat(q, k, v, mask):
            return F.scaled_dot_product_attention(q, torch.cat([k] * G, 1), torch.cat([v] * G, 1), attn_mask=mask)

        self.assertLeftAlone(cat, *inputs(), reason="tile order")

    def test_repeat_written_in_place(self):
        def fn(q, k, v, mask):  # through a view, so the write stays in place in the IR
            keys = repeat_kv(k)
            keys[:, :1].zero_()
            return F.scaled_dot_product_attention(q, keys, repeat_kv(v), attn_mask=mask)

        self.assertLeftAlone(fn, *inputs(), reason="K (reshape) is written in place")

    def test_source_written_between_the_repeat_and_attention(self):
        def fn(q, k, v, mask, cache, pos):
            keys, values = repeat_kv(cache), repeat_kv(cache)
            cache.index_copy_(2, pos, k[:, :, :1])
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

        finding = self.assertLeftAlone(fn, *inputs(), torch.zeros(B, HK, S, D), torch.tensor([0]),
                                       reason="writes cache between")
        self.assertExpectedInline(finding, """[gqa] left alone scaled_dot_product_attention: index_copy_ writes cache between the repeat (K) and the attention""")

    def test_enable_gqa_already_set(self):
        def fn(q, k, v, mask):
            return F.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), attn_mask=mask, enable_gqa=True)

        self.assertLeftAlone(fn, *inputs(), reason="enable_gqa is already set")

    def test_dropout(self):
        def fn(q, k, v, mask):
            return F.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), attn_mask=mask, dropout_p=0.1)

        self.assertLeftAlone(fn, *inputs(), reason="dropout_p=0.1")

    def test_only_keys_repeated(self):
        def fn(q, k, v, mask):
            return F.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v).clone() * 1, attn_mask=mask)

        self.assertLeftAlone(fn, *inputs(), reason="V (mul) is not a repeat")

    def test_keys_and_values_of_different_head_counts(self):
        def fn(q, k, v, mask):
            return F.scaled_dot_product_attention(q, repeat_kv(k), v[:, :1].expand(B, HK * G, S, D), attn_mask=mask)

        self.assertLeftAlone(fn, *inputs(), reason="K repeats 2 heads 3 times, V 1 heads 6 times")


def test_no_repeat_no_finding():
    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    _, result = rewrite(fn, *inputs())
    assert findings(result) == []


def _llama(layers=2):
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval(), config


def test_transformers_llama_verify_step():
    """transformers' SDPA path repeats K/V because a mask is given: the pass fires once per layer,
    the repeats are gone, and the step's logits and caches equal eager's bit for bit."""
    from transformers import StaticCache

    model, config = _llama()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    outs = []
    for compile_it in (False, True):
        cache = StaticCache(config=config, max_cache_len=16)
        cache.early_initialization(batch_size=2, num_heads=2, head_dim=8, dtype=torch.float32,
                                   device=torch.device("cpu"))

        def step(tokens, cache_position):
            return model(input_ids=tokens, past_key_values=cache, cache_position=cache_position).logits

        with torch.no_grad():
            model(input_ids=ids[:, :3], past_key_values=cache)
            if compile_it:
                report = specpass.rewrite(specpass.capture(step, ids[:, 3:], torch.arange(3, 7))).report
                step = torch.compile(step, backend=specpass.backend(handoff="eager"), fullgraph=True)
            logits = step(ids[:, 3:], torch.arange(3, 7))
        outs.append((logits, [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]))
    assert [f.fired for f in report.of("gqa")] == [True] * config.num_hidden_layers, str(report)
    assert torch.equal(outs[1][0], outs[0][0])
    assert all(torch.equal(a, b) for a, b in zip(outs[1][1], outs[0][1], strict=True))


def test_transformers_llama_through_generate():
    """specpass.generate with a standalone draft: the verify graph's rewrites cover every target layer,
    and the tokens are transformers' own greedy generate's."""
    model, _ = _llama(layers=3)
    draft, _ = _llama(layers=1)
    ids = torch.tensor([[0, 0, 5, 17, 33], [8, 41, 9, 60, 12]])
    mask = (ids != 0).long()
    out = specpass.generate(model, ids, attention_mask=mask, assistant_model=draft, max_new_tokens=8,
                            num_assistant_tokens=3, compile=specpass.backend(handoff="eager"),
                            return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False))
    fired = [line for line in out.rewrites["verify"] if line.startswith("[gqa] rewrote")]
    assert calls_rewritten(fired) == 3, out.rewrites["verify"]
    assert any("repeated_subgraph" in line for line in fired), fired  # most through the layers' one shared body


def test_after_the_live_row_gather():
    """A grouped-query catch-up step: the live-row gather still lands before attention (its query
    rows), and the attention it left reads the un-repeated cache; the step equals eager."""
    from models.toy import ToyDraft

    torch.manual_seed(0)
    model = ToyDraft(kv_heads=2).eval()
    tokens, positions = torch.randint(0, 64, (2, 4)), torch.arange(4)
    result = specpass.rewrite(specpass.capture(model, tokens, positions))
    (rows,) = [f for f in result.report.of("live_rows") if f.rows is not None]  # the row gather's verdict
    (grouped,) = result.report.of("gqa")
    assert rows.fired and rows.rows == (8, 2) and grouped.fired, str(result.report)
    (attention,) = result.graph_module.graph.find_nodes(op="call_function",
                                                        target=torch.ops.aten.scaled_dot_product_attention.default)
    assert attention.kwargs["enable_gqa"] and attention.meta["val"].shape == (2, 4, 1, 8)  # 1 query row
    with torch.no_grad():
        want, want_cache = model(tokens, positions), model.k_cache.clone()
        model.k_cache.zero_(), model.v_cache.zero_()
        got = compiled(model, tokens, positions)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # matmuls over fewer rows round otherwise
    assert torch.equal(model.k_cache, want_cache)

"""The live-row pass on every zoo draft head and on Hugging Face models: graph diffs, the rows it
saves, and numerics against eager (outputs and KV caches)."""

import expecttest
import pytest
import torch

import specpass
from models.zoo import build
from specpass.testing import full_row_matmuls, graph_str

aten = torch.ops.aten
HEADS = ["tiny-llama-eagle3", "tiny-deepseek-eagle3-mla", "tiny-deepseek-nextn", "tiny-qwen3.5-nextn",
         "tiny-qwen3.5-moe-nextn", "tiny-llama-draft"]
B, T, S = 3, 4, 16


def _catch_up(name):
    """A head with its caches, and catch-up inputs: per-request positions and live rows differ."""
    model = build(name)
    model.setup_caches(B, S)
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    positions = torch.arange(T) + torch.tensor([[2], [7], [0]])
    width = {"eagle3": 3 * getattr(cfg, "target_hidden_size", cfg.hidden_size), "nextn": cfg.hidden_size}
    kind = next((k for k in width if k in name), None)
    hidden = None if kind is None else torch.randn(B, T, width[kind], generator=g)
    return model, (tokens, positions, hidden, torch.tensor([3, 0, 2]))


def _caches(model):
    return [b.clone() for n, b in model.named_buffers() if "cache" in n]


@pytest.mark.filterwarnings("error::specpass.SpecpassWarning")
@pytest.mark.parametrize("name", HEADS)
def test_head_matches_eager(name):
    model, inputs = _catch_up(name)
    with torch.no_grad():
        want = model.catch_up(*inputs)
        want_caches = _caches(model)
        for n, b in model.named_buffers():
            if "cache" in n:
                b.zero_()
        got = torch.compile(model.catch_up, backend=specpass.backend(handoff="eager"))(*inputs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(g, w) for g, w in zip(_caches(model), want_caches, strict=True))


@pytest.mark.parametrize("name", HEADS)
def test_head_attention_runs_on_live_rows(name):
    """The gather lands inside the last layer, before attention: T times fewer query rows there,
    every earlier layer untouched, and T times fewer matmul FLOPs from the query projection on."""
    model, inputs = _catch_up(name)
    gm = specpass.capture(model.catch_up, *inputs)
    result = specpass.rewrite(gm, argmax=False)
    (finding,) = result.report.of("live_rows")
    assert finding.fired and finding.rows == (B * T, B)
    assert finding.matmul_flops[1] * T == finding.matmul_flops[0]

    def queries(graph_module):
        return [n.meta["val"].shape[-2] for n in graph_module.graph.nodes
                if n.target is aten.scaled_dot_product_attention.default]

    *earlier, last = queries(gm)
    assert queries(result.graph_module) == earlier + [last // T]


class TestGraphs(expecttest.TestCase):
    def _tail(self, name):
        """The rewritten graph from the last KV write on (the part the pass changes)."""
        model, inputs = _catch_up(name)
        text = graph_str(specpass.rewrite(specpass.capture(model.catch_up, *inputs), argmax=False).graph_module)
        lines = text.splitlines()
        last_write = max(i for i, line in enumerate(lines) if "index_put_(" in line)
        return "\n".join(lines[last_write:])

    def test_llama_eagle3(self):
        self.assertExpectedInline(self._tail("tiny-llama-eagle3"), """\
index_put__1: f32[3, 16, 2, 16] = index_put_(midlayer_self_attn_v_cache, [unsqueeze_11, positions], view_1)
slice_5: f32[3, 16, 2, 16] = slice.Tensor(index_put_, 0, 0, 3)
slice_6: f32[3, 16, 2, 16] = slice.Tensor(index_put__1, 0, 0, 3)
transpose: f32[3, 4, 1, 16] = transpose.int(add, 1, 2)
transpose_1: f32[3, 2, 16, 16] = transpose.int(slice_5, 1, 2)
transpose_2: f32[3, 2, 16, 16] = transpose.int(slice_6, 1, 2)
scaled_dot_product_attention: f32[3, 4, 1, 16] = scaled_dot_product_attention(transpose, transpose_1, transpose_2, le, scale=0.25, enable_gqa=True)
transpose_3: f32[3, 1, 4, 16] = transpose.int(scaled_dot_product_attention, 1, 2)
reshape_1: f32[3, 1, 64] = reshape(transpose_3, [3, 1, 64])
linear_4: f32[3, 1, 64] = linear(reshape_1, midlayer_self_attn_o_proj_weight)
linear_rows: f32[3, 1, 64] = index.Tensor(linear, [unsqueeze_default_1, unsqueeze_default])
add_2: f32[3, 1, 64] = add.Tensor(linear_rows, linear_4)
rms_norm_2: f32[3, 1, 64] = rms_norm(add_2, [64], midlayer_post_attention_layernorm_weight, 1e-05)
linear_5: f32[3, 1, 128] = linear(rms_norm_2, midlayer_mlp_gate_proj_weight)
silu: f32[3, 1, 128] = silu(linear_5)
linear_6: f32[3, 1, 128] = linear(rms_norm_2, midlayer_mlp_up_proj_weight)
mul_6: f32[3, 1, 128] = mul.Tensor(silu, linear_6)
linear_7: f32[3, 1, 64] = linear(mul_6, midlayer_mlp_down_proj_weight)
add_3: f32[3, 1, 64] = add.Tensor(add_2, linear_7)
rms_norm_3: f32[3, 1, 64] = rms_norm(add_3, [64], norm_weight, 1e-05)
linear_8: f32[3, 1, 96] = linear(rms_norm_3, lm_head_weight)
index: f32[3, 96] = reshape(linear_8, [3, 96])
index_1: f32[3, 64] = reshape(add_3, [3, 64])
return (index, index_1)""")

    def test_deepseek_eagle3_mla(self):
        self.assertExpectedInline(self._tail("tiny-deepseek-eagle3-mla"), """\
index_put__1: f32[3, 16, 8] = index_put_(midlayer_self_attn_k_rope_cache, [unsqueeze_12, positions], select)
view_1: f32[4, 28, 24] = view(midlayer_self_attn_kv_b_proj_weight, [4, 28, 24])
slice_5: f32[4, 16, 24] = slice.Tensor(view_1, 1, 0, 16)
slice_6: f32[4, 12, 24] = slice.Tensor(view_1, 1, 16, 9223372036854775807)
einsum: f32[3, 1, 4, 24] = einsum('bthn,hnr->bthr', [getitem, slice_5])
cat_4: f32[3, 1, 4, 32] = cat([einsum, add], -1)
reshape: f32[3, 4, 1, 32] = reshape(cat_4, [3, 4, 1, 32])
slice_7: f32[3, 16, 24] = slice.Tensor(index_put_, 0, 0, 3)
slice_8: f32[3, 16, 8] = slice.Tensor(index_put__1, 0, 0, 3)
cat_5: f32[3, 16, 32] = cat([slice_7, slice_8], -1)
unsqueeze_13: f32[3, 16, 1, 32] = unsqueeze(cat_5, 2)
unsqueeze_14: f32[3, 16, 1, 24] = unsqueeze(slice_7, 2)
unsqueeze_15: b8[3, 1, 1, 1, 16] = reshape(le, [3, 1, 1, 1, 16])
expand: b8[3, 1, 1, 4, 16] = expand(unsqueeze_15, [3, 1, 1, 4, 16])
reshape_1: b8[3, 1, 4, 16] = reshape(expand, [3, 1, 4, 16])
transpose: f32[3, 1, 4, 32] = transpose.int(reshape, 1, 2)
transpose_1: f32[3, 1, 16, 32] = transpose.int(unsqueeze_13, 1, 2)
transpose_2: f32[3, 1, 16, 24] = transpose.int(unsqueeze_14, 1, 2)
scaled_dot_product_attention: f32[3, 1, 4, 24] = scaled_dot_product_attention(transpose, transpose_1, transpose_2, reshape_1, scale=0.2041241452319315)
transpose_3: f32[3, 4, 1, 24] = transpose.int(scaled_dot_product_attention, 1, 2)
view_2: f32[3, 1, 4, 24] = reshape(transpose_3, [3, 1, 4, 24])
einsum_1: f32[3, 1, 4, 12] = einsum('bthr,hvr->bthv', [view_2, slice_6])
reshape_2: f32[3, 1, 48] = reshape(einsum_1, [3, 1, 48])
linear_4: f32[3, 1, 64] = linear(reshape_2, midlayer_self_attn_o_proj_weight)
linear_rows: f32[3, 1, 64] = index.Tensor(linear, [unsqueeze_default_4, unsqueeze_default])
add_2: f32[3, 1, 64] = add.Tensor(linear_rows, linear_4)
rms_norm_4: f32[3, 1, 64] = rms_norm(add_2, [64], midlayer_post_attention_layernorm_weight, 1e-05)
linear_5: f32[3, 1, 128] = linear(rms_norm_4, midlayer_mlp_gate_proj_weight)
silu: f32[3, 1, 128] = silu(linear_5)
linear_6: f32[3, 1, 128] = linear(rms_norm_4, midlayer_mlp_up_proj_weight)
mul_6: f32[3, 1, 128] = mul.Tensor(silu, linear_6)
linear_7: f32[3, 1, 64] = linear(mul_6, midlayer_mlp_down_proj_weight)
add_3: f32[3, 1, 64] = add.Tensor(add_2, linear_7)
rms_norm_5: f32[3, 1, 64] = rms_norm(add_3, [64], norm_weight, 1e-05)
linear_8: f32[3, 1, 96] = linear(rms_norm_5, lm_head_weight)
index: f32[3, 96] = reshape(linear_8, [3, 96])
index_1: f32[3, 64] = reshape(add_3, [3, 64])
return (index, index_1)""")

    def test_deepseek_nextn_moe(self):
        self.assertExpectedInline(self._tail("tiny-deepseek-nextn"), """\
index_put__1: f32[3, 16, 8] = index_put_(decoder_self_attn_k_rope_cache, [unsqueeze_12, positions], select)
view_1: f32[4, 28, 24] = view(decoder_self_attn_kv_b_proj_weight, [4, 28, 24])
slice_5: f32[4, 16, 24] = slice.Tensor(view_1, 1, 0, 16)
slice_6: f32[4, 12, 24] = slice.Tensor(view_1, 1, 16, 9223372036854775807)
einsum: f32[3, 1, 4, 24] = einsum('bthn,hnr->bthr', [getitem, slice_5])
cat_4: f32[3, 1, 4, 32] = cat([einsum, add], -1)
reshape: f32[3, 4, 1, 32] = reshape(cat_4, [3, 4, 1, 32])
slice_7: f32[3, 16, 24] = slice.Tensor(index_put_, 0, 0, 3)
slice_8: f32[3, 16, 8] = slice.Tensor(index_put__1, 0, 0, 3)
cat_5: f32[3, 16, 32] = cat([slice_7, slice_8], -1)
unsqueeze_13: f32[3, 16, 1, 32] = unsqueeze(cat_5, 2)
unsqueeze_14: f32[3, 16, 1, 24] = unsqueeze(slice_7, 2)
unsqueeze_15: b8[3, 1, 1, 1, 16] = reshape(le, [3, 1, 1, 1, 16])
expand: b8[3, 1, 1, 4, 16] = expand(unsqueeze_15, [3, 1, 1, 4, 16])
reshape_1: b8[3, 1, 4, 16] = reshape(expand, [3, 1, 4, 16])
transpose: f32[3, 1, 4, 32] = transpose.int(reshape, 1, 2)
transpose_1: f32[3, 1, 16, 32] = transpose.int(unsqueeze_13, 1, 2)
transpose_2: f32[3, 1, 16, 24] = transpose.int(unsqueeze_14, 1, 2)
scaled_dot_product_attention: f32[3, 1, 4, 24] = scaled_dot_product_attention(transpose, transpose_1, transpose_2, reshape_1, scale=0.2041241452319315)
transpose_3: f32[3, 4, 1, 24] = transpose.int(scaled_dot_product_attention, 1, 2)
view_2: f32[3, 1, 4, 24] = reshape(transpose_3, [3, 1, 4, 24])
einsum_1: f32[3, 1, 4, 12] = einsum('bthr,hvr->bthv', [view_2, slice_6])
reshape_2: f32[3, 1, 48] = reshape(einsum_1, [3, 1, 48])
linear_4: f32[3, 1, 64] = linear(reshape_2, decoder_self_attn_o_proj_weight)
linear_rows: f32[3, 1, 64] = index.Tensor(linear, [unsqueeze_default_4, unsqueeze_default])
add_2: f32[3, 1, 64] = add.Tensor(linear_rows, linear_4)
rms_norm_5: f32[3, 1, 64] = rms_norm(add_2, [64], decoder_post_attention_layernorm_weight, 1e-06)
to_4: f32[3, 1, 64] = to.dtype(rms_norm_5, f32)
to_5: f32[8, 64] = to.dtype(decoder_mlp_gate_weight, f32)
linear_5: f32[3, 1, 8] = linear(to_4, to_5)
sigmoid: f32[3, 1, 8] = sigmoid(linear_5)
add_3: f32[3, 1, 8] = add.Tensor(sigmoid, decoder_mlp_gate_e_score_correction_bias)
unflatten: f32[3, 1, 4, 2] = reshape(add_3, [3, 1, 4, 2])
topk: (f32[3, 1, 4, 2], i64[3, 1, 4, 2]) = topk(unflatten, 2)
getitem_4: f32[3, 1, 4, 2] = getitem(topk, 0)
sum_1: f32[3, 1, 4] = sum.dim_IntList(getitem_4, [-1])
topk_1: (f32[3, 1, 2], i64[3, 1, 2]) = topk(sum_1, 2)
getitem_7: i64[3, 1, 2] = getitem(topk_1, 1)
zeros_like: f32[3, 1, 4] = zeros_like(sum_1, pin_memory=False)
scatter: f32[3, 1, 4] = scatter.value(zeros_like, -1, getitem_7, 1.0)
to_6: b8[3, 1, 4] = to.dtype(scatter, b8)
unsqueeze_16: b8[3, 1, 4, 1] = reshape(to_6, [3, 1, 4, 1])
expand_1: b8[3, 1, 4, 2] = expand(unsqueeze_16, [3, 1, 4, 2])
flatten: b8[3, 1, 8] = reshape(expand_1, [3, 1, 8])
bitwise_not: b8[3, 1, 8] = bitwise_not(flatten)
masked_fill: f32[3, 1, 8] = masked_fill.Scalar(add_3, bitwise_not, -inf)
topk_2: (f32[3, 1, 2], i64[3, 1, 2]) = topk(masked_fill, 2)
getitem_9: i64[3, 1, 2] = getitem(topk_2, 1)
gather: f32[3, 1, 2] = gather(sigmoid, -1, getitem_9)
sum_2: f32[3, 1, 1] = sum.dim_IntList(gather, [-1], True)
add_4: f32[3, 1, 1] = add.Tensor(sum_2, 1e-20)
div_1: f32[3, 1, 2] = div.Tensor(gather, add_4)
mul_6: f32[3, 1, 2] = mul.Tensor(div_1, 2.5)
to_7: f32[3, 1, 2] = to.dtype(mul_6, f32)
linear_6: f32[3, 1, 32] = linear(to_4, decoder_mlp_shared_experts_gate_proj_weight)
silu: f32[3, 1, 32] = silu(linear_6)
linear_7: f32[3, 1, 32] = linear(to_4, decoder_mlp_shared_experts_up_proj_weight)
mul_7: f32[3, 1, 32] = mul.Tensor(silu, linear_7)
linear_8: f32[3, 1, 64] = linear(mul_7, decoder_mlp_shared_experts_down_proj_weight)
eq: b8[3, 1, 2] = eq.Scalar(getitem_9, 0)
mul_8: f32[3, 1, 2] = mul.Tensor(to_7, eq)
sum_3: f32[3, 1, 1] = sum.dim_IntList(mul_8, [-1], True)
select_1: f32[64, 64] = select.int(decoder_mlp_experts_gate_up_proj, 0, 0)
linear_9: f32[3, 1, 64] = linear(to_4, select_1)
chunk: (f32[3, 1, 32], f32[3, 1, 32]) = chunk(linear_9, 2, -1)
getitem_10: f32[3, 1, 32] = getitem(chunk, 0)
getitem_11: f32[3, 1, 32] = getitem(chunk, 1)
silu_1: f32[3, 1, 32] = silu(getitem_10)
mul_9: f32[3, 1, 32] = mul.Tensor(silu_1, getitem_11)
select_2: f32[64, 32] = select.int(decoder_mlp_experts_down_proj, 0, 0)
linear_10: f32[3, 1, 64] = linear(mul_9, select_2)
mul_10: f32[3, 1, 64] = mul.Tensor(linear_10, sum_3)
eq_1: b8[3, 1, 2] = eq.Scalar(getitem_9, 1)
mul_11: f32[3, 1, 2] = mul.Tensor(to_7, eq_1)
sum_4: f32[3, 1, 1] = sum.dim_IntList(mul_11, [-1], True)
select_3: f32[64, 64] = select.int(decoder_mlp_experts_gate_up_proj, 0, 1)
linear_11: f32[3, 1, 64] = linear(to_4, select_3)
chunk_1: (f32[3, 1, 32], f32[3, 1, 32]) = chunk(linear_11, 2, -1)
getitem_12: f32[3, 1, 32] = getitem(chunk_1, 0)
getitem_13: f32[3, 1, 32] = getitem(chunk_1, 1)
silu_2: f32[3, 1, 32] = silu(getitem_12)
mul_12: f32[3, 1, 32] = mul.Tensor(silu_2, getitem_13)
select_4: f32[64, 32] = select.int(decoder_mlp_experts_down_proj, 0, 1)
linear_12: f32[3, 1, 64] = linear(mul_12, select_4)
mul_13: f32[3, 1, 64] = mul.Tensor(linear_12, sum_4)
add_5: f32[3, 1, 64] = add.Tensor(mul_10, mul_13)
eq_2: b8[3, 1, 2] = eq.Scalar(getitem_9, 2)
mul_14: f32[3, 1, 2] = mul.Tensor(to_7, eq_2)
sum_5: f32[3, 1, 1] = sum.dim_IntList(mul_14, [-1], True)
select_5: f32[64, 64] = select.int(decoder_mlp_experts_gate_up_proj, 0, 2)
linear_13: f32[3, 1, 64] = linear(to_4, select_5)
chunk_2: (f32[3, 1, 32], f32[3, 1, 32]) = chunk(linear_13, 2, -1)
getitem_14: f32[3, 1, 32] = getitem(chunk_2, 0)
getitem_15: f32[3, 1, 32] = getitem(chunk_2, 1)
silu_3: f32[3, 1, 32] = silu(getitem_14)
mul_15: f32[3, 1, 32] = mul.Tensor(silu_3, getitem_15)
select_6: f32[64, 32] = select.int(decoder_mlp_experts_down_proj, 0, 2)
linear_14: f32[3, 1, 64] = linear(mul_15, select_6)
mul_16: f32[3, 1, 64] = mul.Tensor(linear_14, sum_5)
add_6: f32[3, 1, 64] = add.Tensor(add_5, mul_16)
eq_3: b8[3, 1, 2] = eq.Scalar(getitem_9, 3)
mul_17: f32[3, 1, 2] = mul.Tensor(to_7, eq_3)
sum_6: f32[3, 1, 1] = sum.dim_IntList(mul_17, [-1], True)
select_7: f32[64, 64] = select.int(decoder_mlp_experts_gate_up_proj, 0, 3)
linear_15: f32[3, 1, 64] = linear(to_4, select_7)
chunk_3: (f32[3, 1, 32], f32[3, 1, 32]) = chunk(linear_15, 2, -1)
getitem_16: f32[3, 1, 32] = getitem(chunk_3, 0)
getitem_17: f32[3, 1, 32] = getitem(chunk_3, 1)
silu_4: f32[3, 1, 32] = silu(getitem_16)
mul_18: f32[3, 1, 32] = mul.Tensor(silu_4, getitem_17)
select_8: f32[64, 32] = select.int(decoder_mlp_experts_down_proj, 0, 3)
linear_16: f32[3, 1, 64] = linear(mul_18, select_8)
mul_19: f32[3, 1, 64] = mul.Tensor(linear_16, sum_6)
add_7: f32[3, 1, 64] = add.Tensor(add_6, mul_19)
eq_4: b8[3, 1, 2] = eq.Scalar(getitem_9, 4)
mul_20: f32[3, 1, 2] = mul.Tensor(to_7, eq_4)
sum_7: f32[3, 1, 1] = sum.dim_IntList(mul_20, [-1], True)
select_9: f32[64, 64] = select.int(decoder_mlp_experts_gate_up_proj, 0, 4)
linear_17: f32[3, 1, 64] = linear(to_4, select_9)
chunk_4: (f32[3, 1, 32], f32[3, 1, 32]) = chunk(linear_17, 2, -1)
getitem_18: f32[3, 1, 32] = getitem(chunk_4, 0)
getitem_19: f32[3, 1, 32] = getitem(chunk_4, 1)
silu_5: f32[3, 1, 32] = silu(getitem_18)
mul_21: f32[3, 1, 32] = mul.Tensor(silu_5, getitem_19)
select_10: f32[64, 32] = select.int(decoder_mlp_experts_down_proj, 0, 4)
linear_18: f32[3, 1, 64] = linear(mul_21, select_10)
mul_22: f32[3, 1, 64] = mul.Tensor(linear_18, sum_7)
add_8: f32[3, 1, 64] = add.Tensor(add_7, mul_22)
eq_5: b8[3, 1, 2] = eq.Scalar(getitem_9, 5)
mul_23: f32[3, 1, 2] = mul.Tensor(to_7, eq_5)
sum_8: f32[3, 1, 1] = sum.dim_IntList(mul_23, [-1], True)
select_11: f32[64, 64] = select.int(decoder_mlp_experts_gate_up_proj, 0, 5)
linear_19: f32[3, 1, 64] = linear(to_4, select_11)
chunk_5: (f32[3, 1, 32], f32[3, 1, 32]) = chunk(linear_19, 2, -1)
getitem_20: f32[3, 1, 32] = getitem(chunk_5, 0)
getitem_21: f32[3, 1, 32] = getitem(chunk_5, 1)
silu_6: f32[3, 1, 32] = silu(getitem_20)
mul_24: f32[3, 1, 32] = mul.Tensor(silu_6, getitem_21)
select_12: f32[64, 32] = select.int(decoder_mlp_experts_down_proj, 0, 5)
linear_20: f32[3, 1, 64] = linear(mul_24, select_12)
mul_25: f32[3, 1, 64] = mul.Tensor(linear_20, sum_8)
add_9: f32[3, 1, 64] = add.Tensor(add_8, mul_25)
eq_6: b8[3, 1, 2] = eq.Scalar(getitem_9, 6)
mul_26: f32[3, 1, 2] = mul.Tensor(to_7, eq_6)
sum_9: f32[3, 1, 1] = sum.dim_IntList(mul_26, [-1], True)
select_13: f32[64, 64] = select.int(decoder_mlp_experts_gate_up_proj, 0, 6)
linear_21: f32[3, 1, 64] = linear(to_4, select_13)
chunk_6: (f32[3, 1, 32], f32[3, 1, 32]) = chunk(linear_21, 2, -1)
getitem_22: f32[3, 1, 32] = getitem(chunk_6, 0)
getitem_23: f32[3, 1, 32] = getitem(chunk_6, 1)
silu_7: f32[3, 1, 32] = silu(getitem_22)
mul_27: f32[3, 1, 32] = mul.Tensor(silu_7, getitem_23)
select_14: f32[64, 32] = select.int(decoder_mlp_experts_down_proj, 0, 6)
linear_22: f32[3, 1, 64] = linear(mul_27, select_14)
mul_28: f32[3, 1, 64] = mul.Tensor(linear_22, sum_9)
add_10: f32[3, 1, 64] = add.Tensor(add_9, mul_28)
eq_7: b8[3, 1, 2] = eq.Scalar(getitem_9, 7)
mul_29: f32[3, 1, 2] = mul.Tensor(to_7, eq_7)
sum_10: f32[3, 1, 1] = sum.dim_IntList(mul_29, [-1], True)
select_15: f32[64, 64] = select.int(decoder_mlp_experts_gate_up_proj, 0, 7)
linear_23: f32[3, 1, 64] = linear(to_4, select_15)
chunk_7: (f32[3, 1, 32], f32[3, 1, 32]) = chunk(linear_23, 2, -1)
getitem_24: f32[3, 1, 32] = getitem(chunk_7, 0)
getitem_25: f32[3, 1, 32] = getitem(chunk_7, 1)
silu_8: f32[3, 1, 32] = silu(getitem_24)
mul_30: f32[3, 1, 32] = mul.Tensor(silu_8, getitem_25)
select_16: f32[64, 32] = select.int(decoder_mlp_experts_down_proj, 0, 7)
linear_24: f32[3, 1, 64] = linear(mul_30, select_16)
mul_31: f32[3, 1, 64] = mul.Tensor(linear_24, sum_10)
add_11: f32[3, 1, 64] = add.Tensor(add_10, mul_31)
add_12: f32[3, 1, 64] = add.Tensor(add_11, linear_8)
add_13: f32[3, 1, 64] = add.Tensor(add_2, add_12)
rms_norm_6: f32[3, 1, 64] = rms_norm(add_13, [64], shared_head_norm_weight, 1e-06)
linear_25: f32[3, 1, 256] = linear(rms_norm_6, shared_head_head_weight)
index: f32[3, 256] = reshape(linear_25, [3, 256])
index_1: f32[3, 64] = reshape(add_13, [3, 64])
return (index, index_1)""")

    def test_qwen35_nextn(self):
        self.assertExpectedInline(self._tail("tiny-qwen3.5-nextn"), """\
index_put__1: f32[3, 16, 2, 16] = index_put_(decoder_self_attn_v_cache, [unsqueeze_11, positions], view_2)
slice_9: f32[3, 16, 2, 16] = slice.Tensor(index_put_, 0, 0, 3)
slice_10: f32[3, 16, 2, 16] = slice.Tensor(index_put__1, 0, 0, 3)
transpose: f32[3, 4, 1, 16] = transpose.int(cat_3, 1, 2)
transpose_1: f32[3, 2, 16, 16] = transpose.int(slice_9, 1, 2)
transpose_2: f32[3, 2, 16, 16] = transpose.int(slice_10, 1, 2)
scaled_dot_product_attention: f32[3, 4, 1, 16] = scaled_dot_product_attention(transpose, transpose_1, transpose_2, le, scale=0.25, enable_gqa=True)
transpose_3: f32[3, 1, 4, 16] = transpose.int(scaled_dot_product_attention, 1, 2)
reshape_2: f32[3, 1, 64] = reshape(transpose_3, [3, 1, 64])
sigmoid: f32[3, 1, 64] = sigmoid(reshape)
mul_6: f32[3, 1, 64] = mul.Tensor(reshape_2, sigmoid)
linear_4: f32[3, 1, 64] = linear(mul_6, decoder_self_attn_o_proj_weight)
linear_rows: f32[3, 1, 64] = index.Tensor(linear, [unsqueeze_default_1, unsqueeze_default])
add_2: f32[3, 1, 64] = add.Tensor(linear_rows, linear_4)
rms_norm_5: f32[3, 1, 64] = rms_norm(add_2, [64], decoder_post_attention_layernorm_weight, 1e-06)
linear_5: f32[3, 1, 128] = linear(rms_norm_5, decoder_mlp_gate_proj_weight)
silu: f32[3, 1, 128] = silu(linear_5)
linear_6: f32[3, 1, 128] = linear(rms_norm_5, decoder_mlp_up_proj_weight)
mul_7: f32[3, 1, 128] = mul.Tensor(silu, linear_6)
linear_7: f32[3, 1, 64] = linear(mul_7, decoder_mlp_down_proj_weight)
add_3: f32[3, 1, 64] = add.Tensor(add_2, linear_7)
rms_norm_6: f32[3, 1, 64] = rms_norm(add_3, [64], shared_head_norm_weight, 1e-06)
linear_8: f32[3, 1, 256] = linear(rms_norm_6, shared_head_head_weight)
index: f32[3, 256] = reshape(linear_8, [3, 256])
index_1: f32[3, 64] = reshape(add_3, [3, 64])
return (index, index_1)""")

    def test_standalone_draft(self):
        self.assertExpectedInline(self._tail("tiny-llama-draft"), """\
index_put__3: f32[3, 16, 1, 16] = index_put_(model_layers_1_self_attn_v_cache, [unsqueeze_17, positions], view_3)
slice_11: f32[3, 16, 1, 16] = slice.Tensor(index_put__2, 0, 0, 3)
slice_12: f32[3, 16, 1, 16] = slice.Tensor(index_put__3, 0, 0, 3)
transpose_4: f32[3, 4, 1, 16] = transpose.int(add_4, 1, 2)
transpose_5: f32[3, 1, 16, 16] = transpose.int(slice_11, 1, 2)
transpose_6: f32[3, 1, 16, 16] = transpose.int(slice_12, 1, 2)
permute_default: b8[3, 4, 1, 16] = permute(le, [0, 2, 1, 3])
le_rows: b8[3, 1, 1, 16] = index.Tensor(permute_default, [unsqueeze_default_1, unsqueeze_default])
le_rows_1: b8[3, 1, 1, 16] = permute(le_rows, [0, 2, 1, 3])
scaled_dot_product_attention_1: f32[3, 4, 1, 16] = scaled_dot_product_attention(transpose_4, transpose_5, transpose_6, le_rows_1, scale=0.25, enable_gqa=True)
transpose_7: f32[3, 1, 4, 16] = transpose.int(scaled_dot_product_attention_1, 1, 2)
reshape_3: f32[3, 1, 64] = reshape(transpose_7, [3, 1, 64])
linear_10: f32[3, 1, 64] = linear(reshape_3, model_layers_1_self_attn_o_proj_weight)
add_3_rows: f32[3, 1, 64] = index.Tensor(add_3, [unsqueeze_default_1, unsqueeze_default])
add_6: f32[3, 1, 64] = add.Tensor(add_3_rows, linear_10)
rms_norm_3: f32[3, 1, 64] = rms_norm(add_6, [64], model_layers_1_post_attention_layernorm_weight, 1e-05)
linear_11: f32[3, 1, 96] = linear(rms_norm_3, model_layers_1_mlp_gate_proj_weight)
silu_1: f32[3, 1, 96] = silu(linear_11)
linear_12: f32[3, 1, 96] = linear(rms_norm_3, model_layers_1_mlp_up_proj_weight)
mul_11: f32[3, 1, 96] = mul.Tensor(silu_1, linear_12)
linear_13: f32[3, 1, 64] = linear(mul_11, model_layers_1_mlp_down_proj_weight)
add_7: f32[3, 1, 64] = add.Tensor(add_6, linear_13)
rms_norm_4: f32[3, 1, 64] = rms_norm(add_7, [64], model_norm_weight, 1e-05)
linear_14: f32[3, 1, 256] = linear(rms_norm_4, model_embed_tokens_weight)
index: f32[3, 256] = reshape(linear_14, [3, 256])
index_1: f32[3, 64] = reshape(add_7, [3, 64])
return (index, index_1)""")


@pytest.mark.filterwarnings("error::specpass.SpecpassWarning")
@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "gemma"])
def test_hugging_face_static_cache(family):
    """transformers' own models, unchanged: the compiled step slices logits[:, -1]. The ideal is
    reached: every matmul that feeds no KV write runs on the live rows only (Phi-3's eval-mode
    dropout and Gemma's type_as are row-local through their decompositions; Phi-3's fused qkv_proj
    is split so that its query block runs on the live rows only)."""
    import transformers
    from transformers import StaticCache

    config_cls, model_cls = (getattr(transformers, f"{name}{suffix}") for name in [
        {"llama": "Llama", "qwen3": "Qwen3", "phi3": "Phi3", "gemma": "Gemma"}[family]] for suffix in
        ("Config", "ForCausalLM"))
    config = config_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    ids = torch.randint(0, 64, (2, 7))
    results = []
    for compiled in (False, True):
        cache = StaticCache(config=config, max_cache_len=16)
        cache.early_initialization(batch_size=2, num_heads=2, head_dim=8, dtype=torch.float32,
                                   device=torch.device("cpu"))

        def step(tokens, cache_position):
            return model(input_ids=tokens, past_key_values=cache, cache_position=cache_position,
                         use_cache=True).logits[:, -1]

        with torch.no_grad():
            model(input_ids=ids[:, :3], past_key_values=cache, use_cache=True)  # a prefix in the cache
            if compiled:
                # split_min_rows=0: split Phi-3's fused qkv_proj even at these few rows
                result = specpass.rewrite(specpass.capture(step, ids[:, 3:], torch.arange(3, 7)), split_min_rows=0)
                report, rewritten = result.report, result.graph_module
                step = torch.compile(step, backend=specpass.backend(handoff="eager", split_min_rows=0))
            logits = step(ids[:, 3:], torch.arange(3, 7))
        results.append((logits, [layer.keys.clone() for layer in cache.layers]))
    (finding,) = [f for f in report.of("live_rows") if f.rows is not None]
    assert finding.fired and finding.rows == (2 * 4, 2), str(report)
    assert not full_row_matmuls(rewritten, {4, 2 * 4}), str(report)
    splits = [f for f in report.of("live_rows") if f.rows is None]  # Phi-3's fused qkv_proj: Q on live rows
    assert [f.fired for f in splits] == ([True] if family == "phi3" else []), str(report)
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    for got, want in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

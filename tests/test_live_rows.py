"""Live-row pass: graph diffs per gather spelling, numerics against eager, refusals, FLOPs."""

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch import library

import specpass
from models.toy import ToyDraft
from specpass.testing import full_row_matmuls, graph_str

B, T, H, V, S = 3, 4, 8, 16, 6


class Draft(torch.nn.Module):
    """A one-layer catch-up step small enough to print: KV write, attention, o_proj, lm_head."""

    def __init__(self, batch=B, cache_len=S, causal=False):
        super().__init__()
        torch.manual_seed(0)
        self.wq, self.wk, self.wo = (torch.nn.Parameter(torch.randn(H, H) / H**0.5) for _ in range(3))
        self.head = torch.nn.Parameter(torch.randn(V, H) / H**0.5)
        self.register_buffer("cache", torch.zeros(batch, cache_len, H))
        self.causal = causal

    def hidden(self, x, pos):
        # x: [B, T, H]; pos: [T], the cache slots of the T rows
        self.cache.index_copy_(1, pos, F.linear(x, self.wk))
        q = F.linear(x, self.wq)
        if self.causal:
            a = F.scaled_dot_product_attention(q, self.cache[:, : x.shape[1]], self.cache[:, : x.shape[1]], is_causal=True)
        else:
            mask = torch.arange(self.cache.shape[1]) <= pos[:, None]  # [T, S]
            a = F.scaled_dot_product_attention(q, self.cache, self.cache, attn_mask=mask)
        return x + F.linear(a, self.wo)  # [B, T, H]

    def logits(self, x, pos):
        return F.linear(F.rms_norm(self.hidden(x, pos), (H,)), self.head)  # [B, T, V]


def last(m, x, pos, live):
    return m.logits(x, pos)[:, -1]


def per_request(m, x, pos, live):
    h = m.hidden(x, pos)
    rows = torch.arange(x.shape[0])
    return F.linear(F.rms_norm(h, (H,)), m.head)[rows, live], h[rows, live]


def flat_static(m, x, pos, live):
    Bx, Tx = x.shape[:2]
    return m.logits(x, pos).reshape(Bx * Tx, V).index_select(0, torch.arange(Bx) * Tx + Tx - 1)


def flat_runtime(m, x, pos, live):
    Bx, Tx = x.shape[:2]
    return m.logits(x, pos).reshape(Bx * Tx, V)[torch.arange(Bx) * Tx + live]


def last_two(m, x, pos, live):
    return m.logits(x, pos)[:, -2:]


def narrow_last(m, x, pos, live):
    return m.logits(x, pos).narrow(1, x.shape[1] - 1, 1)


def gather_live(m, x, pos, live):
    return torch.gather(m.logits(x, pos), 1, live[:, None, None].expand(-1, 1, V))


def greedy_last(m, x, pos, live):
    return m.logits(x, pos).argmax(-1)[:, -1]


def first_request(m, x, pos, live):
    return m.logits(x, pos)[0]


def last_of_last_two(m, x, pos, live):
    return m.logits(x, pos)[:, -2:][:, -1]  # one range of the same axis


def vocab_prefix(m, x, pos, live):
    return m.logits(x, pos)[:, -1, : V - 3]  # the row moves; the vocabulary slice stays after it


def every_other(m, x, pos, live):
    return m.logits(x, pos)[:, ::2]


def centered(m, x, pos, live):
    h = m.hidden(x, pos)
    return F.linear(h - h.mean(1, keepdim=True), m.head)[:, -1]  # the token mean is kept whole


def two_rows_per_request(m, x, pos, live):
    rows = torch.stack([live, (live + 1) % x.shape[1]], 1)  # [B, 2]
    return m.logits(x, pos)[torch.arange(x.shape[0])[:, None], rows]


def window_per_request(m, x, pos, live):
    rows = live.clamp(max=x.shape[1] - 2)[:, None] + torch.arange(2)  # [B, 2]: K = 2 rows from a runtime start
    return m.logits(x, pos)[torch.arange(x.shape[0])[:, None], rows]  # a parallel drafter's K drafts


def negative_live(m, x, pos, live):
    return m.logits(x, pos)[torch.arange(x.shape[0]), live - x.shape[1]]


FORMS = [last, per_request, flat_static, flat_runtime, last_two, narrow_last, gather_live, greedy_last,
         first_request, last_of_last_two, vocab_prefix, every_other, centered, two_rows_per_request, window_per_request,
         negative_live]


@pytest.mark.parametrize("form, rows", [(last, (12, 3)), (per_request, (12, 3)), (flat_static, (12, 3)),
                                        (flat_runtime, (12, 3)), (last_two, (12, 6)), (gather_live, (12, 3)),
                                        (first_request, (3, 1)), (last_of_last_two, (6, 3)), (vocab_prefix, (12, 3)),
                                        (every_other, (12, 6)), (centered, (12, 3)), (two_rows_per_request, (12, 6)),
                                        (window_per_request, (12, 6)),
                                        (negative_live, (12, 3))], ids=lambda f: getattr(f, "__name__", ""))
def test_each_form_fires(form, rows):
    _, result = _rewrite(form, Draft(), *_inputs())
    (finding,) = result.report.rewrites
    assert finding.rows == rows


def _inputs(batch=B, rows=T):
    torch.manual_seed(1)
    live = torch.tensor([rows - 1, 0, rows // 2, 1][:batch]) % rows
    return torch.randn(batch, rows, H), torch.arange(rows) + (S - rows), live


def _rewrite(fn, model, *args, **options):
    gm = specpass.capture(lambda *a: fn(model, *a), *args)
    return gm, specpass.rewrite(gm, argmax=False, **options)


def _run(fn, model, args, backend=None):
    model.cache.zero_()
    step = (lambda *a: fn(model, *a))
    if backend is not None:
        torch._dynamo.reset()
        step = torch.compile(step, backend=backend)
    with torch.no_grad():
        out = step(*args)
    return torch.utils._pytree.tree_leaves(out), model.cache.clone()


class TestGraphs(expecttest.TestCase):
    def test_toy_draft(self):
        torch.manual_seed(0)
        gm = specpass.capture(ToyDraft().eval(), torch.randint(0, 64, (2, 4)), torch.arange(4))
        result = specpass.rewrite(gm, argmax=False)
        self.assertExpectedInline(graph_str(result.graph_module), """\
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
positions_rows: i64[1] = slice.Tensor(positions, 0, 3, 4, 1)
unsqueeze_1: i64[1, 1] = reshape(positions_rows, [1, 1])
le: b8[1, 16] = le.Tensor(unsqueeze, unsqueeze_1)
getitem_rows: f32[2, 4, 1, 8] = slice.Tensor(getitem, 2, 3, 4, 1)
scaled_dot_product_attention: f32[2, 4, 1, 8] = scaled_dot_product_attention(getitem_rows, index_copy_, index_copy__1, le)
transpose_1: f32[2, 1, 4, 8] = transpose.int(scaled_dot_product_attention, 1, 2)
reshape: f32[2, 1, 32] = reshape(transpose_1, [2, 1, 32])
linear_1: f32[2, 1, 32] = linear(reshape, o_proj_weight)
embedding_rows: f32[2, 1, 32] = slice.Tensor(embedding, 1, 3, 4, 1)
add: f32[2, 1, 32] = add.Tensor(embedding_rows, linear_1)
rms_norm_1: f32[2, 1, 32] = rms_norm(add, [32], mlp_norm_weight, 1e-06)
linear_2: f32[2, 1, 64] = linear(rms_norm_1, up_weight)
silu: f32[2, 1, 64] = silu(linear_2)
linear_3: f32[2, 1, 32] = linear(silu, down_weight)
add_1: f32[2, 1, 32] = add.Tensor(add, linear_3)
rms_norm_2: f32[2, 1, 32] = rms_norm(add_1, [32], norm_weight, 1e-06)
linear_4: f32[2, 1, 64] = linear(rms_norm_2, lm_head_weight)
select: f32[2, 64] = reshape(linear_4, [2, 64])
return (select,)""")
        self.assertExpectedInline(str(result.report), """\
specpass: 1 rewrite(s), 0 left alone; graph matmul FLOPs 180K -> 81.9K, 2.20x fewer
  [live_rows] rewrote select: 11 ops run on the selected rows only; gathered after embedding (needed in full by rms_norm); getitem (used by the in-place index_copy_ index_copy__1 (via unbind)); positions (a graph input) (rows 8 -> 2; matmul FLOPs 131K -> 32.8K)""")

    def test_last(self):
        gm, result = _rewrite(last, Draft(), *_inputs())
        self.assertExpectedInline(graph_str(gm), """\
model_cache: f32[3, 6, 8]
model_wk: f32[8, 8]
a_0: f32[3, 4, 8]
a_1: i64[4]
model_wq: f32[8, 8]
model_wo: f32[8, 8]
model_head: f32[16, 8]
linear: f32[3, 4, 8] = linear(a_0, model_wk)
index_copy_: f32[3, 6, 8] = index_copy_(model_cache, 1, a_1, linear)
linear_1: f32[3, 4, 8] = linear(a_0, model_wq)
arange: i64[6] = arange(6, device=cpu, pin_memory=False)
unsqueeze: i64[4, 1] = unsqueeze(a_1, 1)
le: b8[4, 6] = le.Tensor(arange, unsqueeze)
scaled_dot_product_attention: f32[3, 4, 8] = scaled_dot_product_attention(linear_1, index_copy_, index_copy_, le)
linear_2: f32[3, 4, 8] = linear(scaled_dot_product_attention, model_wo)
add: f32[3, 4, 8] = add.Tensor(a_0, linear_2)
rms_norm: f32[3, 4, 8] = rms_norm(add, [8])
linear_3: f32[3, 4, 16] = linear(rms_norm, model_head)
select: f32[3, 16] = select.int(linear_3, 1, -1)
return (select,)""")
        self.assertExpectedInline(graph_str(result.graph_module), """\
model_cache: f32[3, 6, 8]
model_wk: f32[8, 8]
a_0: f32[3, 4, 8]
a_1: i64[4]
model_wq: f32[8, 8]
model_wo: f32[8, 8]
model_head: f32[16, 8]
linear: f32[3, 4, 8] = linear(a_0, model_wk)
index_copy_: f32[3, 6, 8] = index_copy_(model_cache, 1, a_1, linear)
a_0_rows: f32[3, 1, 8] = slice.Tensor(a_0, 1, 3, 4, 1)
linear_1: f32[3, 1, 8] = linear(a_0_rows, model_wq)
arange: i64[6] = arange(6, device=cpu, pin_memory=False)
a_1_rows: i64[1] = slice.Tensor(a_1, 0, 3, 4, 1)
unsqueeze: i64[1, 1] = reshape(a_1_rows, [1, 1])
le: b8[1, 6] = le.Tensor(arange, unsqueeze)
scaled_dot_product_attention: f32[3, 1, 8] = scaled_dot_product_attention(linear_1, index_copy_, index_copy_, le)
linear_2: f32[3, 1, 8] = linear(scaled_dot_product_attention, model_wo)
add: f32[3, 1, 8] = add.Tensor(a_0_rows, linear_2)
rms_norm: f32[3, 1, 8] = rms_norm(add, [8])
linear_3: f32[3, 1, 16] = linear(rms_norm, model_head)
select: f32[3, 16] = reshape(linear_3, [3, 16])
return (select,)""")

    def test_window_of_rows_per_request(self):
        # P-EAGLE's draft forward keeps K rows per request from a runtime start: the Q-slice takes them.
        _, result = _rewrite(window_per_request, Draft(), *_inputs())
        self.assertExpectedInline(graph_str(result.graph_module), """\
a_2: i64[3]
a_0: f32[3, 4, 8]
model_cache: f32[3, 6, 8]
model_wk: f32[8, 8]
a_1: i64[4]
model_wq: f32[8, 8]
model_wo: f32[8, 8]
model_head: f32[16, 8]
arange_start_step: i64[3] = arange.start_step(0, 3, 1, dtype=i64, device=cpu)
unsqueeze_default: i64[3, 1] = unsqueeze(arange_start_step, 1)
arange: i64[2] = arange(2, device=cpu, pin_memory=False)
clamp: i64[3] = clamp(a_2, None, 2)
unsqueeze: i64[3, 1] = unsqueeze(clamp, 1)
add: i64[3, 2] = add.Tensor(unsqueeze, arange)
linear: f32[3, 4, 8] = linear(a_0, model_wk)
index_copy_: f32[3, 6, 8] = index_copy_(model_cache, 1, a_1, linear)
a_0_rows: f32[3, 2, 8] = index.Tensor(a_0, [unsqueeze_default, add])
linear_1: f32[3, 2, 8] = linear(a_0_rows, model_wq)
arange_1: i64[6] = arange(6, device=cpu, pin_memory=False)
unsqueeze_1: i64[4, 1] = unsqueeze(a_1, 1)
le: b8[4, 6] = le.Tensor(arange_1, unsqueeze_1)
expand_default: b8[3, 4, 6] = expand(le, [3, 4, 6])
le_rows: b8[3, 2, 6] = index.Tensor(expand_default, [unsqueeze_default, add])
scaled_dot_product_attention: f32[3, 2, 8] = scaled_dot_product_attention(linear_1, index_copy_, index_copy_, le_rows)
linear_2: f32[3, 2, 8] = linear(scaled_dot_product_attention, model_wo)
add_1: f32[3, 2, 8] = add.Tensor(a_0_rows, linear_2)
rms_norm: f32[3, 2, 8] = rms_norm(add_1, [8])
linear_3: f32[3, 2, 16] = linear(rms_norm, model_head)
return (linear_3,)""")
        self.assertExpectedInline(str(result.report), """\
specpass: 1 rewrite(s), 0 left alone; graph matmul FLOPs 9.98K -> 5.76K, 1.73x fewer
  [live_rows] rewrote index: 6 ops run on the selected rows only; gathered after a_0 (a graph input); le (needed in full by scaled_dot_product_attention) (rows 12 -> 6; matmul FLOPs 8.45K -> 4.22K)""")

    def test_per_request_rows_shared_by_two_outputs(self):
        _, result = _rewrite(per_request, Draft(), *_inputs())
        self.assertExpectedInline(graph_str(result.graph_module), """\
model_cache: f32[3, 6, 8]
model_wk: f32[8, 8]
a_0: f32[3, 4, 8]
a_1: i64[4]
model_wq: f32[8, 8]
model_wo: f32[8, 8]
model_head: f32[16, 8]
a_2: i64[3]
arange_start_step: i64[3] = arange.start_step(0, 3, 1, dtype=i64, device=cpu)
unsqueeze_default_1: i64[3, 1] = unsqueeze(arange_start_step, 1)
unsqueeze_default: i64[3, 1] = unsqueeze(a_2, 1)
linear: f32[3, 4, 8] = linear(a_0, model_wk)
index_copy_: f32[3, 6, 8] = index_copy_(model_cache, 1, a_1, linear)
a_0_rows: f32[3, 1, 8] = index.Tensor(a_0, [unsqueeze_default_1, unsqueeze_default])
linear_1: f32[3, 1, 8] = linear(a_0_rows, model_wq)
arange: i64[6] = arange(6, device=cpu, pin_memory=False)
unsqueeze: i64[4, 1] = unsqueeze(a_1, 1)
le: b8[4, 6] = le.Tensor(arange, unsqueeze)
expand_default: b8[3, 4, 6] = expand(le, [3, 4, 6])
le_rows: b8[3, 1, 6] = index.Tensor(expand_default, [unsqueeze_default_1, unsqueeze_default])
scaled_dot_product_attention: f32[3, 1, 8] = scaled_dot_product_attention(linear_1, index_copy_, index_copy_, le_rows)
linear_2: f32[3, 1, 8] = linear(scaled_dot_product_attention, model_wo)
add: f32[3, 1, 8] = add.Tensor(a_0_rows, linear_2)
rms_norm: f32[3, 1, 8] = rms_norm(add, [8])
linear_3: f32[3, 1, 16] = linear(rms_norm, model_head)
index: f32[3, 16] = reshape(linear_3, [3, 16])
index_1: f32[3, 8] = reshape(add, [3, 8])
return (index, index_1)""")
        self.assertEqual(len(result.report.rewrites), 1)

    def test_flat_static_index_becomes_a_slice(self):
        """index_select(0, arange(B) * T + T - 1) on [B * T, V] is x[:, -1]: a slice, and the
        mask needs one row."""
        _, result = _rewrite(flat_static, Draft(), *_inputs())
        self.assertExpectedInline(graph_str(result.graph_module), """\
a_0: f32[3, 4, 8]
model_cache: f32[3, 6, 8]
model_wk: f32[8, 8]
a_1: i64[4]
model_wq: f32[8, 8]
model_wo: f32[8, 8]
model_head: f32[16, 8]
linear: f32[3, 4, 8] = linear(a_0, model_wk)
index_copy_: f32[3, 6, 8] = index_copy_(model_cache, 1, a_1, linear)
a_0_rows: f32[3, 1, 8] = slice.Tensor(a_0, 1, 3, 4, 1)
linear_1: f32[3, 1, 8] = linear(a_0_rows, model_wq)
arange: i64[6] = arange(6, device=cpu, pin_memory=False)
a_1_rows: i64[1] = slice.Tensor(a_1, 0, 3, 4, 1)
unsqueeze: i64[1, 1] = reshape(a_1_rows, [1, 1])
le: b8[1, 6] = le.Tensor(arange, unsqueeze)
scaled_dot_product_attention: f32[3, 1, 8] = scaled_dot_product_attention(linear_1, index_copy_, index_copy_, le)
linear_2: f32[3, 1, 8] = linear(scaled_dot_product_attention, model_wo)
add: f32[3, 1, 8] = add.Tensor(a_0_rows, linear_2)
rms_norm: f32[3, 1, 8] = rms_norm(add, [8])
linear_3: f32[3, 1, 16] = linear(rms_norm, model_head)
reshape: f32[3, 16] = reshape(linear_3, [3, 16])
return (reshape,)""")

    def test_flat_runtime_index_stops_before_attention(self):
        _, result = _rewrite(flat_runtime, Draft(), *_inputs())
        self.assertExpectedInline(graph_str(result.graph_module), """\
a_0: f32[3, 4, 8]
model_cache: f32[3, 6, 8]
model_wk: f32[8, 8]
a_1: i64[4]
model_wq: f32[8, 8]
model_wo: f32[8, 8]
model_head: f32[16, 8]
a_2: i64[3]
arange_1: i64[3] = arange(3, device=cpu, pin_memory=False)
mul: i64[3] = mul.Tensor(arange_1, 4)
add_1: i64[3] = add.Tensor(mul, a_2)
remainder_scalar: i64[3] = remainder.Scalar(add_1, 12)
expand_default: i64[3] = expand(remainder_scalar, [3])
reshape_default: i64[3] = reshape(expand_default, [-1])
linear: f32[3, 4, 8] = linear(a_0, model_wk)
index_copy_: f32[3, 6, 8] = index_copy_(model_cache, 1, a_1, linear)
linear_1: f32[3, 4, 8] = linear(a_0, model_wq)
arange: i64[6] = arange(6, device=cpu, pin_memory=False)
unsqueeze: i64[4, 1] = unsqueeze(a_1, 1)
le: b8[4, 6] = le.Tensor(arange, unsqueeze)
scaled_dot_product_attention: f32[3, 4, 8] = scaled_dot_product_attention(linear_1, index_copy_, index_copy_, le)
reshape_default_1: f32[12, 8] = reshape(scaled_dot_product_attention, [12, 8])
index_select_default: f32[3, 8] = index_select(reshape_default_1, 0, reshape_default)
scaled_dot_product_attention_rows: f32[1, 3, 8] = reshape(index_select_default, [1, 3, 8])
linear_2: f32[1, 3, 8] = linear(scaled_dot_product_attention_rows, model_wo)
reshape_default_2: f32[12, 8] = reshape(a_0, [12, 8])
index_select_default_1: f32[3, 8] = index_select(reshape_default_2, 0, reshape_default)
a_0_rows: f32[1, 3, 8] = reshape(index_select_default_1, [1, 3, 8])
add: f32[1, 3, 8] = add.Tensor(a_0_rows, linear_2)
rms_norm: f32[1, 3, 8] = rms_norm(add, [8])
linear_3: f32[1, 3, 16] = linear(rms_norm, model_head)
reshape: f32[3, 16] = reshape(linear_3, [3, 16])
return (reshape,)""")
        self.assertIn("not provably per request", str(result.report))

    def test_last_two(self):
        _, result = _rewrite(last_two, Draft(), *_inputs())
        self.assertExpectedInline(graph_str(result.graph_module), """\
model_cache: f32[3, 6, 8]
model_wk: f32[8, 8]
a_0: f32[3, 4, 8]
a_1: i64[4]
model_wq: f32[8, 8]
model_wo: f32[8, 8]
model_head: f32[16, 8]
linear: f32[3, 4, 8] = linear(a_0, model_wk)
index_copy_: f32[3, 6, 8] = index_copy_(model_cache, 1, a_1, linear)
a_0_rows: f32[3, 2, 8] = slice.Tensor(a_0, 1, 2, 4, 1)
linear_1: f32[3, 2, 8] = linear(a_0_rows, model_wq)
arange: i64[6] = arange(6, device=cpu, pin_memory=False)
a_1_rows: i64[2] = slice.Tensor(a_1, 0, 2, 4, 1)
unsqueeze: i64[2, 1] = reshape(a_1_rows, [2, 1])
le: b8[2, 6] = le.Tensor(arange, unsqueeze)
scaled_dot_product_attention: f32[3, 2, 8] = scaled_dot_product_attention(linear_1, index_copy_, index_copy_, le)
linear_2: f32[3, 2, 8] = linear(scaled_dot_product_attention, model_wo)
add: f32[3, 2, 8] = add.Tensor(a_0_rows, linear_2)
rms_norm: f32[3, 2, 8] = rms_norm(add, [8])
linear_3: f32[3, 2, 16] = linear(rms_norm, model_head)
return (linear_3,)""")

    def test_narrow(self):
        _, result = _rewrite(narrow_last, Draft(), *_inputs())
        self.assertExpectedInline(graph_str(result.graph_module), """\
model_cache: f32[3, 6, 8]
model_wk: f32[8, 8]
a_0: f32[3, 4, 8]
a_1: i64[4]
model_wq: f32[8, 8]
model_wo: f32[8, 8]
model_head: f32[16, 8]
linear: f32[3, 4, 8] = linear(a_0, model_wk)
index_copy_: f32[3, 6, 8] = index_copy_(model_cache, 1, a_1, linear)
a_0_rows: f32[3, 1, 8] = slice.Tensor(a_0, 1, 3, 4, 1)
linear_1: f32[3, 1, 8] = linear(a_0_rows, model_wq)
arange: i64[6] = arange(6, device=cpu, pin_memory=False)
a_1_rows: i64[1] = slice.Tensor(a_1, 0, 3, 4, 1)
unsqueeze: i64[1, 1] = reshape(a_1_rows, [1, 1])
le: b8[1, 6] = le.Tensor(arange, unsqueeze)
scaled_dot_product_attention: f32[3, 1, 8] = scaled_dot_product_attention(linear_1, index_copy_, index_copy_, le)
linear_2: f32[3, 1, 8] = linear(scaled_dot_product_attention, model_wo)
add: f32[3, 1, 8] = add.Tensor(a_0_rows, linear_2)
rms_norm: f32[3, 1, 8] = rms_norm(add, [8])
linear_3: f32[3, 1, 16] = linear(rms_norm, model_head)
return (linear_3,)""")

    def test_torch_gather(self):
        _, result = _rewrite(gather_live, Draft(), *_inputs())
        self.assertExpectedInline(graph_str(result.graph_module), """\
model_cache: f32[3, 6, 8]
model_wk: f32[8, 8]
a_0: f32[3, 4, 8]
a_1: i64[4]
model_wq: f32[8, 8]
model_wo: f32[8, 8]
model_head: f32[16, 8]
a_2: i64[3]
arange_start_step: i64[3] = arange.start_step(0, 3, 1, dtype=i64, device=cpu)
unsqueeze_default: i64[3, 1] = unsqueeze(arange_start_step, 1)
unsqueeze_1: i64[3, 1] = unsqueeze(a_2, 1)
unsqueeze_2: i64[3, 1, 1] = unsqueeze(unsqueeze_1, 2)
reshape_default: i64[3, 1] = reshape(unsqueeze_2, [3, 1])
linear: f32[3, 4, 8] = linear(a_0, model_wk)
index_copy_: f32[3, 6, 8] = index_copy_(model_cache, 1, a_1, linear)
a_0_rows: f32[3, 1, 8] = index.Tensor(a_0, [unsqueeze_default, reshape_default])
linear_1: f32[3, 1, 8] = linear(a_0_rows, model_wq)
arange: i64[6] = arange(6, device=cpu, pin_memory=False)
unsqueeze: i64[4, 1] = unsqueeze(a_1, 1)
le: b8[4, 6] = le.Tensor(arange, unsqueeze)
expand_default: b8[3, 4, 6] = expand(le, [3, 4, 6])
le_rows: b8[3, 1, 6] = index.Tensor(expand_default, [unsqueeze_default, reshape_default])
scaled_dot_product_attention: f32[3, 1, 8] = scaled_dot_product_attention(linear_1, index_copy_, index_copy_, le_rows)
linear_2: f32[3, 1, 8] = linear(scaled_dot_product_attention, model_wo)
add: f32[3, 1, 8] = add.Tensor(a_0_rows, linear_2)
rms_norm: f32[3, 1, 8] = rms_norm(add, [8])
linear_3: f32[3, 1, 16] = linear(rms_norm, model_head)
return (linear_3,)""")

    def test_through_argmax(self):
        _, result = _rewrite(greedy_last, Draft(), *_inputs())
        self.assertExpectedInline(graph_str(result.graph_module), """\
model_cache: f32[3, 6, 8]
model_wk: f32[8, 8]
a_0: f32[3, 4, 8]
a_1: i64[4]
model_wq: f32[8, 8]
model_wo: f32[8, 8]
model_head: f32[16, 8]
linear: f32[3, 4, 8] = linear(a_0, model_wk)
index_copy_: f32[3, 6, 8] = index_copy_(model_cache, 1, a_1, linear)
a_0_rows: f32[3, 1, 8] = slice.Tensor(a_0, 1, 3, 4, 1)
linear_1: f32[3, 1, 8] = linear(a_0_rows, model_wq)
arange: i64[6] = arange(6, device=cpu, pin_memory=False)
a_1_rows: i64[1] = slice.Tensor(a_1, 0, 3, 4, 1)
unsqueeze: i64[1, 1] = reshape(a_1_rows, [1, 1])
le: b8[1, 6] = le.Tensor(arange, unsqueeze)
scaled_dot_product_attention: f32[3, 1, 8] = scaled_dot_product_attention(linear_1, index_copy_, index_copy_, le)
linear_2: f32[3, 1, 8] = linear(scaled_dot_product_attention, model_wo)
add: f32[3, 1, 8] = add.Tensor(a_0_rows, linear_2)
rms_norm: f32[3, 1, 8] = rms_norm(add, [8])
linear_3: f32[3, 1, 16] = linear(rms_norm, model_head)
argmax: i64[3, 1] = argmax(linear_3, -1)
select: i64[3] = reshape(argmax, [3])
return (select,)""")

    def test_causal_attention_gets_an_explicit_mask(self):
        x, pos, live = _inputs()
        _, result = _rewrite(last, Draft(cache_len=T, causal=True), x, torch.arange(T), live)
        self.assertExpectedInline(graph_str(result.graph_module), """\
model_cache: f32[3, 4, 8]
model_wk: f32[8, 8]
a_0: f32[3, 4, 8]
a_1: i64[4]
model_wq: f32[8, 8]
model_wo: f32[8, 8]
model_head: f32[16, 8]
arange_start_step_1: i64[1] = arange.start_step(3, 4, 1, dtype=i64, device=cpu)
unsqueeze_default: i64[1, 1] = unsqueeze(arange_start_step_1, 1)
arange_start_step: i64[4] = arange.start_step(0, 4, 1, dtype=i64, device=cpu)
linear: f32[3, 4, 8] = linear(a_0, model_wk)
index_copy_: f32[3, 4, 8] = index_copy_(model_cache, 1, a_1, linear)
a_0_rows: f32[3, 1, 8] = slice.Tensor(a_0, 1, 3, 4, 1)
linear_1: f32[3, 1, 8] = linear(a_0_rows, model_wq)
alias: f32[3, 4, 8] = alias(index_copy_)
alias_1: f32[3, 4, 8] = alias(index_copy_)
le_tensor: b8[1, 4] = le.Tensor(arange_start_step, unsqueeze_default)
scaled_dot_product_attention: f32[3, 1, 8] = scaled_dot_product_attention(linear_1, alias, alias_1, attn_mask=le_tensor, dropout_p=0.0, is_causal=False)
linear_2: f32[3, 1, 8] = linear(scaled_dot_product_attention, model_wo)
add: f32[3, 1, 8] = add.Tensor(a_0_rows, linear_2)
rms_norm: f32[3, 1, 8] = rms_norm(add, [8])
linear_3: f32[3, 1, 16] = linear(rms_norm, model_head)
select: f32[3, 16] = reshape(linear_3, [3, 16])
return (select,)""")

    def test_q_slice_off_gathers_after_attention(self):
        _, result = _rewrite(last, Draft(), *_inputs(), q_slice=False)
        self.assertExpectedInline(graph_str(result.graph_module), """\
model_cache: f32[3, 6, 8]
model_wk: f32[8, 8]
a_0: f32[3, 4, 8]
a_1: i64[4]
model_wq: f32[8, 8]
model_wo: f32[8, 8]
model_head: f32[16, 8]
linear: f32[3, 4, 8] = linear(a_0, model_wk)
index_copy_: f32[3, 6, 8] = index_copy_(model_cache, 1, a_1, linear)
linear_1: f32[3, 4, 8] = linear(a_0, model_wq)
arange: i64[6] = arange(6, device=cpu, pin_memory=False)
unsqueeze: i64[4, 1] = unsqueeze(a_1, 1)
le: b8[4, 6] = le.Tensor(arange, unsqueeze)
scaled_dot_product_attention: f32[3, 4, 8] = scaled_dot_product_attention(linear_1, index_copy_, index_copy_, le)
scaled_dot_product_attention_rows: f32[3, 1, 8] = slice.Tensor(scaled_dot_product_attention, 1, 3, 4, 1)
linear_2: f32[3, 1, 8] = linear(scaled_dot_product_attention_rows, model_wo)
a_0_rows: f32[3, 1, 8] = slice.Tensor(a_0, 1, 3, 4, 1)
add: f32[3, 1, 8] = add.Tensor(a_0_rows, linear_2)
rms_norm: f32[3, 1, 8] = rms_norm(add, [8])
linear_3: f32[3, 1, 16] = linear(rms_norm, model_head)
select: f32[3, 16] = reshape(linear_3, [3, 16])
return (select,)""")
        self.assertIn("q_slice=False", str(result.report))


@pytest.mark.filterwarnings("error::specpass.SpecpassWarning")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
def test_numerics_match_eager(form, batch, rows, causal):
    model = Draft(batch=batch, cache_len=rows if causal else S, causal=causal)
    x, pos, live = _inputs(batch, rows)
    if causal:
        pos = torch.arange(rows)
    want_out, want_cache = _run(form, model, (x, pos, live))
    got_out, got_cache = _run(form, model, (x, pos, live), specpass.backend(handoff="eager", argmax=False))
    for got, want in zip(got_out, want_out, strict=True):
        if want.is_floating_point():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, want)
    assert torch.equal(got_cache, want_cache)
    if form is last:
        assert torch.equal(got_out[0].argmax(-1), want_out[0].argmax(-1))


def _unchanged(test, fn, model, *args, **options):
    gm, result = _rewrite(fn, model, *args, **options)
    test.assertEqual(graph_str(result.graph_module), graph_str(gm))
    test.assertEqual(result.report.rewrites, [])
    return str(result.report)


@library.custom_op("specpass_test::mix_rows", mutates_args=())
def mix_rows(x: torch.Tensor) -> torch.Tensor:
    return x.flip(1)


@mix_rows.register_fake
def _(x):
    return torch.empty_like(x)


class TestRefusals(expecttest.TestCase):
    def test_cumsum_over_tokens(self):
        report = _unchanged(self, lambda m, x, p, l: m.logits(x, p).cumsum(1)[:, -1], Draft(), *_inputs())
        self.assertIn("cumsum mixes rows along axis 1", report)

    def test_softmax_over_tokens(self):
        report = _unchanged(self, lambda m, x, p, l: m.logits(x, p).softmax(1)[:, -1], Draft(), *_inputs())
        self.assertIn("softmax mixes rows along axis 1", report)

    def test_unknown_op_is_row_mixing(self):
        report = _unchanged(self, lambda m, x, p, l: mix_rows(m.logits(x, p))[:, -1], Draft(), *_inputs())
        self.assertIn("mix_rows is not known to be row-local", report)

    def test_full_output_keeps_every_row(self):
        def both(m, x, p, l):
            logits = m.logits(x, p)
            return logits[:, -1], logits

        report = _unchanged(self, both, Draft(), *_inputs())
        self.assertIn("returned as an output", report)

    def test_index_computed_from_the_rows(self):
        def argmax_row(m, x, p, l):
            logits = m.logits(x, p)
            return logits[torch.arange(x.shape[0]), logits.amax(-1).argmax(1)]

        report = _unchanged(self, argmax_row, Draft(), *_inputs())
        self.assertIn("needed in full by amax", report)

    def test_index_written_in_place_before_the_gather(self):
        def bumped(m, x, p, live):
            rows = live.view(-1)  # an alias of live
            logits = m.logits(x, p)
            live.sub_(1)  # the gather reads the decremented rows
            return logits[torch.arange(x.shape[0]), rows]

        report = _unchanged(self, bumped, Draft(), *_inputs())
        self.assertIn("the row index is written in place by sub_", report)

    def test_index_known_only_after_the_rows(self):
        def late(m, x, p, live):
            logits = m.logits(x, p)
            live.sub_(1)  # in place: the gather's index exists only from here on
            return logits[torch.arange(x.shape[0]), live]

        report = _unchanged(self, late, Draft(), *_inputs())
        self.assertIn("is only known after linear_3", report)

    def test_no_gather_says_how_to_fix(self):
        report = _unchanged(self, lambda m, x, p, l: m.logits(x, p), Draft(), *_inputs())
        self.assertIn("logits_to_keep", report)

    def test_no_rows_no_hint(self):
        """A graph with no token axis in its outputs (a one-row draft step) gets no hint."""
        gm, result = _rewrite(lambda m, x, p, l: m.hidden(x, p).sum(1), Draft(), *_inputs())
        self.assertEqual(result.report.of("live_rows"), [])

    def test_write_between_reads_gathers_each_epoch(self):
        buf = torch.randn(B, S, H)

        def reread(x):
            v = buf[:, :T]
            y = v * 2
            buf.mul_(0.5)  # v's rows change between the two reads
            return (y + v + x)[:, -1]

        x = torch.randn(B, T, H)
        result = specpass.rewrite(specpass.capture(reread, x), argmax=False)
        gathers = [n for n in result.graph_module.graph.nodes if n.name.startswith("slice_1_rows")]
        self.assertEqual(len(gathers), 2)  # one before the write, one after
        self.assertIn("mul_ writes it in place", str(result.report))
        saved = buf.clone()
        want = reread(x)
        buf.copy_(saved)
        torch._dynamo.reset()
        got = torch.compile(reread, backend=specpass.backend(handoff="eager", argmax=False))(x)
        torch.testing.assert_close(got, want)


def test_matmul_flops_in_the_report():
    _, result = _rewrite(last, Draft(), *_inputs())
    (finding,) = result.report.rewrites

    def flops(rows):  # q_proj, attention (QK^T and PV over S slots), o_proj, lm_head
        return 2 * rows * H * H + 2 * rows * S * (H + H) + 2 * rows * H * H + 2 * rows * H * V

    assert finding.rows == (B * T, B)
    assert finding.matmul_flops == (flops(B * T), flops(B))


# Ops with no rule of their own, classified from torch's metadata: reductions by their tag and
# schema, the rest through their decompositions (CompositeImplicitAutograd or torch._decomp).
DERIVED = {
    "std": lambda h: h.std(-1)[:, -1],
    "var_keepdim": lambda h: h.var(-1, keepdim=True)[:, -1],
    "nansum": lambda h: h.nansum(-1)[:, -1],
    "aminmax": lambda h: torch.aminmax(h, dim=-1).max[:, -1],
    "count_nonzero": lambda h: torch.count_nonzero(h > 0, dim=-1)[:, -1],
    "nanmean": lambda h: h.nanmean(-1)[:, -1],
    "dropout_eval": lambda h: F.dropout(h, 0.3, training=False)[:, -1],
    "dropout_p0": lambda h: F.dropout(h, 0.0, training=True)[:, -1],
    "type_as": lambda h: (h.type_as(torch.zeros(1, dtype=torch.float64)) * 2)[:, -1],
    "glu": lambda h: F.glu(h, -1)[:, -1],
    "hardswish": lambda h: F.hardswish(h)[:, -1],
}


class Head(torch.nn.Module):
    def __init__(self, tail):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(V, H))
        self.tail = tail

    def forward(self, x):
        return self.tail(F.linear(x, self.w))  # [B, T, V] -> the tail's gather


@pytest.mark.filterwarnings("error::specpass.SpecpassWarning")
@pytest.mark.parametrize("name", DERIVED)
def test_derived_rules_move_the_gather_exactly(name):
    model, x = Head(DERIVED[name]), torch.randn(B, T, H)
    (finding,) = specpass.explain(model, x).of("live_rows")
    assert finding.fired and finding.rows == (B * T, B), str(finding)
    torch._dynamo.reset()
    got = torch.compile(model, backend=specpass.backend(handoff="eager"))(x)
    torch.testing.assert_close(got, model(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tail, reason", [
    (lambda h: F.dropout(h, 0.3, training=True)[:, -1], "dropout draws random numbers"),
    (lambda h: F.glu(h, 1)[:, -1], "glu: "),  # its decomposition splits the token axis in two
], ids=["dropout_train", "glu_over_tokens"])
def test_derived_refusals_say_why(tail, reason):
    report = specpass.explain(Head(tail), torch.randn(B, T, H))
    (finding,) = report.of("live_rows")
    assert not finding.fired and reason in finding.message, str(report)


def test_every_row_gather_gets_exactly_one_finding():
    """Each row gather gets its own verdict, also where two read the same rows and stay (once
    moved, gathers that move together share one finding). Column slices (RoPE's halves) and
    slices of weights are not row gathers."""
    def many(m, x, p, live):
        logits = m.logits(x, p)  # RoPE-like column halves of the input, and one of a weight
        mixed = torch.cat([x[..., H // 2:], x[..., : H // 2]], -1) + m.wq[: H // 2].sum()
        return logits[:, -1], logits[:, -1].softmax(-1), logits.cumsum(1)[:, -1], mixed[:, -2]

    _, result = _rewrite(many, Draft(), *_inputs())
    where = [f.where for f in result.report.of("live_rows")]
    assert sorted(where) == ["select", "select_1", "select_2", "select_3"], str(result.report)
    assert [f.where for f in result.report.rewrites] == ["select_3"]


def test_a_node_reported_twice_drops_the_pass(monkeypatch):
    from specpass import pipeline
    from specpass.report import Finding

    twice = [Finding("live_rows", "select", False, "one"), Finding("live_rows", "select, index", True, "two")]
    monkeypatch.setattr(pipeline, "PASSES", [("live_rows", lambda gm, options: twice)])
    _, result = _rewrite(last, Draft(), *_inputs())
    assert result.report.findings == [] and "reported ['select'] twice" in result.report.errors[0]


def test_slice_with_runtime_bounds_is_not_a_static_range():
    """BERT-style position ids sliced by `.item()` bounds: not a static range; the pass goes on
    (it used to raise TypeError and drop every rewrite of the graph)."""
    def step(x, offset):
        start = offset.item()
        pos = torch.arange(16)[None][:, start : start + x.shape[1]]  # [1, T], bounds from a tensor
        return (F.linear(x, torch.ones(V, H)) + pos[..., None])[:, -1]

    x = torch.randn(B, T, H)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        result = specpass.rewrite(specpass.capture(step, x, torch.tensor(2)), argmax=False)
    assert result.report.errors == []
    assert [f.where for f in result.report.rewrites] == ["select"], str(result.report)


@pytest.mark.parametrize("rows_of", [lambda y: y.exp()[:, :T, :1], lambda y: y.mean(2)[:, :T, None]],
                         ids=["exp-slice-slice", "mean-slice-unsqueeze"])
def test_a_range_that_fired_before_a_gather_by_index(rows_of):
    """A range of rows (`y.exp()[:, :T]`, which fires and is read through its source from then on)
    under a gather by per-request index: the index gather of the range reads the rewritten source
    (the pass used to rewrite the consumer on the range's old shape, fail its shape check and drop)."""
    def step(x, y, idx):
        h = x + rows_of(y)  # [B, T, H] + [B, T, 1]
        return h[torch.arange(x.shape[0])[:, None], idx]  # [B, 1, H]

    x, y, idx = torch.randn(B, T, H), torch.randn(B, T + 3, 2), torch.tensor([[T - 1], [0], [1]])
    result = specpass.rewrite(specpass.capture(step, x, y, idx))
    assert not result.report.errors and len(result.report.rewrites) == 2, str(result.report)
    got = torch.compile(step, backend=specpass.backend(handoff="eager"), fullgraph=True)(x, y, idx)
    torch.testing.assert_close(got, step(x, y, idx), rtol=0, atol=0)


def test_two_spellings_of_the_last_row_move_as_one():
    """x[arange(B), full(B, T - 1)] is x[:, -1]: both outputs share one gather and one finding,
    and it is a slice, not an index."""
    def both(m, x, p, live):
        logits = m.logits(x, p)
        return logits[:, -1], logits[torch.arange(x.shape[0]), torch.full((x.shape[0],), x.shape[1] - 1)]

    _, result = _rewrite(both, Draft(), *_inputs())
    (finding,) = result.report.of("live_rows")
    assert finding.fired and set(finding.nodes) == {"select", "index"}, str(result.report)
    gathers = [n.target for n in result.graph_module.graph.nodes if n.name.endswith("_rows")]
    assert gathers and all(t is torch.ops.aten.slice.Tensor for t in gathers), gathers


def _exact_and_ideal(step, *args):
    """Rewritten with no error, no matmul left on every row (T or B * T of them), equal to eager."""
    result = specpass.rewrite(specpass.capture(step, *args))
    assert not result.report.errors and result.report.rewrites, str(result.report)
    assert full_row_matmuls(result.graph_module, {T, B * T}) == [], str(result.report)
    want = step(*args)
    got = torch.compile(step, backend=specpass.backend(handoff="eager"), fullgraph=True)(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_range_of_a_range_at_a_positive_start():
    """GPT-Neo's mask `bias[:, :, S - T : S]` then the last row: rows 3:4 of rows 12:16 are row 15.
    The composed range is gathered from the buffer; the slice is not applied a second time."""
    bias = torch.tril(torch.ones(2 * S, 2 * S, dtype=torch.bool))
    proj, head = torch.randn(2 * S, H), torch.randn(V, 2 * S)

    def step(x):
        scores = F.linear(x, proj).masked_fill(~bias[S - T: S], -1e9).softmax(-1)  # [B, T, 2S]
        return F.linear(scores, head)[:, -1]

    _exact_and_ideal(step, torch.randn(B, T, H))


def test_view_as_reads_the_other_tensor_for_its_shape_only():
    """Beam's gate: `gate_proj(x).view_as(attn_out)` reshapes its first operand; attn_out is not
    needed on every row because of it."""
    wv, wg, wo = (torch.randn(H, H) for _ in range(3))

    def step(x):
        out = F.linear(x, wv).view(*x.shape[:2], 2, H // 2)
        gate = F.linear(x, wg).view_as(out)
        return F.linear((out * gate.sigmoid()).flatten(2), wo)[:, -1]

    _exact_and_ideal(step, torch.randn(B, T, H))


def test_a_count_read_as_a_number_is_not_a_row_gather():
    """`counts[e].item()` (a split size in a sort-based MoE) selects an expert, not token rows: no
    candidate, no finding; the real gather keeps its one finding."""
    w, head = torch.randn(4, H), torch.randn(V, H)

    def step(x):
        counts = F.one_hot(F.linear(x, w).argmax(-1), 4).sum((0, 1))  # [4]: tokens per expert
        first = counts[0].item()
        return F.linear(x, head)[:, -1] + first

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        result = specpass.rewrite(specpass.capture(step, torch.randn(B, T, H)))
    assert [f.nodes for f in result.report.of("live_rows")] == [["select_1"]], str(result.report)


@pytest.mark.filterwarnings("error::specpass.SpecpassWarning")
@pytest.mark.parametrize("inner,outer", [
    (inner, outer)
    for inner in [(2, 5, 1), (1, 6, 2), (-4, None, 1), (0, -1, 1), (-5, -1, 2), (3, None, 1)]
    for outer in [-1, 0, slice(-2, None), slice(0, None, 2)]
    if len(range(S)[slice(*inner)][outer if isinstance(outer, slice) else slice(outer, outer + 1 or None)])
    < len(range(S)[slice(*inner)])])  # the outer selection keeps fewer rows: a row gather
def test_range_of_a_range_of_a_cache_just_written(inner, outer):
    """A slice of a cache read back after the write, then rows of it: the two ranges compose into
    one, whatever the starts, stops, steps and signs."""
    w, cache = torch.randn(H, H), torch.zeros(2, S, H)

    def step(x, pos):
        cache.index_copy_(1, pos, F.linear(x, w))
        return torch.tanh(cache[:, slice(*inner)])[:, outer]

    x, pos = torch.randn(2, 3, H), torch.tensor([2, 3, 4])
    want = step(x, pos)
    cache.zero_()
    result = specpass.rewrite(specpass.capture(step, x, pos))
    got = torch.compile(step, backend=specpass.backend(handoff="eager"), fullgraph=True)(x, pos)
    assert not result.report.errors and result.report.rewrites, str(result.report)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_negative_per_request_row_of_one_request_through_a_flat_view():
    """B = 1 and `live - T` (negative): one request's rows become flat ids, wrapped as x[b, -1]
    wraps (index_select does not). Found by the program generator."""
    w = torch.randn(4, 4)

    def step(x, live):
        h = F.linear(x.reshape(2, 4), w).reshape(1, 2, 4)
        return h[torch.arange(1), live - 2]

    _exact_and_ideal(step, torch.randn(1, 2, 4), torch.tensor([0]))


def test_expand_as_reads_the_other_tensor_for_its_shape_only():
    """F.normalize is x / norm(x).clamp_min(eps).expand_as(x): expanded to the gathered rows.
    Found by the program generator."""
    w = torch.randn(V, H)
    _exact_and_ideal(lambda x: F.linear(F.normalize(x, dim=-1), w)[:, -1], torch.randn(B, T, H))


@pytest.mark.parametrize("view", ["per_token_operand", "unsqueeze", "reshape"])
def test_an_empty_selection_is_no_row_gather(view):
    """T = 1: `h[:, :-1]` (a shift's slice) keeps no row: nothing to move, nothing to fail on.
    Found by the program generator."""
    w = torch.randn(4, 4)

    def step(x, pos):
        y = F.linear(x, w)
        h = {"per_token_operand": lambda: y * pos[:, None],
             "unsqueeze": lambda: y.unsqueeze(2).squeeze(2),
             "reshape": lambda: y.reshape(2, 4).reshape(2, 1, 4)}[view]()
        return h[:, :-1]

    args = torch.randn(2, 1, 4), torch.arange(1)
    result = specpass.rewrite(specpass.capture(step, *args))
    assert not result.report.errors and not result.report.rewrites, str(result.report)
    torch.testing.assert_close(torch.compile(step, backend=specpass.backend(handoff="eager"))(*args), step(*args))


def test_a_range_that_fired_is_not_selected_again_by_a_later_gather():
    """XLNet's relative shift: position scores [B, T, 2T] read as [B, 2T, T], rows 1: of that,
    read as [B, T, 2T - 1], the first T columns. The range `[:, 1:]` fires (its source runs on
    rows 1:), and the last row's flat gather above it reads the range's values from the source;
    it used to read the old slice node, which sliced the gathered source a second time
    (`RuntimeError: shape '[28, 3]' is invalid`, and the pass was dropped)."""
    torch.manual_seed(0)
    wq, wk, wr, head = (torch.randn(H, H) / H**0.5 for _ in range(4))
    positions = torch.randn(2 * T, H)

    def step(x):
        q, k = F.linear(x, wq), F.linear(x, wk)  # [B, T, H]
        by_position = torch.einsum("bih,jh->bij", q, F.linear(positions, wr))  # [B, T, 2T]
        shifted = by_position.reshape(B, 2 * T, T)[:, 1:].reshape(B, T, 2 * T - 1)[:, :, :T]  # [B, T, T]
        scores = (q @ k.transpose(1, 2) + shifted).softmax(-1)  # [B, T, T]
        return F.linear(scores @ x, head)[:, -1]  # [B, H]

    x = torch.randn(B, T, H)
    result = specpass.rewrite(specpass.capture(step, x))
    assert not result.report.errors, str(result.report)
    moved = {f.where: f.message for f in result.report.rewrites}
    assert moved.keys() == {"slice_1", "select"}, str(result.report)
    assert "slice_1 (slice mixes rows along axis 1)" in moved["select"], str(result.report)
    got = torch.compile(step, backend=specpass.backend(handoff="eager"), fullgraph=True)(x)
    torch.testing.assert_close(got, step(x), rtol=1e-5, atol=1e-6)



@pytest.mark.filterwarnings("error::specpass.SpecpassWarning")  # a pass that fails warns
def test_xlnet_relative_shift_rewrites_exactly(caplog):
    """transformers' XLNetLMHeadModel at a tiny config (no cache: XLNet has no StaticCache), the
    step that slices logits[:, -1]: each layer's relative shift is the range above, and the pass
    now rewrites the step (it raised at a reshape it emitted, and was dropped)."""
    import transformers

    config = transformers.XLNetConfig(vocab_size=96, d_model=32, n_layer=1, n_head=2, d_inner=64,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.XLNetLMHeadModel(config).eval()
    ids = torch.randint(3, 96, (B, T))

    def step(tokens):
        return model(input_ids=tokens, use_cache=False).logits[:, -1]

    with torch.no_grad(), caplog.at_level("INFO", logger="specpass"):  # the backend logs its report
        got = torch.compile(step, backend=specpass.backend(handoff="eager"), fullgraph=True)(ids)
        want = step(ids)
    (report,) = [r.getMessage() for r in caplog.records if hasattr(r, "report")]
    assert report.count("rewrote slice_") == config.n_layer, report  # one fired range per layer's shift
    assert "rewrote select: " in report and f"rows {B * T} -> {B}" in report, report
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_range_of_keys_joined_along_the_token_axis_is_left_alone_with_its_reason():
    """Dory (a tiny config that runs each layer twice): the cache's keys are `cat([past, new],
    dim=-2)` along the key-token axis, and transformers' SDPA keeps the first q_len of them. That
    range is a range of the joined axis: its rows are not the same rows of each input, so it is
    left alone, and the reason says so. The output's last row moves as usual."""
    torch.manual_seed(0)
    w_past, w_new, head = torch.randn(H, H), torch.randn(H, H), torch.randn(V, H)

    def step(x):
        keys = torch.cat([F.linear(x, w_past), F.linear(x, w_new)], dim=1)[:, :T]  # [B, 2T, H] -> [B, T, H]
        return F.linear((x @ keys.transpose(1, 2)).softmax(-1) @ keys, head)[:, -1]  # [B, V]

    x = torch.randn(B, T, H)
    result = specpass.rewrite(specpass.capture(step, x))
    assert not result.report.errors, str(result.report)
    assert [(f.where, f.fired) for f in result.report.of("live_rows")] == [("slice_1", False), ("select", True)]
    assert result.report.refusals[0].message == (
        f"cat: cat joins 2 inputs along the selected axis 1 ({T} + {T} rows, one input after another): the "
        "selected rows are not the same rows of each input"), str(result.report)
    got = torch.compile(step, backend=specpass.backend(handoff="eager"), fullgraph=True)(x)
    torch.testing.assert_close(got, step(x), rtol=1e-5, atol=1e-6)


NOTHING = torch.tensor([])  # a cache created empty: torch.cat skips a 1-D empty input


@pytest.mark.parametrize("inputs, dim", [(2, -1), (1, 1), (1, -1)],
                         ids=["along-the-features", "to-nothing-along-the-rows", "to-nothing-along-the-features"])
def test_a_concatenation_off_the_selected_axis_passes_the_rows_through(inputs, dim):
    """Joined along the features, or one input joined to a 1-D empty tensor (nothing, on any
    axis): every projection runs on the last row only. The rule reads the output's frame, not the
    first input's (the empty tensor's one axis made the pass raise IndexError)."""
    torch.manual_seed(0)
    ws = [torch.randn(H, H) for _ in range(inputs)]
    head = torch.randn(V, H * inputs if dim == -1 else H)

    def step(x):
        joined = torch.cat([F.linear(x, w) for w in ws] if inputs == 2 else [NOTHING, F.linear(x, ws[0])], dim)
        return F.linear(joined, head)[:, -1]

    _exact_and_ideal(step, torch.randn(B, T, H))


def test_a_reader_of_a_source_both_directly_and_through_a_fired_range():
    """`keys = s[:, :T]` is returned, and an einsum reads both `keys` and `s` itself: the range
    fires (s runs on its rows :T only), and the einsum keeps its two arguments apart — the rows
    it needs of `keys` are gathered from the rewritten s, and s is read as it now is. (The pass
    used to raise "einsum reads tanh both directly and through slice_1" and was dropped.)"""
    torch.manual_seed(0)
    K = T + 2
    w = torch.randn(H, H) / H**0.5

    def step(x):
        s = (x @ F.linear(x, w).transpose(1, 2)).tanh()  # [B, K, K]
        keys = s[:, :T]  # [B, T, K]
        return torch.einsum("bij,bjk->bj", keys, s)[:, :T], keys  # [B, T], [B, T, K]

    x = torch.randn(B, K, H)
    result = specpass.rewrite(specpass.capture(step, x))
    assert not result.report.errors, str(result.report)
    (finding,) = result.report.of("live_rows")
    assert finding.fired and finding.nodes == ["slice_1", "slice_2"], str(result.report)
    assert finding.rows == (B * K, B * T), str(result.report)
    (einsum,) = [n for n in result.graph_module.graph.nodes if n.target is torch.ops.aten.einsum.default]
    assert list(einsum.meta["val"].shape) == [B, T], str(result.graph_module.graph)  # on the selected rows
    got = torch.compile(step, backend=specpass.backend(handoff="eager"), fullgraph=True)(x)
    for g, want in zip(got, step(x), strict=True):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


def test_an_index_moved_to_the_step_device_is_read_as_a_constant_on_the_cpu():
    """`arange(B).to(x.device, torch.int64) * T + T - 1` on CUDA spells the device positionally
    (`aten.to.device`): the constant reader evaluated it on the GPU, then compared it with CPU ids
    and raised, and the pass was dropped (seen on an H200). Here the meta device stands for the GPU."""
    from specpass.passes.live_rows.program import constant

    aten, graph = torch.ops.aten, torch.fx.Graph()
    ids = graph.call_function(aten.arange.default, (B,), {"dtype": torch.int64, "device": torch.device("cpu")})
    moved = graph.call_function(aten.to.device, (ids, torch.device("meta"), torch.int64))
    last = graph.call_function(aten.add.Tensor, (graph.call_function(aten.mul.Tensor, (moved, T)), T - 1))
    graph.output(last)
    value = constant(last)
    assert value is not None and value.device.type == "cpu", value
    assert value.tolist() == [T - 1, 2 * T - 1, 3 * T - 1]

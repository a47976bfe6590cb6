"""Fused projections split by liveness: graph diff, numerics against eager, FLOPs, and the cases
that must stay fused."""

import expecttest
import pytest
import torch
import torch.nn.functional as F

import specpass
from specpass.testing import full_row_matmuls, graph_str

B, T, H, V, S = 3, 4, 8, 16, 6


class FusedDraft(torch.nn.Module):
    """A catch-up step with a fused QKV projection ([q | k | v] columns, 8 each), in the spellings
    engines and HF models use."""

    def __init__(self, spelling="split", bias=False):
        super().__init__()
        torch.manual_seed(0)
        self.wqkv = torch.nn.Parameter(torch.randn(3 * H, H) / H**0.5)
        self.bqkv = torch.nn.Parameter(torch.randn(3 * H)) if bias else None
        self.wo = torch.nn.Parameter(torch.randn(H, H) / H**0.5)
        self.head = torch.nn.Parameter(torch.randn(V, H) / H**0.5)
        self.register_buffer("kc", torch.zeros(B, S, H))
        self.register_buffer("vc", torch.zeros(B, S, H))
        self.spelling = spelling

    def qkv(self, x):
        if self.spelling == "split":  # vLLM / SGLang: qkv.split([q, kv, kv], dim=-1)
            return F.linear(x, self.wqkv, self.bqkv).split([H, H, H], dim=-1)
        if self.spelling == "slices":  # Phi-3: qkv[..., :q], qkv[..., q:q + kv], ...
            qkv = F.linear(x, self.wqkv, self.bqkv)
            return qkv[..., :H], qkv[..., H: 2 * H], qkv[..., 2 * H:]
        if self.spelling == "addmm_view":  # GPT-2's Conv1D: addmm on [B*T, in], a view back, split
            flat = torch.addmm(self.bqkv, x.reshape(-1, H), self.wqkv.t())
            return flat.view(*x.shape[:2], 3 * H).split(H, dim=2)
        if self.spelling == "interleaved":  # two groups of [q | k | v]: the Q columns are two blocks
            qkv = F.linear(x, self.wqkv, self.bqkv).view(*x.shape[:2], 2, 3 * H // 2)
            return (t.flatten(2) for t in qkv.split(H // 2, dim=-1))
        raise ValueError(self.spelling)

    def forward(self, x, pos, live):
        q, k, v = self.qkv(x)
        self.kc.index_copy_(1, pos, k)
        self.vc.index_copy_(1, pos, v)
        mask = torch.arange(S) <= pos[:, None]
        h = x + F.linear(F.scaled_dot_product_attention(q, self.kc, self.vc, attn_mask=mask), self.wo)
        return F.linear(h, self.head)[torch.arange(x.shape[0]), live]


def _inputs():
    torch.manual_seed(1)
    return torch.randn(B, T, H), torch.arange(T), torch.tensor([3, 1, 2])


def _rewrite(model, **options):
    options.setdefault("split_min_rows", 0)  # the drafts here have 12 rows; the default is a GPU's
    return specpass.rewrite(specpass.capture(model, *_inputs()), **options)


def _splits(report):
    return [f for f in report.of("live_rows") if "fused projection split" in f.message]


def _check_exact(model, **options):
    x, pos, live = _inputs()
    want = model(x, pos, live)
    caches = [model.kc.clone(), model.vc.clone()]
    model.kc.zero_(), model.vc.zero_()
    options.setdefault("split_min_rows", 0)
    got = torch.compile(model, backend=specpass.backend(handoff="eager", **options))(x, pos, live)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close([model.kc, model.vc], caches, rtol=0, atol=0)


class TestGraph(expecttest.TestCase):
    def test_query_block_runs_on_the_live_rows(self):
        result = _rewrite(FusedDraft("split"))
        self.assertExpectedInline(graph_str(result.graph_module), """\
wqkv: f32[24, 8]
x: f32[3, 4, 8]
kc: f32[3, 6, 8]
pos: i64[4]
vc: f32[3, 6, 8]
wo: f32[8, 8]
head: f32[16, 8]
live: i64[3]
arange_start_step: i64[3] = arange.start_step(0, 3, 1, dtype=i64, device=cpu)
unsqueeze_default_1: i64[3, 1] = unsqueeze(arange_start_step, 1)
unsqueeze_default: i64[3, 1] = unsqueeze(live, 1)
wqkv_cols: f32[8, 8] = slice.Tensor(wqkv, 0, 0, 8, 1)
x_rows: f32[3, 1, 8] = index.Tensor(x, [unsqueeze_default_1, unsqueeze_default])
linear_cols: f32[3, 1, 8] = linear(x_rows, wqkv_cols)
wqkv_cols_1: f32[16, 8] = slice.Tensor(wqkv, 0, 8, 24, 1)
linear_cols_1: f32[3, 4, 16] = linear(x, wqkv_cols_1)
getitem_1: f32[3, 4, 8] = slice.Tensor(linear_cols_1, 2, 0, 8)
getitem_2: f32[3, 4, 8] = slice.Tensor(linear_cols_1, 2, 8, 16)
index_copy_: f32[3, 6, 8] = index_copy_(kc, 1, pos, getitem_1)
index_copy__1: f32[3, 6, 8] = index_copy_(vc, 1, pos, getitem_2)
arange: i64[6] = arange(6, device=cpu, pin_memory=False)
unsqueeze: i64[4, 1] = unsqueeze(pos, 1)
le: b8[4, 6] = le.Tensor(arange, unsqueeze)
expand_default: b8[3, 4, 6] = expand(le, [3, 4, 6])
le_rows: b8[3, 1, 6] = index.Tensor(expand_default, [unsqueeze_default_1, unsqueeze_default])
scaled_dot_product_attention: f32[3, 1, 8] = scaled_dot_product_attention(linear_cols, index_copy_, index_copy__1, le_rows)
linear_1: f32[3, 1, 8] = linear(scaled_dot_product_attention, wo)
add: f32[3, 1, 8] = add.Tensor(x_rows, linear_1)
linear_2: f32[3, 1, 16] = linear(add, head)
index: f32[3, 16] = reshape(linear_2, [3, 16])
return (index,)""")
        self.assertExpectedInline(str(result.report), """\
specpass: 2 rewrite(s), 0 left alone; graph matmul FLOPs 11.5K -> 5.18K, 2.22x fewer
  [live_rows] rewrote index: 5 ops run on the selected rows only; gathered after x (a graph input); le (needed in full by scaled_dot_product_attention) (rows 12 -> 3; matmul FLOPs 8.45K -> 2.11K)
  [live_rows] rewrote linear: fused projection split by the needs of its columns: 0:8 on the selected rows, 8:24 on every row (matmul FLOPs 4.61K -> 3.46K)""")


@pytest.mark.parametrize("spelling,bias", [("split", False), ("split", True), ("slices", True),
                                           ("addmm_view", True)])
def test_every_spelling_splits_exactly(spelling, bias):
    model = FusedDraft(spelling, bias)
    result = _rewrite(model)
    (split,) = _splits(result.report)
    # Q: 8 columns on 3 live rows instead of 12; K/V: 16 columns on all 12 rows (2 FLOPs per MAC)
    assert split.matmul_flops == (2 * B * T * 3 * H * H, 2 * B * H * H + 2 * B * T * 2 * H * H), str(result.report)
    assert not full_row_matmuls(result.graph_module, {T, B * T}), str(result.report)
    _check_exact(model)


def test_interleaved_columns_stay_fused():
    """Q's columns are two blocks with K/V between them: one matmul per need would need a copy
    of the weight, so the projection stays fused (and exact)."""
    model = FusedDraft("interleaved")
    result = _rewrite(model)
    assert not _splits(result.report)
    assert "linear" in [n.name for n in result.graph_module.graph.nodes]
    _check_exact(model)


def test_option_off_keeps_the_projection_fused():
    model = FusedDraft("split")
    result = _rewrite(model, split_projections=False)
    assert not _splits(result.report) and result.report.rewrites
    _check_exact(model, split_projections=False)


@pytest.mark.parametrize("min_rows,split", [(B * T, True), (B * T + 1, False)])
def test_a_projection_on_few_rows_stays_fused(min_rows, split):
    """Below split_min_rows a matmul reads its whole weight whatever the rows: a split would only
    add a launch."""
    assert bool(_splits(_rewrite(FusedDraft("split"), split_min_rows=min_rows).report)) == split


@pytest.mark.parametrize("value", [-1, 1.5, True, "512"])
def test_split_min_rows_must_be_a_count(value):
    with pytest.raises(ValueError, match="split_min_rows= must be an int >= 0"):
        specpass.backend(split_min_rows=value)

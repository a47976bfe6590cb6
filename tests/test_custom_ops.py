"""specpass.register_row_rule: an engine's custom ops (paged attention, fused add+RMSNorm, RoPE)
declared row-local, so that the live-row gather moves through them; and what it refuses."""

from typing import Optional

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch import library

import specpass
from specpass.passes.row_rules import engine as rule_engine
from specpass.testing import graph_str

HEADS, D, V, FFN, EPS = 2, 4, 16, 16, 1e-6
H = HEADS * D
CU_SEQLENS = [0, 3, 4, 8]  # three requests with 3, 1 and 4 new tokens
N, REQUESTS = CU_SEQLENS[-1], len(CU_SEQLENS) - 1

pytestmark = pytest.mark.filterwarnings("error::specpass.SpecpassWarning")  # a fallback to plain Inductor fails


@library.custom_op("specpass_test::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


@write_kv.register_fake
def _(k_cache, v_cache, k, v, slots):
    return None


@library.custom_op("specpass_test::attn", mutates_args=())
def attn(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_ids: torch.Tensor,
         positions: torch.Tensor, slot_table: torch.Tensor) -> torch.Tensor:
    """Query row n attends to the cached keys of its request at positions <= positions[n]."""
    k, v = k_cache[slot_table[seq_ids]], v_cache[slot_table[seq_ids]]  # [n, max_len, heads, d]
    scores = torch.einsum("nhd,nshd->nhs", q, k) / q.shape[-1] ** 0.5
    visible = torch.arange(slot_table.shape[1]) <= positions[:, None]
    return torch.einsum("nhs,nshd->nhd", scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1), v)


@attn.register_fake
def _(q, k_cache, v_cache, seq_ids, positions, slot_table):
    return torch.empty_like(q)


@library.custom_op("specpass_test::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return F.rms_norm(residual, weight.shape, weight, eps), residual


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@library.custom_op("specpass_test::rope", mutates_args=())
def rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, heads, d]; positions: [B, T], or [1, T] for every request alike."""
    cos, sin = cos_sin[positions].unsqueeze(-2).chunk(2, -1)
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


@rope.register_fake
def _(x, positions, cos_sin):
    return torch.empty_like(x)


@pytest.fixture(autouse=True)
def _own_registry(monkeypatch):
    """Each test starts from the built-in rules; what it registers goes away after it."""
    monkeypatch.setattr(rule_engine, "_RULES", dict(rule_engine._RULES))


def register_attn():
    specpass.register_row_rule(torch.ops.specpass_test.attn.default, rows=("q", "seq_ids", "positions"),
                               full=("k_cache", "v_cache", "slot_table"), query=True)


def register_add_rms_norm(**kwargs):
    specpass.register_row_rule(torch.ops.specpass_test.add_rms_norm, rows=("x", "residual"), full="weight", **kwargs)


class Engine(torch.nn.Module):
    """An engine-style step on a flat token axis: varlen requests, paged KV cache, fused norms."""

    def __init__(self, num_slots=32):
        super().__init__()
        torch.manual_seed(0)

        def weight(*shape):
            return torch.nn.Parameter(torch.randn(*shape) / shape[-1] ** 0.5)

        self.embed, self.wqkv, self.wo = weight(V, H), weight(3 * H, H), weight(H, H)
        self.up, self.down, self.head = weight(FFN, H), weight(H, FFN), weight(V, H)
        self.attn_norm, self.mlp_norm, self.final_norm = (torch.nn.Parameter(1 + torch.rand(H)) for _ in range(3))
        self.register_buffer("k_cache", torch.randn(num_slots, HEADS, D))  # earlier context: random
        self.register_buffer("v_cache", torch.randn(num_slots, HEADS, D))

    def forward(self, tokens, cu_seqlens, context_lens, slot_table):
        token = torch.arange(tokens.shape[0])
        seq_ids = torch.searchsorted(cu_seqlens[1:], token, right=True)
        positions = context_lens[seq_ids] + token - cu_seqlens[seq_ids]
        h = F.embedding(tokens, self.embed)
        qkv = F.linear(F.rms_norm(h, (H,), self.attn_norm, EPS), self.wqkv)
        q, k, v = qkv.view(-1, 3, HEADS, D).unbind(1)
        write_kv(self.k_cache, self.v_cache, k, v, slot_table[seq_ids, positions])
        a = attn(q, self.k_cache, self.v_cache, seq_ids, positions, slot_table)
        normed, residual = add_rms_norm(F.linear(a.flatten(1), self.wo), h, self.mlp_norm, EPS)
        mlp = F.linear(F.silu(F.linear(normed, self.up)), self.down)
        normed, _ = add_rms_norm(mlp, residual, self.final_norm, EPS)
        return F.linear(normed, self.head)[cu_seqlens[1:] - 1]  # each request's last token


def engine_inputs():
    torch.manual_seed(1)
    slot_table = torch.randperm(32)[: REQUESTS * 8].view(REQUESTS, 8)  # 8 positions per request
    return torch.randint(0, V, (N,)), torch.tensor(CU_SEQLENS), torch.tensor([2, 5, 0]), slot_table


def rewrite_engine(**options):
    return specpass.rewrite(specpass.capture(Engine(), *engine_inputs()), **options)


def calls(result, op):
    return [n for n in result.graph_module.graph.nodes if n.target is op]


def rows(node):
    return node.meta["val"].shape[0]


def run_engine(backend=None):
    model = Engine()
    step = model
    if backend is not None:
        torch._dynamo.reset()
        step = torch.compile(model, backend=backend)
    with torch.no_grad():
        return step(*engine_inputs()), model.k_cache.clone(), model.v_cache.clone()


def assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_engine_step_runs_attention_and_fused_norms_on_live_rows():
    register_attn()
    register_add_rms_norm()
    result = rewrite_engine()
    (finding,) = result.report.of("live_rows")
    assert finding.fired and finding.rows == (N, REQUESTS), str(result.report)
    ops = torch.ops.specpass_test
    (attention,) = calls(result, ops.attn.default)
    assert rows(attention.args[0]) == REQUESTS  # the Q-slice
    norms = calls(result, ops.add_rms_norm.default)
    assert [[v.shape[0] for v in norm.meta["val"]] for norm in norms] == [[REQUESTS, REQUESTS]] * 2
    (write,) = calls(result, ops.write_kv.default)
    assert rows(write.args[2]) == rows(write.args[3]) == N  # every token's K and V are written
    want = run_engine()
    assert_same(run_engine(specpass.backend(handoff="eager")), want)
    assert_same(run_engine(specpass.backend()), want)  # Inductor


def test_q_slice_off_keeps_the_gather_after_the_attention_op():
    register_attn()
    register_add_rms_norm()
    result = rewrite_engine(q_slice=False)
    (finding,) = result.report.of("live_rows")
    assert finding.fired and "attn (q_slice=False keeps attn on every query row)" in finding.message  # landed after
    (attention,) = calls(result, torch.ops.specpass_test.attn.default)
    assert rows(attention.args[0]) == rows(attention) == N
    assert_same(run_engine(specpass.backend(handoff="eager", q_slice=False)), run_engine())


@pytest.mark.parametrize("registered, stops_at", [((), "add_rms_norm"), ((register_add_rms_norm,), "attn")],
                         ids=["nothing", "add_rms_norm_only"])
def test_unregistered_custom_op_stops_the_gather(registered, stops_at):
    for register in registered:
        register()
    result = rewrite_engine()
    assert f"{stops_at} is not known to be row-local; assumed to mix rows" in str(result.report)
    (attention,) = calls(result, torch.ops.specpass_test.attn.default)
    assert rows(attention.args[0]) == N


class TestGraph(expecttest.TestCase):
    def test_fused_add_rms_norm_runs_on_the_gathered_rows(self):
        register_add_rms_norm()

        def step(x, residual, w_in, weight, head, last):
            normed, residual = add_rms_norm(F.linear(x, w_in), residual, weight, EPS)
            return F.linear(normed, head)[last], residual[last]

        x, residual, w_in, weight, head = torch.randn(4, H), torch.randn(4, H), torch.randn(H, H), torch.ones(H), \
            torch.randn(V, H)
        gm = specpass.capture(step, x, residual, w_in, weight, head, torch.tensor([1, 3]))
        result = specpass.rewrite(gm)
        self.assertExpectedInline(graph_str(result.graph_module), """\
x: f32[4, 8]
w_in: f32[8, 8]
residual: f32[4, 8]
weight: f32[8]
head: f32[16, 8]
last: i64[2]
remainder_scalar: i64[2] = remainder.Scalar(last, 4)
expand_default: i64[2] = expand(remainder_scalar, [2])
reshape_default: i64[2] = reshape(expand_default, [-1])
reshape_default_1: f32[4, 8] = reshape(x, [4, 8])
index_select_default: f32[2, 8] = index_select(reshape_default_1, 0, reshape_default)
x_rows: f32[2, 8] = reshape(index_select_default, [2, 8])
linear: f32[2, 8] = linear(x_rows, w_in)
reshape_default_2: f32[4, 8] = reshape(residual, [4, 8])
index_select_default_1: f32[2, 8] = index_select(reshape_default_2, 0, reshape_default)
residual_rows: f32[2, 8] = reshape(index_select_default_1, [2, 8])
add_rms_norm: (f32[2, 8], f32[2, 8]) = specpass_test.add_rms_norm(linear, residual_rows, weight, 1e-06)
getitem: f32[2, 8] = getitem(add_rms_norm, 0)
getitem_1: f32[2, 8] = getitem(add_rms_norm, 1)
linear_1: f32[2, 16] = linear(getitem, head)
return (linear_1, getitem_1)""")
        self.assertExpectedInline(str(result.report), """\
specpass: 1 rewrite(s), 0 left alone; graph matmul FLOPs 1.54K -> 768, 2.00x fewer
  [live_rows] rewrote index, index_1: 3 ops run on the selected rows only; gathered after residual (a graph input); x (a graph input) (rows 4 -> 2; matmul FLOPs 1.54K -> 768)""")


def fused_norm_last_token(x, residual, weight):
    return add_rms_norm(x, residual, weight, EPS)[0][:, -1]  # x: [B, T, H]


def explain_fused_norm_last_token():
    (finding,) = specpass.explain(fused_norm_last_token, torch.randn(2, 3, H), torch.randn(2, 3, H),
                                  torch.ones(H)).of("live_rows")
    return finding


def test_selecting_a_feature_axis_is_left_alone():
    register_add_rms_norm()  # row_dims=1: of [B, T, H], only B is rows
    finding = explain_fused_norm_last_token()
    assert not finding.fired, str(finding)
    assert "add_rms_norm selects a feature axis: axis 1 is not among its first row_dims=1" in finding.message


def test_replace_swaps_the_rule():
    register_add_rms_norm()
    register_add_rms_norm(row_dims=2, replace=True)  # now the tokens of [B, T, H] are rows too
    assert explain_fused_norm_last_token().fired


def last_token(y, live):
    return y[:, -1]


def per_request(y, live):
    return y[torch.arange(y.shape[0]), live]


@pytest.mark.parametrize("positions_rows", [3, 1], ids=["per_request_positions", "shared_positions"])
@pytest.mark.parametrize("gather", [last_token, per_request], ids=lambda f: f.__name__)
def test_batch_by_token_op_moves_the_gather(gather, positions_rows):
    """rope on [B, T, heads, d] with row_dims=2; positions [1, T] broadcast over the requests."""
    specpass.register_row_rule(torch.ops.specpass_test.rope, rows=("x", "positions"), full="cos_sin", row_dims=2)
    torch.manual_seed(0)
    B, T = 3, 4
    wq, head, cos_sin = torch.randn(H, H), torch.randn(V, H), torch.randn(16, D)
    positions = torch.arange(T).repeat(positions_rows, 1) + torch.arange(positions_rows)[:, None]

    def step(x, positions, live):
        q = rope(F.linear(x, wq).view(B, T, HEADS, D), positions, cos_sin)
        return gather(F.linear(q.flatten(2), head), live)

    args = torch.randn(B, T, H), positions, torch.tensor([3, 0, 2])
    result = specpass.rewrite(specpass.capture(step, *args))
    (finding,) = result.report.of("live_rows")
    assert finding.fired and finding.rows == (B * T, B), str(result.report)
    (rope_node,) = [n for n in result.graph_module.graph.nodes if n.target is torch.ops.specpass_test.rope.default]
    assert list(rope_node.meta["val"].shape) == [B, 1, HEADS, D]
    got = torch.compile(step, backend=specpass.backend(handoff="eager"))(*args)
    torch.testing.assert_close(got, step(*args))


@library.custom_op("specpass_test::biased", mutates_args=())
def biased(x: torch.Tensor, bias: Optional[torch.Tensor], extras: list[torch.Tensor], scale: float) -> torch.Tensor:
    return x * scale


@pytest.mark.parametrize("op, declaration, error, match", [
    (add_rms_norm, {"rows": "x"}, TypeError, r"takes an op of torch.ops.*got <CustomOpDef\(specpass_test::add_rms"),
    (torch.ops.specpass_test.add_rms_norm, {"rows": ("x", "residul"), "full": "weight"}, ValueError,
     "has no tensor argument residul; its tensor arguments are x, residual, weight"),
    (torch.ops.specpass_test.add_rms_norm, {"rows": ("x", "residual", "eps"), "full": "weight"}, ValueError,
     "has no tensor argument eps"),
    (torch.ops.specpass_test.biased, {"rows": "x"}, ValueError, r"bias, extras declared in neither rows= nor full="),
    (torch.ops.specpass_test.add_rms_norm, {"rows": ("x", "residual"), "full": ("weight", "x")}, ValueError,
     "x named in both rows= and full="),
    (torch.ops.specpass_test.write_kv, {"rows": ("k", "v", "slots"), "full": ("k_cache", "v_cache")}, ValueError,
     "writes k_cache, v_cache in place, and an in-place write is never row-local"),
    (torch.ops.specpass_test.add_rms_norm, {"rows": ("x", "residual"), "full": "weight", "row_dims": 0}, ValueError,
     "row_dims=0: .* at least 1"),
    (torch.ops.specpass_test.add_rms_norm, {"rows": (), "full": ("x", "residual", "weight")}, ValueError,
     "rows= names no argument"),
    (torch.ops.aten.linear.default, {"rows": "input", "full": ("weight", "bias")}, ValueError,
     r"aten.linear.default already has a row rule .*replace=True"),
], ids=["not_an_op", "unknown_name", "not_a_tensor", "undeclared", "both", "mutable", "row_dims", "no_rows",
        "built_in"])
def test_declarations_that_cannot_be_right_are_refused(op, declaration, error, match):
    with pytest.raises(error, match=match):
        specpass.register_row_rule(op, **declaration)


def test_registering_twice_needs_replace():
    register_add_rms_norm()
    with pytest.raises(ValueError, match=r"add_rms_norm.default already has a row rule .*replace=True"):
        register_add_rms_norm()

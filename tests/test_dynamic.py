"""Symbolic shapes: the live-row pass on graphs compiled with dynamic=True (a symbolic batch and
token count, a flat token axis with a runtime index), one compile reused across sizes, numerics
against eager, and what it refuses with a reason."""

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import specpass
from specpass.passes.row_rules import engine as rule_engine
from specpass.testing import graph_str
from tests import test_custom_ops as engine
from tests.test_live_rows_models import HEADS, _caches, _catch_up

H, V, S, MAX_BATCH = 8, 16, 6, 8
pytestmark = pytest.mark.filterwarnings("error::specpass.SpecpassWarning")  # a fallback fails the test


class Draft(torch.nn.Module):
    """A catch-up step over a cache of MAX_BATCH requests, of which the step writes the first B:
    both B and T are free to change from call to call."""

    def __init__(self, select):
        super().__init__()
        torch.manual_seed(0)
        self.wq, self.wk, self.wo = (torch.nn.Parameter(torch.randn(H, H) / H**0.5) for _ in range(3))
        self.head = torch.nn.Parameter(torch.randn(V, H) / H**0.5)
        self.register_buffer("cache", torch.zeros(MAX_BATCH, S, H))
        self.select = select

    def forward(self, x, pos, live):
        cache = self.cache[: x.shape[0]]
        cache.index_copy_(1, pos, F.linear(x, self.wk))
        mask = torch.arange(S) <= pos[:, None]
        h = x + F.linear(F.scaled_dot_product_attention(F.linear(x, self.wq), cache, cache, attn_mask=mask), self.wo)
        return self.select(F.linear(F.rms_norm(h, (H,)), self.head), live)


def last(logits, live):
    return logits[:, -1]


def per_request(logits, live):
    return logits[torch.arange(logits.shape[0]), live]


def flat(logits, live):
    B, T = logits.shape[:2]
    return logits.reshape(B * T, V)[torch.arange(B) * T + live]


SIZES = [(3, 4), (5, 4), (6, 3)]  # (B, T): one compile serves all three


def _inputs(B, T):
    g = torch.Generator().manual_seed(B * 10 + T)
    return torch.randn(B, T, H, generator=g), torch.arange(T), torch.randint(0, T, (B,), generator=g)


@pytest.mark.parametrize("select", [last, per_request, flat])
@pytest.mark.parametrize("handoff", ["eager", "inductor"])
def test_one_compile_serves_every_batch_and_token_count(select, handoff):
    model = Draft(select)
    counter = CompileCounterWithBackend(specpass.backend(handoff=handoff))
    compiled = torch.compile(model, backend=counter, dynamic=True)
    for B, T in SIZES:
        inputs = _inputs(B, T)
        model.cache.zero_()
        want, want_cache = model(*inputs), model.cache.clone()
        model.cache.zero_()
        torch.testing.assert_close(compiled(*inputs), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model.cache, want_cache, rtol=0, atol=0)
    assert counter.frame_count == 1


@pytest.mark.parametrize("select,moved", [(last, 7), (per_request, 6), (flat, 4)])
def test_symbolic_rows_are_rewritten(select, moved):
    report = specpass.rewrite(specpass.capture(Draft(select), *_inputs(3, 4), dynamic=True)).report
    (finding,) = report.of("live_rows")
    assert finding.fired and finding.message.startswith(f"{moved} ops run on the selected rows only"), str(report)
    assert [str(r) for r in finding.rows] == ["s27*s77", "s77"], str(report)


def test_flat_ids_across_requests_stop_before_attention_with_a_reason():
    """arange(B) * T + live is per request only if live < T; with a symbolic B the ids cannot be
    evaluated at compile time, so attention keeps every query row and says why."""
    report = specpass.rewrite(specpass.capture(Draft(flat), *_inputs(3, 4), dynamic=True)).report
    assert "scaled_dot_product_attention (the rows are flat ids across requests, not provably per request" \
        in str(report)


class TestGraph(expecttest.TestCase):
    def test_last_row_with_symbolic_sizes(self):
        """Sizes in new nodes are computed in the graph (`add_1 = -1 + s27`: T - 1), never baked in."""
        result = specpass.rewrite(specpass.capture(Draft(last), *_inputs(3, 4), dynamic=True))
        self.assertExpectedInline(graph_str(result.graph_module), """\
cache: f32[8, 6, 8]
s77
s27
x: f32[s77, s27, 8]
wk: f32[8, 8]
pos: i64[s27]
wq: f32[8, 8]
wo: f32[8, 8]
head: f32[16, 8]
add_1 = add(-1, s27)
slice_1: f32[s77, 6, 8] = slice.Tensor(cache, 0, 0, s77)
linear: f32[s77, s27, 8] = linear(x, wk)
index_copy_: f32[s77, 6, 8] = index_copy_(slice_1, 1, pos, linear)
arange: i64[6] = arange(6, device=cpu, pin_memory=False)
pos_rows: i64[1] = slice.Tensor(pos, 0, add_1, s27, 1)
slice_2: i64[1] = slice.Tensor(pos_rows, 0, 0, 9223372036854775807)
unsqueeze: i64[1, 1] = reshape(slice_2, [1, 1])
le_1: b8[1, 6] = le.Tensor(arange, unsqueeze)
x_rows: f32[s77, 1, 8] = slice.Tensor(x, 1, add_1, s27, 1)
linear_1: f32[s77, 1, 8] = linear(x_rows, wq)
scaled_dot_product_attention: f32[s77, 1, 8] = scaled_dot_product_attention(linear_1, index_copy_, index_copy_, le_1)
linear_2: f32[s77, 1, 8] = linear(scaled_dot_product_attention, wo)
add: f32[s77, 1, 8] = add.Tensor(x_rows, linear_2)
rms_norm: f32[s77, 1, 8] = rms_norm(add, [8])
linear_3: f32[s77, 1, 16] = linear(rms_norm, head)
select: f32[s77, 16] = reshape(linear_3, [s77, 16])
return (select,)""")


@pytest.mark.parametrize("name", HEADS)
def test_zoo_heads_with_dynamic_token_count(name):
    """The zoo's caches fix the batch (Dynamo specializes it); T stays symbolic. specpass compiles
    no more often than Dynamo alone does (backend="eager": its guards on these heads recompile
    once for T = 3)."""
    model, inputs = _catch_up(name)
    report = specpass.rewrite(specpass.capture(model.catch_up, *inputs, dynamic=True), argmax=False).report
    (finding,) = report.of("live_rows")
    assert finding.fired and "s" in str(finding.rows[0]), str(report)
    frames = {}
    for backend in ("eager", specpass.backend(handoff="eager")):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(model.catch_up, backend=counter, dynamic=True)
        for T in (4, 3):
            tokens, positions, hidden, live = inputs
            step = [None if t is None else t[:, :T].contiguous() for t in (tokens, positions, hidden)]
            step.append(live.clamp(max=T - 1))
            with torch.no_grad():
                _zero_caches(model)
                want, want_caches = model.catch_up(*step), _caches(model)
                _zero_caches(model)
                got = compiled(*step)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
            assert all(torch.equal(g, w) for g, w in zip(_caches(model), want_caches, strict=True))
        frames[backend if isinstance(backend, str) else "specpass"] = counter.frame_count
    assert frames["specpass"] == frames["eager"], frames


def _zero_caches(model):
    for n, b in model.named_buffers():
        if "cache" in n:
            b.zero_()


def test_hugging_face_llama_with_dynamic_token_count():
    import transformers
    from transformers import StaticCache

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 10))
    counter = CompileCounterWithBackend(specpass.backend(handoff="eager"))
    results = []
    for compiled in (False, True):
        cache = StaticCache(config=config, max_cache_len=16)

        def step(tokens, cache_position):
            return model(input_ids=tokens, past_key_values=cache, cache_position=cache_position,
                         use_cache=True).logits[:, -1]

        run = torch.compile(step, backend=counter, dynamic=True) if compiled else step
        with torch.no_grad():
            model(input_ids=ids[:, :3], past_key_values=cache, use_cache=True)
            logits = [run(ids[:, 3:7], torch.arange(3, 7)), run(ids[:, 7:10], torch.arange(7, 10))]  # T = 4, 3
            if compiled:
                report = specpass.rewrite(specpass.capture(step, ids[:, 3:7], torch.arange(3, 7), dynamic=True)).report
        results.append((logits, [layer.keys.clone() for layer in cache.layers]))
    (finding,) = report.of("live_rows")
    assert finding.fired and "s" in str(finding.rows[0]), str(report)
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


@pytest.fixture
def own_registry(monkeypatch):
    monkeypatch.setattr(rule_engine, "_RULES", dict(rule_engine._RULES))


def test_flat_token_axis_with_runtime_last_positions(own_registry):
    """vLLM's layout: tokens [num_tokens] of requests of different lengths, logits at a runtime
    index of each request's last token; num_tokens and the number of requests are symbolic."""
    engine.register_attn()
    engine.register_add_rms_norm()
    model = engine.Engine()
    counter = CompileCounterWithBackend(specpass.backend(handoff="eager"))
    compiled = torch.compile(model, backend=counter, dynamic=True)
    tokens, _, context_lens, slot_table = engine.engine_inputs()
    # 7 and 6 tokens: sizes unlike the slot table's 8 columns, so Dynamo does not tie them together
    cases = [(tokens[:7], torch.tensor([0, 3, 4, 7]), context_lens, slot_table),
             (tokens[:6], torch.tensor([0, 2, 6]), torch.tensor([2, 3]), slot_table[:2])]
    report = specpass.rewrite(specpass.capture(model, *cases[0], dynamic=True)).report
    (finding,) = report.of("live_rows")
    assert finding.fired and "attn" not in finding.message, str(report)  # the Q-slice through the custom op
    for inputs in cases:
        caches = model.k_cache.clone(), model.v_cache.clone()
        want = model(*inputs)
        want_caches = model.k_cache.clone(), model.v_cache.clone()
        model.k_cache.copy_(caches[0]), model.v_cache.copy_(caches[1])
        torch.testing.assert_close(compiled(*inputs), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close((model.k_cache, model.v_cache), want_caches, rtol=0, atol=0)
    assert counter.frame_count == 1

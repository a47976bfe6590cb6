"""specpass.export: every zoo head exported, rewritten and run as an ExportedProgram — its outputs
and the KV caches it writes equal the unrewritten program's and eager's — re-exported, in its
functional form (run_decompositions), with a dynamic token count, saved and loaded, and through
AOTInductor."""

import importlib
import io
import os
import warnings

import expecttest
import pytest
import torch
import torch.nn as nn
from torch.export import Dim

import specpass
from models.toy import ToyDraft
from specpass import pipeline
from specpass.graph import is_mutation
from specpass.testing import graph_str
from tests.test_live_rows_models import HEADS, B, T, _catch_up

aten = torch.ops.aten
export_module = importlib.import_module("specpass.export_program")


class CatchUp(nn.Module):
    """A zoo head's catch-up step as a module: torch.export exports modules."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, positions, hidden, live):
        return self.model.catch_up(tokens, positions, hidden, live)


def _written(program):
    """The buffers a program writes, read from its functional form's graph signature."""
    return set(program.run_decompositions({}).graph_signature.buffers_to_mutate.values())


def _run(module, inputs, written):
    """Outputs and the written buffers after one call, each written buffer zeroed first."""
    buffers = dict(module.named_buffers())
    for name in written:
        buffers[name].zero_()
    with torch.no_grad():
        out = module(*inputs)
    return out, {name: buffers[name].clone() for name in written}


def _assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def _inputs_with_tokens(inputs, t):
    """The catch-up inputs with `t` rows per request: theirs repeated, positions counted on."""
    tokens, positions, hidden, _ = inputs
    tokens, hidden = (None if x is None else torch.cat([x] * t, 1)[:, :t].contiguous() for x in (tokens, hidden))
    return tokens, positions[:, :1] + torch.arange(t), hidden, torch.tensor([t - 1, 0, t // 2])


@pytest.mark.filterwarnings("error::specpass.SpecpassWarning")
@pytest.mark.parametrize("name", HEADS)
def test_head(name):
    model, inputs = _catch_up(name)
    step = CatchUp(model)
    plain = torch.export.export(step, inputs)
    program = specpass.export(step, inputs)
    (finding,) = program.specpass_report.of("live_rows")
    assert finding.fired and finding.rows == (B * T, B), str(program.specpass_report)
    # exactly what the torch.compile backend does to the same step
    assert program.specpass_report.matmul_flops == specpass.explain(model.catch_up, *inputs).matmul_flops
    written = _written(plain)
    assert written and _written(program) == written

    want = _run(step, inputs, written)
    _assert_same(_run(plain.module(), inputs, written), want)
    _assert_same(_run(program.module(), inputs, written), want)
    _assert_same(_run(torch.export.export(program.module(), inputs).module(), inputs, written), want)

    # the functional form: its writes are outputs, and stay outputs
    functional = plain.run_decompositions({})
    rewritten = specpass.export(functional)
    assert rewritten.specpass_report.matmul_flops == program.specpass_report.matmul_flops
    assert [(s.kind, s.target) for s in rewritten.graph_signature.output_specs] == \
        [(s.kind, s.target) for s in functional.graph_signature.output_specs]
    assert not [n for n in rewritten.graph.nodes if is_mutation(n)]
    _assert_same(_run(rewritten.module(), inputs, written), want)


@pytest.mark.filterwarnings("error::specpass.SpecpassWarning")
@pytest.mark.parametrize("name", ["tiny-llama-draft", "tiny-deepseek-nextn"])  # GQA, and MLA with MoE
def test_head_with_a_dynamic_token_count(name):
    model, inputs = _catch_up(name)
    step = CatchUp(model)
    rows = Dim("T", min=1, max=9)  # positions up to 7 + T - 1 stay in the 16 cache slots
    dynamic = ({1: rows}, {1: rows}, None if inputs[2] is None else {1: rows}, None)
    plain = torch.export.export(step, inputs, dynamic_shapes=dynamic)
    program = specpass.export(plain)  # exported once: symbolic sizes make exporting slow
    (finding,) = program.specpass_report.of("live_rows")
    assert finding.fired and finding.rows[1] == B and isinstance(finding.rows[0], torch.SymInt)
    written = _written(torch.export.export(step, inputs))
    saved = io.BytesIO()
    torch.export.save(program, saved)
    saved.seek(0)
    modules = [p.module() for p in (program, torch.export.load(saved))]
    for t in (1, 3, 9):
        cut = _inputs_with_tokens(inputs, t)
        # torch.export's own program is the reference at every T; it matches eager (the caches bit for
        # bit) at every T, since attention is one SDPA call at every T, as in the traced program.
        want = _run(plain.module(), cut, written)
        _assert_same(want, _run(step, cut, written))
        for module in modules:
            _assert_same(_run(module, cut, written), want)


@pytest.mark.filterwarnings("error::specpass.SpecpassWarning")
def test_aoti_compiles_the_rewritten_program(tmp_path):
    """One package (AOTInductor is slow to compile on CPU) serves every token count; the caches
    are the caller's, handed to the package (`user_managed`), so their writes can be read."""
    model, inputs = _catch_up("tiny-llama-eagle3")
    step = CatchUp(model)
    rows = Dim("T", min=1, max=9)
    program = specpass.export(step, inputs, dynamic_shapes=({1: rows}, {1: rows}, {1: rows}, None))
    assert program.specpass_report.rewrites
    written = _written(program)
    path = torch._inductor.aoti_compile_and_package(program, package_path=os.fspath(tmp_path / "step.pt2"))
    compiled = torch._inductor.aoti_load_package(path)
    caches = {name: torch.zeros_like(step.get_buffer(name)) for name in written}
    compiled.load_constants(caches, check_full_update=False, user_managed=True)
    for t in (T, 2):
        cut = _inputs_with_tokens(inputs, t)
        for cache in caches.values():
            cache.zero_()
        got = compiled(*cut), {name: cache.clone() for name, cache in caches.items()}
        for want in (_run(torch.export.export(step, cut).module(), cut, written), _run(step, cut, written)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # compiled kernels round differently


def _toy():
    torch.manual_seed(0)
    return ToyDraft().eval(), (torch.randint(0, 64, (2, 4)), torch.arange(4))


class TestGraph(expecttest.TestCase):
    def test_toy_draft(self):
        """The exported graph, rewritten: the live row is gathered right after the KV writes (the
        query rows, `positions`' last row for the mask, the residual) and the rest runs on it."""
        model, args = _toy()
        text = graph_str(specpass.export(model, args).graph_module)
        self.assertEqual(graph_str(specpass.export(model, args, strict=True).graph_module), text)  # Dynamo's trace
        self.assertExpectedInline(text, """\
p_embed_weight: f32[64, 32]
p_attn_norm_weight: f32[32]
p_qkv_weight: f32[96, 32]
p_o_proj_weight: f32[32, 32]
p_mlp_norm_weight: f32[32]
p_up_weight: f32[64, 32]
p_down_weight: f32[32, 64]
p_norm_weight: f32[32]
p_lm_head_weight: f32[64, 32]
b_k_cache: f32[2, 4, 16, 8]
b_v_cache: f32[2, 4, 16, 8]
tokens: i64[2, 4]
positions: i64[4]
embedding: f32[2, 4, 32] = embedding(p_embed_weight, tokens)
rms_norm: f32[2, 4, 32] = rms_norm(embedding, [32], p_attn_norm_weight, 1e-06)
linear: f32[2, 4, 96] = linear(rms_norm, p_qkv_weight)
view: f32[2, 4, 3, 4, 8] = view(linear, [2, 4, 3, 4, 8])
transpose: f32[2, 4, 3, 4, 8] = transpose.int(view, 1, 3)
unbind: (f32[2, 4, 4, 8], f32[2, 4, 4, 8], f32[2, 4, 4, 8]) = unbind.int(transpose, 2)
getitem: f32[2, 4, 4, 8] = getitem(unbind, 0)
getitem_1: f32[2, 4, 4, 8] = getitem(unbind, 1)
getitem_2: f32[2, 4, 4, 8] = getitem(unbind, 2)
index_copy_: f32[2, 4, 16, 8] = index_copy_(b_k_cache, 2, positions, getitem_1)
index_copy__1: f32[2, 4, 16, 8] = index_copy_(b_v_cache, 2, positions, getitem_2)
arange: i64[16] = arange(16, device=cpu, pin_memory=False)
unsqueeze: i64[1, 16] = unsqueeze(arange, 0)
positions_rows: i64[1] = slice.Tensor(positions, 0, 3, 4, 1)
unsqueeze_1: i64[1, 1] = reshape(positions_rows, [1, 1])
le: b8[1, 16] = le.Tensor(unsqueeze, unsqueeze_1)
getitem_rows: f32[2, 4, 1, 8] = slice.Tensor(getitem, 2, 3, 4, 1)
scaled_dot_product_attention: f32[2, 4, 1, 8] = scaled_dot_product_attention(getitem_rows, index_copy_, index_copy__1, le)
transpose_1: f32[2, 1, 4, 8] = transpose.int(scaled_dot_product_attention, 1, 2)
reshape: f32[2, 1, 32] = reshape(transpose_1, [2, 1, 32])
linear_1: f32[2, 1, 32] = linear(reshape, p_o_proj_weight)
embedding_rows: f32[2, 1, 32] = slice.Tensor(embedding, 1, 3, 4, 1)
add: f32[2, 1, 32] = add.Tensor(embedding_rows, linear_1)
rms_norm_1: f32[2, 1, 32] = rms_norm(add, [32], p_mlp_norm_weight, 1e-06)
linear_2: f32[2, 1, 64] = linear(rms_norm_1, p_up_weight)
silu: f32[2, 1, 64] = silu(linear_2)
linear_3: f32[2, 1, 32] = linear(silu, p_down_weight)
add_1: f32[2, 1, 32] = add.Tensor(add, linear_3)
rms_norm_2: f32[2, 1, 32] = rms_norm(add_1, [32], p_norm_weight, 1e-06)
linear_4: f32[2, 1, 64] = linear(rms_norm_2, p_lm_head_weight)
select: f32[2, 64] = reshape(linear_4, [2, 64])
return (select,)""")


@pytest.mark.filterwarnings("error::specpass.SpecpassWarning")
def test_a_step_with_nothing_to_rewrite_is_returned_as_exported():
    args = (torch.randn(2, 8),)
    program = specpass.export(nn.Linear(8, 8), args)
    assert not program.specpass_report.rewrites and not program.specpass_report.errors
    assert graph_str(program.graph_module) == graph_str(torch.export.export(nn.Linear(8, 8), args).graph_module)


class CachesAsInputs(nn.Module):
    """A step whose KV caches are inputs (an engine owns them), with an input named `input` (a
    Python builtin, which a copied FX graph renames)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48, bias=False)
        self.o_proj = nn.Linear(16, 32, bias=False)

    def forward(self, input, positions, k_cache, v_cache):
        B, T, _ = input.shape
        q, k, v = self.qkv(input).view(B, T, 3, 2, 8).transpose(1, 3).unbind(2)
        k_cache.index_copy_(2, positions, k)
        v_cache.index_copy_(2, positions, v)
        mask = torch.arange(k_cache.shape[2]) <= positions[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, 16))[:, -1]


@pytest.mark.filterwarnings("error::specpass.SpecpassWarning")
def test_caches_as_inputs_with_a_dynamic_batch_and_token_count():
    torch.manual_seed(0)
    step = CachesAsInputs()

    def run(module, b, t):
        torch.manual_seed(b * t)
        x, k_cache, v_cache = torch.randn(b, t, 16), torch.zeros(b, 2, 8, 8), torch.zeros(b, 2, 8, 8)
        with torch.no_grad():
            return module(x, torch.arange(t), k_cache, v_cache), k_cache, v_cache

    batch, rows = Dim("B", max=8), Dim("T", max=8)
    example = (torch.randn(2, 4, 16), torch.arange(4), torch.zeros(2, 2, 8, 8), torch.zeros(2, 2, 8, 8))
    dynamic = ({0: batch, 1: rows}, {0: rows}, {0: batch}, {0: batch})
    functional = torch.export.export(step, example, dynamic_shapes=dynamic).run_decompositions({})
    for program in (specpass.export(step, example, dynamic_shapes=dynamic), specpass.export(functional)):
        (finding,) = program.specpass_report.rewrites
        x = next(n for n in program.graph.nodes if n.name == program.graph_signature.user_inputs[0])
        requests, tokens = (size.node.expr for size in x.meta["val"].shape[:2])
        assert [r.node.expr for r in finding.rows] == [requests * tokens, requests], finding
        for b, t in ((2, 4), (1, 1), (3, 7)):
            want = run(step, b, t)
            torch.testing.assert_close(run(program.module(), b, t), want, rtol=1e-5, atol=1e-5)
            assert want[1].any()
    assert [(s.kind, s.target) for s in program.graph_signature.output_specs] == \
        [(s.kind, s.target) for s in functional.graph_signature.output_specs]


# ----------------------------------------------------------------------------- failures


def _exported_with_warnings(program, args=(), **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = specpass.export(program, args, **options)
    return result, [str(w.message) for w in caught if issubclass(w.category, specpass.SpecpassWarning)]


def _assert_runs_as_eager(program, model, args):
    written = _written(program)
    _assert_same(_run(program.module(), args, written), _run(model, args, written))


def test_a_failing_pass_is_dropped(monkeypatch):
    def raising(gm, options):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(pipeline, "PASSES", [(n, raising if n == "live_rows" else run) for n, run in pipeline.PASSES])
    model, args = _toy()
    program, (message,) = _exported_with_warnings(model, args)
    assert "pass live_rows failed (RuntimeError: injected failure)" in message, message
    assert program.specpass_report.errors == [message] and not program.specpass_report.rewrites
    _assert_runs_as_eager(program, model, args)


def test_a_pipeline_failure_returns_the_program_unrewritten(monkeypatch):
    def run_passes(gm, options):
        raise RuntimeError("injected pipeline failure")

    monkeypatch.setattr(export_module, "run_passes", run_passes)
    model, args = _toy()
    program, (message,) = _exported_with_warnings(model, args)
    assert "could not rewrite this program (RuntimeError: injected pipeline failure)" in message, message
    assert graph_str(program.graph_module) == graph_str(torch.export.export(model, args).graph_module)
    _assert_runs_as_eager(program, model, args)


def _silu(x):
    return x * torch.sigmoid(x)


def test_a_rewrite_torch_export_refuses_returns_the_program_unrewritten(monkeypatch):
    """A pass may emit what FX runs but an ExportedProgram may not hold (a Python function)."""
    def python_silu(gm, options):
        for node in gm.graph.find_nodes(op="call_function", target=aten.silu.default):
            node.target = _silu
        return [specpass.Finding("live_rows", "silu", True, "silu as a Python function")]

    monkeypatch.setattr(pipeline, "PASSES", [("live_rows", python_silu)])
    model, args = _toy()
    program, (message,) = _exported_with_warnings(model, args)
    assert "could not rewrite this program (SpecViolationError: Operator '<function _silu" in message, message
    assert len(message.splitlines()) == 1
    assert aten.silu.default in {n.target for n in program.graph.nodes}
    _assert_runs_as_eager(program, model, args)


@pytest.mark.parametrize("thing", [lambda tokens: tokens, "model", None])
def test_only_modules_and_exported_programs(thing):
    with pytest.raises(TypeError, match=r"expected an nn.Module or a torch.export.ExportedProgram, got a \w+: .* wrap"):
        specpass.export(thing, (torch.zeros(2),))


def test_an_exported_program_takes_no_example_inputs():
    model, args = _toy()
    with pytest.raises(TypeError, match="pass it alone"):
        specpass.export(torch.export.export(model, args), args)


@pytest.mark.parametrize("options,error,message", [
    (dict(q_slices=False), TypeError, r"unknown specpass option\(s\) \['q_slices'\]; valid options are"),
    (dict(max_probs="some"), ValueError, r"max_probs= must be one of \['exact', 'ones'\]"),
    (dict(handoff="eager"), TypeError, "handoff= is an option of the torch.compile backend"),
])
def test_bad_options_are_refused_before_exporting(monkeypatch, options, error, message):
    monkeypatch.setattr(torch.export, "export", None)  # never reached
    with pytest.raises(error, match=message):
        specpass.export(ToyDraft(), (torch.zeros(2, 4, dtype=torch.long), torch.arange(4)), **options)

"""rewrite/explain plumbing: copies, switches, invariants the pipeline enforces, the report."""

import itertools
import unittest.mock

import expecttest
import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.multiprocessing.reductions import StorageWeakRef

import specpass
from models.toy import ToyDraft
from specpass import pipeline
from specpass.graph import emit
from specpass.report import Finding, Report, graph_matmul_flops
from specpass.testing import graph_str
from tests.test_backend import broken_pass, silu_to_sigmoid
from tests.test_live_rows_models import HEADS, _catch_up

aten = torch.ops.aten


def _value_signature(value):
    if isinstance(value, (tuple, list)):
        return [_value_signature(v) for v in value]
    if isinstance(value, torch.Tensor):
        return str(tuple(value.shape)), str(value.stride()), value.dtype, value.storage_offset()
    return str(value)


def _alias_classes(gm):
    """The nodes grouped by the storage their values live in (which values alias which)."""
    classes = {}
    for n in gm.graph.nodes:
        if isinstance(n.meta.get("val"), torch.Tensor):
            classes.setdefault(StorageWeakRef(n.meta["val"].untyped_storage()), []).append(n.name)
    return sorted(classes.values())


def _captured(batch=2, T=4):
    torch.manual_seed(0)
    return specpass.capture(ToyDraft(batch=batch).eval(), torch.randint(0, 64, (batch, T)), torch.arange(T))


def shrink_output(gm, options):
    """Breaks the output-shape invariant: returns a narrower tensor."""
    out = gm.graph.output_node()
    (result,) = out.args[0]
    with gm.graph.inserting_before(out):
        narrowed = emit(gm.graph, aten.slice.Tensor, (result, 1, 0, 1))
    out.args = ((narrowed,),)
    return [Finding("shrink", result.name, True, "bad")]


def stride_output(gm, options):
    """Breaks the dense-output invariant, not the shape: the output becomes the first half of each
    row of a doubled tensor, the same values under other strides."""
    out = gm.graph.output_node()
    (result,) = out.args[0]
    with gm.graph.inserting_before(out):
        doubled = emit(gm.graph, aten.cat.default, ([result, result], -1))
        half = emit(gm.graph, aten.slice.Tensor, (doubled, -1, 0, result.meta["val"].shape[-1]))
    out.args = ((half,),)
    return [Finding("stride", result.name, True, "bad")]


def drop_kv_write(gm, options):
    """Breaks the in-place-write invariant: replaces the first KV write by its input."""
    write = next(n for n in gm.graph.nodes if n.target is aten.index_copy_.default)
    write.replace_all_uses_with(write.args[0])
    gm.graph.erase_node(write)
    return [Finding("drop", write.name, True, "bad")]


def swap_kv_buffers(gm, options):
    """Breaks the in-place-write invariant subtly: the V write goes to the K cache (same ops)."""
    k_write, v_write = [n for n in gm.graph.nodes if n.target is aten.index_copy_.default][:2]
    v_write.args = (k_write.args[0], *v_write.args[1:])
    return [Finding("swap", v_write.name, True, "bad")]


def copy_after_transpose(gm, options):
    """Changes values inside the graph, not its outputs: the attention's transposed view becomes a
    contiguous copy, so the nodes after it (as they were) get other strides and storages."""
    (transpose,) = [n for n in gm.graph.nodes if n.target is aten.transpose.int][:1]
    with gm.graph.inserting_after(transpose):
        copy = emit(gm.graph, aten.clone.default, (transpose,), {"memory_format": torch.contiguous_format})
    transpose.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)
    return [Finding("copy", transpose.name, True, "contiguous")]


def refuse_silu(gm, options):
    """Looks at silu and leaves the graph alone."""
    (silu,) = gm.graph.find_nodes(op="call_function", target=aten.silu.default)
    return [Finding("refuse", silu.name, False, "not worth it")]


def retarget_lm_head(gm, options):
    """Breaks the graph without a new node or argument: the lm_head's linear becomes a matmul of the
    same operands ([2, 4, 32] @ [64, 32] does not compose); only re-running that node finds out."""
    lm_head = [n for n in gm.graph.nodes if n.target is aten.linear.default][-1]
    lm_head.target = aten.matmul.default
    return [Finding("retarget", lm_head.name, True, "bad")]


class TestPipeline(expecttest.TestCase):
    def setUp(self):  # each test runs the passes it names, alone
        self._passes, self._after_bodies = pipeline.PASSES, pipeline.AFTER_BODIES
        pipeline.AFTER_BODIES = []

    def tearDown(self):
        pipeline.PASSES, pipeline.AFTER_BODIES = self._passes, self._after_bodies

    def test_rewrite_returns_a_new_graph_and_leaves_the_input_alone(self):
        pipeline.PASSES = [("live_rows", silu_to_sigmoid)]
        gm = _captured()
        before = graph_str(gm)
        result = specpass.rewrite(gm)
        self.assertEqual(graph_str(gm), before)
        self.assertIsNot(result.graph_module, gm)
        targets = [n.target for n in result.graph_module.graph.nodes]
        self.assertNotIn(aten.silu.default, targets)
        self.assertIn(aten.sigmoid.default, targets)
        self.assertEqual([f.where for f in result.report.rewrites], ["silu"])

    def test_passes_switch_off_by_name(self):
        pipeline.PASSES = [("live_rows", silu_to_sigmoid), ("argmax", broken_pass)]
        result = specpass.rewrite(_captured(), live_rows=False, argmax=False)
        self.assertEqual(result.report.findings, [])
        self.assertEqual(result.report.errors, [])
        self.assertIn(aten.silu.default, [n.target for n in result.graph_module.graph.nodes])

    def test_failed_pass_keeps_earlier_rewrites(self):
        pipeline.PASSES = [("argmax", silu_to_sigmoid), ("live_rows", broken_pass)]
        result = specpass.rewrite(_captured())
        self.assertEqual(len(result.report.rewrites), 1)
        self.assertEqual(len(result.report.errors), 1)
        self.assertIn("pass live_rows failed (RuntimeError: injected failure)", result.report.errors[0])

    def test_invariants_reject_a_pass(self):
        for bad, message in [(shrink_output, "outputs changed"), (drop_kv_write, "in-place writes changed"),
                             (swap_kv_buffers, "in-place writes changed")]:
            pipeline.PASSES = [("live_rows", bad)]
            gm = _captured()
            result = specpass.rewrite(gm)
            self.assertEqual(result.report.findings, [])
            self.assertIn(message, result.report.errors[0])
            self.assertEqual(graph_str(result.graph_module), graph_str(gm))

    def test_a_dense_output_is_left_dense(self):
        """A pass that leaves a dense output strided (same shape and values): the pipeline copies it
        back to the dense layout; ToyDraft's `logits[:, -1]`, strided as captured, is not copied."""
        pipeline.PASSES = [("live_rows", stride_output)]
        result = specpass.rewrite(specpass.capture(torch.nn.Linear(8, 16).eval(), torch.randn(3, 8)))  # a dense [3, 16]
        self.assertEqual([f.pass_name for f in result.report.rewrites], ["stride"])
        (out,) = result.graph_module.graph.output_node().args[0]
        self.assertEqual((out.target, out.args[0].target), (aten.clone.default, aten.slice.Tensor))
        self.assertEqual(out.meta["val"].stride(), (16, 1))
        strided = specpass.rewrite(_captured()).graph_module.graph
        self.assertEqual(strided.output_node().args[0][0].target, aten.slice.Tensor)  # as the pass left it

    def test_a_pass_that_leaves_the_graph_alone_is_not_propagated_again(self):
        propagated = []
        pipeline.PASSES = [("live_rows", refuse_silu)]
        with unittest.mock.patch.object(pipeline, "propagate_fake_tensors",
                                        side_effect=lambda gm, *kept: propagated.append(gm)):
            result = specpass.rewrite(_captured())
        self.assertEqual(len(propagated), 1)  # the preparation's
        self.assertEqual([f.where for f in result.report.refusals], ["silu"])
        self.assertNotIn("live_rows/propagate", result.report.seconds)
        pipeline.PASSES = [("live_rows", silu_to_sigmoid)]
        propagated.clear()
        with unittest.mock.patch.object(pipeline, "propagate_fake_tensors",
                                        side_effect=lambda gm, *kept: propagated.append(gm)):
            specpass.rewrite(_captured())
        self.assertEqual(len(propagated), 2)

    def test_a_rewrite_propagates_what_it_changed_until_the_values_are_as_they_were(self):
        computed = []
        run_node = FakeTensorProp.run_node

        def spy(interpreter, node):
            computed.append(node.name)
            return run_node(interpreter, node)

        def propagate(gm, *before):
            computed.append("--")  # a new propagation
            propagate_fake_tensors(gm, *before)

        propagate_fake_tensors = pipeline.propagate_fake_tensors
        pipeline.PASSES = [("live_rows", silu_to_sigmoid)]
        with unittest.mock.patch.object(FakeTensorProp, "run_node", spy), \
                unittest.mock.patch.object(pipeline, "propagate_fake_tensors", propagate):
            result = specpass.rewrite(_captured())
        after = result.graph_module.graph
        (mul,) = after.find_nodes(op="call_function", target=aten.mul.Tensor)
        placeholders = [n.name for n in after.find_nodes(op="placeholder")]
        self.assertEqual(computed.count("--"), 2)  # the preparation's, the pass's
        # x * sigmoid(x) has silu's value: its users (their arguments edited) are computed once more,
        # take their old values back, and nothing after them is computed again
        self.assertEqual(sorted(computed[computed.index("--", 1) + 1:]),
                         sorted(placeholders + [mul.args[1].name, mul.name] + [u.name for u in mul.users] + ["output"]))

    def test_incremental_propagation_gives_the_values_a_full_one_gives(self):
        """The preparation and every pass propagate incrementally (from the captured values on);
        a full propagation of the result computes the same values, aliases included. The toy step
        (two batch shapes) and the zoo heads' catch-up steps (MLA, MoE, a standalone draft)."""
        every = (self._passes, self._after_bodies)
        captured = [(passes, _captured(batch, T)) for passes, (batch, T) in itertools.product(
            [every, ([("live_rows", copy_after_transpose)], [])], [(2, 4), (1, 3)])]
        for name in HEADS:
            model, inputs = _catch_up(name)
            captured.append((every, specpass.capture(model.catch_up, *inputs)))
        for (passes, after_bodies), gm in captured:
            pipeline.PASSES, pipeline.AFTER_BODIES = passes, after_bodies
            result = specpass.rewrite(gm)
            self.assertTrue(result.report.rewrites)  # values downstream of the edits changed
            gm = result.graph_module
            incremental = {n.name: _value_signature(n.meta.get("val")) for n in gm.graph.nodes}
            aliases = _alias_classes(gm)
            pipeline.propagate_fake_tensors(gm)  # every node computed again
            self.assertEqual({n.name: _value_signature(n.meta.get("val")) for n in gm.graph.nodes}, incremental)
            self.assertEqual(_alias_classes(gm), aliases)

    def test_a_pass_that_edits_a_node_in_place_is_propagated_and_dropped(self):
        pipeline.PASSES = [("live_rows", retarget_lm_head)]
        gm = _captured()
        result = specpass.rewrite(gm)
        self.assertEqual(result.report.findings, [])
        self.assertIn("pass live_rows failed", result.report.errors[0])
        self.assertEqual(graph_str(result.graph_module), graph_str(gm))

    def test_created_nodes_carry_true_fake_values(self):
        pipeline.PASSES = [("live_rows", silu_to_sigmoid)]
        result = specpass.rewrite(_captured())
        for node in result.graph_module.graph.nodes:
            if node.op == "call_function":
                self.assertIsInstance(node.meta["val"], (torch.Tensor, tuple, list), node.name)
            if node.target in (aten.sigmoid.default, aten.mul.Tensor):
                self.assertEqual(tuple(node.meta["val"].shape), (2, 4, 64))

    def test_matmul_flops_from_shapes(self):
        gm = _captured(batch=2, T=4)
        rows, H, V, nh, hd, S = 2 * 4, 32, 64, 4, 8, 16
        linears = rows * (H * 3 * H + H * H + H * 2 * H + 2 * H * H + H * V)
        one_attention_matmul = 2 * nh * 4 * S * hd  # per request: [nh, T, hd] x [nh, S, hd]
        self.assertEqual(graph_matmul_flops(gm), 2 * linears + 2 * 2 * one_attention_matmul)  # QK^T, PV; B=2

    def test_report_text(self):
        pipeline.PASSES = [("live_rows", silu_to_sigmoid)]
        report = specpass.rewrite(_captured()).report
        report.findings.append(Finding("live_rows", "select", False, "index depends on the rows it selects"))
        report.findings.append(Finding("live_rows", "select_1", True, "gather moved", rows=(8, 2),
                                       matmul_flops=(1_200_000, 300_000)))
        self.assertExpectedInline(str(report), """\
specpass: 2 rewrite(s), 1 left alone; graph matmul FLOPs 180K -> 180K
  [silu] rewrote silu: silu -> x * sigmoid(x)
  [live_rows] left alone select: index depends on the rows it selects
  [live_rows] rewrote select_1: gather moved (rows 8 -> 2; matmul FLOPs 1.2M -> 300K)""")

    def test_report_times_each_enabled_pass_and_no_disabled_one(self):
        pipeline.PASSES = [("live_rows", silu_to_sigmoid), ("argmax", silu_to_sigmoid)]
        seconds = specpass.rewrite(_captured(), argmax=False).report.seconds
        steps = ("copy", "rewrite", "clean", "propagate", "checks")
        for part in [f"prepare/{s}" for s in ("copy", "functional", "clean", "propagate")] + \
                [f"live_rows/{s}" for s in steps] + ["report/flops", "report/code"]:
            self.assertIn(part, seconds)
        self.assertEqual([part for part in seconds if part.startswith("argmax")], [])
        for part, value in seconds.items():
            self.assertIsInstance(value, float, part)
            self.assertGreaterEqual(value, 0.0, part)

    def test_the_result_is_a_plain_graph_module_whose_code_is_its_graph(self):
        """The copies the passes run on generate their code lazily; the result has its code, of the
        rewritten graph, and runs as a plain GraphModule (what the compile cache and Inductor get)."""
        pipeline.PASSES = [("live_rows", silu_to_sigmoid)]
        gm = _captured()
        result = specpass.rewrite(gm).graph_module
        self.assertIs(type(result).__mro__[1], fx.GraphModule)
        self.assertEqual(type(result).__name__, type(gm).__name__)
        self.assertIn("sigmoid", result.code)
        self.assertNotIn("silu", result.code)

    def test_timing_text(self):
        report = Report(seconds={"capture": 0.25, "live_rows/copy": 0.001, "live_rows/rewrite": 0.0104})
        self.assertExpectedInline(report.timing(), """\
specpass seconds: capture 0.250; live_rows 0.011 (copy 0.001, rewrite 0.010)""")

    def test_explain_without_passes_reports_nothing_fired(self):
        pipeline.PASSES = []
        torch.manual_seed(0)
        report = specpass.explain(ToyDraft().eval(), torch.randint(0, 64, (2, 4)), torch.arange(4))
        self.assertIsInstance(report, Report)
        self.assertEqual(report.rewrites, [])
        self.assertTrue(str(report).startswith("specpass: 0 rewrite(s)"))


def test_report_formats_any_size():
    """A constant token reorder once gave the re-propagated graph fresh symbolic sizes, and the
    report could not format them (`SymFloat.__format__`); a dynamic capture has symbolic sizes by
    design. Both print."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.head = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(12, 8))

        def forward(self, x):
            unused = torch.nn.functional.linear(x, self.w)  # noqa: F841
            return torch.softmax(torch.nn.functional.linear(x[:, [1, 0, 2, 3]], self.head), -1).max(-1).indices

    static = str(specpass.explain(M(), torch.randn(1, 4, 8)))
    assert "graph matmul FLOPs 1.28K -> 768" in static, static
    x = torch.randn(3, 4, 8)
    dynamic = str(specpass.rewrite(specpass.capture(M(), x, dynamic=True)).report)
    assert "rewrote softmax" in dynamic and "*s" in dynamic, dynamic  # FLOPs as an expression of the sizes


# --- local writes: an in-place op on the graph's own unshared tensor is a new value

W = torch.randn(8, 8)


def _in_place_ops(gm):
    return sorted(n.target.__name__ for n in gm.graph.nodes
                  if n.op == "call_function" and n.target._schema.is_mutable)


def _rewritten_and_checked(step, *args):
    """The step rewritten (its in-place ops listed), and compiled with specpass equal to eager."""
    result = specpass.rewrite(specpass.capture(step, *args))
    torch._dynamo.reset()
    got = torch.compile(step, backend=specpass.backend(handoff="eager"), fullgraph=True)(*args)
    torch.testing.assert_close(got, step(*args))
    return result


def test_a_write_to_a_local_tensor_becomes_a_new_value():
    def step(x):
        h = x @ W
        before = h * 2  # reads h before the writes
        h.add_(1.0)
        h.mul_(before)  # reads it after the first
        return (h + before)[:, -1]

    result = _rewritten_and_checked(step, torch.randn(2, 5, 8))
    assert _in_place_ops(result.graph_module) == []
    assert len(result.report.rewrites) == 1, str(result.report)  # the matmul runs on the last row
    assert result.report.matmul_flops[1] * 5 == result.report.matmul_flops[0]


def test_writes_through_views_to_inputs_and_with_promotion_stay():
    cache = torch.zeros(2, 5, 8)

    def step(x):
        h = x @ W
        h[..., :1].mul_(2.0)  # a view shares h: the write stays, and h stays whole
        low = (x @ W).bfloat16()
        low.add_(W[0])  # add would promote to float32: add_ keeps bfloat16
        cache.index_copy_(1, torch.arange(5), h)  # a graph input
        return h[:, -1], low[:, -1]

    result = _rewritten_and_checked(step, torch.randn(2, 5, 8))
    assert _in_place_ops(result.graph_module) == ["add_.Tensor", "index_copy_.default", "mul_.Tensor"]


def test_a_view_taken_after_the_last_write_reads_the_new_value():
    """`top /= s; top.reshape(-1)`: the view sees no write, so the write is a new value; a view
    taken before a write sees it, and the write stays in place."""
    def after(x):
        h = x @ W
        h.div_(h.sum(-1, keepdim=True))
        h.add_(1.0)
        return h.view(-1, 8)[-1:], h.to(torch.float32)[:, -1]  # to its own dtype: an alias

    def before(x):
        h = x @ W
        flat = h.view(-1, 8)
        h.add_(1.0)
        return flat[-1:]

    x = torch.randn(2, 5, 8)
    assert _in_place_ops(_rewritten_and_checked(after, x).graph_module) == []
    assert _in_place_ops(_rewritten_and_checked(before, x).graph_module) == ["add_.Tensor"]

"""The masks pass: an attention's boolean mask converted once, before the layers' calls, instead of
inside each call (each repeated layer's body). Graph diffs, the refusals, numerics against the
model as written (bit for bit, fp32, CPU, fully masked rows included), Inductor's kernels."""

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import specpass
from specpass.report import collecting_reports
from specpass.graph import is_region_call
from specpass.passes import masks
from specpass.testing import Recorder, graph_str

D, HEADS = 8, 2


class Block(nn.Module):
    """Self-attention of two heads under the mask, and the residual add."""

    def __init__(self, seed, reads_mask=False):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D, generator=torch.Generator().manual_seed(seed)) / D)
        self.reads_mask = reads_mask

    def forward(self, h, mask):
        B, T, _ = h.shape
        x = F.linear(h, self.w).view(B, T, HEADS, D // HEADS).transpose(1, 2)
        out = F.scaled_dot_product_attention(x, x, x, attn_mask=mask).transpose(1, 2).reshape(B, T, D)
        if self.reads_mask:  # the mask read besides the attention: it must stay the body's input
            out = out * mask.any(-1).transpose(1, 2)
        return h + out


class Stack(nn.Module):
    def __init__(self, blocks=3, reads_mask=False):
        super().__init__()
        self.layers = nn.ModuleList(Block(i, reads_mask) for i in range(blocks))

    def forward(self, h, lengths, mode="bool"):
        T = h.shape[1]
        mask = (torch.arange(T) < lengths[:, None])[:, None, None]  # [B, 1, 1, T]: the padding
        if mode == "written":  # the caller's mask, written between the layers: each reads it as it is then
            mask = lengths
        if mode == "float":
            mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
        for layer in self.layers:
            h = layer(h, mask)
            if mode == "written":
                mask[..., 0] = ~mask[..., 0]
        return h


H, LENGTHS = torch.randn(2, 4, D), torch.tensor([4, 2])


def inputs(mode, lengths=LENGTHS):
    """(h, lengths or, where the mode writes it, the caller's mask [B, 1, 1, T], mode)"""
    if mode == "written":
        return H, (torch.arange(H.shape[1]) < lengths[:, None])[:, None, None], mode
    return H, lengths, mode


def compile_stack(mode="bool", blocks=3, reads_mask=False, regional=True, **options):
    torch._dynamo.reset()
    model = Stack(blocks, reads_mask)
    if regional:
        specpass.mark_repeated_blocks(model)
    recorder = Recorder(**options)
    with collecting_reports() as reports:
        out = torch.compile(model, backend=recorder, fullgraph=True)(*inputs(mode))
    [(_, report)] = reports
    return model, out, recorder.rewritten[0], report


def found(report):
    return "\n".join(str(f) for f in report.of("masks"))


def calls_and_body(gm):
    """The printed graph's mask and its conversion, the attention inline (the first layer, which
    Dynamo traces apart), the calls; and the body the calls run."""
    lines = graph_str(gm).splitlines()
    first, converted, calls = (next(i for i, line in enumerate(lines) if text in line)
                               for text in (" = lt.Tensor(", " = where.self(", " = self."))
    attention = [line for line in lines[converted:calls] if " = scaled_dot_product_attention(" in line]
    body = getattr(gm, gm.graph.find_nodes(op="get_attr")[0].target)
    return "\n".join(lines[first:converted + 1] + attention + lines[calls:]), graph_str(body)


class TestGraphs(expecttest.TestCase):
    def test_the_mask_is_converted_once_before_the_calls(self):
        _, _, gm, report = compile_stack()
        calls, body = calls_and_body(gm)
        self.assertExpectedInline(calls, """\
lt: b8[2, 4] = lt.Tensor(arange, unsqueeze)
unsqueeze_1: b8[2, 1, 4] = unsqueeze(lt, 1)
unsqueeze_2: b8[2, 1, 1, 4] = unsqueeze(unsqueeze_1, 2)
scalar_tensor: f32[] = scalar_tensor(-inf, dtype=f32, device=cpu)
scalar_tensor_1: f32[] = scalar_tensor(0.0, dtype=f32, layout=torch.strided, device=cpu)
where: f32[2, 1, 1, 4] = where.self(unsqueeze_2, scalar_tensor_1, scalar_tensor)
scaled_dot_product_attention: f32[2, 2, 4, 4] = scaled_dot_product_attention(transpose, transpose, transpose, where)
repeated_subgraph0_masks = self.repeated_subgraph0_masks
invoke_subgraph: (f32[2, 4, 8]) = invoke_subgraph(repeated_subgraph0_masks, 'subgraph_1_masks', add, layers_1_w, where)
getitem: f32[2, 4, 8] = getitem(invoke_subgraph, 0)
invoke_subgraph_1: (f32[2, 4, 8]) = invoke_subgraph(repeated_subgraph0_masks, 'subgraph_1_masks', getitem, layers_2_w, where)
getitem_1: f32[2, 4, 8] = getitem(invoke_subgraph_1, 0)
return (getitem_1,)""")
        self.assertExpectedInline(body, """\
arg0_1: f32[2, 4, 8]
arg1_1: f32[8, 8]
arg2_1: f32[2, 1, 1, 4]
linear: f32[2, 4, 8] = linear(arg0_1, arg1_1)
view: f32[2, 4, 2, 4] = view(linear, [2, 4, 2, 4])
transpose: f32[2, 2, 4, 4] = transpose.int(view, 1, 2)
scaled_dot_product_attention: f32[2, 2, 4, 4] = scaled_dot_product_attention(transpose, transpose, transpose, arg2_1)
transpose_1: f32[2, 4, 2, 4] = transpose.int(scaled_dot_product_attention, 1, 2)
reshape: f32[2, 4, 8] = reshape(transpose_1, [2, 4, 8])
add: f32[2, 4, 8] = add.Tensor(arg0_1, reshape)
return (add,)""")
        self.assertExpectedInline(found(report), """\
[masks] rewrote repeated_subgraph0.scaled_dot_product_attention: the boolean mask converted once (scalar_tensor, where) to the torch.float32 mask the kernel reads, outside the body, for its 2 calls
[masks] rewrote scaled_dot_product_attention: the boolean mask converted once (scalar_tensor, where) to the torch.float32 mask the kernel reads, shared by the 3 attention calls that read the mask""")

    def test_inline_layers_share_one_conversion(self):
        _, _, gm, report = compile_stack(regional=False)
        self.assertEqual(sum(n.target is torch.ops.aten.where.self for n in gm.graph.nodes), 1)
        attention = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.scaled_dot_product_attention.default)
        self.assertEqual(len(attention), 3)
        self.assertEqual({a.args[3].target for a in attention}, {torch.ops.aten.where.self})
        self.assertEqual([f.fired for f in report.of("masks")], [True] * 3)

    def test_a_mask_written_in_place_is_refused(self):
        _, _, gm, report = compile_stack("written")
        self.assertExpectedInline(found(report), """[masks] left alone repeated_subgraph0.scaled_dot_product_attention: the mask lengths is written in place: a converted copy would go stale""")
        self.assertFalse(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.where.self))

    def test_a_body_that_reads_its_mask_otherwise_keeps_it(self):
        _, _, gm, report = compile_stack(reads_mask=True)
        self.assertExpectedInline(found(report), """[masks] left alone repeated_subgraph0.scaled_dot_product_attention: the body also reads its mask input arg2_1 in any_1: it stays an input""")
        self.assertFalse(any(n.args[1].endswith("_masks") for n in gm.graph.nodes if is_region_call(n)))

    def test_a_float_mask_is_not_a_candidate(self):
        _, _, _, report = compile_stack("float")
        self.assertEqual(report.of("masks"), [])

    def test_a_call_that_decomposes_otherwise_is_refused(self):
        """The proof itself: a decomposition that is not the same with the converted mask (faked
        here: the converted call traced with the scale changed) leaves the call as it is."""
        traced = masks._decomposed

        def otherwise(node, mask):
            if mask.dtype == torch.bool:
                return traced(node, mask)
            node.kwargs = {**node.kwargs, "scale": 0.5}
            try:
                return traced(node, mask)
            finally:
                node.kwargs = {k: v for k, v in node.kwargs.items() if k != "scale"}

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(masks, "_decomposed", otherwise)
            _, _, gm, report = compile_stack(regional=False, blocks=2)
        self.assertExpectedInline(found(report), """\
[masks] left alone scaled_dot_product_attention: the call decomposes otherwise with the converted mask (another kernel or other arguments): left as it is
[masks] left alone scaled_dot_product_attention_1: the call decomposes otherwise with the converted mask (another kernel or other arguments): left as it is""")
        self.assertFalse(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.where.self))


@pytest.mark.parametrize("mode,regional", [("bool", True), ("bool", False), ("written", True)])
def test_the_rewritten_stack_is_bit_for_bit_the_model(mode, regional):
    """Rows that see no key (the second request's padding queries see its two keys; a length of 0
    would see none) come out as the model computes them, bit for bit."""
    lengths = torch.tensor([4, 0])
    torch._dynamo.reset()
    model = Stack(4)
    if regional:
        specpass.mark_repeated_blocks(model)
    expected = model(*inputs(mode, lengths))
    out = torch.compile(model, backend=specpass.backend(handoff="eager"), fullgraph=True)(*inputs(mode, lengths))
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


def test_masks_off_leaves_the_bodies_their_boolean_mask():
    _, _, gm, report = compile_stack(masks=False)
    assert report.of("masks") == []
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.where.self)


def test_inductor_converts_the_mask_once():
    """Inductor on CPU, each kernel profiled: 5 blocks (5 calls of one body) run 5 kernels fewer
    with the pass: each call's conversion is gone, and the one conversion left fuses with the kernel
    that makes the mask. The same values."""
    from torch.profiler import ProfilerActivity, profile

    kernels, outs = {}, {}
    with torch.no_grad(), torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        for on in (False, True):
            torch._dynamo.reset()
            model = Stack(5)
            specpass.mark_repeated_blocks(model)
            step = torch.compile(model, backend=specpass.backend(masks=on), fullgraph=True)
            step(H, LENGTHS)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                outs[on] = step(H, LENGTHS)
            kernels[on] = sum("cpp_fused" in e.name for e in prof.events())
    assert kernels[False] - kernels[True] == 5, kernels
    assert torch.equal(outs[False], outs[True])


def test_symbolic_sizes_stay_symbolic():
    """With the batch and the sequence symbolic, torch's conversion is traced on the symbolic sizes:
    the pass fires, pins no size (the pipeline would drop it), and a second shape runs the same
    compiled graph with the model's values."""
    torch._dynamo.reset()
    model = Stack(3)
    specpass.mark_repeated_blocks(model)
    recorder = Recorder()
    step = torch.compile(model, backend=recorder, fullgraph=True, dynamic=True)
    with collecting_reports() as reports:
        step(H, LENGTHS)
    [(_, report)] = reports
    assert [f.fired for f in report.of("masks")] == [True, True] and not report.errors, (found(report), report.errors)
    h, lengths = torch.randn(3, 6, D), torch.tensor([6, 1, 3])
    torch.testing.assert_close(step(h, lengths), model(h, lengths), rtol=0, atol=0)
    assert len(recorder.rewritten) == 1  # no recompile

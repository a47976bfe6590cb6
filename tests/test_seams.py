"""The seams pass: each layer's body also computes the next layer's head (its norm), so that
Inductor fuses it with the residual add that ends the layer. Graph diffs, the traps it refuses,
numerics against the model as written (bit for bit, fp32, CPU), Inductor's fused kernel."""

import expecttest
import torch
import torch.nn as nn
import torch.nn.functional as F

import specpass
from specpass.report import collecting_reports
from specpass.testing import Recorder, graph_str

D = 8


class Block(nn.Module):
    """A pre-norm residual block: rms_norm, a matmul, the residual add."""

    def __init__(self, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.norm = nn.Parameter(1 + torch.rand(D, generator=gen))
        self.proj = nn.Parameter(torch.randn(D, D, generator=gen) / D)

    def forward(self, h, scale=None):
        x = F.rms_norm(h, [D], self.norm, 1e-6)
        if scale is not None:
            x = x * scale
        return h + F.linear(x, self.proj)


class Stack(nn.Module):
    def __init__(self, blocks=3):
        super().__init__()
        self.layers = nn.ModuleList(Block(i) for i in range(blocks))
        self.scales = nn.Parameter(torch.rand(blocks, D))
        self.register_buffer("gain", torch.ones(D))
        self.final = nn.Parameter(1 + torch.rand(D))

    def forward(self, h, mode="plain"):
        for i, layer in enumerate(self.layers):
            if mode == "made_between":  # the next call's head operand computed after the call before it
                h = layer(h, self.scales[i] * 2)
            elif mode == "written_between":  # what the next head reads written between the calls
                h = layer(h, self.gain)
                self.gain.mul_(2)
            else:
                h = layer(h)
        return F.rms_norm(h, [D], None if mode == "bare_end" else self.final, 1e-6)


def compile_stack(mode="plain", blocks=3, **options):
    torch._dynamo.reset()
    model = Stack(blocks)
    specpass.mark_repeated_blocks(model)
    recorder = Recorder(**options)
    with collecting_reports() as reports:
        out = torch.compile(model, backend=recorder, fullgraph=True)(torch.randn(2, 3, D), mode)
    [(_, report)] = reports
    return model, out, recorder.rewritten[0], report


def from_last_call(gm):
    """The printed graph from its last region call on (what differs at a chain's end)."""
    lines = graph_str(gm).splitlines()
    last = max(i for i, line in enumerate(lines) if " = invoke_subgraph(" in line)
    return "\n".join(lines[last:])


def seams(report):
    return "\n".join(str(f) for f in report.of("seams"))


class TestGraphs(expecttest.TestCase):
    def test_the_next_norm_moves_into_each_body(self):
        _, _, gm, report = compile_stack()
        body = getattr(gm, gm.graph.find_nodes(op="get_attr")[0].target)
        self.assertExpectedInline(graph_str(gm), """\
h: f32[2, 3, 8]
layers_0_norm: f32[8]
layers_0_proj: f32[8, 8]
layers_1_norm: f32[8]
layers_1_proj: f32[8, 8]
layers_2_norm: f32[8]
layers_2_proj: f32[8, 8]
final: f32[8]
rms_norm: f32[2, 3, 8] = rms_norm(h, [8], layers_0_norm, 1e-06)
linear: f32[2, 3, 8] = linear(rms_norm, layers_0_proj)
add: f32[2, 3, 8] = add.Tensor(h, linear)
repeated_subgraph0_seams = self.repeated_subgraph0_seams
rms_norm_2: f32[2, 3, 8] = rms_norm(add, [8], layers_1_norm, 1e-06)
invoke_subgraph_2: (f32[2, 3, 8], f32[2, 3, 8]) = invoke_subgraph(repeated_subgraph0_seams, 'subgraph_1_seams', add, layers_1_norm, layers_1_proj, rms_norm_2, layers_2_norm)
getitem_2: f32[2, 3, 8] = getitem(invoke_subgraph_2, 1)
getitem: f32[2, 3, 8] = getitem(invoke_subgraph_2, 0)
invoke_subgraph_3: (f32[2, 3, 8], f32[2, 3, 8]) = invoke_subgraph(repeated_subgraph0_seams, 'subgraph_1_seams', getitem, layers_2_norm, layers_2_proj, getitem_2, final)
getitem_3: f32[2, 3, 8] = getitem(invoke_subgraph_3, 1)
return (getitem_3,)""")
        self.assertExpectedInline(graph_str(body), """\
arg0_1: f32[2, 3, 8]
arg1_1: f32[8]
arg2_1: f32[8, 8]
rms_norm_in: f32[2, 3, 8]
next_arg1_1: f32[8]
linear: f32[2, 3, 8] = linear(rms_norm_in, arg2_1)
add: f32[2, 3, 8] = add.Tensor(arg0_1, linear)
rms_norm: f32[2, 3, 8] = rms_norm(add, [8], next_arg1_1, 1e-06)
return (add, rms_norm)""")
        self.assertExpectedInline(seams(report), """[seams] rewrote invoke_subgraph, invoke_subgraph_1: 2 calls of one body: each also computes the next call's rms_norm, fused with its own end; the same rms_norm after the last call moved into it""")

    def test_without_the_same_head_after_it_the_last_call_computes_one_nothing_reads(self):
        """A final norm without a weight is not the layers' norm: the last body's head stays, unread."""
        _, _, gm, report = compile_stack("bare_end")
        self.assertExpectedInline(from_last_call(gm), """\
invoke_subgraph_3: (f32[2, 3, 8], f32[2, 3, 8]) = invoke_subgraph(repeated_subgraph0_seams, 'subgraph_1_seams', getitem, layers_2_norm, layers_2_proj, getitem_2, layers_2_norm)
getitem_1: f32[2, 3, 8] = getitem(invoke_subgraph_3, 0)
rms_norm_1: f32[2, 3, 8] = rms_norm(getitem_1, [8], None, 1e-06)
return (rms_norm_1,)""")

    def test_a_head_operand_made_after_the_call_before_is_refused(self):
        _, _, gm, report = compile_stack("made_between")
        self.assertExpectedInline(seams(report), """[seams] left alone invoke_subgraph, invoke_subgraph_1: invoke_subgraph_1's head reads mul_3, made after invoke_subgraph: the head cannot move into invoke_subgraph's body""")

    def test_a_head_operand_written_between_the_calls_is_refused(self):
        _, _, gm, report = compile_stack("written_between")
        self.assertExpectedInline(seams(report), """[seams] left alone invoke_subgraph, invoke_subgraph_1: invoke_subgraph_1's head reads mul__1, made after invoke_subgraph: the head cannot move into invoke_subgraph's body""")


def test_rotated_stack_is_bit_for_bit_the_model():
    def stack(blocks):
        torch.manual_seed(0)
        return Stack(blocks)

    x = torch.randn(2, 3, D)
    for mode in ("plain", "bare_end", "made_between", "written_between"):
        for blocks in (2, 4):
            expected = stack(blocks)(x, mode)
            model = stack(blocks)
            specpass.mark_repeated_blocks(model)
            torch._dynamo.reset()
            got = torch.compile(model, backend=specpass.backend(handoff="eager"), fullgraph=True)(x, mode)
            assert torch.equal(got, expected), (mode, blocks)


def test_seams_off_leaves_the_calls():
    _, _, gm, report = compile_stack(seams=False)
    assert report.of("seams") == []
    assert not any("seams" in str(n.target) for n in gm.graph.find_nodes(op="get_attr"))


def test_inductor_runs_one_kernel_a_call_fewer():
    """Inductor on CPU, each kernel profiled: 5 blocks (the first inlined by Dynamo, 4 calls), the
    norm and the add fused in each body with the pass (the last body's with the final norm), apart
    without it; the same values."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(2, 3, D)
    kernels, outs = {}, {}
    with torch.no_grad(), torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        for on in (True, False):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = Stack(5)
            specpass.mark_repeated_blocks(model)
            step = torch.compile(model, backend=specpass.backend(seams=on), fullgraph=True)
            step(x)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                outs[on] = step(x)
            kernels[on] = sum("cpp_fused" in e.name for e in prof.events())
    assert kernels[False] - kernels[True] == 5, kernels  # 4 seams, and the final norm
    torch.testing.assert_close(outs[True], outs[False])

"""Repeated blocks compiled once (specpass.mark_repeated_blocks, the Decoder's `regional`): a
deeper target adds no layer body to trace or rewrite, the passes still fire (inside the shared body,
and in the one call they inline), and the tokens are plain greedy decoding's (a transformers target:
tests/test_gqa.py). fp32, CPU."""

import warnings

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import specpass
from models import zoo
from models.drafters import ZooDrafter
from models.llama import Llama, LlamaConfig
from specpass.compile_backend import SpecpassWarning
from specpass.graph import is_region_call
from specpass.loop import Decoder
from specpass.testing import Recorder

PROMPTS = [[3, 14, 15], [9, 2, 6, 5, 35, 89, 79, 32, 38], [46]]
NEW, MAX_LEN = 12, 40


def tiny_llama(layers: int) -> Llama:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return Llama(config).eval()


def bodies(gms) -> list[tuple[str, ...]]:
    """The distinct region bodies the graphs call, each as the ops it runs."""
    called = {getattr(gm, call.args[0].target) for gm in gms for call in gm.graph.nodes if is_region_call(call)}
    return sorted({tuple(str(n.target) for n in body.graph.nodes if n.op == "call_function") for body in called})


def computed(gm) -> int:
    """Nodes that compute, outside region calls and their results."""
    return sum(n.op == "call_function" and not is_region_call(n) and not (
        n.target.__name__ == "getitem" and is_region_call(n.args[0])) for n in gm.graph.nodes)


def decode(layers: int, **options):
    target = tiny_llama(layers)
    recorder = Recorder()
    dec = Decoder(target, ZooDrafter(zoo.build("tiny-llama-draft", seed=3)), k=3, max_batch=3, max_len=MAX_LEN,
                  compile=recorder, **options)
    return target, dec.generate(PROMPTS, NEW).tokens, recorder


def test_depth_adds_no_body_and_no_rewritten_node():
    """A 4-layer and a 6-layer target: the same layer bodies and the same computing nodes outside them in
    every graph; only the calls (and the weights they read) grow. (A layer Dynamo traces unlike the
    others, the first, whose sizes it reads itself, is inlined in both; 4 layers, not 3: the verify's last
    is inlined too, and a lone call hands nothing on to a next one, where the seams pass moves a norm.)"""
    shallow, deep = (decode(layers, fused_round=True) for layers in (4, 6))
    assert len(bodies(shallow[2].dynamo)) >= 1
    assert bodies(shallow[2].dynamo) == bodies(deep[2].dynamo)
    assert [computed(gm) for gm in shallow[2].rewritten] == [computed(gm) for gm in deep[2].rewritten]
    assert all(any("_seams" in t for t in (n.target for n in gm.graph.find_nodes(op="get_attr")))
               for gm in deep[2].rewritten if any(map(is_region_call, gm.graph.nodes)))
    for target, tokens, _ in (shallow, deep):
        plain = Decoder(target, None, max_batch=3, max_len=MAX_LEN, compile="eager").generate(PROMPTS, NEW).tokens
        assert tokens == plain


def test_inline_layers_without_regions():
    """regional=False compiles every layer inline: no region call, and plain greedy decoding's tokens."""
    target, tokens, recorder = decode(3, regional=False)
    assert not bodies(recorder.dynamo)
    assert tokens == Decoder(target, None, max_batch=3, max_len=MAX_LEN, compile="eager").generate(PROMPTS, NEW).tokens


def test_marking_is_structural_and_leaves_eager_alone():
    model = tiny_llama(3)
    x, positions = torch.tensor([[1, 2, 3]]), torch.arange(3)[None]
    model.setup_caches(1, 8)
    with torch.no_grad():
        before = model(x, positions)
    assert specpass.mark_repeated_blocks(model) == 3
    assert specpass.mark_repeated_blocks(model) == 3  # idempotent
    assert all("forward" in layer.__dict__ for layer in model.model.layers)
    with torch.no_grad():
        assert torch.equal(model(x, positions), before)
    lone = tiny_llama(1)
    assert specpass.mark_repeated_blocks(lone) == 0  # one layer repeats nothing
    mixed = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 8)])
    assert specpass.mark_repeated_blocks(mixed) == 2  # the two of one shape


class OwnCache(torch.nn.Module):
    """A layer that writes a cache buffer of its own in place (torch 2.13's body reuse stamped out the
    first layer's buffer for every later layer)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(2, 8))

    def forward(self, x, pos):
        self.cache.index_copy_(1, pos, x)
        return x + self.cache.sum(1, keepdim=True)


def test_each_call_writes_its_own_layer_s_buffers():
    stack, reference = (torch.nn.ModuleList([OwnCache() for _ in range(3)]) for _ in range(2))
    specpass.mark_repeated_blocks(stack)

    def run(layers, x, pos):
        for layer in layers:
            x = layer(x, pos)
        return x

    x, pos = torch.randn(2, 3), torch.tensor([1, 4, 6])
    with torch.no_grad():
        want = run(reference, x, pos)
        got = torch.compile(run, backend=specpass.backend(handoff="eager"), fullgraph=True)(stack, x, pos)
    assert torch.equal(got, want)
    assert all(torch.equal(a.cache, b.cache) for a, b in zip(stack, reference, strict=True))


def test_live_rows_inline_the_last_call():
    """The last-position slice after a marked stack: the gather moves into the last layer's call, inlined,
    up to its KV write, as in the stack compiled inline; the other layers stay one shared body."""
    flat, marked = tiny_llama(3), tiny_llama(3)
    specpass.mark_repeated_blocks(marked)
    reports = []
    for model in (flat, marked):
        model.setup_caches(2, 16)
        tokens, positions = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.arange(3).expand(2, 3)
        with torch.no_grad():
            gm = specpass.capture(lambda t, p: model(t, p)[:, -1], tokens, positions)
        result = specpass.rewrite(gm)
        reports.append(result.report)
    (flat_rows,), (marked_rows,) = (r.of("live_rows") for r in reports)
    assert marked_rows.fired and marked_rows.rows == flat_rows.rows
    assert reports[1].matmul_flops == reports[0].matmul_flops
    calls = [n for n in result.graph_module.graph.nodes if is_region_call(n)]
    assert len(calls) == 2  # layers 0 and 1; layer 2 inlined


class _SeenByInductor(CustomGraphPass):
    """An Inductor post-grad pass that records the ops of the graph and of the bodies it calls."""

    def __init__(self):
        self.ops = set()

    def __call__(self, graph):
        for module in graph.owning_module.modules():
            self.ops |= {str(n.target) for n in module.graph.nodes if n.op == "call_function"}

    def uuid(self):
        return None  # not cacheable: each test's compile is its own


def test_inductor_compiles_the_rewritten_body():
    """Inductor gets the body the passes rewrote: torch keeps the bodies a trace makes by the region's
    name, and the capture's own trace must not stand in for them (it once did: undecomposed, that body
    failed Inductor's lowering, here at its softmax)."""
    region = torch.compiler.nested_compile_region(lambda x: torch.softmax(x.float(), -1).max(-1).indices)

    def f(x):
        return region(x) + region(x * 2)

    x, seen = torch.randn(3, 5), _SeenByInductor()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpecpassWarning)
        with torch._inductor.config.patch(post_grad_custom_pre_pass=seen):
            got = torch.compile(f, backend=specpass.backend(), fullgraph=True)(x)
    assert torch.equal(got, f(x))
    assert "aten.argmax.default" in seen.ops and not {"aten._softmax.default", "aten.amax.default"} & seen.ops, seen.ops

"""Every draft's catch-up and draft step compile as one graph (fullgraph=True) under the specpass
backend, match eager (outputs and KV-cache contents), and capture into specpass's IR."""

import dataclasses

import pytest
import torch

import specpass
from models import zoo
from tests.test_models import B, PREFIX, S, close, hidden_width, prefill_prefix, sequence, take

aten = torch.ops.aten

HEADS = ["tiny-llama-draft", "tiny-llama-eagle3", "tiny-deepseek-eagle3-mla", "tiny-deepseek-nextn",
         "tiny-deepseek-nextn:dispatch", "tiny-qwen3.5-nextn", "tiny-qwen3.5-moe-nextn"]


def ready(spec):
    """A model after each request's prompt, and the inputs of one catch-up and one draft step."""
    name, _, impl = spec.partition(":")
    cfg = zoo.config(name)
    if impl:
        cfg = dataclasses.replace(cfg, moe_impl=impl)
    model = zoo.build(cfg, seed=2)
    model.setup_caches(B, S)
    tokens, hidden = sequence(model, fused=True, length=S)
    prefill_prefix(model, tokens, hidden)
    T = 4
    index = PREFIX[:, None] + torch.arange(T)
    catch_up_args = (take(tokens, index), index, take(hidden, index), torch.tensor([3, 0, 2]))
    own = hidden_width(model, fused=False)
    step_hidden = None if own is None else torch.randn(B, own, generator=torch.Generator().manual_seed(5))
    draft_args = (tokens[:, 0], PREFIX + T, step_hidden)
    return model, catch_up_args, draft_args


def cache_state(model):
    return {name: b.clone() for name, b in model.named_buffers() if "cache" in name}


def restore(model, state):
    for name, b in model.named_buffers():
        if name in state:
            b.copy_(state[name])


def run_both(model, method, args, backend):
    """(eager outputs, eager caches, compiled outputs, compiled caches) from the same starting state."""
    start = cache_state(model)
    with torch.no_grad():
        eager = getattr(model, method)(*args)
        eager_caches = cache_state(model)
        restore(model, start)
        compiled_fn = torch.compile(getattr(model, method), backend=backend, fullgraph=True, dynamic=False)
        compiled = compiled_fn(*args)
    return eager, eager_caches, compiled, cache_state(model)


@pytest.mark.parametrize("method", ["catch_up", "draft_step"])
@pytest.mark.parametrize("spec", HEADS)
def test_compiles_in_one_graph_and_matches_eager(spec, method):
    model, catch_up_args, draft_args = ready(spec)
    args = catch_up_args if method == "catch_up" else draft_args
    eager, eager_caches, compiled, compiled_caches = run_both(model, method, args, specpass.backend(handoff="eager"))
    for e, c in zip(eager, compiled):
        close(c, e)
    for key in eager_caches:
        close(compiled_caches[key], eager_caches[key])


@pytest.mark.parametrize("method", ["catch_up", "draft_step"])
@pytest.mark.parametrize("spec", HEADS)
def test_captures_into_specpass_ir(spec, method):
    model, catch_up_args, draft_args = ready(spec)
    args = catch_up_args if method == "catch_up" else draft_args
    gm = specpass.capture(getattr(model, method), *args)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    n_caches = len(cache_state(model))
    assert targets.count(aten.index_put_.default) == n_caches  # every cache written in place, once
    assert aten.scaled_dot_product_attention.default in targets
    outputs = gm.graph.output_node().args[0]
    vocab = model.lm_head.out_features if hasattr(model, "lm_head") else model.shared_head.head.out_features
    assert [tuple(o.meta["val"].shape) for o in outputs] == [(B, vocab), (B, model.config.hidden_size)]


def test_smallest_head_through_inductor():
    model, catch_up_args, _ = ready("tiny-llama-eagle3")
    eager, eager_caches, compiled, compiled_caches = run_both(model, "catch_up", catch_up_args, specpass)
    for e, c in zip(eager, compiled):
        close(c, e, atol=1e-4, rtol=1e-4)
    for key in eager_caches:
        close(compiled_caches[key], eager_caches[key], atol=1e-4, rtol=1e-4)

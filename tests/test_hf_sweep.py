"""A fast subset of benchmarks/hf_sweep.py: transformers' own decoders, a StaticCache continuation
step, rewritten exactly and to the ideal (no matmul on every token row unless it feeds a KV write
or an attention's keys and values).
The full sweep over every causal LM in transformers is in docs/results.md."""

import pytest
import torch

from benchmarks.hf_sweep import B, T, _recording_backend, _what_the_passes_did, sweep_one

SUBSET = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
          "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM", "olmo2": "Olmo2ForCausalLM",
          "gpt2": "GPT2LMHeadModel", "bloom": "BloomForCausalLM",
          # a range of a range at a positive start; view_as; no cache (K/V from the new rows)
          "gpt_neo": "GPTNeoForCausalLM", "beam": "BeamForCausalLM", "openai-gpt": "OpenAIGPTLMHeadModel"}


@pytest.mark.parametrize("model_type", SUBSET)
def test_decoder_reaches_the_ideal_exactly(model_type):
    row = sweep_one(model_type, SUBSET[model_type])
    assert row["built"], row
    assert row["pieces"] == 1 and row["rewritten"] and row["exact"] and row["ideal"], row
    assert row["matmul_after_before"] < 0.8 and not row["errors"], row


def test_a_graph_with_runtime_constants_compiles_unrewritten():
    """Mamba's step makes tensors from data while tracing, which the IR would hold as fake
    constants: specpass refuses to capture it (it used to break the compiled step) and the
    step compiles without rewrites, equal to eager."""
    row = sweep_one("mamba", "MambaForCausalLM")
    assert row["exact"] is True and row["pieces"] == 1 and row["captured"] is False, row
    assert "constants whose values are only known at run time" in row["stops"][0], row
    assert any(w.startswith("specpass could not capture this graph") for w in row["warnings"]), row


def test_a_graph_broken_step_is_measured_over_its_pieces():
    """XGLM's position embedding breaks the graph: the layers and `logits[:, -1]` land in
    different pieces, so every piece is captured and compiles exactly, but the gather cannot
    move into the layers' piece and their matmuls stay on every row."""
    row = sweep_one("xglm", "XGLMForCausalLM")
    assert row["exact"] is True and row["captured"] and row["pieces"] > 1, row
    assert any("modeling_xglm.py" in b for b in row["graph_breaks"]), row
    assert not row["ideal"] and row["matmul_after_before"] == 1.0, row
    assert row["stopped_in"] > 0 and row["full_row_matmuls"], row  # the layers' piece, not the embedding's
    assert any("no row gather at the outputs" in s for s in row["stops"]), row


def test_a_value_written_in_a_later_piece_feeds_a_kv_write():
    """K projected in one piece and written to the cache in the next: the projection feeds a KV
    write (followed across the pieces at run time), so it may stay on every row."""
    torch.manual_seed(0)
    k_proj, o_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    cache = torch.zeros(B, 16, 8)

    def step(x, positions):
        k = k_proj(x)
        torch._dynamo.graph_break()
        cache.index_copy_(1, positions, k)
        return o_proj(x + cache[:, :T].sum(1, keepdim=True))[:, -1]

    pieces, calls = [], []
    with torch.no_grad():
        torch._dynamo.reset()
        torch.compile(step, backend=_recording_backend(pieces, calls))(torch.randn(B, T, 8), torch.arange(T))
    row = _what_the_passes_did(pieces, calls)
    assert row["pieces"] == 2 and row["rewritten"] and row["ideal"], row
    unlinked = _what_the_passes_did(pieces, calls[1:])  # without the later call, nothing shows the write
    assert not unlinked["ideal"] and unlinked["stopped_in"] == 0, unlinked


@pytest.mark.parametrize("model_type, class_name", [("mixtral", "MixtralForCausalLM"),
                                                    ("hunyuan_v1_moe", "HunYuanMoEV1ForCausalLM")])
def test_a_router_normalised_in_place_keeps_every_pass(model_type, class_name):
    """The router's `top /= top.sum(-1, keepdim=True)` on softmax -> topk's values, then read
    through a reshape or a cast to their own dtype: a new value, so the arg-max pass rewrites
    the topk (it used to retarget the write and be dropped). Not at the ideal: the live-row
    gather stops at the sort-based expert dispatch (an index_put), and the router's division,
    no longer a write, no longer exempts what feeds it from running on every row."""
    row = sweep_one(model_type, class_name)
    assert row["exact"] is True and row["rewritten"] and row["errors"] == [] and row["warnings"] == [], row
    assert not row["ideal"] and "index_put" in row["stops"][0], row

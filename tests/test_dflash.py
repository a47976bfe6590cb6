"""DFlash block drafting (specpass/drafters/dflash.py): z-lab's folder layout loaded onto transformers
Llama and Qwen3 targets (bf16 or fp32), every loader error named, the block forward against a
reference written from z-lab's model, and the loop lossless with it (greedy and sampled, apart and
fused, batched and ragged) through `Decoder` and `specpass.generate`. fp32, CPU, random weights."""

import json
import tempfile
from pathlib import Path

import expecttest
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import specpass
from specpass.drafters import DFlashConfig, DFlashDraft, load_drafter
from specpass.hf.adapters import HFTarget
from specpass.loop import Decoder
from specpass.testing import graph_str
from tests.test_drafters import refused

V, H, LAYERS = 96, 64, 4
SIZES = dict(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
PROMPTS = [[5, 6, 7], [9, 2, 6, 5, 35, 89, 79, 32, 38], [46]]  # ragged: 3, 9, 1 tokens


def make_target(kind: str = "qwen3", dtype=torch.float32, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config, cls = (Qwen3Config, Qwen3ForCausalLM) if kind == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    return cls(config(**SIZES, attn_implementation="sdpa")).to(dtype).eval()


def dflash_folder(path: Path, seed: int = 1, layers: int = 2, extra_tensors: dict | None = None, prefix: str = "",
                  sizes: dict = SIZES, reads: tuple[int, ...] = (0, 2, 3), **changes) -> Path:
    """A DFlash folder as z-lab writes one for a target of `sizes`: config.json (options under
    dflash_config) and model.safetensors (names with no prefix), random weights scaled to draft something;
    `reads` its target_layer_ids, `changes` written over the config's fields as they are."""
    v, h = sizes["vocab_size"], sizes["hidden_size"]
    config = DFlashConfig(**{k: v for k, v in sizes.items() if k != "num_hidden_layers"}, num_hidden_layers=layers,
                          block_size=8, rope_theta=10000.0, target_layer_ids=list(reads), mask_token_id=v - 1)
    torch.manual_seed(seed)
    draft = DFlashDraft(config, torch.nn.Embedding(v, h), torch.nn.Linear(h, v, bias=False))
    state = {name: t for name, t in draft.state_dict().items() if not name.startswith(("embed_tokens.", "lm_head."))}
    raw = config.to_dict()
    for key, value in changes.items():
        if key in raw["dflash_config"] or key in ("input_embedding_scale", "output_multiplier"):
            raw["dflash_config"][key] = value
        else:
            raw[key] = value
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    tensors = {prefix + name: t.contiguous() for name, t in {**state, **(extra_tensors or {})}.items()}
    safetensors.torch.save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def qwen3():
    return make_target("qwen3")


# --- the block forward against z-lab's, written out


def reference_block(draft: DFlashDraft, target: torch.nn.Module, seq: list[int], k: int) -> torch.Tensor:
    """z-lab's draft forward after `seq` was verified, without caches: the context is seq's states at
    positions 0..n-1, the block [the target's next token, mask x K] at n..n+K; every block query
    attends to the whole context and the whole block. -> logits [K, V]."""
    c = draft.config
    out = target(torch.tensor([seq]), output_hidden_states=True)
    ctx = draft.hidden_norm(draft.fc(torch.cat([out.hidden_states[i + 1] for i in c.target_layer_ids], -1)))[0]
    n = len(seq)
    x = draft.embed_tokens(torch.tensor([int(out.logits[0, -1].argmax())] + [c.mask_token_id] * k))
    x = x * c.input_embedding_scale  # [K+1, H]
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))

    def rot(t, pos):  # t [T, heads, d]
        ang = torch.cat([pos[:, None].float() * inv] * 2, -1)[:, None]
        half = t.shape[-1] // 2
        return t * ang.cos() + torch.cat([-t[..., half:], t[..., :half]], -1) * ang.sin()

    pos_ctx, pos_blk = torch.arange(n), torch.arange(n, n + k + 1)
    for layer in draft.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        heads = lambda proj, t: proj(t).view(t.shape[0], -1, a.head_dim)  # noqa: E731
        q = rot(a.q_norm(heads(a.q_proj, h)), pos_blk)
        keys = torch.cat([rot(a.k_norm(heads(a.k_proj, ctx)), pos_ctx), rot(a.k_norm(heads(a.k_proj, h)), pos_blk)])
        values = torch.cat([heads(a.v_proj, ctx), heads(a.v_proj, h)])
        g = a.n_heads // a.n_kv_heads
        att = F.scaled_dot_product_attention(q.transpose(0, 1), keys.repeat_interleave(g, 1).transpose(0, 1),
                                             values.repeat_interleave(g, 1).transpose(0, 1))  # no mask
        x = x + a.o_proj(att.transpose(0, 1).reshape(k + 1, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    logits = target.lm_head(draft.norm(x))[1:] * c.output_multiplier
    cap = c.final_logit_softcapping
    return torch.tanh(logits / cap) * cap if cap else logits


@pytest.mark.parametrize("changes", [{}, dict(input_embedding_scale=0.5, output_multiplier=2.0,
                                              final_logit_softcapping=3.0)])
@torch.no_grad()
def test_two_blocks_are_z_labs(tmp_path, qwen3, changes):
    """The prefill's block, then a round's with 2 of K drafts accepted (the rejected rows' context
    written, then covered by the block): each equals z-lab's forward over the sequence so far."""
    draft = load_drafter(dflash_folder(tmp_path, **changes), qwen3)
    assert isinstance(draft, specpass.ParallelDrafter) and not isinstance(draft, specpass.ChainDrafter)
    prompt, k, a = PROMPTS[1], 5, 2
    target = HFTarget(qwen3)
    target.setup_caches(1, 32)
    draft.setup_caches(1, 32)
    n = len(prompt)
    logits, hidden = target.forward_with_hidden(torch.tensor([prompt]), torch.arange(n)[None], draft.hidden_kind)
    x_n = int(logits[0, -1].argmax())
    tokens = torch.tensor([prompt[1:] + [x_n]])  # row t: the token at t + 1 and the state at t
    drafts = draft.draft_parallel(tokens, torch.arange(1, n + 1)[None], hidden, torch.tensor([n - 1]), k)[0]
    torch.testing.assert_close(drafts, reference_block(draft, qwen3, prompt, k), rtol=1e-4, atol=1e-4)
    d = drafts.argmax(-1).tolist()  # [K]
    logits, hidden = target.forward_with_hidden(torch.tensor([[x_n] + d]), torch.arange(n, n + k + 1)[None],
                                                draft.hidden_kind)  # the verify: rows at n..n+K
    y = d[:a] + logits[0, a:].argmax(-1).tolist()  # accept d_1..d_a (whatever the target says), then its own
    drafts = draft.draft_parallel(torch.tensor([y]), torch.arange(n + 1, n + k + 2)[None], hidden,
                                  torch.tensor([a]), k)[0]
    torch.testing.assert_close(drafts, reference_block(draft, qwen3, prompt + [x_n] + d[:a], k), rtol=1e-4, atol=1e-4)


# --- the loop: lossless


def plain(model, prompts, new):
    return Decoder(HFTarget(model), None, max_batch=len(prompts), max_len=64, compile="eager").generate(prompts, new)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_greedy_tokens_equal_plain_decoding(tmp_path, kind):
    model = make_target(kind)
    draft = load_drafter(dflash_folder(tmp_path), model)
    for prompts in (PROMPTS, PROMPTS[1:2]):  # ragged; bs 1
        want = plain(model, prompts, 20)
        for k in (1, 3, 7):
            dec = Decoder(HFTarget(model), draft, k=k, max_batch=len(prompts), max_len=64, compile="eager")
            assert dec.generate(prompts, 20).tokens == want.tokens, (len(prompts), k)


@pytest.mark.parametrize("fused", [True, False])
def test_generate_with_a_dflash_draft_compiled(tmp_path, qwen3, fused):
    """specpass.generate, compiled by specpass (eager handoff), the round fused or apart: model.generate's tokens."""
    draft = load_drafter(dflash_folder(tmp_path), qwen3)
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 2, 6, 5, 35]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    want = qwen3.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    out = specpass.generate(qwen3, ids, attention_mask=mask, assistant_model=draft, max_new_tokens=12,
                            num_assistant_tokens=4, compile=specpass.backend(handoff="eager"), fused_round=fused,
                            pad_token_id=0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    assert any("[argmax]" in line for lines in out.rewrites.values() for line in lines), out.rewrites


# --- the loader


def test_bf16_target_and_model_prefix(tmp_path):
    model = make_target("llama", torch.bfloat16)
    draft = load_drafter(dflash_folder(tmp_path, prefix="model."), model)
    assert draft.fc.weight.dtype == torch.bfloat16
    assert draft.embed_tokens is model.get_input_embeddings() and draft.lm_head is model.get_output_embeddings()
    assert draft.hidden_kind == "layers:0,2,3"
    with pytest.raises(ValueError, match="a DFlash draft runs on the target's lm_head .torch.bfloat16 on cpu."):
        load_drafter(dflash_folder(tmp_path / "again"), model, dtype=torch.float32)


@pytest.mark.parametrize("changes, words", [
    (dict(target_layer_ids=[0, 4]), ["target_layer_ids [4] are outside the target's 4 layers (0..3)"]),
    (dict(hidden_size=32), ["hidden_size 32 != the target's hidden_size 64"]),
    (dict(vocab_size=95, mask_token_id=3), ["vocab_size: the target has 96 tokens, the draft 95"]),
    (dict(block_size=1), ["block_size must be an int >= 2"]),
    (dict(mask_token_id=None), ["lacks ['mask_token_id']"]),
    (dict(mask_token_id=96), ["mask_token_id must be a token id below vocab_size 96"]),
    (dict(target_layer_ids=[]), ["target_layer_ids must be a non-empty list"]),
    (dict(conv_kernel_size=2, conv_group_size=16), ["DFlash2 fields ['conv_kernel_size', 'conv_group_size']"]),
    (dict(layer_types=["sliding_attention"] * 2), ["sliding-window draft layers"]),
    (dict(architectures=["DFlash2DraftModel"]), ["not a DFlash draft (DFlashDraftModel)"]),
])
def test_bad_configs_name_the_field(tmp_path, qwen3, monkeypatch, changes, words):
    refused(monkeypatch, dflash_folder(tmp_path, **changes), qwen3, *words)


def test_dflash2_tensors_and_a_wrong_layout_are_named(tmp_path, qwen3, monkeypatch):
    conv = {"layers.0.attention_conv.base_kernel": torch.zeros(2, 2, H),
            "candidate_selector.hidden_projection.weight": torch.zeros(8, H)}
    refused(monkeypatch, dflash_folder(tmp_path / "a", extra_tensors=conv), qwen3,
            "DFlash2's ['attention_conv', 'candidate_selector']")
    refused(monkeypatch, dflash_folder(tmp_path / "b", layers=2, num_hidden_layers=3), qwen3,
            "missing tensors", "layers.2.self_attn.q_proj.weight", "3 layer(s)")


def test_tune_k_prices_each_block_with_its_own_acceptance(tmp_path, qwen3):
    """A block's drafts depend on K (the block attends both ways): tune_k times each K given and
    prices it with the acceptance measured at it, and refuses one acceptance for them all."""
    draft = load_drafter(dflash_folder(tmp_path), qwen3)
    dec = Decoder(HFTarget(qwen3), draft, k=3, max_batch=3, max_len=64, compile="eager")
    choice = dec.tune_k(PROMPTS, (2, 5), new_tokens=(4, 12), repeats=1, off=True)
    assert sorted(choice.own_acceptance) == [2, 5] and [len(choice.own_acceptance[k]) for k in (2, 5)] == [2, 5]
    assert set(choice.round_ms) == {2, 5, 0} and choice.k in (0, 2, 5) and choice.verified
    assert dec.generate(PROMPTS, 12).tokens == plain(qwen3, PROMPTS, 12).tokens
    with pytest.raises(ValueError, match="this drafter's drafts depend on K"):
        dec.tune_k(PROMPTS, (2, 5), acceptance=[0.5] * 5)


# --- what the passes do to the round's draft forward


class TestTheBlockForwardRewritten(expecttest.TestCase):
    """The parallel round's catch-up with a one-layer DFlash draft, greedy: its logits' softmax -> max
    becomes an arg-max, and the block's first row (the bonus token's, whose draft is not read) is
    dropped after the last attention: o_proj, the MLP, the norm and the lm_head run on K rows."""

    def test_graph_after_the_last_attention(self):
        model = make_target("qwen3")
        draft = load_drafter(dflash_folder(Path(tempfile.mkdtemp()), layers=1), model)
        k = 3
        dec = Decoder(HFTarget(model), draft, k=k, max_batch=3, max_len=64, compile="eager")
        dec.generate(PROMPTS, 2)  # binds the round's steps
        g = torch.Generator().manual_seed(0)
        args = (torch.randint(0, V - 1, (3, k + 1), generator=g), torch.tensor([4, 11, 2]),
                torch.randn(3, k + 1, 3 * H, generator=g), torch.tensor([0, 3, 2]), None)
        result = specpass.rewrite(specpass.capture(dec.steps.catch_up, *args))
        fired = sorted(f.pass_name for f in result.report.findings if f.fired)
        self.assertEqual(fired, ["argmax", "live_rows"])
        lines = graph_str(result.graph_module).splitlines()
        last_attention = max(i for i, line in enumerate(lines) if "scaled_dot_product_attention" in line)
        self.assertExpectedInline("\n".join(lines[last_attention:]), """\
transpose_3: f32[3, 3, 4, 16] = transpose.int(scaled_dot_product_attention, 1, 2)
reshape_1: f32[3, 3, 64] = reshape(transpose_3, [3, 3, 64])
linear_6: f32[3, 3, 64] = linear(reshape_1, fn_args_0_layers_0_self_attn_o_proj_weight)
embedding_rows: f32[3, 3, 64] = slice.Tensor(embedding, 1, 1, 4, 1)
add_6: f32[3, 3, 64] = add.Tensor(embedding_rows, linear_6)
rms_norm_5: f32[3, 3, 64] = rms_norm(add_6, [64], fn_args_0_layers_0_post_attention_layernorm_weight, 1e-06)
linear_7: f32[3, 3, 128] = linear(rms_norm_5, fn_args_0_layers_0_mlp_gate_proj_weight)
silu: f32[3, 3, 128] = silu(linear_7)
linear_8: f32[3, 3, 128] = linear(rms_norm_5, fn_args_0_layers_0_mlp_up_proj_weight)
mul_10: f32[3, 3, 128] = mul.Tensor(silu, linear_8)
linear_9: f32[3, 3, 64] = linear(mul_10, fn_args_0_layers_0_mlp_down_proj_weight)
add_7: f32[3, 3, 64] = add.Tensor(add_6, linear_9)
rms_norm_6: f32[3, 3, 64] = rms_norm(add_7, [64], fn_args_0_norm_weight, 1e-06)
linear_10: f32[3, 3, 96] = linear(rms_norm_6, fn_args_0_lm_head_weight)
flatten: f32[9, 96] = flatten.using_ints(linear_10, 0, 1)
to_8: f32[9, 96] = to.dtype(flatten, f32)
argmax_default: i64[9, 1] = argmax(to_8, 1, True)
gather_default: f32[9, 1] = gather(to_8, 1, argmax_default)
lt_scalar: b8[9, 1] = lt.Scalar(gather_default, inf)
where_scalar_other: i64[9, 1] = where.ScalarOther(lt_scalar, argmax_default, 0)
squeeze_dims: i64[9] = squeeze.dims(where_scalar_other, [1])
view_4: i64[3, 3] = view(squeeze_dims, [3, 3])
return (view_4,)""")


# --- the choice among drafters


def test_choose_drafter_takes_the_drafter_whose_choice_decodes_most():
    """tune_k on a chain head's Decoder and a block draft's (the same prompts and batch size), the
    drafter whose chosen K makes the most tokens per ms taken, each decoder left at its choice."""
    from models import zoo
    from models.drafters import ZooDrafter
    from specpass.loop import choose_drafter

    targets = [zoo.build("tiny-llama") for _ in range(2)]  # a target per Decoder: each sets up its caches
    drafters = {"eagle": ZooDrafter(zoo.build("tiny-llama-eagle3", seed=3)),
                "block": zoo.build("tiny-llama-dflash", seed=4, target=targets[1])}
    decoders = {name: Decoder(target, drafter, k=2, max_batch=3, max_len=64, compile="eager")
                for target, (name, drafter) in zip(targets, drafters.items())}
    options = dict(ks=(2, 4), new_tokens=(4, 12), repeats=1, off=True)
    name, choices = choose_drafter(decoders, PROMPTS, {"eagle": options, "block": options})
    rate = {n: c.tokens_per_ms[c.k] for n, c in choices.items()}
    assert set(rate) == {"eagle", "block"} and rate[name] == max(rate.values())
    assert all(decoders[n].k == c.k for n, c in choices.items())
    plain = Decoder(targets[0], None, max_batch=3, max_len=64, compile="eager").generate(PROMPTS, 12).tokens
    assert decoders[name].generate(PROMPTS, 12).tokens == plain
    with pytest.raises(ValueError, match="needs at least one Decoder"):
        choose_drafter({}, PROMPTS)
    with pytest.raises(ValueError, match=r"options for \['tree'\], which are not among the decoders"):
        choose_drafter(decoders, PROMPTS, {"tree": options})
    decoders["block"].reserve(5)
    with pytest.raises(ValueError, match=r"the decoders' max_batch differ \(\[3, 5\]\)"):
        choose_drafter(decoders, PROMPTS)

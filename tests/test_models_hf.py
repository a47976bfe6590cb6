"""Our Llama against transformers' LlamaForCausalLM, from the same safetensors folder (both ways)."""

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from models import zoo
from models.checkpoint import load, save
from models.llama import Llama


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def both(name, tmp_path):
    zoo.make_checkpoint(name, tmp_path)
    hf = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ours = load(Llama, tmp_path)
    return hf, ours


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama-draft"])  # untied and tied embeddings
def test_same_logits_as_transformers(name, tmp_path):
    hf, ours = both(name, tmp_path)
    if ours.config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    tokens = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    ours.setup_caches(2, 16)
    with torch.no_grad():
        expected = hf(tokens).logits
        actual = ours(tokens, torch.arange(11).expand(2, -1))
    close(actual, expected)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama-draft"])
def test_same_greedy_tokens_as_transformers(name, tmp_path):
    """Ours decodes with its KV cache (prompts of different lengths); transformers recomputes the
    whole sequence every step. Same tokens, same logits at every step."""
    hf, ours = both(name, tmp_path)
    B, steps = 2, 8
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 3)]
    ours.setup_caches(B, 32)
    with torch.no_grad():
        # prefill both prompts in one padded call; pad rows write slots that get overwritten
        T = max(len(p) for p in prompts)
        padded = torch.stack([torch.cat([p, p.new_zeros(T - len(p))]) for p in prompts])
        logits = ours(padded, torch.arange(T).expand(B, -1))
        pos = torch.tensor([len(p) for p in prompts])
        nxt = logits[torch.arange(B), pos - 1].argmax(-1)
        ours_tokens = [nxt]
        for _ in range(steps - 1):
            logits = ours(nxt[:, None], pos[:, None])[:, 0]
            nxt = logits.argmax(-1)
            ours_tokens.append(nxt)
            pos = pos + 1
        ours_tokens = torch.stack(ours_tokens, 1)

        for b, prompt in enumerate(prompts):
            seq = prompt[None]
            for step in range(steps):
                hf_logits = hf(seq).logits[0, -1]
                token = hf_logits.argmax()
                assert token == ours_tokens[b, step], f"request {b} step {step}"
                seq = torch.cat([seq, token.view(1, 1)], dim=1)


def test_aux_hidden_states_are_transformers_hidden_states(tmp_path):
    """EAGLE-3's fused states are HF's output_hidden_states[2, L//2, L-3]; "last" is the input of
    the final norm (HF reports the normed state as its last entry, so read it with a hook)."""
    hf, ours = both("tiny-llama", tmp_path)
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    seen = {}

    def grab(module, args, out):  # returns None: leaves the output alone
        seen["pre_norm"] = args[0]

    hf.model.norm.register_forward_hook(grab)
    ours.setup_caches(2, 16)
    positions = torch.arange(9).expand(2, -1)
    with torch.no_grad():
        out = hf(tokens, output_hidden_states=True)
        logits, aux = ours.forward_with_hidden(tokens, positions, "eagle3")
        _, last = ours.forward_with_hidden(tokens, positions, "last")
    L = ours.config.num_hidden_layers
    assert ours.eagle3_layers == (2, L // 2, L - 3) == (2, 4, 5)
    close(aux, torch.cat([out.hidden_states[i] for i in (2, 4, 5)], dim=-1))
    close(last, seen["pre_norm"])
    close(logits, out.logits)


@pytest.mark.parametrize("shard", [None, "200KB"], ids=["single", "sharded"])
def test_transformers_saved_folder_loads_into_ours(tmp_path, shard):
    config = HFLlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                           rope_parameters={"rope_type": "default", "rope_theta": 1234.0})
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(shard)
    ours = load(Llama, tmp_path)
    assert ours.config.rope_theta == 1234.0 and ours.config.rms_norm_eps == 1e-6
    tokens = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(2))
    ours.setup_caches(2, 8)
    with torch.no_grad():
        close(ours(tokens, torch.arange(7).expand(2, -1)), hf(tokens).logits)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama-draft"])
def test_our_sharded_folder_loads_into_transformers_and_ours(name, tmp_path):
    model = zoo.build(name, seed=4)
    save(model, model.config, tmp_path, max_shard_bytes=100_000)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    hf = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ours = load(Llama, tmp_path)
    for key, value in model.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(5))
    ours.setup_caches(2, 9)
    with torch.no_grad():
        logits = ours(tokens, torch.arange(9).expand(2, -1))
        close(hf(tokens).logits, logits)

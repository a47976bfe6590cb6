"""specpass.generate on a transformers model loaded tensor-parallel (`from_pretrained(...,
tp_plan="auto")`, transformers' own plan, DTensor weights) over two gloo processes: the tokens of
transformers' single-process greedy generate, plain, with a replicated standalone draft and with a
DFlash draft over the sharded model's embedding and lm_head, at bs 1 and on a left-padded ragged batch; sampled with a seed, the single-process specpass tokens; compiled
through specpass with its rewrites (the passes see the local shards: `specpass.tensor_parallel.
localize`); the user's model left as it was. A style localize does not know is refused."""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import specpass
from specpass.tensor_parallel import localize
from tests.test_dflash import dflash_folder
from tests.test_tp_loop import gloo_rank, run_ranks, save_rank

PROMPTS = [[11, 40, 3, 5], [6, 5], [35, 8, 9], [7, 7, 8]]  # ragged; the first decodes 10 tokens without an EOS
NEW = 10
SAMPLED = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=5)


SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


def save_pair(path):
    """A tiny Llama target (4 query, 2 K/V heads; 64 tokens), a 1-layer draft of its vocabulary and a
    DFlash draft over it."""
    for name, layers, seed in (("target", 2, 0), ("draft", 1, 1)):
        torch.manual_seed(seed)
        config = LlamaConfig(**SIZES, num_hidden_layers=layers, max_position_embeddings=128,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0)
        LlamaForCausalLM(config).save_pretrained(path / name)
    dflash_folder(path / "dflash", layers=1, sizes={**SIZES, "head_dim": 8}, reads=(0, 1))
    one_head = {**SIZES, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 32}
    dflash_folder(path / "dflash_one_head", layers=1, sizes=one_head, reads=(0, 1))  # does not split over 2


def batch(prompts):
    """Left-padded ids and mask, as transformers' decoder-only generate takes them."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def new_tokens(model, prompts, **kw):
    ids, mask = batch(prompts)
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, **kw)[:, ids.shape[1]:].tolist()


def ours(model, prompts, **kw):
    ids, mask = batch(prompts)
    out = specpass.generate(model, ids, attention_mask=mask, max_new_tokens=NEW,
                            return_dict_in_generate=True, **{"compile": "eager", **kw})
    return out.sequences[:, ids.shape[1]:].tolist(), out.rewrites


def _worker(rank, path):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    with gloo_rank(rank, path):
        model = LlamaForCausalLM.from_pretrained(f"{path}/target", tp_plan="auto", dtype=torch.float32).eval()
        draft = LlamaForCausalLM.from_pretrained(f"{path}/draft", dtype=torch.float32).eval()
        sharded = type(model.model.layers[0].self_attn.q_proj.weight).__name__
        # the passes on the local shards, the rewritten graphs run eagerly (Inductor at TP: benchmarks/hf_tp.py)
        specpass_tokens, rewrites = ours(model, PROMPTS, compile=specpass.backend(handoff="eager"), assistant_model=draft)
        block = specpass.load_drafter(f"{path}/dflash", model)  # over the DTensor embedding and lm_head
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            one_head_tokens = ours(model, PROMPTS, num_assistant_tokens=3,
                                   assistant_model=specpass.load_drafter(f"{path}/dflash_one_head", model))[0]
        got = {
            "sharded": sharded,
            "plain bs 1": ours(model, PROMPTS[:1])[0],
            "plain ragged": ours(model, PROMPTS)[0],
            "draft ragged": ours(model, PROMPTS, assistant_model=draft)[0],
            "sampled ragged": ours(model, PROMPTS, assistant_model=draft, **SAMPLED)[0],
            "specpass draft ragged": specpass_tokens,
            "block ragged": ours(model, PROMPTS, assistant_model=block, num_assistant_tokens=3)[0],
            "one-head block ragged": one_head_tokens,
            "one-head warning": [str(w.message) for w in caught if issubclass(w.category, specpass.SpecpassWarning)],
            # the draft generate ran: its heads sharded (2 of 4, 8 wide), the user's left whole
            "block draft heads": [list(specpass.generate.cache)[-1].drafter.layers[0].self_attn.q_proj.out_features,
                                  block.layers[0].self_attn.q_proj.out_features],
            "rewrites": sorted({line.split("]")[0][1:] for lines in rewrites.values() for line in lines}),
            "still sharded": type(model.model.layers[0].self_attn.q_proj.weight).__name__,
        }
        try:
            localize(model, {**model.tp_plan, "model.layers.*.self_attn.q_proj": "local_colwise"})
            got["unknown style"] = None
        except ValueError as exc:
            got["unknown style"] = str(exc)
        got["kept"] = len(specpass.generate.cache)
    got["after teardown"] = [len(specpass.generate.cache), dist.is_initialized()]  # specpass.destroy_process_group
    save_rank(path, rank, got)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_hf")
    save_pair(path)
    return path


@pytest.fixture(scope="module")
def ranks(pair):
    return run_ranks(_worker, pair)


@pytest.fixture(scope="module")
def one_process(pair):
    model = LlamaForCausalLM.from_pretrained(pair / "target", dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(pair / "draft", dtype=torch.float32).eval()
    return {"greedy bs 1": new_tokens(model, PROMPTS[:1], do_sample=False, pad_token_id=0),
            "greedy ragged": new_tokens(model, PROMPTS, do_sample=False, pad_token_id=0),
            "sampled ragged": ours(model, PROMPTS, assistant_model=draft, **SAMPLED)[0]}


def test_the_model_is_loaded_sharded(ranks):
    assert ranks[0]["sharded"] == ranks[1]["sharded"] == "DTensor"


@pytest.mark.parametrize("case, want", [("plain bs 1", "greedy bs 1"), ("plain ragged", "greedy ragged"),
                                        ("draft ragged", "greedy ragged"), ("sampled ragged", "sampled ragged"),
                                        ("specpass draft ragged", "greedy ragged"), ("block ragged", "greedy ragged")])
def test_every_rank_emits_the_single_process_tokens(ranks, one_process, case, want):
    assert ranks[0][case] == ranks[1][case] == one_process[want]
    assert max(sum(t != 0 for t in row) for row in one_process[want]) > NEW // 2  # not stopped at once


def test_a_dflash_draft_runs_sharded_over_the_local_shards(ranks):
    assert ranks[0]["block draft heads"] == ranks[1]["block draft heads"] == [16, 32]


def test_a_draft_whose_heads_do_not_split_runs_whole_with_a_warning(ranks, one_process):
    for got in ranks:
        assert got["one-head block ragged"] == one_process["greedy ragged"]
        assert any("the drafter runs whole on every rank (layers.0.self_attn: 1 query and 1 K/V heads do not "
                   "split over 2 ranks" in w for w in got["one-head warning"]), got["one-head warning"]


def test_the_passes_rewrite_the_local_shards_and_the_model_stays_sharded(ranks):
    for got in ranks:
        assert "live_rows" in got["rewrites"], got["rewrites"]
        assert got["still sharded"] == "DTensor"


def test_teardown_drops_the_kept_decoders_and_the_group(ranks):
    for got in ranks:
        assert got["kept"] > 0
        assert got["after teardown"] == [0, False]


def test_a_style_localize_does_not_know_is_refused(ranks):
    for got in ranks:
        assert got["unknown style"] is not None and "model.layers.0.self_attn.q_proj: specpass runs a " \
            "tensor-parallel linear under transformers' styles" in got["unknown style"], got["unknown style"]
        assert "got style 'local_colwise'" in got["unknown style"]

"""The loop at tensor parallel 2: two gloo processes run the same `Decoder` on their shards of the
tiny Llama target and its EAGLE-3 head (models/tp.py, torch's plan) and emit the tokens one process
emits with the whole models: greedy at bs 1 and on a ragged batch, sampled with a seed, and compiled
through specpass (the fused round); a DFlash draft's block rounds (its layers sharded, over the
sharded target's embedding and lm_head) likewise. The ranks' checks (specpass/loop/distributed.py): different
prompts or settings, a drafter whose logits are its rank's vocabulary shard, ranks that diverge
mid-run, each a clear error on every rank. A group of one decodes as one process. The plan's
refusals run in this process (no group needed)."""

import contextlib
import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import specpass
from models import zoo
from models.drafters import ZooDrafter, adapt
from models.tp import tensor_parallel
from specpass.tensor_parallel import shard_plan
from specpass.loop import Decoder, cache_slots

PROMPTS = [[3, 14, 15], [9, 2, 6, 5, 35, 89, 79, 32, 38], [46]]  # ragged: 3, 9, 1
NEW, K = 12, 3
MAX_LEN = cache_slots(9, NEW, K)
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=5)


def models():
    return zoo.build("tiny-llama", seed=0), zoo.build("tiny-llama-eagle3", seed=3)


def block_draft(target):
    return zoo.build("tiny-llama-dflash", seed=4, target=target)


def decode(target, head, prompts, group=None, **kw):
    options = {"compile": "eager", **{k: kw.pop(k) for k in ("compile", "fused_round", "check_ranks", "compile_prefill")
                                      if k in kw}}
    dec = Decoder(target, adapt(head) if head is not None else None, k=K if head is not None else 0,
                  max_batch=len(prompts), max_len=MAX_LEN, group=group, **options)
    return dec.generate(prompts, NEW, **kw).tokens


def error_of(fn):
    """(type name, message) of what fn raises, or None."""
    try:
        fn()
    except Exception as exc:  # recorded for the parent to assert on
        return [type(exc).__name__, str(exc)]
    return None


def emit_differently(dec, rank):
    """Rank 1's rounds record other tokens than rank 0's (as a nondeterministic kernel would make
    them), the rest of the state kept: the ranks still run the same rounds."""
    bound = dec._bound[dec.k]

    def round_(state, carry, params):
        state, carry, finished = bound.round(state, carry, params)
        return state._replace(out=state.out + rank), carry, finished

    dec._bound[dec.k] = dataclasses.replace(bound, round=round_)


@contextlib.contextmanager
def gloo_rank(rank, path):
    """This process as rank `rank` of two gloo ranks meeting at `path` -> the group of both."""
    dist.init_process_group("gloo", init_method=f"file://{path}/store", rank=rank, world_size=2)
    torch.set_num_threads(1)  # two processes on two cores
    try:
        yield dist.group.WORLD
    finally:
        specpass.destroy_process_group()


def run_ranks(worker, path):
    """worker(rank, path) in two processes, each saving what it got with `save_rank` -> [rank 0's, rank 1's]."""
    mp.spawn(worker, args=(str(path),), nprocs=2, join=True)
    return [json.loads((path / f"out.{rank}").read_text()) for rank in range(2)]


def save_rank(path, rank, got):
    with open(f"{path}/out.{rank}", "w") as f:
        json.dump(got, f)


def _worker(rank, path):
    with gloo_rank(rank, path) as group:
        alone = [dist.new_group([r]) for r in range(2)][rank]  # every rank makes every group
        target, head = models()
        tp_target, tp_head = tensor_parallel(target, group), tensor_parallel(head, group)
        got = {
            "greedy bs 1": decode(tp_target, tp_head, PROMPTS[1:2], group),
            "greedy ragged": decode(tp_target, tp_head, PROMPTS, group, eos_id=7),
            "sampled ragged": decode(tp_target, tp_head, PROMPTS, group, **SAMPLED),
            "specpass fused": decode(tp_target, tp_head, PROMPTS, group, compile=specpass.backend(handoff="eager"),
                                     fused_round=True, compile_prefill=False, check_ranks=True),
            "group of one": decode(tensor_parallel(target, alone), tensor_parallel(head, alone), PROMPTS, alone,
                                   check_ranks=True),
        }
        tp_block = tensor_parallel(block_draft(target), group, target=tp_target)
        got["block greedy ragged"] = decode(tp_target, tp_block, PROMPTS, group, eos_id=7, check_ranks=True)
        got["block sampled ragged"] = decode(tp_target, tp_block, PROMPTS, group, **SAMPLED)
        got["block fused"] = decode(tp_target, tp_block, PROMPTS, group, compile=specpass.backend(handoff="eager"),
                                    fused_round=True, compile_prefill=False, check_ranks=True)
        got["block sharded"] = [tp_block.layers[0].self_attn.q_proj.out_features, tp_block.lm_head is tp_target.lm_head]
        # Errors, on every rank
        other = PROMPTS if rank == 0 else [PROMPTS[0], PROMPTS[1], [47]]
        got["other prompts"] = error_of(lambda: decode(tp_target, tp_head, other, group))
        got["other temperature"] = error_of(lambda: decode(tp_target, tp_head, PROMPTS, group,
                                                           temperature=0.8 + 0.1 * rank, seed=5))
        local_vocab = tensor_parallel(head, group)
        local_vocab.lm_head._forward_hooks.clear()  # its logits: this rank's half of the draft vocabulary
        got["draft vocabulary shard"] = error_of(lambda: decode(tp_target, local_vocab, PROMPTS, group))
        for name, check_ranks in (("diverged, checked per round", True), ("diverged", False)):
            dec = Decoder(tp_target, ZooDrafter(tp_head), k=K, max_batch=3, max_len=MAX_LEN, compile="eager",
                          group=group, check_ranks=check_ranks)
            emit_differently(dec, rank)
            got[name] = error_of(lambda: dec.generate(PROMPTS, NEW))
        save_rank(path, rank, got)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of the two ranks returned."""
    return run_ranks(_worker, tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="module")
def one_process():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny models run faster on one thread of a shared machine
    target, head = models()
    block = block_draft(target)
    yield {"greedy bs 1": decode(target, head, PROMPTS[1:2]), "greedy ragged": decode(target, head, PROMPTS, eos_id=7),
           "sampled ragged": decode(target, head, PROMPTS, **SAMPLED), "ragged": decode(target, head, PROMPTS),
           "block greedy ragged": decode(target, block, PROMPTS, eos_id=7),
           "block sampled ragged": decode(target, block, PROMPTS, **SAMPLED)}
    torch.set_num_threads(threads)


@pytest.mark.parametrize("case", ["greedy bs 1", "greedy ragged", "sampled ragged"])
def test_every_rank_emits_the_single_process_tokens(ranks, one_process, case):
    assert ranks[0][case] == ranks[1][case] == one_process[case]
    assert sum(map(len, one_process[case])) > len(one_process[case])  # decoded past the first token


def test_compiled_through_specpass_fused_round(ranks, one_process):
    assert ranks[0]["specpass fused"] == ranks[1]["specpass fused"] == one_process["ragged"]


@pytest.mark.parametrize("case", ["block greedy ragged", "block sampled ragged"])
def test_block_rounds_emit_the_single_process_tokens(ranks, one_process, case):
    assert ranks[0][case] == ranks[1][case] == one_process[case]
    assert one_process["block greedy ragged"] == one_process["greedy ragged"]  # lossless: the chain's tokens


def test_block_draft_sharded_over_the_sharded_target(ranks, one_process):
    assert ranks[0]["block fused"] == ranks[1]["block fused"] == one_process["ragged"]
    assert ranks[0]["block sharded"] == ranks[1]["block sharded"] == [32, True]  # 2 of 4 query heads of 16


def test_a_group_of_one_decodes_as_one_process(ranks, one_process):
    assert ranks[0]["group of one"] == ranks[1]["group of one"] == one_process["ragged"]


@pytest.mark.parametrize("case, says", [
    ("other prompts", "differ in the arguments of generate: prompts (this is rank {rank})"),
    ("other temperature", "differ in the arguments of generate: sampling parameters (this is rank {rank})"),
    ("draft vocabulary shard", "differ in the logits of one probe token: draft logits (this is rank {rank}). "
                               "Every rank must return the whole vocabulary's logits"),
    ("diverged, checked per round", "differ in their state after round 1 (this is rank {rank})"),
    ("diverged", "differ in the tokens generated: tokens (this is rank {rank})"),
])
def test_ranks_that_disagree_are_refused_on_every_rank(ranks, case, says):
    for rank, got in enumerate(ranks):
        assert got[case] is not None, f"rank {rank} ran {case!r} without an error"
        kind, message = got[case]
        assert kind == "RanksDisagree" and says.format(rank=rank) in message, message


@pytest.mark.parametrize("name, change, world, says", [
    ("tiny-llama", {}, 3, "model.layers.0.self_attn: 4 query and 2 K/V heads do not split over 3 ranks"),
    ("tiny-llama", {}, 4, "4 query and 2 K/V heads do not split over 4 ranks"),
    ("tiny-llama", {"vocab_size": 255}, 2, "lm_head: the vocabulary 255 does not split over 2 ranks"),
    ("tiny-llama-eagle3", {"draft_vocab_size": 95}, 2, "lm_head: the vocabulary 95 does not split over 2 ranks"),
    ("tiny-llama", {"intermediate_size": 129}, 2, "the intermediate size 129 does not split over 2 ranks"),
])
def test_sizes_that_do_not_split_are_refused(name, change, world, says):
    model = zoo.build(dataclasses.replace(zoo.config(name), **change))
    with pytest.raises(ValueError, match=says):
        shard_plan(model, world)


def test_one_k_v_head_stays_whole_on_every_rank():
    plan = shard_plan(zoo.build("tiny-llama-draft"), 2)  # 4 query heads, 1 K/V head
    assert {n.rsplit(".", 1)[1] for n in plan if ".self_attn." in n} == {"q_proj", "o_proj"}


def test_check_ranks_needs_a_group():
    target, head = models()
    with pytest.raises(ValueError, match="check_ranks=True compares the ranks of a tensor-parallel Decoder: pass "
                                         "the process group"):
        Decoder(target, ZooDrafter(head), k=K, max_batch=1, max_len=MAX_LEN, compile="eager", check_ranks=True)

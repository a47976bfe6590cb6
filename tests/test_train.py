"""examples/train.py: its cache-free training forwards compute what inference computes — the
Llama forward, and EAGLE-3's training-time test row for row against catch-up + draft steps with
ZooDrafter's alignment, P-EAGLE's and DFlash's rows against their draft forwards — and a CPU smoke
run trains, evaluates and writes loadable folders."""

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from models import zoo
from models.checkpoint import CheckpointError, load
from models.drafters import ZooDrafter
from models.eagle3 import Eagle3Head
from models.llama import Llama
from models.text import VOCAB, load_prompts

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train", ROOT / "examples" / "train.py")
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_llama_training_forward_equals_cached_forward():
    model = zoo.build("tiny-llama", seed=2)
    B, T = 2, 13
    tokens = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
    model.setup_caches(B, T + 3)
    with torch.no_grad():
        logits, hidden = model.forward_with_hidden(tokens, torch.arange(T).expand(B, -1), "eagle3")
        train_logits, captured = train.llama_forward(model, tokens, model.eagle3_layers)
    close(train_logits, logits)
    close(torch.cat(captured, -1), hidden)


def test_rollout_mask_is_the_draft_step_cache():
    mask = train.rollout_mask(6, 2, "cpu")  # step 2: keys of steps 0, 1, 2 side by side
    step0, step1, step2 = mask.view(6, 3, 6).unbind(1)
    assert step0[4].tolist() == [True, True, True, False, False, False]  # catch-up up to slot 4-2
    assert step1[4].nonzero().flatten().tolist() == [3] and step2[4].nonzero().flatten().tolist() == [4]
    assert step1[0].sum() == 0 and step2[0].nonzero().flatten().tolist() == [0]  # invalid rows see their own key


def test_eagle3_rollout_is_catch_up_then_draft_steps():
    """Step j, slot s of the training-time test == inference: catch-up of the tokens at positions
    1..s-j+1 with target states 0..s-j (ZooDrafter shifts to slots 0..s-j; padding rows after the
    live row, as a round writes them), then j draft steps on the next tokens, each continuing from
    the previous step's hidden state. Every valid row of every step, in fp32."""
    head = zoo.build("tiny-llama-eagle3", seed=5)
    B, T, J, pad = 2, 11, 4, 2
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (B, T + 1), generator=g)  # x_0..x_T; slot s holds x_{s+1}
    features = torch.randn(B, T, 3 * head.config.target_hidden_size, generator=g)  # f_0..f_{T-1}
    with torch.no_grad():
        rollout = train.eagle3_rollout(head, tokens[:, 1:], features, J)  # J x [B, T, Vd]
        drafter = ZooDrafter(head)
        drafter.setup_caches(B, T + pad + 1)  # one cache for all cases: stale slots, as in decoding
        close(rollout[0], head.forward_rows(tokens[:, 1:], torch.arange(T).expand(B, -1), features)[0])
        for j in range(J):
            assert j == 0 or (rollout[j][:, j:] - rollout[0][:, j:]).abs().max() > 1e-2  # not a re-run of step 0
            for s in range(j, T):
                live = s - j  # the catch-up's last accepted row, at slot s - j
                rows = live + 1 + pad
                pad_tokens = torch.randint(0, 256, (B, pad), generator=g)
                pad_hidden = torch.randn(B, pad, features.shape[-1], generator=g)
                catch_tokens = torch.cat([tokens[:, 1 : live + 2], pad_tokens], 1)
                catch_hidden = torch.cat([features[:, : live + 1], pad_hidden], 1)
                positions = torch.arange(1, rows + 1).expand(B, -1)
                logits, h = drafter.catch_up(catch_tokens, positions, catch_hidden, torch.full((B,), live))
                for m in range(1, j + 1):  # draft step m: the token at position live+m+1, slot live+m
                    logits, h = drafter.draft_step(tokens[:, live + m + 1], torch.full((B,), live + m + 1), h)
                close(rollout[j][:, s], logits)


def test_compile_failure_falls_back_to_eager(monkeypatch):
    def broken(fn):
        def call(*args):
            raise RuntimeError("no compiler here")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    w = torch.nn.Parameter(torch.ones(3))

    def loss_fn(x):
        loss = (w * x).sum()
        return loss, loss[None]

    with pytest.warns(UserWarning, match="torch.compile failed, training eagerly"):
        fn, parts = train.compiled_first_step(loss_fn, torch.arange(3.0), compile=True)
    assert fn is loss_fn and parts.item() == 3.0 and w.grad.tolist() == [0.0, 1.0, 2.0]


def test_lr_schedule():
    lrs = [train.lr_at(s, 1.0, 10, 100) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0) and lrs[100] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


SMOKE = ["--device", "cpu", "--tiny", "--batch", "8", "--drafts-batch", "8", "--seq-len", "64",
         "--eval-windows", "8", "--prompts", "4", "--log-every", "20"]


def test_cpu_smoke_run_trains_and_writes_loadable_folders(tmp_path, capsys):
    log = train.main([*SMOKE, "--target-steps", "40", "--drafts-steps", "40", "--out", str(tmp_path)])
    assert log["target"]["steps"] == log["drafts"]["steps"] == 40
    assert log["target"]["loss_final"][0] < log["target"]["loss_first"][0] - 1.0  # from ln(258) = 5.55 down
    first, final = log["drafts"]["loss_first"], log["drafts"]["loss_final"]
    assert all(b < a for a, b in zip(first, final)), (first, final)  # every EAGLE-3 step and the draft
    assert json.loads((tmp_path / "train_log.json").read_text())["eval"] == log["eval"]
    ev = log["eval"]
    assert ev["windows"] == 8 and len(ev["eagle3_agreement"]) == 4
    assert 0 < ev["target_loss"] < 5.5 and all(0 <= a <= 1 for a in [ev["target_top1"], *ev["eagle3_agreement"]])
    assert "held-out" in capsys.readouterr().out

    target = load(Llama, tmp_path / "stdlib-llama")
    embed = target.model.embed_tokens.weight
    head = load(Eagle3Head, tmp_path / "stdlib-llama-eagle3", shared={"embed_tokens.weight": embed})
    draft = load(Llama, tmp_path / "stdlib-llama-draft")
    assert target.lm_head.weight.dtype == torch.bfloat16 and draft.config.tie_word_embeddings
    assert head.t2d.all() and not head.d2t.any() and head.config.draft_vocab_size == VOCAB
    assert len(load_prompts(tmp_path / "prompts.json")) == 4

    # Phase 2 again from the saved target, as a timed-out run is finished.
    resumed = train.main([*SMOKE, "--target", str(tmp_path / "stdlib-llama"), "--drafts-steps", "5",
                          "--out", str(tmp_path / "resumed")])
    assert "target" not in resumed and resumed["drafts"]["steps"] == 5
    assert not (tmp_path / "resumed" / "stdlib-llama").exists()
    assert (tmp_path / "resumed" / "stdlib-llama-eagle3" / "model.safetensors").is_file()
    # Both second phases ran against the same (saved, bf16) target.
    assert resumed["eval"]["target_loss"] == pytest.approx(ev["target_loss"], rel=1e-6)


@pytest.mark.parametrize("layers", [1, 2])
def test_parallel_rows_are_the_draft_forward(layers):
    """Row (s, j) of the training forward == row j of inference's draft forward with slot s the last
    verified one (its mask slots after it), in every layer of a one- and a two-layer head. fp32."""
    cfg = dataclasses.replace(zoo.config("tiny-llama-peagle3"), num_hidden_layers=layers)
    head = zoo.build(cfg, seed=5)
    T, K = 9, 4
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 256, (1, T), generator=g)
    features = torch.randn(1, T, 3 * cfg.target_hidden_size, generator=g)
    for s in (0, 4, T - 1):
        anchor = torch.cat([torch.arange(T), torch.full((K - 1,), s)])
        depth = torch.cat([torch.zeros(T, dtype=torch.long), torch.arange(1, K)])
        with torch.no_grad():
            rows = train.parallel_rows(head, tokens, features, anchor, depth)[0]  # [T + K - 1, Vd]
            head.setup_caches(1, T + K)
            want = head.draft_parallel(tokens[:, : s + 1], torch.arange(s + 1)[None], features[:, : s + 1],
                                       torch.tensor([s]), K)[0]  # [K, Vd]
        close(torch.cat([rows[s : s + 1], rows[T:]]), want)


@pytest.mark.parametrize("weigh", ["depth", "row"])
def test_parallel_kl_weights(weigh):
    torch.manual_seed(0)
    target, head = Llama(train.TINY["target"]), train.ParallelEagle3Head(train.TINY["peagle3"])
    x = torch.randint(0, VOCAB, (2, 33))
    depths, ratio = 4, 0.7
    kl, weight = train.parallel_kl(head, target, x, depths, ratio, train.contextlib.nullcontext, weigh)
    sizes = train.cod_sizes(32, depths, ratio)
    assert kl.shape == (2, sum(sizes)) and (kl > -1e-5).all()
    close(weight.sum(), torch.tensor(1.0))
    per_depth = weight.split(sizes)
    for j, w in enumerate(per_depth):
        assert (w == 0).sum() <= j  # a row at depth j needs a label j bytes on: the last j slots have none
    if weigh == "depth":
        close(torch.stack([w.sum() for w in per_depth]), torch.full((depths,), 1 / depths))
    else:
        assert len(set(weight[weight > 0].tolist())) == 1


@pytest.fixture(scope="module")
def chain_run(tmp_path_factory):
    """A target and its one-layer chain EAGLE-3 head, trained a few steps: (folder, target dir,
    chain dir, the --parallel --init-from arguments that start from them)."""
    out = tmp_path_factory.mktemp("chain")
    train.main([*SMOKE, "--target-steps", "5", "--drafts-steps", "5", "--out", str(out)])
    target_dir, chain_dir = out / "stdlib-llama", out / "stdlib-llama-eagle3"
    common = [*SMOKE, "--parallel", "--target", str(target_dir), "--init-from", str(chain_dir), "--depths", "4"]
    return out, target_dir, chain_dir, common


def _chain_head(target_dir, chain_dir):
    embed = load(Llama, target_dir).model.embed_tokens.weight
    return embed, load(Eagle3Head, chain_dir, shared={"embed_tokens.weight": embed})


def test_parallel_head_starts_from_the_chain_head(chain_run):
    """--parallel --init-from: every weight the chain head has is the chain head's (lr 0: one step
    that changes nothing), mask_hidden its own."""
    out, target_dir, chain_dir, common = chain_run
    train.main([*common, "--drafts-steps", "1", "--drafts-lr", "0", "--out", str(out / "copy")])
    embed, chain = _chain_head(target_dir, chain_dir)
    head = load(train.ParallelEagle3Head, out / "copy" / "stdlib-llama-peagle3", shared={"embed_tokens.weight": embed})
    ours = head.state_dict()
    for name, tensor in chain.state_dict().items():
        assert torch.equal(ours[name], tensor), name
    assert ours["mask_hidden"].abs().sum() > 0


def test_parallel_head_from_the_chain_head_learns_every_depth(chain_run):
    """From the chain head, a few steps of training weighted by row lower every depth's KL."""
    out, _, _, common = chain_run
    log = train.main([*common, "--weigh", "row", "--drafts-steps", "30", "--out", str(out / "row")])
    first, final = log["parallel"]["loss_first"], log["parallel"]["loss_final"]
    assert all(b < a for a, b in zip(first, final)), (first, final)
    assert log["parallel"]["loss_parts"][0] == "kl weighted by row" and len(log["eval"]["agreement"]) == 4


def test_a_second_layer_starts_adding_nothing(chain_run):
    """Two layers: the chain head's midlayer is layers.0, and layers.1 starts adding nothing, so the
    untrained head drafts as the chain head does (depth 0: the chain head's catch-up)."""
    out, target_dir, chain_dir, common = chain_run
    train.main([*common, "--layers", "2", "--drafts-steps", "1", "--drafts-lr", "0", "--out", str(out / "two")])
    embed, chain = _chain_head(target_dir, chain_dir)
    two = load(train.ParallelEagle3Head, out / "two" / "stdlib-llama-peagle3", shared={"embed_tokens.weight": embed})
    assert two.config.num_hidden_layers == 2 and not hasattr(two, "midlayer")
    for name, tensor in chain.state_dict().items():
        assert torch.equal(two.state_dict()[name.replace("midlayer.", "layers.0.")], tensor), name
    later = two.layers[1]
    assert not later.self_attn.o_proj.weight.any() and not later.mlp.down_proj.weight.any()
    assert later.self_attn.q_proj.weight.any()
    tokens = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    hidden = torch.randn(2, 7, 3 * chain.config.target_hidden_size, generator=torch.Generator().manual_seed(4))
    for model in (chain, two):
        model.setup_caches(2, 8)
    with torch.no_grad():
        close(two.forward_rows(tokens, torch.arange(7).expand(2, -1), hidden.bfloat16())[0],
              chain.forward_rows(tokens, torch.arange(7).expand(2, -1), hidden.bfloat16())[0])


def test_init_from_a_folder_that_is_no_chain_head_is_refused(chain_run):
    """--init-from the target's folder: the loader names what the folder holds and what it takes."""
    out, target_dir, _, _ = chain_run
    bad = [*SMOKE, "--parallel", "--target", str(target_dir), "--init-from", str(target_dir), "--drafts-steps", "1"]
    with pytest.raises(CheckpointError, match=r"stdlib-llama/config\.json describes \['LlamaForCausalLM'\], "
                                              r"not a checkpoint Eagle3Head loads"):
        train.main([*bad, "--out", str(out / "bad")])
    assert not (out / "bad" / "stdlib-llama-peagle3").exists()


@pytest.mark.parametrize("layers", [1, 2])
def test_dflash_rows_are_the_block_forward(layers):
    """The block at anchor s in the training forward == inference's block forward after a prefill of
    s tokens (the context: the target's states at 0..s-1), in a one- and a two-layer draft. fp32."""
    torch.manual_seed(0)
    target = Llama(train.TINY["target"]).eval()
    cfg = dataclasses.replace(train.TINY["dflash"], num_hidden_layers=layers)
    draft = train.DFlashDraft(cfg, target.model.embed_tokens, target.lm_head).eval()
    L, K = 12, cfg.block_size - 1
    x = torch.randint(0, VOCAB, (2, L), generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([1, 3, L - K])
    with torch.no_grad():
        _, features = train.llama_forward(target, x, tuple(i + 1 for i in cfg.target_layer_ids))
        features = torch.cat(features, -1)  # [B, L, n·H]: the outputs of target_layer_ids
        rows = train.dflash_rows(draft, x, features, anchors, K)  # [B, M, K, V]
        for m, s in enumerate(anchors.tolist()):
            draft.setup_caches(2, L + K + 1)
            want = draft.draft_parallel(x[:, 1 : s + 1], torch.arange(1, s + 1).expand(2, s), features[:, :s],
                                        torch.full((2,), s - 1), K)  # row t: the token at t + 1, the state at t
            close(rows[:, m], want)


def test_dflash_draft_learns_every_position(tmp_path):
    """A few steps from a trained target lower the KL at every draft position, and write z-lab's folder."""
    train.main([*SMOKE, "--target-steps", "5", "--drafts-steps", "1", "--out", str(tmp_path)])
    log = train.main([*SMOKE, "--dflash", "--target", str(tmp_path / "stdlib-llama"), "--blocks", "8",
                      "--drafts-steps", "30", "--out", str(tmp_path)])
    first, final = log["dflash"]["loss_first"], log["dflash"]["loss_final"]
    assert all(b < a for a, b in zip(first, final)), (first, final)
    assert len(log["eval"]["agreement"]) == train.TINY["dflash"].block_size - 1 and log["eval"]["accepted_length"] >= 1
    config = json.loads((tmp_path / "stdlib-llama-dflash" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and "target_layer_ids" in config["dflash_config"]
    # --init-from goes on from that folder: its first step's loss is the trained one's, not a new draft's
    again = train.main([*SMOKE, "--dflash", "--target", str(tmp_path / "stdlib-llama"), "--blocks", "8",
                        "--drafts-steps", "1", "--init-from", str(tmp_path / "stdlib-llama-dflash"),
                        "--out", str(tmp_path / "again")])
    assert again["dflash"]["loss_first"][0] < (first[0] + final[0]) / 2, (first[0], final[0], again["dflash"])

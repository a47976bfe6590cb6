"""benchmarks/scale/floors.py's floors for heads of one and two layers: the live-row catch-up runs every
layer but the last on every row it writes K/V for, the last layer's K/V too, the rest on the live
rows. Checked against FLOPs counted from the config, not from the modules the floors walk."""

import dataclasses

import pytest
import torch

from benchmarks.scale.floors import floors
from models import zoo

FLOPS_ONLY = dict(bandwidth=float("inf"), flops=1e3)  # a floor in ms is then its FLOPs
BS, CONTEXT = 3, 40


def meta(name: str, **changes):
    cls, config = zoo.CONFIGS[name][0], dataclasses.replace(zoo.config(name), **changes)
    with torch.device("meta"):
        return cls(config)


def per_row(c) -> dict[str, int]:
    """FLOPs a row costs in each part of the head, from its config."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    mlp = 2 * 3 * c.hidden_size * c.intermediate_size
    return dict(fc=2 * 3 * c.target_hidden_size * c.hidden_size,
                first_kv=2 * 2 * (2 * c.hidden_size) * kv,  # the midlayer reads [embeds, hidden]: 2H
                first_rest=2 * (2 * c.hidden_size) * q + 2 * q * c.hidden_size + mlp,
                plain_kv=2 * 2 * c.hidden_size * kv,
                plain_rest=2 * c.hidden_size * q + 2 * q * c.hidden_size + mlp,
                lm_head=2 * c.hidden_size * c.draft_vocab_size,
                attention=4 * CONTEXT * q)  # a query over the context: scores and values


@pytest.mark.parametrize("layers", [1, 2])
def test_the_chain_catch_up_runs_every_layer_but_the_last_on_every_row(layers):
    target, head = meta("tiny-llama"), meta("tiny-llama-eagle3", num_hidden_layers=layers)
    f = per_row(head.config)
    catch_up = {k: floors(target, head, BS, k, CONTEXT, FLOPS_ONLY)["catch_up"] for k in (4, 5)}
    # one more draft: one more verified row through everything that runs on every row
    every_row = f["fc"] + f["first_kv"] if layers == 1 else (
        f["fc"] + f["first_kv"] + f["first_rest"] + f["attention"] + f["plain_kv"])
    assert catch_up[5] - catch_up[4] == pytest.approx(BS * every_row)
    live = f["first_rest"] if layers == 1 else f["plain_rest"]
    assert catch_up[4] == pytest.approx(BS * (5 * every_row + live + f["lm_head"] + f["attention"]))


def test_the_parallel_catch_up_writes_2k_rows_and_runs_k_live_rows():
    target, head = meta("tiny-llama"), meta("tiny-llama-peagle3", num_hidden_layers=2)
    f = per_row(head.config)
    every_row = f["fc"] + f["first_kv"] + f["first_rest"] + f["attention"] + f["plain_kv"]
    live = f["plain_rest"] + f["lm_head"] + f["attention"]
    for k in (3, 6):
        got = floors(target, head, BS, k, CONTEXT, FLOPS_ONLY)
        assert got["draft"] == 0 and got["catch_up"] == pytest.approx(BS * (2 * k * every_row + k * live))


def test_the_block_round_is_the_verify_and_one_block_forward():
    """A DFlash round: no draft steps and no separate catch-up; its one block forward runs fc and every
    layer's K/V on the K+1 context rows, every layer on the K+1 block rows, the target's lm_head on
    the K drafts."""
    target = meta("tiny-llama")
    with torch.device("meta"):
        draft = zoo.CONFIGS["tiny-llama-dflash"][0](zoo.config("tiny-llama-dflash"), target.model.embed_tokens,
                                                    target.lm_head)
    c = draft.config
    q, kv, n = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.num_hidden_layers
    layer = 2 * c.hidden_size * (2 * q + 2 * kv) + 2 * 3 * c.hidden_size * c.intermediate_size + 4 * CONTEXT * q
    for k in (3, 7):
        got = floors(target, draft, BS, k, CONTEXT, FLOPS_ONLY)
        context = 2 * len(c.target_layer_ids) * c.hidden_size ** 2 + n * 2 * c.hidden_size * 2 * kv
        want = BS * ((k + 1) * (context + n * layer) + k * 2 * c.hidden_size * c.vocab_size)
        assert got["draft"] == 0 and got["catch_up"] == pytest.approx(want)
        assert got["round"] == pytest.approx(got["verify"] + want)


def test_paired_variants_flip_one_switch_from_its_default():
    """scale's decode+SUFFIX and specpass+SUFFIX variants (--paired): each compiles with one specpass
    switch off its default, named by the suffix (+no-gemv: gemv off; +pdl: pdl on)."""
    from benchmarks.scale.sweep import VARIANTS
    from specpass import Options

    flipped = {name: options for name, (options, _) in VARIANTS.items() if "+" in name}
    assert {name.partition("+")[2] for name in flipped} >= {"pdl", "coordinate_descent", "no-gemv", "no-gemv_group"}
    for name, options in flipped.items():
        made = Options.make(**options)
        [(switch, value)] = [(f.name, getattr(made, f.name)) for f in dataclasses.fields(Options)
                             if getattr(made, f.name) != f.default]
        assert name.partition("+")[2] == (switch if value else f"no-{switch}"), name

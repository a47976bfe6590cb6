"""A subset of benchmarks/generate_sweep.py: five transformers families through `specpass.generate`,
one after another in one process (as a server loads them), bs 1 and a ragged batch, equal to
`model.generate` token for token and with every step compiled with its rewrites. What one family's
compiles leave in Dynamo must not change the next one's graphs: it made the next family's float
attributes symbolic, and a pass or Inductor's lowering failed on them, depending on the order.
The whole sweep, with Inductor, is in docs/results.md."""

import pytest
import torch

import specpass
from benchmarks.generate_sweep import outcome, run_family

FIVE = {"olmo2": "Olmo2ForCausalLM", "stablelm": "StableLmForCausalLM", "granite": "GraniteForCausalLM",
        "qwen2": "Qwen2ForCausalLM", "cohere": "CohereForCausalLM"}


def test_five_families_in_one_process_are_exact_with_their_rewrites():
    compile_with = specpass.backend(handoff="eager")  # the passes are what is checked; Inductor on the GPU sweep
    rows = [run_family(model_type, class_name, compile_with, fused=(False,), device=torch.device("cpu"))
            for model_type, class_name in FIVE.items()]
    assert [outcome(row) for row in rows] == ["exact"] * len(FIVE), rows
    for row in rows:
        assert set(row["runs"]) == {"bs1/apart", "ragged3/apart"}, row
        assert all({"prefill", "catch_up"} <= set(run["rewritten"]) and not run["warnings"]
                   for run in row["runs"].values()), row


def test_moe_layers_and_a_last_layer_kept_as_a_region_call_keep_the_live_row_pass():
    """Found by the sweep, where the live-row pass was dropped from the prefill and the catch-up:
    FlexOlmo's experts write a buffer of the layer's own in place (named apart before and after the
    last layer is inlined: the pipeline's check of the writes refused the pass), and GPT-Neo's last
    layer, whose body holds a constant, stays a region call that writes the cache (its output was
    gathered as if it were a tensor)."""
    for model_type, class_name in {"flex_olmo": "FlexOlmoForCausalLM", "gpt_neo": "GPTNeoForCausalLM"}.items():
        row = run_family(model_type, class_name, specpass.backend(handoff="eager"), fused=(False,),
                         device=torch.device("cpu"))
        assert outcome(row) == "exact", row
        assert all({"prefill", "catch_up"} <= set(run["rewritten"]) for run in row["runs"].values()), row


def test_shards_run_side_by_side_and_merge_in_the_sweep_s_order(tmp_path):
    """`--shards`: the families dealt round-robin over processes, each writing its rows beside `--out`,
    merged pass by pass in the sweep's order. Three types the sweep cannot build keep it short."""
    import argparse

    from benchmarks.generate_sweep import sharded
    from benchmarks.hf_sweep import architectures

    names = ["xlnet", "prophetnet", "longcat_flash"]  # no sequence limit; no num_hidden_layers; too large
    archs = {name: architectures()[name] for name in names}
    args = argparse.Namespace(shards=2, repeat=1, handoff="eager", fused="apart", device="cpu",
                              out=tmp_path / "sweep.json", balance=None, deadline=None)
    result = sharded(archs, args)
    assert [row["model_type"] for row in result["rows"]] == names
    assert [outcome(row) for row in result["rows"]] == ["not built"] * 3, result["rows"]
    assert result["env"]["shard_exit_codes"] == [0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.shard0.json", "sweep.shard1.json"]


def test_balance_deals_the_longest_first_to_the_least_loaded_and_a_deadline_keeps_what_ran(tmp_path):
    """`--balance`: a previous run's seconds per type, longest first onto the share with the fewest
    (a type it lacks counts as their mean); `--deadline`: shards cut off, the types they did not reach named."""
    import argparse
    import json

    from benchmarks.generate_sweep import deal, sharded
    from benchmarks.hf_sweep import architectures

    previous = tmp_path / "previous.json"
    previous.write_text(json.dumps({"rows": [{"model_type": n, "seconds": s}
                                             for n, s in (("a", 10), ("b", 7), ("c", 5), ("d", 4))]}))
    # a 10 -> 0; b 7 -> 1; e 6.5 (the mean) -> 1 (7 < 10); c 5 -> 0 (10 < 13.5); d 4 -> 1 (13.5 < 15)
    assert deal(["a", "b", "c", "d", "e"], 2, previous) == [["a", "c"], ["b", "e", "d"]]
    assert deal(["a", "b", "c"], 2, None) == [["a", "c"], ["b"]]

    names = ["xlnet", "prophetnet"]  # no shard imports torch in no time: both are cut off before a row
    args = argparse.Namespace(shards=2, repeat=1, handoff="eager", fused="apart", device="cpu",
                              out=tmp_path / "sweep.json", balance=None, deadline=0.0)
    with pytest.raises(SystemExit, match=r"no shard wrote its rows \(exit codes \['cut off after 0 s', 'cut off"):
        sharded({name: architectures()[name] for name in names}, args)

"""The byte tokenizer, and the standard-library corpus: its held-out split and prompts."""

import json

import pytest
import torch

from models.text import (BOS, EOS, HELD_OUT, VOCAB, corpus, decode, encode, is_held_out, load_prompts, make_prompts,
                         stdlib_files)


@pytest.fixture(scope="module")
def files():
    return stdlib_files()


@pytest.mark.parametrize("text", ["", "def f(x):\n    return x\n", "naïve → ✓ \x00\t", "日本語 🐍"])
def test_round_trip(text):
    ids = encode(text)
    assert ids[0] == BOS and all(0 <= i < 256 for i in ids[1:]) and len(ids) == 1 + len(text.encode())
    assert decode(ids) == text
    assert decode([*ids, EOS]) == text


def test_vocabulary_and_undecodable_bytes():
    assert (BOS, EOS, VOCAB) == (256, 257, 258)
    assert decode([BOS, 0x61, 0xFF, 0x62, EOS]) == "a\ufffdb"


def test_held_out_modules_exist_and_are_disjoint_from_training(files):
    rels = [rel for rel, _ in files]
    assert len(rels) > 500 and rels == sorted(rels)
    assert not any("site-packages" in rel.split("/") for rel in rels)
    for entry in HELD_OUT:  # every entry names something in this standard library
        assert any(is_held_out(rel) and (rel == entry or rel.startswith(entry)) for rel in rels), entry
    held = [rel for rel in rels if is_held_out(rel)]
    assert "json/decoder.py" in held and "csv.py" in held
    assert not is_held_out("json_helpers.py") and not is_held_out("test/test_json/test_decode.py")


def test_corpus_splits_every_file_once(files):
    train, held_out = corpus()
    assert train.dtype == held_out.dtype == torch.int16
    held_files = [p for rel, p in files if is_held_out(rel)]
    train_files = [p for rel, p in files if not is_held_out(rel)]
    assert int((held_out == BOS).sum()) == int((held_out == EOS).sum()) == len(held_files) > 0
    assert int((train == BOS).sum()) == len(train_files)
    assert held_out.numel() == sum(p.stat().st_size + 2 for p in held_files)
    assert train.numel() == sum(p.stat().st_size + 2 for p in train_files)
    assert 0.01 < held_out.numel() / (train.numel() + held_out.numel()) < 0.05
    first = held_files[0].read_bytes()  # held-out files in path order, each BOS + bytes + EOS
    assert held_out[: len(first) + 2].tolist() == [BOS, *first, EOS]


def test_prompts_are_deterministic_def_lines_from_held_out_modules(files, tmp_path):
    prompts = make_prompts(n=16)
    assert prompts == make_prompts(n=16) and len(prompts) == 16
    assert len({p["path"] for p in prompts}) > 3
    sources = dict(files)
    for p in prompts:
        assert is_held_out(p["path"])
        text = p["text"]
        assert 150 <= len(text.encode()) <= 400
        last = text.splitlines()[-1]
        assert last.lstrip().startswith("def ") and last.rstrip().endswith(":") and text.endswith("\n")
        source = sources[p["path"]].read_text()
        assert text in source and source.splitlines()[p["line"] - 1] == last
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    assert load_prompts(tmp_path / "prompts.json") == [p["text"] for p in prompts]

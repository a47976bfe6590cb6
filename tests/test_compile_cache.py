"""specpass's compile cache (specpass/compile_cache.py, issue 35): a second process compiling the same
step loads specpass's rewrite and hits torch's AOTAutograd and FX graph caches; a changed option or
graph misses; an unreadable, foreign or tampered entry is ignored with a warning, never loaded, and
the step still computes what eager computes."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specpass

ROOT = Path(__file__).resolve().parents[1]


class Step(torch.nn.Module):
    """A catch-up in miniature: a KV write on every row, the logits of the last row only, softmax then
    max: both the live-row and the arg-max rewrites fire."""

    def __init__(self, activation=torch.relu):
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.head, self.activation = torch.nn.Linear(16, 16), torch.nn.Linear(16, 32), activation

    def forward(self, x, cache, pos):
        h = self.proj(x)
        cache.index_copy_(0, pos, h)
        return torch.softmax(self.head(self.activation(h))[-1:], -1).max(-1)


def inputs(rows=4):
    torch.manual_seed(1)
    return torch.randn(rows, 16), torch.zeros(8, 16), torch.arange(rows)


def eager(step, rows=4):
    with torch.no_grad():
        return step(*inputs(rows))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPASS_CACHE", "1")  # conftest turns it off for the rest of the suite
    monkeypatch.setenv("SPECPASS_CACHE_DIR", str(tmp_path))
    return tmp_path


def compiled(step, caplog, rows=4, **options):
    """Compile and run `step` afresh (Dynamo reset), the steps handed off eagerly; the messages specpass
    logged and the output."""
    torch._dynamo.reset()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="specpass"), torch.no_grad():
        out = torch.compile(step, backend=specpass.backend(handoff="eager", **options))(*inputs(rows))
    return [r.getMessage() for r in caplog.records if r.name == "specpass"], out


def loaded(messages):
    return any("rewrite loaded from the compile cache" in m for m in messages)


def entries(directory):
    return sorted(directory.rglob("*.pt"))


def assert_same(out, expected):
    torch.testing.assert_close(out.values, expected.values)
    assert torch.equal(out.indices, expected.indices)


CHILD = """
import json, logging, torch
from torch._dynamo.utils import counters
import specpass
from tests.test_compile_cache import Step, inputs

class Messages(logging.Handler):
    seen = []
    def emit(self, record):
        self.seen.append(record.getMessage())

logging.getLogger("specpass").addHandler(Messages())
logging.getLogger("specpass").setLevel(logging.INFO)
with torch.no_grad():
    out = torch.compile(Step(), backend=specpass.backend())(*inputs())
print(json.dumps({"messages": Messages.seen, "inductor": dict(counters["inductor"]),
                  "aot": dict(counters["aot_autograd"]), "values": out.values.tolist(),
                  "indices": out.indices.tolist()}))
"""


def test_a_second_process_hits_specpass_and_torch_caches(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECPASS_CACHE": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
           "SPECPASS_CACHE_DIR": str(tmp_path / "specpass"), "OMP_NUM_THREADS": "1"}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert any("rewrite stored in the compile cache" in m for m in first["messages"])
    assert not loaded(first["messages"]) and first["inductor"].get("fxgraph_cache_hit", 0) == 0
    assert loaded(second["messages"])
    assert any("[live_rows] rewrote" in m and "[argmax] rewrote" in m for m in second["messages"]), \
        "the stored report is logged as the rewrite's"
    assert second["inductor"].get("fxgraph_cache_hit", 0) + second["aot"].get("autograd_cache_hit", 0) >= 1
    assert second["aot"].get("autograd_cache_hit", 0) == 1, "the rebuilt graph is the module Inductor got first"
    expected = eager(Step())
    assert second["indices"] == expected.indices.tolist()
    torch.testing.assert_close(torch.tensor(second["values"]), expected.values)


def test_same_graph_and_options_hit_in_process(cache_dir, caplog):
    messages, first = compiled(Step(), caplog)
    assert not loaded(messages) and len(entries(cache_dir)) == 1
    messages, again = compiled(Step(), caplog)
    assert loaded(messages)
    assert_same(again, eager(Step()))
    assert_same(first, eager(Step()))


@pytest.mark.parametrize("change", ["option", "graph", "shape"])
def test_a_changed_option_or_graph_misses(cache_dir, caplog, change):
    compiled(Step(), caplog)
    step, rows, options = Step(), 4, {}
    if change == "option":
        options = {"argmax": False}
    elif change == "graph":
        step = Step(activation=torch.sigmoid)
    else:
        rows = 3
    messages, out = compiled(step, caplog, rows=rows, **options)
    assert not loaded(messages)
    assert len(entries(cache_dir)) == 2
    assert_same(out, eager(step, rows))


def test_caching_off_writes_nothing(cache_dir, caplog, monkeypatch):
    monkeypatch.setenv("SPECPASS_CACHE", "0")
    compiled(Step(), caplog)
    messages, _ = compiled(Step(), caplog)
    assert not loaded(messages) and entries(cache_dir) == []


def test_a_corrupted_entry_is_ignored_with_a_warning_and_replaced(cache_dir, caplog):
    compiled(Step(), caplog)
    entry, = entries(cache_dir)
    entry.write_bytes(b"\x00garbage" * 100)
    with pytest.warns(specpass.SpecpassWarning, match="ignored a compile cache entry.*cannot be read"):
        messages, out = compiled(Step(), caplog)
    assert not loaded(messages)
    assert_same(out, eager(Step()))
    messages, _ = compiled(Step(), caplog)
    assert loaded(messages), "the entry was written again"


def test_a_foreign_entry_is_ignored_with_a_warning(cache_dir, caplog):
    compiled(Step(), caplog)
    relu_entry, = entries(cache_dir)
    sigmoid = Step(activation=torch.sigmoid)
    compiled(sigmoid, caplog)
    sigmoid_entry, = [e for e in entries(cache_dir) if e != relu_entry]
    sigmoid_entry.write_bytes(relu_entry.read_bytes())  # a valid entry, of the relu graph's key
    with pytest.warns(specpass.SpecpassWarning, match="not written for this graph"):
        messages, out = compiled(sigmoid, caplog)
    assert not loaded(messages)
    assert_same(out, eager(sigmoid))


def test_a_tampered_entry_is_ignored_with_a_warning(cache_dir, caplog):
    compiled(Step(), caplog)
    path, = entries(cache_dir)
    entry = torch.load(path, weights_only=True)
    assert "aten.relu.default" in entry["nodes"]
    entry["nodes"] = entry["nodes"].replace("aten.relu.default", "aten.sigmoid.default")  # its key and digest kept
    torch.save(entry, path)
    with pytest.warns(specpass.SpecpassWarning, match="fails its digest"):
        messages, out = compiled(Step(), caplog)
    assert not loaded(messages)
    assert_same(out, eager(Step()))  # relu's values: the sigmoid graph was not run


PRECOMPILE = """
import json, logging, sys, torch
from torch._dynamo.utils import counters
import specpass
from tests.test_compile_cache import Step, inputs

class Messages(logging.Handler):
    seen = []
    def emit(self, record):
        self.seen.append(record.getMessage())

def step_of(model, x, cache, pos):
    return model(x, cache, pos)

logging.getLogger("specpass").addHandler(Messages())
logging.getLogger("specpass").setLevel(logging.INFO)
torch.set_grad_enabled(False)  # a grad-mode guard: saved and loaded under the same mode
step, path = Step(), sys.argv[2]
if sys.argv[1] == "save":
    fn = torch.compile(step_of, backend=specpass.backend(), fullgraph=True).aot_compile(((step, *inputs()), {}))
    fn.save_compiled_function(path, external_data={"model": step})
else:
    with open(path, "rb") as f:
        fn = torch.compiler.load_compiled_function(f, external_data={"model": step})
x, cache, pos = inputs()
out = fn(step, x, cache, pos)
print(json.dumps({"messages": Messages.seen, "captured": counters["stats"]["calls_captured"],
                  "values": out.values.tolist(), "indices": out.indices.tolist(), "cache": cache.tolist()}))
"""


@pytest.mark.skipif(not hasattr(torch.compiler, "load_compiled_function"), reason="torch without precompile")
def test_torch_precompile_saves_the_rewritten_step_and_a_new_process_loads_it_without_dynamo(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "OMP_NUM_THREADS": "1"}
    runs = {}
    for mode in ("save", "load"):
        done = subprocess.run([sys.executable, "-c", PRECOMPILE, mode, str(tmp_path / "step.bin")], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    saved, loaded_run = runs["save"], runs["load"]
    assert any("[live_rows] rewrote" in m and "[argmax] rewrote" in m for m in saved["messages"])
    assert saved["captured"] > 0
    assert loaded_run["captured"] == 0 and loaded_run["messages"] == [], "no Dynamo, no specpass: the artifact runs"
    step = Step()
    x, cache, pos = inputs()
    with torch.no_grad():
        expected = step(x, cache, pos)
    assert loaded_run["indices"] == expected.indices.tolist()
    torch.testing.assert_close(torch.tensor(loaded_run["values"]), expected.values)
    assert cache.abs().sum() > 0
    torch.testing.assert_close(torch.tensor(loaded_run["cache"]), cache)  # the loaded step writes the KV cache too

"""Tensor parallel: functional collectives are row-local, so the live-row gather moves above the
all-reduces of o_proj and down_proj and the all-gather of a vocabulary-parallel lm_head; a
collective that gathers or scatters along a selected axis is left alone, with the reason.

Graphs are captured on a fake process group of 2 ranks (this process is rank 0). The numerics run
on 2 gloo processes (`benchmarks/catchup_tp.py`'s `check`, which that script also runs on 2 GPUs):
on each rank the compiled TP catch-up step equals, in its outputs and its K/V caches, the TP step
run unrewritten and the single-process step of the same full weights."""

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

import specpass
from benchmarks.catchup_tp import check, collective_bytes, small_step
from models import zoo
from models.tp import tensor_parallel
from specpass.tensor_parallel import gather_last, parallelize
from specpass.testing import graph_str

B, T, S, H, V = 3, 4, 16, 8, 12  # B, T and S as in small_step
LIVE = torch.tensor([3, 0, 2])
MESH = None  # a device mesh over the fake group, for the DTensor spellings


@pytest.fixture(scope="module")
def group():
    global MESH
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    MESH = DeviceMesh("cpu", [0, 1])  # for the DTensor spellings
    yield dist.group.WORLD
    dist.destroy_process_group()


def collectives(gm):
    """(op, shape) of each collective of a captured graph, in order (waits left out)."""
    return [(n.target.overloadpacket.__name__, list(n.meta["val"].shape)) for n in gm.graph.nodes
            if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "_c10d_functional"
            and n.target.overloadpacket.__name__ != "wait_tensor"]


def _tp_head(name, group):
    model = tensor_parallel(zoo.build(name), group)
    model.setup_caches(B, S)
    return model


class TPDraft(torch.nn.Module):
    """A one-layer catch-up step small enough to print, this rank's shard of it (torch's plan, run
    on local shards by models/tp.py): half the K and Q columns, a row-parallel o_proj, a
    vocabulary-parallel lm_head."""

    def __init__(self, group):
        super().__init__()
        torch.manual_seed(0)
        self.wk, self.wq, self.o_proj = (torch.nn.Linear(H, H, bias=False) for _ in range(3))
        self.lm_head = torch.nn.Linear(H, V, bias=False)
        parallelize(self, group, {"wk": ColwiseParallel(), "wq": ColwiseParallel(), "o_proj": RowwiseParallel(),
                                  "lm_head": ColwiseParallel(output_layouts=Replicate())})
        self.register_buffer("cache", torch.zeros(B, S, H // 2))

    def forward(self, x, pos, live):  # x: [B, T, H]; pos: [T], the cache slots of the T rows
        self.cache.index_copy_(1, pos, self.wk(x))
        mask = torch.arange(S) <= pos[:, None]
        a = F.scaled_dot_product_attention(self.wq(x), self.cache, self.cache, attn_mask=mask)
        h = x + self.o_proj(a)
        return self.lm_head(F.rms_norm(h, (H,)))[torch.arange(x.shape[0]), live]


class TestGraphs(expecttest.TestCase):
    @pytest.fixture(autouse=True)
    def _group(self, group):
        self.group = group

    def test_tp_draft(self):
        """The gather lands after the KV write: the all-reduce of o_proj and the all-gather of the
        lm_head carry the live row of each request only."""
        gm = specpass.capture(TPDraft(self.group), torch.randn(B, T, H), torch.arange(T) + S - T, LIVE)
        result = specpass.rewrite(gm, argmax=False)
        self.assertExpectedInline(graph_str(result.graph_module), """\
cache: f32[3, 16, 4]
wk_weight: f32[4, 8]
x: f32[3, 4, 8]
pos: i64[4]
wq_weight: f32[4, 8]
o_proj_weight: f32[8, 4]
lm_head_weight: f32[6, 8]
live: i64[3]
arange_start_step: i64[3] = arange.start_step(0, 3, 1, dtype=i64, device=cpu)
unsqueeze_default_1: i64[3, 1] = unsqueeze(arange_start_step, 1)
unsqueeze_default: i64[3, 1] = unsqueeze(live, 1)
linear: f32[3, 4, 4] = linear(x, wk_weight)
index_copy_: f32[3, 16, 4] = index_copy_(cache, 1, pos, linear)
arange: i64[16] = arange(16, device=cpu, pin_memory=False)
unsqueeze: i64[4, 1] = unsqueeze(pos, 1)
le: b8[4, 16] = le.Tensor(arange, unsqueeze)
x_rows: f32[3, 1, 8] = index.Tensor(x, [unsqueeze_default_1, unsqueeze_default])
linear_1: f32[3, 1, 4] = linear(x_rows, wq_weight)
expand_default: b8[3, 4, 16] = expand(le, [3, 4, 16])
le_rows: b8[3, 1, 16] = index.Tensor(expand_default, [unsqueeze_default_1, unsqueeze_default])
scaled_dot_product_attention: f32[3, 1, 4] = scaled_dot_product_attention(linear_1, index_copy_, index_copy_, le_rows)
linear_2: f32[3, 1, 8] = linear(scaled_dot_product_attention, o_proj_weight)
all_reduce: f32[3, 1, 8] = _c10d_functional.all_reduce(linear_2, 'sum', '0')
wait_tensor: f32[3, 1, 8] = _c10d_functional.wait_tensor(all_reduce)
add: f32[3, 1, 8] = add.Tensor(x_rows, wait_tensor)
rms_norm: f32[3, 1, 8] = rms_norm(add, [8])
linear_3: f32[3, 1, 6] = linear(rms_norm, lm_head_weight)
unsqueeze_1: f32[1, 3, 1, 6] = reshape(linear_3, [1, 3, 1, 6])
all_gather_into_tensor: f32[2, 3, 1, 6] = _c10d_functional.all_gather_into_tensor(unsqueeze_1, 2, '0')
wait_tensor_1: f32[2, 3, 1, 6] = _c10d_functional.wait_tensor(all_gather_into_tensor)
movedim: f32[3, 1, 2, 6] = movedim.int(wait_tensor_1, 0, -2)
flatten: f32[3, 1, 12] = reshape(movedim, [3, 1, 12])
index: f32[3, 12] = reshape(flatten, [3, 12])
return (index,)""")
        self.assertExpectedInline(str(result.report), """\
specpass: 1 rewrite(s), 0 left alone; graph matmul FLOPs 6.53K -> 2.21K, 2.96x fewer
  [live_rows] rewrote index: 11 ops run on the selected rows only; gathered after x (a graph input); le (needed in full by scaled_dot_product_attention) (rows 12 -> 3; matmul FLOPs 5.76K -> 1.44K)""")

    def test_llama_draft_last_layer_collectives_carry_live_rows(self):
        """Two layers: the first layer's collectives feed the second layer's K/V (every row); the
        last layer's and the lm_head's carry the live rows."""
        model = _tp_head("tiny-llama-draft", self.group)
        result = specpass.rewrite(specpass.capture(model.catch_up, *small_step(model)))
        assert collectives(result.graph_module) == [
            ("all_reduce", [B, T, 64]), ("all_reduce", [B, T, 64]),
            ("all_reduce", [B, 1, 64]), ("all_reduce", [B, 1, 64]), ("all_gather_into_tensor", [2, B, 1, 128])]

    def test_all_reduce_bytes_drop_by_T(self):
        model = _tp_head("tiny-llama-eagle3", self.group)
        gm = specpass.capture(model.catch_up, *small_step(model))
        before, after = collective_bytes(gm), collective_bytes(specpass.rewrite(gm).graph_module)
        assert before == {"all_reduce": 2 * B * T * 64 * 4, "all_gather_into_tensor": B * T * 96 * 4}
        assert after == {name: size // T for name, size in before.items()}

    def test_one_request_collectives_carry_its_live_row(self):
        """bs 1: the hidden state's gather (x[arange(1), live]) and the logits' (read through the
        lm_head's gathered axes) are one selection, so both move above the collectives."""
        model = tensor_parallel(zoo.build("tiny-llama-eagle3"), self.group)
        model.setup_caches(1, S)
        tokens, positions, hidden, live = small_step(model)
        gm = specpass.capture(model.catch_up, tokens[:1], positions[:1], hidden[:1], live[:1])
        result = specpass.rewrite(gm)
        assert collectives(result.graph_module) == [
            ("all_reduce", [1, 1, 64]), ("all_reduce", [1, 1, 64]), ("all_gather_into_tensor", [2, 1, 1, 48])]
        assert str(result.report).startswith("specpass: 1 rewrite(s), 0 left alone")


# --- one collective after a projection, in each spelling; then the live rows


def last(x):
    return x[:, -1]


def per_request(x):
    return x[torch.arange(x.shape[0]), LIVE.repeat(x.shape[0] // B)]  # every rank's requests, once gathered


def project(x):
    return x @ torch.ones(H, H)  # [B, T, H]


def all_reduce(x, select):
    return select(funcol.all_reduce(project(x), "sum", dist.group.WORLD))


def gather_vocab_funcol(x, select):
    """funcol's gather_dim=-1: all_gather along the request axis, then chunk and cat."""
    return select(funcol.all_gather_tensor(project(x), -1, dist.group.WORLD))


def gather_vocab_leading(x, select):
    """models/tp.py's spelling: all_gather along a new leading axis, moved next to the last."""
    return select(gather_last(project(x), dist.group.WORLD))


def scatter_hidden(x, select):
    """A reduce-scatter of the hidden axis: a row-parallel output that stays sharded."""
    return select(funcol.reduce_scatter_tensor(project(x), "sum", -1, dist.group.WORLD))


def gather_requests(x, select):
    return select(funcol.all_gather_tensor(project(x), 0, dist.group.WORLD))


def gather_flat_tokens(x, select):
    """Sequence parallel on flat token rows [B * T, H]: the gather runs along the tokens."""
    flat = funcol.all_gather_tensor(project(x).flatten(0, 1), 0, dist.group.WORLD)
    return select(flat.unflatten(0, (-1, T)))


def scatter_flat_tokens(x, select):
    flat = funcol.reduce_scatter_tensor(project(x).flatten(0, 1).repeat(2, 1), "sum", 0, dist.group.WORLD)
    return select(flat.unflatten(0, (-1, T)))


def scatter_tokens(x, select):
    """Sequence parallel: each rank keeps a block of the tokens, funcol's chunk + cat before the scatter."""
    return select(funcol.reduce_scatter_tensor(project(x).repeat(1, 2, 1), "sum", 1, dist.group.WORLD))


def dtensor_reduce(x, select):
    y = DTensor.from_local(project(x), MESH, [Partial()], run_check=False)
    return select(y.redistribute(MESH, [Replicate()]).to_local())


def dtensor_gather_vocab(x, select):
    y = DTensor.from_local(project(x), MESH, [Shard(2)], run_check=False)
    return select(y.redistribute(MESH, [Replicate()]).to_local())


def late_wait(x, select):
    """A wait issued later than its collective (overlapped by hand) stays, and so does the collective."""
    reduced = torch.ops._c10d_functional.all_reduce(project(x), "sum", dist.group.WORLD.group_name)
    other = project(x) * 2
    return select(torch.ops._c10d_functional.wait_tensor(reduced) + other)


def in_place(x, select):
    y = project(x)
    dist.all_reduce(y)
    return select(y)


@pytest.mark.parametrize("step, select, shapes", [
    (all_reduce, per_request, [("all_reduce", [B, 1, H])]),
    (gather_vocab_leading, per_request, [("all_gather_into_tensor", [2, B, 1, H])]),
    (gather_vocab_funcol, last, [("all_gather_into_tensor", [2 * B, 1, H])]),
    (scatter_hidden, last, [("reduce_scatter_tensor", [B, 1, H // 2])]),
    (scatter_tokens, last, [("reduce_scatter_tensor", [B, 1, H])]),  # each rank's own last token
    (gather_requests, last, [("all_gather_into_tensor", [2 * B, 1, H])]),
    (dtensor_reduce, per_request, [("all_reduce", [B, 1, H])]),
    (in_place, per_request, [("all_reduce", [B, 1, H])]),  # dist.all_reduce(y): y a new value, not a write
    (dtensor_gather_vocab, last, [("all_gather_into_tensor", [2 * B, 1, H])]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_collective_carries_the_selected_rows(group, step, select, shapes):
    result = specpass.rewrite(specpass.capture(lambda x: step(x, select), torch.randn(B, T, H)), argmax=False)
    assert [f.fired for f in result.report.of("live_rows")] == [True], str(result.report)
    assert collectives(result.graph_module) == shapes


@pytest.mark.parametrize("step, select, reason", [
    (gather_flat_tokens, last, "all_gather_into_tensor gathers along axis 0 across ranks, the selection's token "
                               "axis: the rows it picks there are not only this rank's"),
    (scatter_flat_tokens, last, "reduce_scatter_tensor scatters along axis 0 across ranks, the selection's token axis"),
    (gather_requests, per_request, "all_gather_into_tensor gathers along axis 0 across ranks, the selection's "
                                   "request axis"),
    (scatter_hidden, per_request, "reduce_scatter_tensor scatters along axis 0 across ranks, the selection's "
                                  "request axis"),
    (gather_vocab_funcol, per_request, "chunk mixes rows along axis 0"),  # funcol's chunk + cat along the requests
    (late_wait, per_request, "wait_tensor does not directly follow its collective all_reduce as its only user"),
], ids=lambda v: getattr(v, "__name__", ""))
def test_collective_along_a_selected_axis_is_left_alone(group, step, select, reason):
    gm = specpass.capture(lambda x: step(x, select), torch.randn(B, T, H))
    result = specpass.rewrite(gm, argmax=False)
    assert reason in str(result.report), str(result.report)
    assert collectives(result.graph_module) == collectives(gm)  # every row, as before
    for wait in result.graph_module.graph.find_nodes(op="call_function",
                                                     target=torch.ops._c10d_functional.wait_tensor.default):
        assert wait.args[0].target.namespace == "_c10d_functional"  # it waits for the collective, not a gather


def test_a_shard_is_built_without_the_whole_model(group):
    """zoo.build(shard=): the plan runs on the meta device, then the shard alone is materialised (a 70B
    target at TP 4 never allocates its 140 GB): the shapes of sharding the built model."""
    seen = []

    def shard(model):
        seen.extend(p.device.type for p in model.parameters())
        return tensor_parallel(model, group)

    for name in ("tiny-llama", "tiny-llama-eagle3"):
        seen.clear()
        built = zoo.build(name, shard=shard)
        expected = dict(tensor_parallel(zoo.build(name), group).named_parameters())
        assert set(seen) == {"meta"}
        got = dict(built.named_parameters())
        assert {n: p.shape for n, p in got.items()} == {n: p.shape for n, p in expected.items()}
        assert {p.device.type for p in got.values()} == {"cpu"} and all(p.isfinite().all() for p in got.values())
        assert got["lm_head.weight"].shape[0] * 2 == zoo.build(name).lm_head.weight.shape[0]


# --- numerics: 2 processes


def _worker(rank, world, store_path):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    torch.set_num_threads(1)  # two processes on two cores
    try:  # Inductor's lowering of the collectives once; the rest rewritten and run as is (faster)
        for name, handoff in (("tiny-llama-eagle3", "inductor"), ("tiny-llama-draft", "eager")):
            check(name, dist.group.WORLD, "cpu", specpass.backend(handoff=handoff))
    finally:
        dist.destroy_process_group()


def test_numerics_on_two_processes(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=True)

"""EAGLE-3 catch-up step at tensor parallel 2: plain Inductor vs specpass, ms and collective bytes per step.

The Llama-3-8B-shaped head of benchmarks/catchup.py (hidden 4096, 32/8 heads, MLP 14336, draft
vocab 32000), bf16, KV cache 2048 per request, sharded by models/tp.py (torch's parallelize_module
plan, run on local shards): column-parallel q/k/v and gate/up, row-parallel o_proj and down_proj
(each all-reduced), a vocabulary-parallel lm_head (its logits all-gathered). Each step runs T rows per request, writes all their K/V and samples one live
row per request (a different one for each request).

Per batch size: ms per step of plain Inductor and specpass, each captured into one CUDA graph (as
catchup.py times them, median); the collective bytes per step, from the graph Inductor compiles
(the output sizes of its collectives) and from the profiler (the c10d collectives of one step run
without CUDA graphs: NCCL kernels and their message sizes); and the same two steps on rank 0 alone
(the unsharded head), for the single-GPU speedup.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m benchmarks.catchup_tp --out catchup_tp.json
    torchrun --nproc-per-node 2 -m benchmarks.catchup_tp --device cpu --quick    # gloo, a tiny head
    python -m benchmarks.catchup_tp --fake-world 2 --out catchup_tp_compute.json

--fake-world N runs one process as rank 0 of N on torch's fake process group, whose collectives
do nothing: the same TP graphs with communication free, so the times are one rank's compute
alone (no check of the outputs, which are not summed, and no profile). Against a real run on N
GPUs it splits a TP step into compute and communication.
"""

import argparse
import json
import math
import os
import pathlib
import tempfile

import torch
import torch.distributed as dist

import specpass
from benchmarks import harness
from benchmarks.catchup import step_ms
from models import zoo
from models.tp import tensor_parallel
from specpass.drafters.attention import Attention

_C10D = "_c10d_functional"


def collective_bytes(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Bytes per collective op of a captured graph: the sizes of their outputs (an all-gather's
    output is everything it gathered), summed per op."""
    sizes: dict[str, int] = {}
    for node in gm.graph.nodes:
        target = node.target  # an op overload: torch.ops.NAMESPACE.NAME.OVERLOAD
        if getattr(target, "namespace", None) == _C10D and hasattr(target, "overloadpacket") and \
                target.overloadpacket.__name__ != "wait_tensor":
            value = node.meta["val"]
            name = target.overloadpacket.__name__
            sizes[name] = sizes.get(name, 0) + value.numel() * value.element_size()
    return sizes


# c10d's dispatcher ops, which the profiler records with their shapes (the outputs first), by the
# functional collective they run
_PROFILED = {"c10d::allreduce_": "all_reduce", "c10d::_allgather_base_": "all_gather_into_tensor",
             "c10d::allgather_into_tensor_coalesced_": "all_gather_into_tensor",
             "c10d::_reduce_scatter_base_": "reduce_scatter_tensor",
             "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor"}


def profiled_collectives(fn, args, element_size: int) -> dict[str, int]:
    """One call of `fn` under the profiler: the bytes each collective wrote (its recorded output
    shape times the activations' element size), summed per op, and the count of NCCL kernels."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        fn(*args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name))["traceEvents"]
    found = {"nccl_kernels": sum(1 for e in events if e.get("cat") == "kernel" and "nccl" in e.get("name", "").lower())}
    for e in events:
        name = _PROFILED.get(e.get("name"))
        if name is not None and e.get("cat") == "cpu_op":
            outputs = e["args"]["Input Dims"][0]  # a tensor's dims, or a list of tensors' dims
            outputs = outputs if outputs and isinstance(outputs[0], list) else [outputs]
            found[name] = found.get(name, 0) + sum(map(math.prod, outputs)) * element_size
    return found


def step_inputs(config, B: int, T: int, cache: int, device, dtype, seed: int):
    """tokens, positions, hidden, live of one catch-up step: the same on every rank."""
    g = torch.Generator(device=device).manual_seed(seed)
    start = torch.randint(0, cache - T, (B, 1), device=device, generator=g)
    return (torch.randint(0, config.vocab_size, (B, T), device=device, generator=g),
            start + torch.arange(T, device=device),
            torch.randn(B, T, 3 * config.target_hidden_size, device=device, dtype=dtype, generator=g),
            torch.randint(0, T, (B,), device=device, generator=g))


def small_step(model, device="cpu"):
    """tokens, positions, hidden (None without an fc), live of a catch-up step of 3 requests of
    4 rows, at positions 2, 5 and 7 on (a 16-slot cache holds them): the same on every rank."""
    g = torch.Generator(device).manual_seed(0)
    positions = torch.tensor([2, 5, 7], device=device)[:, None] + torch.arange(4, device=device)
    tokens = torch.randint(0, model.config.vocab_size, positions.shape, generator=g, device=device)
    fc = getattr(model, "fc", None)
    hidden = None if fc is None else torch.randn(*positions.shape, fc.in_features, generator=g, device=device)
    return tokens, positions, hidden, torch.tensor([3, 0, 2], device=device)


def check(name: str, group: dist.ProcessGroup, device, backend) -> None:
    """On this rank, in fp32: the TP catch-up step compiled with `backend` equals the TP step run
    unrewritten (eager) and the single-device step of the same full weights, in its outputs and in
    this rank's K/V heads of the caches; specpass rewrote it. Raises AssertionError otherwise."""
    full = zoo.build(name, seed=3, device=device)
    tp = tensor_parallel(full, group)
    for model in (full, tp):
        model.setup_caches(3, 16)
    layers = [(full.get_submodule(n), m) for n, m in tp.named_modules() if isinstance(m, Attention)]
    g = torch.Generator(device).manual_seed(1)
    for layer, attn in layers:  # a random prefix in every cache; each rank holds its K/V heads of it
        for cache in ("k_cache", "v_cache"):
            getattr(layer, cache).normal_(generator=g)
            getattr(attn, cache).copy_(_heads(layer, attn, cache, group))
    args = small_step(full, device)
    start = _caches(tp)
    with torch.no_grad():
        single = full.catch_up(*args)
        eager = [t.clone() for t in tp.catch_up(*args)]
        eager_caches = _caches(tp)
        for key, value in start.items():
            tp.get_buffer(key).copy_(value)
        compiled = torch.compile(tp.catch_up, backend=backend, fullgraph=True, dynamic=False)(*args)
    for got, unrewritten, one_device in zip(compiled, eager, single):
        _close(got, unrewritten)
        _close(got, one_device)
    for key, value in _caches(tp).items():
        _close(value, eager_caches[key])
    for layer, attn in layers:
        for cache in ("k_cache", "v_cache"):
            _close(getattr(attn, cache), _heads(layer, attn, cache, group))
    report = specpass.explain(tp.catch_up, *args)
    assert len(report.rewrites) == 1 and not report.errors, str(report)


def _heads(layer, attn, cache: str, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's K/V heads of a full layer's cache [B, S, heads, d] (all of them when they are not
    sharded)."""
    parts = layer.n_kv_heads // attn.n_kv_heads
    return getattr(layer, cache).chunk(parts, 2)[dist.get_rank(group) * parts // dist.get_world_size(group)]


def _caches(model) -> dict[str, torch.Tensor]:
    return {name: b.clone() for name, b in model.named_buffers() if "cache" in name}


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def variants(head) -> dict:
    return {"inductor": torch.compile(head.catch_up, dynamic=False),
            "specpass": torch.compile(head.catch_up, backend=specpass, dynamic=False)}


def table(results: list[dict], world: int, fake: bool = False) -> str:
    """The markdown table of ms per step and collective MB per step."""
    lines = [f"TP = {world}{' with collectives free' if fake else ''}, T = {results[0]['tokens']}, CUDA graphs: "
             "ms per step; MB per step from the graph (the profiler's in brackets)",
             "| bs | Inductor | specpass | speedup | one GPU: speedup | all-reduce MB, Inductor | specpass | ratio | "
             "all-gather MB, Inductor | specpass | tokens as one GPU's |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        graph = {v: r[f"{v}_graph_bytes"] for v in ("inductor", "specpass")}
        profiled = {v: r.get(f"{v}_profiled", {}) for v in ("inductor", "specpass")}
        cells = [f"{r['tp_inductor_ms']:.3f}", f"{r['tp_specpass_ms']:.3f}",
                 f"{r['tp_inductor_ms'] / r['tp_specpass_ms']:.2f}x",
                 f"{r['single_inductor_ms'] / r['single_specpass_ms']:.2f}x"]
        for op in ("all_reduce", "all_gather_into_tensor"):
            cells += [f"{graph[v][op] / 1e6:.2f}" + (f" ({profiled[v][op] / 1e6:.2f})" if op in profiled[v] else "")
                      for v in ("inductor", "specpass")]
            if op == "all_reduce":
                cells.append(f"{graph['inductor'][op] / graph['specpass'][op]:.2f}x")
        cells.append(f"{r['specpass_argmax_agree']:.1%}" if "specpass_argmax_agree" in r else "-")
        lines.append(f"| {r['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.catchup_tp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--tokens", type=int, default=4, help="spec_num_tokens T")
    parser.add_argument("--cache", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="a tiny head: checks the script runs")
    parser.add_argument("--fake-world", type=int, metavar="N",
                        help="one process, rank 0 of N on a fake process group: the TP step's compute alone")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()

    cuda = args.device == "cuda"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
    fake = args.fake_world is not None
    if fake:
        harness.fake_process_group(args.fake_world)
    else:
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    processes = 1 if fake else world
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    say = print if rank == 0 else (lambda *a, **k: None)
    dtype = torch.float32 if args.quick else torch.bfloat16
    env = harness.environment(device, dtype)
    env["device"] = f"{processes} x {env['device']}"
    say(f"{harness.describe(env)}; TP = {world}{' (fake: collectives free)' if fake else ''}, T = {args.tokens}")
    harness.dynamo_limits(64)  # one compile per shape and variant
    checked = [] if fake else ["tiny-llama-eagle3", "tiny-llama-draft"] + ([] if args.quick else ["llama3-8b-eagle3"])
    for head in checked:
        check(head, dist.group.WORLD, device, specpass)
    if checked:
        say(f"checked, fp32, on every rank: {', '.join(checked)}: the specpass TP step's outputs and K/V caches "
            "equal the unrewritten TP step's and the single-device step's")

    if args.quick:
        config, args.batch, args.cache = zoo.config("tiny-llama-eagle3"), [2, 3], 64
    else:
        config = zoo.config("llama3-8b-eagle3")
    torch.set_grad_enabled(False)
    full = zoo.build(config, device=device, dtype=dtype)
    tp = tensor_parallel(full, dist.group.WORLD)
    T = args.tokens

    results, outputs = [], {}
    for B in args.batch:  # tensor parallel, both ranks
        inputs = step_inputs(config, B, T, args.cache, device, dtype, seed=B)
        row = {"batch": B, "tokens": T}
        tp.setup_caches(B, args.cache, device=device, dtype=dtype)
        steps = variants(tp)
        outputs[B] = {v: [t.clone() for t in fn(*inputs)] for v, fn in steps.items()}
        graph = specpass.capture(tp.catch_up, *inputs)
        rewritten = specpass.rewrite(graph)
        row["inductor_graph_bytes"] = collective_bytes(graph)
        row["specpass_graph_bytes"] = collective_bytes(rewritten.graph_module)
        for v, fn in steps.items():
            if not fake:
                row[f"{v}_profiled"] = profiled_collectives(fn, inputs, inputs[2].element_size())
        if cuda:
            for v, ms in step_ms(steps, inputs, args.iters, graph=True).items():
                row[f"tp_{v}_ms"] = ms
        results.append(row)
        say(json.dumps(row), flush=True)
        if args.out and rank == 0:  # partial results survive a time-out
            args.out.write_text(json.dumps(results, indent=1))
    tp.setup_caches(1, 1, device=device, dtype=dtype)  # frees the TP caches
    report = rewritten.report
    say(report)

    single = {}  # the unsharded head on one GPU alone, the batch sizes shared out among the ranks
    for B in args.batch[rank::processes]:
        inputs = step_inputs(config, B, T, args.cache, device, dtype, seed=B)
        full.setup_caches(B, args.cache, device=device, dtype=dtype)
        single[B] = {}
        if not fake:  # the TP steps against the single-GPU one (a fake group's outputs are not summed)
            reference = full.catch_up(*inputs)
            for v, (logits, hidden_out) in outputs[B].items():
                single[B][f"{v}_argmax_agree"] = (logits.argmax(-1) == reference[0].argmax(-1)).float().mean().item()
                single[B][f"{v}_max_err"] = max((logits.float() - reference[0].float()).abs().max().item(),
                                                (hidden_out.float() - reference[1].float()).abs().max().item())
        if cuda:
            for v, ms in step_ms(variants(full), inputs, args.iters, graph=True).items():
                single[B][f"single_{v}_ms"] = ms
    full.setup_caches(1, 1, device=device, dtype=dtype)
    shared = [single] if fake else [None] * world
    if not fake:
        dist.all_gather_object(shared, single)
    for row in results:
        for part in shared:
            row.update(part.get(row["batch"], {}))
    if rank == 0 and args.out:
        meta = {**env, "tp": world, "collectives_free": fake}
        args.out.write_text(json.dumps({**meta, "results": results, "report": str(report)}, indent=1))
    if cuda:
        say(table(results, world, fake))
    specpass.destroy_process_group()


if __name__ == "__main__":
    main()

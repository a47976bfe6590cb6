"""Cold start: the first call of `specpass.generate`, cut into the parts of compilation (issue 35).

    python -m benchmarks.cold_start --device cpu --threads 1 --out cold_start.json
    python -m benchmarks.cold_start --device cuda --dtype bfloat16 --out cold_start_gpu.json
    python -m benchmarks.cold_start --device cpu --threads 1 --compilers specpass --warm
    python -m benchmarks.cold_start --device cuda --dtype bfloat16 --compilers specpass transformers \
        --new-batch-sizes 3,1 --warm

`--pair width8b --layers N`: a transformers Llama of random weights at Llama-3-8B's width, N layers deep,
with a one-layer draft of that width (how the first call grows with depth; issue 46):

    python -m benchmarks.cold_start --device cuda --dtype bfloat16 --compilers specpass transformers \
        --pair width8b --layers 32 --prompts 4 --new-tokens 128

`--warm` runs each compiler a second time in another fresh process with the first one's caches
(torch's Inductor cache, and specpass's compile cache and saved steps, which live inside it): a user's
second run.

The shipped pair loaded by transformers (checkpoints/stdlib-llama and its standalone draft
stdlib-llama-draft), greedy, `--prompts` held-out prompts left-padded, `--new-tokens` per request, K
`--k`; the steps compiled apart on a CPU, as one fused round on a GPU (`--round`; generate's
defaults, CUDA graphs on a GPU). Each compiler ("specpass", plain "inductor", or "transformers":
the target's own `generate` with a static cache, which compiles its decoding step itself, the
issue's baseline; on a CPU too, mode "default") runs in a fresh process with an empty Inductor
cache, as a user's first run: one generate (the first call: it compiles every step), then the same
generate again (the second call), then, per `--new-batch-sizes`, a call at that many prompts (what
a new batch size costs after the first call) and the same call again (warm).

The parts come from torch's own compile timers (`dynamo_timed` regions, summed over every graph)
and specpass's `Report.seconds` (read from its log records), so that they add up to the first call:
  Dynamo            tracing bytecode and building guards (compile_inner less the backend)
  specpass ...      capturing the IR, then each pass: copy, rewrite, clean, fake-tensor propagation, checks
  backend, rest     the backend's time outside the parts named here (Inductor's pre-grad passes)
  AOTAutograd       functionalization and metadata (create_aot_dispatcher_function less Inductor's compiler)
  Inductor passes   joint-graph and post-grad passes (the compiler less lowering and code generation)
  Inductor lowering GraphLowering.run
  Inductor codegen  GraphLowering.codegen (scheduling, fusion, the kernels' source)
  kernels           compiling and loading the generated module (compile_to_module less codegen); the
                    C++/Triton compiler processes, in part inside codegen, are given apart ("compiler calls")
  CUDA-graph capture  recording the graphs on the first replay (GPU)
  outside compile   the first call's eager work: the generate itself, the model runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import resource
import sys
from pathlib import Path

from benchmarks import harness

CHECKPOINTS = harness.ROOT / "checkpoints"
TARGET, DRAFT = CHECKPOINTS / "stdlib-llama", CHECKPOINTS / "stdlib-llama-draft"
COMPILERS = ("specpass", "inductor", "transformers")


@dataclasses.dataclass(kw_only=True)
class ColdRow(harness.Row):
    """One compiler's first and second call; `parts`: seconds per part of the first call (see the module
    docstring), `specpass`: specpass's own seconds per report part, summed over the compiled graphs."""

    first_s: float
    first_cpu_s: float  # the first call's CPU time, this process's and its children's (the C++ compiler's)
    second_s: float
    new_batch_s: dict[str, list[float]]  # batch size -> [its first call, the same call again]
    graphs: int
    parts: dict[str, float]
    specpass: dict[str, float]
    compiler_calls_s: float


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--round", choices=["fused", "apart"], help="default: fused on a GPU, apart on a CPU")
    parser.add_argument("--pair", choices=["shipped", "width8b"], default="shipped",
                        help="width8b: a transformers Llama of random weights at Llama-3-8B's width, --layers deep, "
                             "with a one-layer draft of that width")
    parser.add_argument("--layers", type=int, default=8, help="width8b: the target's decoder layers")
    parser.add_argument("--compilers", nargs="+", choices=COMPILERS, default=["specpass", "inductor"])
    parser.add_argument("--new-batch-sizes", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                        help="after the second call, a call at each of these batch sizes, then again")
    parser.add_argument("--warm", action="store_true", help="also a second process with the first one's caches")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", choices=COMPILERS, help=argparse.SUPPRESS)  # one compiler, in this process
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(first_and_second_call(args, args.child)))
        return 0
    argv = argv if argv is not None else sys.argv[1:]
    command = " ".join(["python -m benchmarks.cold_start", *argv])
    rows, save = [], harness.saver(args.out)
    for compiler in args.compilers:
        for row in harness.in_fresh_processes("benchmarks.cold_start", argv, compiler, runs=2 if args.warm else 1):
            rows.append({**row, "command": command})
            save(rows)
    print(table(rows))
    return 0


def first_and_second_call(args: argparse.Namespace, compiler: str) -> dict:
    import torch
    from transformers import CompileConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    import specpass
    from benchmarks.hf_generate import left_padded
    from models.text import encode, load_prompts

    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    def hf(path):
        return LlamaForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()

    model, draft = (hf(TARGET), hf(DRAFT)) if args.pair == "shipped" else (random_llama(args.layers, device, dtype),
                                                                           random_llama(1, device, dtype))
    texts = load_prompts()
    fused = None if args.round is None else args.round == "fused"
    ours = SpecpassSeconds()
    # transformers compiles generate's decoding step on GPUs only unless told to everywhere
    static = CompileConfig(mode="reduce-overhead" if device.type == "cuda" else "default")
    static._compile_all_devices = True  # its own switch for devices other than GPUs

    def call(batch: int) -> float:
        ids, mask = left_padded(torch, [encode(texts[i % len(texts)]) for i in range(batch)], device)
        start = harness.now(device)
        if compiler == "transformers":
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                               pad_token_id=0, cache_implementation="static", compile_config=static)
        else:
            specpass.generate(model, ids, attention_mask=mask, assistant_model=draft,
                              max_new_tokens=args.new_tokens, num_assistant_tokens=args.k, compile=compiler,
                              fused_round=fused)
        return harness.now(device) - start

    cpu = cpu_seconds()
    first = call(args.prompts)
    first_cpu = cpu_seconds() - cpu
    torch_seconds = harness.compile_seconds()
    second = call(args.prompts)
    new_batch = {str(batch): [call(batch), call(batch)] for batch in args.new_batch_sizes}
    env = harness.environment(device, dtype, threads=torch.get_num_threads(), pair=args.pair,
                              layers=args.layers if args.pair == "width8b" else None)
    return ColdRow(env=env, variant=compiler, first_s=first, first_cpu_s=first_cpu, second_s=second,
                   new_batch_s=new_batch, graphs=harness.graphs_compiled(),
                   parts=parts(first, torch_seconds, ours.by_part),
                   specpass=dict(ours.by_part), compiler_calls_s=torch_seconds.get("compile_file", 0.0)).asdict()


def random_llama(layers: int, device, dtype):
    """A transformers Llama at Llama-3-8B's width (hidden 4096, 32/8 heads, MLP 14336, vocabulary 128256) with
    random weights, `layers` deep: a first call's compile at a real model's width, without its weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                         rope_theta=500000.0, attn_implementation="sdpa", bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype).eval()


def cpu_seconds() -> float:
    """User and system CPU seconds of this process and its finished children: unlike wall time, not
    stretched by other work on a shared machine."""
    return sum(sum(resource.getrusage(who)[:2]) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


class SpecpassSeconds(logging.Handler):
    """specpass's `Report.seconds` of every graph it compiles from here on, summed per part."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.by_part: dict[str, float] = {}
        logger = logging.getLogger("specpass")
        logger.addHandler(self)
        logger.setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        report = getattr(record, "report", None)
        for part, seconds in (report.seconds if report is not None else {}).items():
            self.by_part[part] = self.by_part.get(part, 0.0) + seconds


def parts(first: float, torch_seconds: dict[str, float], ours: dict[str, float]) -> dict[str, float]:
    """The first call's seconds cut into parts that add up to it (see the module docstring)."""
    t = lambda name: torch_seconds.get(name, 0.0)  # noqa: E731
    per_pass: dict[str, float] = {}
    for part, seconds in ours.items():
        name = part.partition("/")[0]
        per_pass[f"specpass {name}"] = per_pass.get(f"specpass {name}", 0.0) + seconds
    inductor = t("compile_fx.<locals>.fw_compiler_base")
    cudagraphs = t("CUDAGraphNode.record")
    return {
        "Dynamo": t("_compile.compile_inner") - t("OutputGraph.call_user_compiler"),
        **per_pass,
        "backend, rest": t("OutputGraph.call_user_compiler") - sum(ours.values()) - t("create_aot_dispatcher_function"),
        "AOTAutograd": t("create_aot_dispatcher_function") - inductor,
        "Inductor passes": inductor - t("GraphLowering.run") - t("GraphLowering.compile_to_module"),
        "Inductor lowering": t("GraphLowering.run"),
        "Inductor codegen": t("GraphLowering.codegen"),
        "kernels": t("GraphLowering.compile_to_module") - t("GraphLowering.codegen"),
        "CUDA-graph capture": cudagraphs,
        "outside compile": first - t("_compile.compile_inner") - cudagraphs,
    }


def table(rows: list[dict]) -> str:
    """Seconds per part, one column per compiler; then the first and second calls and specpass's share."""
    names = list(dict.fromkeys(name for row in rows for name in row["parts"]))
    head = f"| part | {' | '.join(row['variant'] + ' s' for row in rows)} |"
    lines = [head, "|---" * (len(rows) + 1) + "|"]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{row['parts'].get(name, 0.0):.2f}" for row in rows) + " |")
    for label, key in (("compiler calls (in kernels, codegen)", "compiler_calls_s"), ("**first call**", "first_s"),
                       ("first call, CPU time", "first_cpu_s"),
                       ("second call", "second_s"), ("graphs compiled", "graphs")):
        lines.append(f"| {label} | " + " | ".join(_cell(row[key]) for row in rows) + " |")
    for batch in dict.fromkeys(b for row in rows for b in row["new_batch_s"]):
        for i, label in enumerate((f"new batch size {batch}", f"bs {batch} again")):
            lines.append(f"| {label} | " + " | ".join(_cell(row["new_batch_s"][batch][i]) if batch in row["new_batch_s"]
                                                       else "-" for row in rows) + " |")
    by_variant = {row["variant"]: row for row in rows}
    for compiler in COMPILERS:
        if compiler in by_variant and f"{compiler}, warm" in by_variant:
            lines.append(f"\n{compiler}: a second process, caches warm, first call {by_variant[compiler + ', warm']['first_s']:.1f} s "
                         f"(cold {by_variant[compiler]['first_s']:.1f} s)")
    if {"specpass", "transformers"} <= set(by_variant):
        ours, theirs = by_variant["specpass"], by_variant["transformers"]
        lines.append(f"\nspecpass first call {ours['first_s']:.1f} s vs transformers' static-cache generate "
                     f"{theirs['first_s']:.1f} s: {ours['first_s'] / theirs['first_s']:.2f}x")
    if {"specpass", "inductor"} <= set(by_variant):
        ours, plain = by_variant["specpass"], by_variant["inductor"]
        own = sum(ours["specpass"].values())
        lines.append(f"\nspecpass first call {ours['first_s']:.1f} s vs plain Inductor {plain['first_s']:.1f} s "
                     f"({ours['first_s'] / plain['first_s'] - 1:+.1%}); specpass's own work {own:.1f} s "
                     f"({own / plain['first_s']:.1%} of plain Inductor's first call)")
        steps: dict[str, float] = {}
        for part, seconds in ours["specpass"].items():
            step = part.partition("/")[2] or part
            steps[step] = steps.get(step, 0.0) + seconds
        lines.append("specpass's own work by step, all passes: "
                     + ", ".join(f"{step} {s:.2f}" for step, s in sorted(steps.items(), key=lambda kv: -kv[1])))
    env = rows[0]
    lines.append(f"{env['device']}, torch {env['torch']}, {env['dtype']}, {env['threads']} thread(s); {env['command']}")
    return "\n".join(lines)


def _cell(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())

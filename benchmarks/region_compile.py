"""torch's compile time of one forward of a zoo Llama stack at Llama-3-8B width, its layers marked as
repeated blocks (specpass.mark_repeated_blocks) or inline: which parts of a first call grow with depth.

    python -m benchmarks.region_compile --layers 2,8                         # plain Inductor, marked
    python -m benchmarks.region_compile --layers 2,8 --backend specpass --mode reduce-overhead --inline

Each configuration runs in a fresh process with torch's and specpass's caches off; one row each: Dynamo
(tracing less the backend), AOTAutograd (less Inductor's compiler), Inductor, the first call, seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def child(layers: int, backend: str, mode: str | None, marked: bool) -> dict:
    import torch

    import specpass
    from benchmarks import harness
    from models.llama import Llama, LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Llama(config).eval().to(torch.bfloat16)
    model.setup_caches(4, 64)
    if marked:
        specpass.mark_repeated_blocks(model)
    tokens = torch.randint(0, 256, (4, 5), device=device)
    positions = torch.arange(5, device=device)[None].expand(4, 5).contiguous()
    compiled = torch.compile(model, backend=specpass.backend() if backend == "specpass" else backend,
                             mode=mode, fullgraph=True)
    start = time.perf_counter()
    with torch.no_grad():
        compiled(tokens, positions)
    first = time.perf_counter() - start
    t = harness.compile_seconds().get
    inductor = t("compile_fx.<locals>.fw_compiler_base", 0.0)
    return dict(layers=layers, backend=backend, mode=mode, marked=marked, first_s=round(first, 2),
                dynamo_s=round(t("_compile.compile_inner", 0.0) - t("OutputGraph.call_user_compiler", 0.0), 2),
                aot_s=round(t("create_aot_dispatcher_function", 0.0) - inductor, 2), inductor_s=round(inductor, 2),
                env=harness.environment(device, torch.bfloat16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="2,8", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--backend", default="inductor", choices=["inductor", "specpass"])
    parser.add_argument("--mode", default=None)
    parser.add_argument("--inline", action="store_true", help="also each depth with the layers inline")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        layers, marked = args.child.split(",")
        print(json.dumps(child(int(layers), args.backend, args.mode, marked == "1")))
        return
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "SPECPASS_CACHE": "0"}
    for layers in args.layers:
        for marked in (True, False) if args.inline else (True,):
            command = [sys.executable, "-m", "benchmarks.region_compile", "--backend", args.backend,
                       *(["--mode", args.mode] if args.mode else []), "--child", f"{layers},{int(marked)}"]
            out = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            print(f"{row['layers']} layers, {'marked' if marked else 'inline'}: first call {row['first_s']} s, "
                  f"Dynamo {row['dynamo_s']}, AOTAutograd {row['aot_s']}, Inductor {row['inductor_s']} "
                  f"({row['env']['device']}, torch {row['env']['torch']})", flush=True)


if __name__ == "__main__":
    main()

"""What each further round shape costs to compile after the first, and `tune_k` in all (GPU).

    python -m benchmarks.further_shapes --shapes "8;2;4,5,16;4,7,32" --out further_shapes.json
    python -m benchmarks.further_shapes --shapes "4,5,16;4,7,32" --tune --out tune_k.json   # a new process

The shipped pair (the zoo's Llama and its EAGLE-3 head), bf16, a `Decoder` with the fused round and
CUDA graphs, `--bs` held-out prompts, `--new-tokens` each. The first generate at `--k` compiles the
prefill and that K's round; then, per shape of `--shapes` (K, or TOPK,STEPS,TOKENS), `use_k` and a
first generate (it compiles that shape's round alone: the prefill serves every K), then that generate
again (warm). With `--tune` instead: a Decoder's `tune_k` over `--tune-ks` and the trees of `--shapes`,
plain decoding included, alone in its process: its wall time, the prefill and every round it compiles
included (after the shapes above, Inductor's cache would already hold their graphs). Each process
starts with empty Inductor and Triton caches (`TORCHINDUCTOR_CACHE_DIR`, `TRITON_CACHE_DIR`: set
them to new folders) and specpass's compile cache off (`SPECPASS_CACHE=0`), as a user's first run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks import harness

CHECKPOINTS = harness.ROOT / "checkpoints"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=harness.k_or_tree, default=4)
    parser.add_argument("--shapes", default="8;2;4,5,16;4,7,32", help="K or TOPK,STEPS,TOKENS, ';'-separated")
    parser.add_argument("--tune", action="store_true", help="time tune_k instead of the shapes one by one")
    parser.add_argument("--tune-ks", default="2,6", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--bs", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile", default="specpass", help="Decoder's compile= (eager: a quick check of the script)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from models.checkpoint import load
    from models.drafters import load_drafter
    from models.llama import Llama
    from models.text import encode, load_prompts
    from specpass.loop import Decoder, TreeShape, cache_slots

    device = torch.device(args.device)
    dtype, mode = (torch.bfloat16, "reduce-overhead") if device.type == "cuda" else (torch.float32, None)
    shapes = [harness.k_or_tree(s) for s in args.shapes.split(";") if s]
    prompts = [encode(t) for t in load_prompts()[:args.bs]]
    longest = max(args.new_tokens, 40)  # tune_k decodes up to 40 tokens
    max_len = max(cache_slots(max(map(len, prompts)), longest, k) for k in [args.k, *shapes, *args.tune_ks])
    target = load(Llama, CHECKPOINTS / "stdlib-llama", device=device, dtype=dtype)
    head = load_drafter(target, "eagle", CHECKPOINTS / "stdlib-llama-eagle3", device=device, dtype=dtype)

    def timed(fn):
        start = harness.now(device)
        out = fn()
        return harness.now(device) - start, out

    dec = Decoder(target, head, k=args.k, max_batch=args.bs, max_len=max_len, mode=mode, fused_round=True,
                  compile=args.compile)
    rows, tune = [], None
    if args.tune:
        trees = [s for s in shapes if isinstance(s, TreeShape)]
        seconds, choice = timed(lambda: dec.tune_k(prompts, args.tune_ks, off=True, trees=trees))
        tune = {"ks": args.tune_ks, "trees": [str(t) for t in trees], "seconds": seconds, "choice": str(choice.k),
                "graphs": harness.graphs_compiled()}
    for i, shape in enumerate([] if args.tune else [args.k, *shapes]):
        dec.use_k(shape)
        first, _ = timed(lambda: dec.generate(prompts, args.new_tokens))
        warm, out = timed(lambda: dec.generate(prompts, args.new_tokens))
        rows.append({"shape": str(shape), "first_s": first, "warm_s": warm, "graphs": harness.graphs_compiled(),
                     "accept_length": out.metrics.accept_length, "what": "first call" if i == 0 else "further shape"})
        print(rows[-1], flush=True)

    env = harness.environment(device, dtype, bs=args.bs, new_tokens=args.new_tokens)
    harness.saver(args.out)({"env": env, "shapes": rows, "tune_k": tune})
    print(f"\n{harness.describe(env)}")
    if tune is not None:
        print(f"tune_k over K {tune['ks']} and {len(tune['trees'])} trees, plain included: {tune['seconds']:.1f} s, "
              f"chose {tune['choice']}")
        return
    print("| shape | first generate s | warm s | accepted length |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['shape']} ({row['what']}) | {row['first_s']:.2f} | {row['warm_s']:.3f} | {row['accept_length']:.2f} |")


if __name__ == "__main__":
    main()

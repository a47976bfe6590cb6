"""specpass.generate on a transformers target loaded tensor-parallel (`tp_plan="auto"`) on GPUs.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m benchmarks.hf_tp --out hf_tp.json
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 4 -m benchmarks.hf_tp --pair random   # heads 4 ranks divide

The shipped pair loaded by transformers: the target with transformers' own plan (DTensor weights,
NCCL), the standalone draft whole on every rank. Per batch size (held-out prompts, left-padded,
greedy, no EOS): specpass.generate with the draft (its defaults: specpass, Inductor, CUDA graphs,
the fused round), transformers' generate on the same sharded model (eager, dynamic cache), and
rank 0's transformers generate on an unsharded copy of the target on its GPU. Reported: whether
every rank returned the same tokens, the share of tokens equal to each reference, the rewrites
per compiled step, and tokens/s (median of `--repeats`, after a first call that compiles).
A check that the path runs and is exact on GPUs at the transformers version installed; the pair
is 19M parameters, so no speed is claimed for tensor parallelism from it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks import harness
from benchmarks.hf_generate import left_padded

TARGET, DRAFT = harness.ROOT / "checkpoints" / "stdlib-llama", harness.ROOT / "checkpoints" / "stdlib-llama-draft"


def transformers_tp_plan() -> dict:
    """from_pretrained's argument for transformers' own plan: `distributed_config=` where transformers
    takes one (newer versions deprecate `tp_plan=`), else `tp_plan=`."""
    import transformers

    config = getattr(transformers, "DistributedConfig", None)
    if config is not None and "tp_plan" in inspect.signature(config).parameters:
        return {"distributed_config": config(tp_plan="auto")}
    return {"tp_plan": "auto"}


# --pair random: a transformers Llama whose heads every TP size up to 8 divides (random weights, seed 0)
# and a one-layer draft of its vocabulary; "tiny" sizes for a CPU smoke test
RANDOM = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
          "num_key_value_heads": 8, "vocab_size": 32000}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 8, "vocab_size": 512}


def random_pair(sizes: dict) -> tuple[Path, Path, tempfile.TemporaryDirectory | None]:
    """Rank 0 saves the random target and draft in a folder of its own, whose name every rank then
    loads from (transformers' plan loads from a checkpoint); -> the paths and rank 0's folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    scratch = tempfile.TemporaryDirectory(prefix="hf_tp_") if dist.get_rank() == 0 else None
    name = [scratch.name if scratch is not None else None]
    dist.broadcast_object_list(name, src=0)
    target, draft = Path(name[0]) / "target", Path(name[0]) / "draft"
    if scratch is not None:
        for path, layers, seed in ((target, sizes["num_hidden_layers"], 0), (draft, 1, 1)):
            torch.manual_seed(seed)
            config = LlamaConfig(**{**sizes, "num_hidden_layers": layers}, max_position_embeddings=4096,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=0)
            LlamaForCausalLM(config).save_pretrained(path)
    dist.barrier()
    return target, draft, scratch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bs", default="1,8", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="float32 (TF32 off): tokens comparable with transformers' across kernels")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help=">= 1")
    parser.add_argument("--device", default="cuda", help="cuda (NCCL) or cpu (gloo: a smoke test of the script)")
    parser.add_argument("--compile", default="specpass", help="generate's compile= (on a CPU: eager)")
    parser.add_argument("--pair", choices=["shipped", "random", "tiny"], default="shipped",
                        help="the shipped pair (6 query heads: TP 2, 3, 6), or random weights whose heads 2, 4 and 8 "
                             "ranks divide (tiny: for a CPU)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from transformers import LlamaForCausalLM

    import specpass
    from models.text import encode, load_prompts

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", rank))) if args.device == "cuda" else \
        torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = getattr(torch, args.dtype)
    target_path, draft_path, scratch = (TARGET, DRAFT, None) if args.pair == "shipped" else \
        random_pair(RANDOM if args.pair == "random" else TINY)
    model = LlamaForCausalLM.from_pretrained(target_path, **transformers_tp_plan(), dtype=dtype).eval()
    draft = LlamaForCausalLM.from_pretrained(draft_path, dtype=dtype).to(device).eval()
    whole = LlamaForCausalLM.from_pretrained(target_path, dtype=dtype).to(device).eval() if rank == 0 else None
    texts = load_prompts()
    rows = []
    for bs in args.bs:
        ids, mask = left_padded(torch, [encode(texts[i % len(texts)]) for i in range(bs)], device)

        def ours(ids=ids, mask=mask):
            return specpass.generate(model, ids, attention_mask=mask, assistant_model=draft, eos_token_id=None,
                                     pad_token_id=0, max_new_tokens=args.new_tokens, num_assistant_tokens=args.k,
                                     compile=args.compile, return_dict_in_generate=True)

        def theirs(m, ids=ids, mask=mask):
            with torch.no_grad():
                return m.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)

        first = ours()
        tokens = first.sequences[:, ids.shape[1]:]
        seconds, last = {"specpass": [], "transformers": []}, {}
        for _ in range(args.repeats):
            for name, call in (("specpass", ours), ("transformers", lambda: theirs(model))):
                dist.barrier()
                start = harness.now(device)
                last[name] = call()
                seconds[name].append(harness.now(device) - start)
        gathered = [torch.empty_like(tokens) for _ in range(world)]
        dist.all_gather(gathered, tokens.contiguous())
        hf_tp = last["transformers"][:, ids.shape[1]:]  # the last timed call's tokens
        row = dict(bs=bs, tp=world, weights=type(model.model.layers[0].self_attn.q_proj.weight).__name__,
                   ranks_agree=all(torch.equal(g, tokens) for g in gathered),
                   equal_to_transformers_tp=(tokens == hf_tp).float().mean().item(),
                   rewrites={step: len(lines) for step, lines in first.rewrites.items()},
                   **{f"{name}_tokens_per_s": bs * args.new_tokens / statistics.median(s)
                      for name, s in seconds.items()})
        if whole is not None:
            row["equal_to_one_gpu"] = (tokens == theirs(whole)[:, ids.shape[1]:]).float().mean().item()
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), file=sys.stderr, flush=True)
    if rank == 0:
        env = harness.environment(device, dtype, tp=world, pair=args.pair)
        result = {"env": env, "command": " ".join(["torchrun", f"--nproc-per-node {world}", "-m benchmarks.hf_tp",
                                                   *sys.argv[1:]]), "rows": rows}
        harness.saver(args.out)(result)
        print(harness.describe(env))
        print("| bs | TP | weights | ranks agree | = transformers (TP) | = transformers (1 GPU) | specpass tok/s | transformers tok/s |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['bs']} | {r['tp']} | {r['weights']} | {r['ranks_agree']} | {r['equal_to_transformers_tp']:.3f} | "
                  f"{r.get('equal_to_one_gpu', float('nan')):.3f} | {r['specpass_tokens_per_s']:.0f} | "
                  f"{r['transformers_tokens_per_s']:.0f} |")
    dist.barrier()  # rank 0 compared with the whole model alone: no rank leaves before it is done
    if scratch is not None:
        scratch.cleanup()
    specpass.destroy_process_group()  # frees the CUDA graphs holding NCCL collectives first: else it waits forever
    return 0


if __name__ == "__main__":
    sys.exit(main())

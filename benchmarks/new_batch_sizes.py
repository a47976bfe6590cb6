"""specpass.generate's first call at each batch size in one process, then warm calls (GPU).

    python benchmarks/new_batch_sizes.py . --bs 1,8,64 --out new_batch_sizes.json
    python benchmarks/new_batch_sizes.py . --bs 1,8,64 --max-batch 64    # caches for 64 from the first call
    python benchmarks/new_batch_sizes.py old --bs 1,8      # `old`: another commit's tree (an A/B):
        # mkdir old && git archive COMMIT specpass benchmarks models | tar -x -C old && ln -s ../checkpoints old/

The shipped pair loaded by transformers with its EAGLE-3 head (benchmarks/hf_generate.py's Bench),
held-out prompts, 128 new tokens, K 4, generate's GPU defaults (specpass, Inductor, CUDA graphs, the
fused round), bf16. Per batch size, in the order given: the first call (it compiles what that size
needs: nothing, a CUDA-graph recording, or new graphs where the caches grow), then `--warm` calls:
median wall seconds, tokens/s, prefill ms, ms per round, the graphs Dynamo compiled for the size,
the caches' capacity, a digest of the tokens. ROOT is the tree whose specpass is imported.
"""

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("root", type=Path)
parser.add_argument("--bs", default="1,8,64", type=lambda s: [int(x) for x in s.split(",")])
parser.add_argument("--warm", type=int, default=5)
parser.add_argument("--max-batch", type=int, help="generate's max_batch (default: none, the caches grow)")
parser.add_argument("--out", type=Path)
args = parser.parse_args()
sys.path.insert(0, str(args.root.resolve()))

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import specpass  # noqa: E402
from benchmarks.hf_generate import Bench, left_padded  # noqa: E402

assert Path(specpass.__file__).resolve().is_relative_to(args.root.resolve()), specpass.__file__


class Settings:  # what Bench reads
    device, dtype, new_tokens, k, quick = "cuda", "bfloat16", 128, 4, False


bench = Bench(Settings)
max_batch = {} if args.max_batch is None else {"max_batch": args.max_batch}  # generate's default without it
rows = []
for bs in args.bs:
    ids, mask = left_padded(torch, bench.prompts(bs), bench.device)

    def call():
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = specpass.generate(bench.model, ids, attention_mask=mask, assistant_model=bench.eagle3,
                                max_new_tokens=Settings.new_tokens, num_assistant_tokens=Settings.k,
                                return_dict_in_generate=True, **max_batch)
        torch.cuda.synchronize()
        return time.perf_counter() - start, out

    graphs = counters["stats"]["unique_graphs"]
    first, out = call()
    runs = [call() for _ in range(args.warm)]
    warm, metrics = [t for t, _ in runs], [o.metrics for _, o in runs]
    row = dict(bs=bs, first_s=round(first, 3), warm_s=round(statistics.median(warm), 4),
               tokens_per_s=round(bs * Settings.new_tokens / statistics.median(warm)),
               prefill_ms=round(statistics.median(1e3 * m.prefill_seconds for m in metrics), 3),
               round_ms=round(statistics.median(1e3 * (m.seconds - m.prefill_seconds) / m.rounds for m in metrics), 4),
               new_graphs=counters["stats"]["unique_graphs"] - graphs,
               capacity=next(iter(specpass.generate.cache)).max_batch,
               tokens_sha=hashlib.sha1(out.sequences.cpu().numpy().tobytes()).hexdigest()[:12])
    rows.append(row)
    print(json.dumps(row), flush=True)
if args.out:
    args.out.write_text(json.dumps(dict(root=str(args.root), torch=torch.__version__,
                                        device=torch.cuda.get_device_name(), rows=rows), indent=1))

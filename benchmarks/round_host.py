"""Host time of one compiled round outside its kernels, transformers' Llama against the zoo's (CPU).

    python -m benchmarks.round_host          # tiny 12-layer Llama pair, fp32, one thread

The same random weights as a transformers `LlamaForCausalLM` (through `HFTarget`) and as the zoo's
`Llama`, with an EAGLE-3 head or a 2-layer standalone draft; the fused round at bs 1, K 4, compiled
by a backend whose graph runs once and then returns those outputs. Per pair, a call of the round (Dynamo's guards, its input marshalling, the outputs rebuilt: the host's work per
round besides the kernels), under full guards and with guard evaluation skipped as
`Decoder.generate` does from round 3 on; "guards", the difference: their evaluation per round.
Best of 9 batches of calls, microseconds.
"""

from __future__ import annotations

import copy
import tempfile

from benchmarks import harness


def best_us(fn, calls: int) -> float:
    """µs per call: the fastest of 9 batches of `calls` calls."""
    return 1e3 * harness.host_ms(fn, repeats=9, calls=calls, warmup=0, best=True)


class Canned:
    """A backend whose graph runs once, then returns those outputs: a call costs Dynamo's work only."""

    def __call__(self, gm, example_inputs, **kwargs):
        outputs = []

        def run(*args):
            if not outputs:
                outputs.append(gm(*args))
            return outputs[0]
        return run


def main() -> None:
    import torch
    import transformers

    import specpass
    from models import zoo
    from models.checkpoint import load
    from models.drafters import ZooDrafter
    from models.eagle3 import Eagle3Config
    from models.llama import Llama
    from specpass.hf.adapters import HFDrafter, HFTarget

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    sizes = dict(vocab_size=258, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, tie_word_embeddings=False, attn_implementation="sdpa")
    pairs = {}
    torch.manual_seed(0)
    for name, layers in (("target", 12), ("draft", 2)):
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=layers, **sizes)).eval()
        folder = tempfile.mkdtemp()
        hf.save_pretrained(folder)
        pairs[name] = hf, load(Llama, folder)
    head = zoo.build(Eagle3Config(vocab_size=258, draft_vocab_size=258, hidden_size=64, intermediate_size=128,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0), seed=3)
    prompt = [[(7 * i) % 250 + 3 for i in range(40)]]
    print(harness.describe(harness.environment("cpu", torch.float32)))
    print("| target | drafter | call us, full guards | call us, guards skipped | guards us |\n|---|---|---|---|---|")
    for drafter in ("eagle3", "draft"):
        for path in ("zoo", "transformers"):
            side = 0 if path == "transformers" else 1
            target = HFTarget(pairs["target"][0]) if side == 0 else pairs["target"][1]
            draft = (HFDrafter(pairs["draft"][0]) if side == 0 else ZooDrafter(pairs["draft"][1])) \
                if drafter == "draft" else ZooDrafter(copy.deepcopy(head))
            dec = specpass.Decoder(target, draft, k=4, max_batch=1, max_len=256, compile=Canned(), fused_round=True)
            with torch.no_grad():
                run = dec.start(prompt, 16)
                dec.rounds(run, 1)  # compiles
                row = []
                for skip in (False, True):
                    with torch.compiler.set_stance(skip_guard_eval_unsafe=skip):
                        row.append(best_us(lambda: dec.rounds(run, 1), 300))
            row.append(row[0] - row[1])
            print(f"| {path} | {drafter} | " + " | ".join(f"{us:.0f}" for us in row) + " |", flush=True)


if __name__ == "__main__":
    main()

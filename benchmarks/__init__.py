"""specpass's benchmarks, each run from the repository's root as `python -m benchmarks.NAME`
(`--help` gives its doc; most have a `--quick` CPU smoke test). Results go to docs/results.md.

    catchup           the EAGLE-3 catch-up step: Inductor, specpass, a hand-placed Q-slice
    catchup_tp        the same step at tensor parallel 2 (torchrun --nproc-per-node 2 -m benchmarks.catchup_tp)
    sampling          sampling reads of the logits, and the sample op
    verify_attention  the verify's attention alone, per kernel (GPU only)
    e2e               tokens/s of the shipped pair, every loop variant side by side
    lean              the lean plain baseline e2e measures beside plain decoding (a module, no main)
    exact             exact mode on a GPU: its kernels' row invariance, agreement, cost
    hf_generate       specpass.generate on transformers models against transformers' generate
    hf_sweep          the live-row pass on every causal LM in transformers (CPU)
    scale             the loop at Llama-3-8B shape: rounds, floors, attention, tune_k (a package)
    prefill           time to first token and peak memory of the loop's prefill
    acceptance        acceptance per draft position of trained drafters (CPU)
    round_host        host time of a compiled round outside its kernels (CPU)
    region_compile    torch's compile parts of a layer stack, its layers compiled once or inline

harness.py is what they share: timing, the environment record, Dynamo's limits, the GPU lock, rows.
"""

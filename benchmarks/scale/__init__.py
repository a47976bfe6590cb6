"""The loop at Llama-3-8B shape: decode step and round, each phase against its floor (issue 24).

The zoo's `llama3-8b` target and `llama3-8b-eagle3` head (random weights, bf16), the project's
`Decoder` with CUDA graphs. A round's shapes are static, so its time does not depend on what is
accepted: random weights accept nothing, every round costs what a trained pair's would. The
projected speedup uses the shipped pair's measured acceptance per draft position (docs/e2e.json).

    python -m benchmarks.scale --out scale.json                    # the sweep, on a GPU
    python -m benchmarks.scale --points 64x64 --variants specpass --k-sweep 2,6 --out a.json
    python -m benchmarks.scale --plot docs/scale.json              # docs/scale.png and the tables (CPU)
    python -m benchmarks.scale --quick --device cpu                # a smoke test: tiny models
    python -m benchmarks.scale --drafter parallel --head-layers 2 --variants specpass  # P-EAGLE, as shipped
    python -m benchmarks.scale --drafter block --k 15 --points 1x64 --trees "4,7,32" --variants decode,specpass

Per point (batch size x prompt length), each variant is built, compiled, timed and dropped in turn
(they share the weights; each sets up its own caches):
  decode         the target alone (K = 0), one fused graph per step: the loop's plain decoding
  lean           the lean baseline (benchmarks/lean.py, gpt-fast's decoding) on the same target
                 (not at tensor parallel, nor at --direct-at points); the faster of it and decode
                 is each point's baseline:
                 "round / baseline" and the projected speedup are against it
  specpass       the fused round (one graph per round), specpass backend
  inductor       the fused round, plain Inductor (at --inductor-at points)
  specpass-no-split-kv  the fused round, specpass without its split-KV attention kernel
                 (`specpass.backend(split_kv=False)`) (at --no-split-kv-at points)
  decode+SUFFIX, specpass+SUFFIX   decode and specpass with a specpass switch of --paired flipped
                 from its default (at --paired-at points): +no-gemv (cuBLAS's linears), +no-gemv_group
                 (each linear its own launch), +pdl (Inductor's programmatic dependent launch),
                 +coordinate_descent (Inductor's coordinate-descent tuning)
  apart          specpass, steps compiled apart, CUDA events after each step: the phase split
                 (draft / verify / accept / catch-up) (at --apart-at points)
At --tune-at points the loop picks K itself (`Decoder.tune_k` at --tune-ks, the shipped acceptance,
then its search), and the chosen K's tokens/s is set against the best K timed: the chosen K and the --k-sweep K are
timed on the tuning decoder, which keeps every K it compiled. Processes started side by side with
one --gpu-lock file compile at once and take turns to time (each holds the GPU alone while it times;
another's compile may still run its warm-up on the GPU then: a row's samples_ms shows it).
ms per round = (loop time of a long generate - loop time of a short one) / (rounds difference):
prefill, the first round's warm-up and the one round run after the last cancel out. At --direct-at
points (64 x 4K: the prefill's logits alone would take 67 GB) the rounds run from a one-token
prefill with every request moved to the prompt's position, timed over the same rounds.

Floors: each phase's weight and KV-cache bytes over the copy bandwidth measured in the same run,
and its matmul and attention FLOPs over the bf16 matmul rate measured in the same run; a phase's
floor is the larger of the two, a round's the sum of its phases'. Attention bytes count the slots a
request can see (its prompt plus what it has generated), not the whole static cache. At --gemm-at
points (K: --gemm-ks) every linear is also timed alone through cuBLAS at its rows (`gemm_floor`): the
verify's GEMMs against the decode step's, and the round / decode the floors would give with the
GEMMs at that measured time.

One module per measurement: rounds.py (the models, a decoder per variant, ms per round), floors.py
(the floors; cuBLAS GEMMs), attention.py (the verify's attention alone; a round's kernel profile),
tune.py (tune_k's choice of K), sweep.py (the points and variants), report.py (tables, plot),
__main__.py (the command line).
"""

"""The speculative-decoding loop, one job per module (docs/loop.md):

    protocols.py  Target, Drafter, ChainDrafter, ParallelDrafter, TreeTarget, TreeDrafter: what the loop asks of its models
    steps.py      the pure, traceable steps every round shape shares (verify, judge, accept, ...)
    processors.py transformers' logits processors that read the prefix (min_new_tokens, repetition penalty, n-gram ban), per verified position
    shapes.py     RoundShape, round_shape(drafter, k): which shape a drafter's rounds take at K;
                  round_spec(drafter, k): K checked once, bound to its shape (RoundSpec)
    plain.py      PLAIN: no drafter, the target's own decoding
    chain.py      CHAIN: a ChainDrafter's round, K-1 draft steps and a catch-up
    parallel.py   PARALLEL: a ParallelDrafter's round, one draft forward
    tree.py       TREE: a TreeDrafter's round at a TreeShape, a drafted tree verified whole
    tree_math.py  the tree's algorithms: drafting, greedy and lossless sampled acceptance
    cost.py       the choice of K: price, choose_k, next_k_to_time, KChoice
    choose.py     the choice among drafters: choose_drafter, tune_k on a Decoder per drafter
    compiling.py  compiling the steps: own code objects, the symbolic batch, guards, the fallbacks
    round_buffers.py  the state between rounds: the fused round's buffers, CUDA-graph replays' clones
    host.py       the host's side: the prompts' tensor, the clock, the done flag, the phase timer
    saved_steps.py  the compiled steps saved to disk and loaded by later processes without compiling
    background.py the compile worker: steps compiled off the calling thread while the loop decodes
    tuning.py     Decoder.tune_k: each K (a tree, plain decoding) timed, priced, the best chosen
    checks.py     what Decoder is given, checked
    distributed.py  tensor parallel: the ranks' agreement checked, and the group's teardown
    driver.py     Decoder: binds, compiles, prefills, loops
"""

from specpass.loop.choose import choose_drafter
from specpass.loop.cost import KChoice, choose_k, expected_accept_length, next_k_to_time, price
from specpass.loop.driver import Decoder, Metrics, Output, Run
from specpass.loop.protocols import ChainDrafter, Drafter, ParallelDrafter, Target, TreeDrafter, TreeTarget
from specpass.loop.compiling import COMPILERS
from specpass.loop.shapes import RoundShape, RoundSpec, cache_slots, round_shape, round_spec
from specpass.loop.steps import Carry, Proposal, State, Steps
from specpass.loop.tree import TREES, TreeShape

__all__ = [
    "COMPILERS",
    "Carry",
    "ChainDrafter",
    "Decoder",
    "Drafter",
    "KChoice",
    "Metrics",
    "Output",
    "ParallelDrafter",
    "Proposal",
    "RoundShape",
    "RoundSpec",
    "TREES",
    "Run",
    "State",
    "Steps",
    "Target",
    "TreeDrafter",
    "TreeShape",
    "TreeTarget",
    "cache_slots",
    "choose_drafter",
    "choose_k",
    "expected_accept_length",
    "next_k_to_time",
    "price",
    "round_shape",
    "round_spec",
]

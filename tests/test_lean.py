"""The benchmarks' lean baseline (benchmarks/lean.py) decodes what the loop's plain decoding does:
the same greedy tokens for a ragged batch (fp32, CPU, the zoo's tiny target), and metrics of one
token a step."""


from benchmarks.lean import LeanDecoder
from models import zoo
from specpass.loop import Decoder

PROMPTS = [[3, 14, 15], [9, 2, 6, 5, 35, 89, 79, 32, 38], [46]]


def test_lean_baseline_decodes_the_loops_plain_tokens():
    target = zoo.build("tiny-llama", seed=0)
    want = Decoder(target, None, max_batch=3, max_len=64, compile="eager").generate(PROMPTS, 20).tokens
    lean = LeanDecoder(zoo.build("tiny-llama", seed=0), max_batch=3, max_len=64, mode=None, backend="eager")
    out = lean.generate(PROMPTS, 20)
    assert out.tokens == want
    m = out.metrics
    assert (m.new_tokens, m.rounds, m.accept_length) == (60, 19, 1.0) and 0 < m.prefill_seconds < m.seconds

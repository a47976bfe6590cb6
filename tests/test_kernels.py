"""The Triton kernels (specpass/kernels/triton_*.py), on a GPU: values against torch on the
upcast logits, ties, non-finite rows, and use inside a compiled, CUDA-graphed function. Skipped
without CUDA (CI has none; the ops' CPU implementations are tested with the passes that emit
them): run through the device machine."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels need a CUDA GPU and Triton")

SHAPES = [(1, 151936), (3, 32000), (16, 128256), (64, 5000), (256, 151936), (1280, 32000), (5, 100)]


def _top1():
    import specpass.kernels  # noqa: F401  registers torch.ops.specpass.top1_lse

    return torch.ops.specpass.top1_lse


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_index_max_logsumexp_and_value_match_torch(rows, vocab, dtype, log):
    g = torch.Generator(device="cuda").manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 4).to(dtype)
    index, top, lse, value = _top1()(logits, log)
    x = logits.float()
    assert torch.equal(index, x.argmax(-1))
    assert torch.equal(top, x.amax(-1))
    torch.testing.assert_close(lse, torch.logsumexp(x, -1), rtol=2e-6, atol=2e-6)
    want = (torch.log_softmax if log else torch.softmax)(x, -1).amax(-1)
    torch.testing.assert_close(value, want, rtol=2e-6, atol=2e-6)
    rounded = _top1()(logits, log, dtype)[3]  # the value rounded in the kernel: as torch rounds it
    assert rounded.dtype == dtype and torch.equal(rounded, value.to(dtype))


@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_ties_take_the_first_index_across_chunks(rows, vocab):
    logits = torch.zeros(rows, vocab, device="cuda", dtype=torch.bfloat16)
    hot = torch.tensor([vocab - 1, vocab // 2, vocab // 3], device="cuda")
    logits[:, hot] = 3.0  # three equal maxima, the first in the middle of the row
    index = _top1()(logits)[0]
    assert torch.equal(index, logits.float().argmax(-1)) and (index == vocab // 3).all()


def test_rows_with_infinities_and_nan():
    logits = torch.randn(4, 40000, device="cuda")
    logits[0] = float("-inf")  # all -inf: index 0, max -inf, lse -inf
    logits[1, 7] = float("inf")  # softmax is NaN everywhere: its argmax is 0
    logits[2, 30000] = float("nan")  # NaN counts as +inf
    index, top, lse, value = _top1()(logits)
    assert index.tolist() == [0, 0, 0, logits[3].argmax()]
    assert top[0] == float("-inf") and lse[0] == float("-inf")
    assert top[1] == float("inf") and top[2] == float("inf") and lse[1:3].isnan().all()
    assert value[:3].isnan().all() and torch.isfinite(lse[3]) and torch.isfinite(value[3])
    for got, want in zip(_top1()(logits), _top1()(logits.cpu()), strict=True):  # the CPU implementation
        torch.testing.assert_close(got.cpu(), want, rtol=2e-6, atol=2e-6, equal_nan=True)


@pytest.mark.parametrize("config", [(1, 8, 1), (1, 4, 9), (4, 8, 3), (2, 4, 7), (2, 16, 1), (4, 16, 2), (2, 4, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_tile_and_split_against_the_cpu_implementation(config, dtype):
    """Tile shapes and splits, forced (config: E, warps, splits), on rows that reach each path: a
    tie across lanes of one step and across steps, the maximum in the masked tail, all -inf, +inf
    and NaN in the body and in the tail."""
    from specpass.kernels import triton_top1

    g = torch.Generator(device="cuda").manual_seed(3)
    logits = (torch.randn(9, 40007, device="cuda", generator=g) * 4).to(dtype)  # bf16: ties at the max
    logits[1, [3, 900, 4096 + 3]] = 99.0  # three lanes and steps holding the maximum
    logits[2, -1] = 99.0  # in the tail
    logits[3] = float("-inf")
    logits[4, [20000, 30000]] = float("inf")
    logits[5, 40000] = float("nan")
    logits[6, [100, 30000]] = float("nan")
    logits[6, 200] = float("inf")
    logits[7, :20000] = float("-inf")
    got = triton_top1.top1_lse(logits, config=config)
    want = _top1()(logits.cpu())
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    for g, w in zip(got[2:], want[2:]):
        torch.testing.assert_close(g.cpu(), w, rtol=2e-6, atol=2e-6, equal_nan=True)


def test_composes_with_inductor_and_cuda_graphs():
    top1_lse = _top1()

    def sample(logits):
        index, _, _, p = top1_lse(logits)
        return index, p

    logits = torch.randn(8, 32000, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(sample, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        index, p = compiled(logits)
    assert torch.equal(index, logits.float().argmax(-1))
    torch.testing.assert_close(p, torch.softmax(logits.float(), -1).amax(-1), rtol=1e-5, atol=1e-7)

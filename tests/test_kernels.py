"""The Triton kernels (specpass/kernels/triton_*.py), on a GPU: values against torch on the
upcast logits, ties, non-finite rows, folded prologues, the sample op's noise, indices and
distribution, and use inside a compiled, CUDA-graphed function. Skipped without CUDA (CI has none;
the ops' CPU implementations are tested with the passes that emit them, and the sample op's
distribution here, on both devices): run through the device machine."""

import pytest
import torch
import torch.nn.functional as F

from specpass.kernels.counter import key, uniform
from specpass.sampling import TARGET

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels need a CUDA GPU and Triton")

SHAPES = [(1, 151936), (3, 32000), (16, 128256), (64, 5000), (256, 151936), (1280, 32000), (5, 100)]


def _top1():
    import specpass.kernels  # noqa: F401  registers torch.ops.specpass.top1_lse

    return torch.ops.specpass.top1_lse


@cuda
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


@cuda
@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_ties_take_the_first_index_across_chunks(rows, vocab):
    logits = torch.zeros(rows, vocab, device="cuda", dtype=torch.bfloat16)
    hot = torch.tensor([vocab - 1, vocab // 2, vocab // 3], device="cuda")
    logits[:, hot] = 3.0  # three equal maxima, the first in the middle of the row
    index = _top1()(logits)[0]
    assert torch.equal(index, logits.float().argmax(-1)) and (index == vocab // 3).all()


@cuda
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


@cuda
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


@cuda
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


PROLOGUES = {  # name -> (scale per row or None, scalar, divide, rounding)
    "divide": (None, 0.7, True, None),
    "multiply": (None, 1.7, False, None),
    "divide_rounded_bf16": (None, 0.7, True, torch.bfloat16),
    "per_row": ("rows", 1.0, True, None),
    "per_row_rounded_fp16": ("rows", 1.0, True, torch.float16),
    "one_value": ("one", 1.0, False, None),
}


@cuda
@pytest.mark.parametrize("config", [None, (1, 4, 7), (2, 16, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("prologue", PROLOGUES)
def test_folded_prologue_against_the_cpu_implementation(prologue, dtype, config):
    """Each element's quotient or product, correctly rounded (and rounded to 16 bits where asked),
    exactly as torch computes it: the index and max equal the torch implementation's, ties included."""
    from specpass.kernels import triton_top1

    g = torch.Generator(device="cuda").manual_seed(5)
    logits = (torch.randn(64, 40007, device="cuda", generator=g) * 4).to(dtype)
    logits[:, [11, 30000]] = logits.amax(-1, keepdim=True) + 1e-3  # ties the rounding may make or break
    logits[3, 5] = float("nan")
    scale, scalar, divide, rounding = PROLOGUES[prologue]
    if scale == "rows":  # zero and negative temperatures too: every element is computed as torch does
        scale = torch.rand(64, device="cuda", generator=g) * 2 + 0.05
        scale[:3] = torch.tensor([0.0, -0.7, float("inf")])
    elif scale == "one":
        scale = torch.tensor([0.3], device="cuda")
    got = triton_top1.top1_lse(logits, True, None, scale, scalar, divide, rounding, config=config)
    want = _top1()(logits.cpu(), True, None, None if scale is None else scale.cpu(), scalar, divide, rounding)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    for g_, w in zip(got[2:], want[2:]):
        torch.testing.assert_close(g_.cpu(), w, rtol=2e-6, atol=2e-6, equal_nan=True)


if torch.cuda.is_available():
    import triton
    import triton.language as tl

    from specpass.kernels import triton_top1

    @triton.jit
    def _uniforms_kernel(key_ptr, out_ptr, V, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        tl.store(out_ptr + row * V + cols, triton_top1._uniform(tl.load(key_ptr + row).to(tl.uint32), cols),
                 mask=cols < V)

    @triton.jit
    def _quotients_kernel(x_ptr, t_ptr, out_ptr, N, STEPS: tl.constexpr, BLOCK: tl.constexpr):
        """out[row] = triton_top1._divide(x, t[row]): the kernels' division, on its own."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        t = tl.load(t_ptr + row)
        r, lo = triton_top1._reciprocal(t)
        x = tl.load(x_ptr + cols, mask=cols < N)
        tl.store(out_ptr + row.to(tl.int64) * N + cols, triton_top1._divide(x, t, r, lo, STEPS), mask=cols < N)

    @triton.jit
    def _significand_mismatches_kernel(x_ptr, NX, out_ptr, STEPS: tl.constexpr, BLOCK: tl.constexpr,
                                       PER: tl.constexpr):
        """For PER divisors t in [1, 2) (the significands 1 + j 2**-23, j from program * PER), the
        number of the NX x (in [1, 2)) whose _divide(x, t) differs from IEEE div.rn.f32."""
        cols = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + cols, mask=cols < NX, other=1.0)
        bad = tl.zeros([BLOCK], tl.int32)
        for j in range(tl.program_id(0) * PER, tl.program_id(0) * PER + PER):
            t = (j | 0x3F800000).to(tl.float32, bitcast=True)  # one divisor for the whole row, as in the op
            r, lo = triton_top1._reciprocal(t)
            got = triton_top1._divide(x, t, r, lo, STEPS)
            want = tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=f,f,f", [x, t], dtype=tl.float32,
                                             is_pure=True, pack=1)
            bad += (got.to(tl.int32, bitcast=True) != want.to(tl.int32, bitcast=True)).to(tl.int32)
        tl.store(out_ptr + tl.program_id(0), tl.sum(bad, 0))


def _keys(n: int, seed: int = 0, device: str = "cuda") -> torch.Tensor:
    return key(torch.tensor([seed], device=device), torch.arange(n, device=device), TARGET)


@cuda
def test_uniforms_are_the_torch_ones_bit_for_bit():
    keys = torch.cat([_keys(500), torch.tensor([0, 1, 2**31, 2**32 - 1], device="cuda")])
    got = torch.empty(keys.shape[0], 4096, device="cuda")
    _uniforms_kernel[(keys.shape[0],)](keys, got, 4096, BLOCK=4096)
    want = uniform(keys, torch.arange(4096, device="cuda"))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@cuda
@pytest.mark.parametrize("floor", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(1, 151936), (16, 128256), (256, 32000), (5, 100)])
def test_sample_indices_equal_the_torch_implementation(rows, vocab, dtype, floor):
    """The same token as the torch implementation (on the CPU) but where two candidates' scores are
    within float rounding (its log is not CUDA's): count them, expect ~0."""
    from specpass.kernels import triton_top1

    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 3).to(dtype)
    temperature = torch.rand(rows, device="cuda", generator=g) + 0.3
    temperature[0] = 0.0  # greedy
    cut = logits.float().quantile(0.99, -1) if vocab * rows < 2**24 else logits.float().kthvalue(vocab - 50, -1).values
    keys = _keys(rows, seed=vocab)
    for config in (None, (1, 4, 7)):
        got = triton_top1.sample(logits, temperature, keys, cut if floor else None, config=config).cpu()
        want = torch.ops.specpass.sample(logits.cpu(), temperature.cpu(), keys.cpu(), cut.cpu() if floor else None)
        assert got[0] == logits[0].float().argmax()
        assert (got != want).sum() <= max(1, rows // 100), (got != want).nonzero()


def _temperatures() -> torch.Tensor:
    """Divisors for the division tests: the usual ones, every power of two (subnormal to 2**127),
    random ones over 2**-40..2**40 and over (0.05, 2), the fast path's edges, and the specials."""
    g = torch.Generator().manual_seed(22)
    f32 = lambda bits: torch.tensor(bits, dtype=torch.int32).view(torch.float32)  # noqa: E731
    edges = torch.tensor([2.0**-32, 2.0**32])
    return torch.cat([
        torch.tensor([0.7, 1 / 3, 0.6, 1.0, 1.3, 0.05, 2.0, 1e-3, 1e3]),
        torch.tensor([2.0**e for e in range(-149, 128)]),
        torch.exp2(torch.rand(120, generator=g) * 80 - 40),
        torch.rand(120, generator=g) * 1.95 + 0.05,
        edges, edges.nextafter(torch.zeros(2)), edges.nextafter(torch.full((2,), float("inf"))),
        f32([1, 0x007FFFFF, 0x00800000, 0x7F7FFFFF]),  # subnormal, largest subnormal, smallest normal, max
        torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -0.7, -2.0**-40, -3.0]),
    ])


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_division_equals_torch_bit_for_bit(dtype):
    """The kernels' x / t (triton_top1._divide: a reciprocal per row and Markstein corrections, IEEE
    division outside their range) against torch's x / t on the GPU (IEEE, subnormals kept), bit for
    bit (any NaN for NaN): every bf16 and fp16 bit pattern, and for fp32 2**19 random bit patterns
    (every exponent: subnormals, huge, inf, NaN) and 2**19 logit-like values, by every divisor of
    _temperatures()."""
    g = torch.Generator().manual_seed(1)
    if dtype == torch.float32:
        x = torch.cat([torch.randint(-2**31, 2**31, (2**19,), generator=g, dtype=torch.int64).to(torch.int32)
                       .view(torch.float32), torch.randn(2**19, generator=g) * 8]).cuda()
    else:
        x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype).float().cuda()
    t = _temperatures().cuda()
    got = torch.empty(t.shape[0], x.shape[0], device="cuda")
    _quotients_kernel[(t.shape[0], triton.cdiv(x.shape[0], 4096))](x, t, got, x.shape[0],
                                                                   STEPS=2 if dtype == torch.float32 else 1, BLOCK=4096)
    want = x[None, :] / t[:, None]
    same = _same_bits(got, want)
    bad = (~same).nonzero()[:5].tolist()
    assert same.all(), [(x[j].item(), t[i].item(), got[i, j].item(), want[i, j].item()) for i, j in bad]


@cuda
@pytest.mark.parametrize("bits,steps", [(7, 1), (10, 1), (23, 2)])
def test_division_is_exact_for_every_significand_pair(bits, steps):
    """The proof of _divide's fast path: where it runs, every step's result is a normal number or
    0, so x / t's rounding depends on the significands alone. Every x in [1, 2) with `bits` fraction
    bits (bf16: 7, fp16: 10; all 2**bits of them) against every fp32 t in [1, 2) (2**23), compared
    with IEEE div.rn.f32: 2**30 and 2**33 pairs. fp32 x (23 bits, two steps; exact by Markstein's
    theorem, see _divide): 2**23 divisors by 512 x, the 256 largest significands (where RN(x * r)
    is least accurate) and 256 random ones."""
    if bits == 23:
        g = torch.Generator().manual_seed(2)
        fractions = torch.cat([2**23 - 1 - torch.arange(256), torch.randint(0, 2**23, (256,), generator=g)])
    else:
        fractions = torch.arange(2**bits) << (23 - bits)
    x = (fractions.to(torch.int32) | 0x3F800000).view(torch.float32).cuda()
    per = 256
    out = torch.empty(2**23 // per, dtype=torch.int32, device="cuda")
    _significand_mismatches_kernel[(out.shape[0],)](x, x.shape[0], out, STEPS=steps, BLOCK=x.shape[0], PER=per,
                                                    num_warps=max(1, x.shape[0] // 128))  # 4 or 8 x per thread
    assert out.sum().item() == 0


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square goodness of fit (bins of expected count < 5 merged)."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    counts = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    assert (counts[~keep] == 0).all()  # nothing drawn where the probability is 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    return torch.special.gammaincc(torch.tensor((keep.sum().item() - 1) / 2.0), stat / 2).item()


ALPHA = 1e-3  # fixed keys: each case is one deterministic draw of the test; a true sampler fails 1 in 1000


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("floor", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sample_draws_from_softmax_of_x_over_t(device, dtype, floor):
    """Many draws of one row's token (one draw per row, each row its own key) against softmax(x / T)
    over x >= floor: chi-square goodness of fit at ALPHA. Rows of 60 logits (one program each)."""
    import specpass.kernels  # noqa: F401

    draws, vocab, T = 200_000 if device == "cuda" else 40_000, 60, 0.8
    x = (torch.randn(vocab, generator=torch.Generator().manual_seed(7)) * 2).to(dtype)
    cut = x.float().sort(descending=True).values[20].item() if floor else float("-inf")
    probs = torch.softmax(torch.where(x.float() >= cut, x.float() / T, float("-inf")), -1)
    logits = x.to(device).expand(draws, vocab)
    got = torch.ops.specpass.sample(logits, torch.full((draws,), T, device=device), _keys(draws, 3, device),
                                    torch.full((draws,), cut, device=device) if floor else None)
    assert _chi_square_p(torch.bincount(got.cpu(), minlength=vocab), probs) > ALPHA


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sample_draws_from_softmax_over_split_rows(dtype):
    """Few long rows (each cut into chunks and combined): 400 calls of 8 rows of 32,000 logits, 40
    of them holding nearly all the mass, spread over the row, the rest one bin."""
    g = torch.Generator().manual_seed(11)
    x = torch.full((32000,), -40.0)
    hot = torch.randperm(32000, generator=g)[:40]
    x[hot] = torch.randn(40, generator=g) * 1.5
    x = x.to(dtype)
    T = 1.3
    probs = torch.softmax(x.float() / T, -1)
    counts = torch.zeros(32000, dtype=torch.int64)
    logits = x.cuda().expand(8, 32000)
    for call in range(400):
        got = torch.ops.specpass.sample(logits, torch.full((8,), T, device="cuda"), _keys(8, call), None)
        counts += torch.bincount(got.cpu(), minlength=32000)
    assert _chi_square_p(counts, probs) > ALPHA


@cuda
def test_sample_in_a_compiled_cuda_graph_with_new_keys_per_replay():
    import specpass.kernels  # noqa: F401

    def draw(logits, temperature, keys, floor):
        return torch.ops.specpass.sample(logits, temperature, keys, floor)

    logits = torch.randn(64, 32000, device="cuda", dtype=torch.bfloat16) * 2
    temperature = torch.full((64,), 0.9, device="cuda")
    floor = logits.float().topk(40, -1).values[:, -1]
    compiled = torch.compile(draw, mode="reduce-overhead", fullgraph=True)
    tokens = []
    for step in range(5):  # warm-up, record, replays, each with its own keys
        keys = _keys(64, seed=step)
        got = compiled(logits, temperature, keys, floor)
        assert torch.equal(got, draw(logits, temperature, keys, floor))
        assert (logits.float().gather(-1, got[:, None])[:, 0] >= floor).all()
        tokens.append(got.clone())
    assert all(not torch.equal(tokens[0], t) for t in tokens[1:])


@cuda
def test_seen_slots_lists_each_row_s_keys_in_slot_order():
    """What exact mode's CUDA attention reads a row's keys through: a tree node's path (slots 0, 2,
    5) and a chain's row (slots 0..2) both become virtual slots 0, 1, 2; an additive mask's -inf and
    finfo.min hide (exp underflows to 0), an ALiBi-like -30 does not; a broadcast dim is one row."""
    from specpass.kernels.triton_exact import seen_slots
    mask = torch.tensor([[True, False, True, False, False, True], [True, True, True, False, False, False]],
                        device="cuda")
    slots, count = seen_slots(mask[None, None])
    assert count.tolist() == [[[3, 3]]] and slots[0, 0, :, :3].tolist() == [[0, 2, 5], [0, 1, 2]]
    bias = torch.tensor([0.0, float("-inf"), -30.0, torch.finfo(torch.float32).min, 1.5], device="cuda")
    slots, count = seen_slots(bias.to(torch.bfloat16).expand(3, 2, 4, 5))
    assert count.shape == (1, 1, 1) and count.item() == 3 and slots[0, 0, 0, :3].tolist() == [0, 2, 4]
    wide = torch.rand(2, 1, 3, 3000, device="cuda") > 0.5  # several blocks of the kernel's width
    slots, count = seen_slots(wide)
    for row, n, listed in zip(wide.reshape(-1, 3000), count.flatten().tolist(), slots.reshape(-1, 3000)):
        assert listed[:n].tolist() == row.nonzero().flatten().tolist()


GEMV_SHAPES = [(1, 258, 256), (3, 4096, 4096), (4, 50, 300), (1, 128256 // 8, 4096), (2, 4096, 14336), (1, 33, 96)]


def gemv_case(rows, n, k, dtype, bias, device):
    """x (every other column of a wider tensor: a row stride), w, b and the linear in fp64."""
    g = torch.Generator(device=device).manual_seed(rows * n + k)
    x = torch.randn(rows, 2 * k, device=device, generator=g).to(dtype)[:, ::2]
    w = (torch.randn(n, k, device=device, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=device, generator=g).to(dtype) if bias else None
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    return x, w, b, want


@cuda
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,n,k", GEMV_SHAPES)
def test_gemv_is_the_linear_rounded_once(rows, n, k, dtype, bias):
    """The GEMV kernel against the fp64 linear, at every row count it is written for (the op takes
    it at fewer: kernels.gemv.kernel_rows): within one rounding of the output (the fp32 sums of K
    products add at most K ulps of fp32, far below a 16-bit ulp); in 16 bits, as close as F.linear,
    which rounds the same sums once too."""
    from specpass.kernels import triton_gemv

    x, w, b, want = gemv_case(rows, n, k, dtype, bias, "cuda")
    got = triton_gemv.gemv(x, [w], None if b is None else [b])
    assert got.shape == (rows, n) and got.dtype == dtype
    ulp = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -20}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=ulp, atol=ulp * want.abs().max().item())
    if dtype != torch.float32:
        err, cublas_err = ((y.double() - want).abs().max().item() for y in (got, F.linear(x, w, b)))
        assert err <= 1.5 * cublas_err


@cuda
@pytest.mark.parametrize("rows,n,k,kernel", [(1, 4096, 4096, True), (4, 64, 256, True), (5, 64, 256, False),
                                             (2, 4096, 4096, False)])
def test_gemv_op_runs_the_kernel_within_its_rows(rows, n, k, kernel):
    """The op at a call's rows (a symbolic batch's calls): the kernel at one row, or up to 4 of a
    small weight; past that cuBLAS's linear, bit for bit."""
    from specpass.kernels import triton_gemv

    x, w, b, _ = gemv_case(rows, n, k, torch.bfloat16, True, "cuda")
    want = triton_gemv.gemv(x, [w], [b]) if kernel else F.linear(x, w, b)
    assert torch.equal(torch.ops.specpass.gemv(x, w, b), want)


@cuda
def test_gemv_composes_with_the_backend_and_cuda_graphs():
    """The pass on: a one-row step's linears run as the op under Inductor and CUDA graphs, with its
    values; the five-row verify's stay cuBLAS's."""
    import specpass
    from specpass.report import collecting_reports

    def step(h, w1, w2):
        return F.linear(F.silu(F.linear(h, w1)), w2) + h

    w1, w2 = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) / 16 for shape in [(512, 256), (256, 512)])
    for rows in (1, 5):
        h = torch.randn(1, rows, 256, device="cuda", dtype=torch.bfloat16)
        compiled = torch.compile(step, backend=specpass.backend(), mode="reduce-overhead", fullgraph=True,
                                 dynamic=False)  # the rows static: the second size is not a symbolic batch
        with collecting_reports() as reports:
            for _ in range(3):  # warm-up, record, replay
                got = compiled(h, w1, w2)
        torch.testing.assert_close(got, step(h, w1, w2), rtol=2 ** -7, atol=2 ** -7)
        [(_, report)] = reports
        assert [f.fired for f in report.of("gemv")] == [rows == 1] * 2


@cuda
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("ns,k", [((4096, 1024, 1024), 4096), ((50, 7), 300), ((128, 128, 16, 8), 64)])
def test_gemv_group_is_each_weight_s_gemv(ns, k, rows):
    """One launch over 2 to 4 weights: each weight's columns bit for bit the kernel's over that
    weight alone (the same chunks, the same order of sums), with and without biases."""
    from specpass.kernels import triton_gemv
    from specpass.kernels.gemv import MAX_GROUP

    assert MAX_GROUP == triton_gemv.WEIGHT_SLOTS  # the pass groups what one launch reads
    g = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    weights = [(torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16) for n in ns]
    biases = [torch.randn(n, device="cuda", generator=g).to(torch.bfloat16) for n in ns]
    for b in (None, biases):
        got = triton_gemv.gemv(x, weights, b)
        want = torch.cat([triton_gemv.gemv(x, [w], None if b is None else [bias])
                          for w, bias in zip(weights, biases)], -1)
        assert torch.equal(got, want)


@cuda
def test_gemv_group_composes_with_the_backend_and_cuda_graphs():
    """q, k and v of one row in one launch under Inductor and CUDA graphs, with their values."""
    import specpass
    from specpass.report import collecting_reports

    def step(h, wq, wk, wv):
        return F.linear(h, wq) * torch.cat([F.linear(h, wk), F.linear(h, wv)], -1)

    wq, wk, wv = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) / 16
                  for shape in [(512, 256), (256, 256), (256, 256)])
    h = torch.randn(1, 1, 256, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(step, backend=specpass.backend(gemv_group=True), mode="reduce-overhead", fullgraph=True)
    with collecting_reports() as reports:
        for _ in range(3):  # warm-up, record, replay
            got = compiled(h, wq, wk, wv)
    torch.testing.assert_close(got, step(h, wq, wk, wv), rtol=2 ** -6, atol=2 ** -6)
    [(_, report)] = reports
    assert all(f.fired and "gemv_group" in f.message for f in report.of("gemv")), report

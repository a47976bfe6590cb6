"""The CUDA implementations of `specpass::top1_lse` and `specpass::sample` (kernels/top1.py):
one pass over each row, one kernel for both.

Each element is first turned into the value the row is reduced over (`_score`): for top1_lse the
prologue folded into the op, s = x * scale or x / scale in fp32, correctly rounded (the quotient
by a reciprocal per row and Markstein corrections, `_divide`: Triton's default fp32 division is
approximate, and div_rn costs a reciprocal MUFU, a check and 5 fmas per element), then rounded
to a 16-bit dtype where the original rounded; for sample, x / T (`_divide`) plus the Gumbel
noise of the counter hash, the same uint32 arithmetic as counter.uniform so that the
uniforms are bit-identical, -inf under the floor. Then the same reduction serves both: sample keeps the max and its first index, top1_lse
also the sum of exp.

A program reads a chunk of one row, a tile of E x T elements at a step: each thread holds E
vectors of VEC adjacent elements (16 bytes, so every load is 16 bytes wide), T elements apart.
A thread's E x VEC elements of a tile are one "lane" group: the lane keeps a running max m,
z = sum(exp(x - m)) and the tile t where m last grew. Per element the work is a max, a subtract,
a multiply, an exp2 and an add; the rescale of z and the tile bookkeeping are once per lane per
step (E x VEC elements). No index is tracked per element: at the end, one reduction over the
lanes gives the chunk's max and the sum rescaled to it, and each lane holding the max reads its
tile t again (E x VEC elements, one lane per row in practice) for the first position of it; the
smallest position among them is the first index on ties, as torch.argmax. NaN and +inf turn z
into NaN (the max itself skips NaN): the chunk's max is then +inf, and its row's index 0
(softmax is NaN there).

Few rows (fewer than the GPU's SMs): each row is cut into `splits` chunks, one program each,
enough to fill the GPU, and a second, tiny kernel combines them: m = max(m_c), z = sum(z_c *
exp(m_c - m)), the index from the first chunk holding m. Otherwise one launch writes the
outputs. Tiles and splits come from `config_for`, tuned by a sweep (docs/results.md, sampling).

Triton is imported here only, on the first call on a CUDA tensor.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

NONE, MUL, DIV = 0, 1, 2  # top1_lse's prologue


@triton.jit
def _lanes(v):
    """A lane's value beside each of its elements of the tile: [LANES] -> [LANES, 1, 1]."""
    return v[:, None, None]


@triton.jit
def _step(x, m, t, z, jj, SUM: tl.constexpr):
    """Fold one tile (fp32, first column jj) into the lanes' (m, t, z); z only with SUM."""
    gm = tl.max(tl.max(x, 2), 1)  # skips NaN: a NaN shows up in z (sample has none: _score)
    t = tl.where(gm > m, jj, t)  # strictly bigger: a lane keeps the first tile holding its max
    m_new = tl.maximum(m, gm)
    if SUM:
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane of -inf alone adds 0, not NaN
        s = tl.sum(tl.sum(tl.exp2((x - _lanes(ref)) * 1.4426950408889634), 2), 1)
        z = z * tl.exp2((m - ref) * 1.4426950408889634) + s
    return m_new, t, z


@triton.jit
def _mix32(x):
    """murmur3's finaliser on uint32 (counter.mix32, there in int64)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _uniform(key, cols):
    """counter.uniform(key, cols), bit for bit: key uint32, cols int32 >= 0."""
    h = _mix32(key ^ _mix32(cols.to(tl.uint32) ^ 0x9E3779B9))
    return ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23: exact, in (0, 1)


def _divide_asm(steps: int, pack: int = 4) -> str:
    """_divide's PTX for `pack` elements: $i = x_i / t for x_i = $(pack + i), t, r = RN(1 / t) and lo
    the next operands (each repeated `pack` times, the same value)."""
    x, t, r, lo = (lambda i, k=k: f"${k * pack + i}" for k in range(1, 5))
    lines = [f"{{ .reg .f32 q<{pack}>, n, a; .reg .pred p;"]
    for i in range(pack):
        lines.append(f"mul.rn.f32 q{i}, {x(i)}, {r(0)};")
        lines += [f"neg.f32 n, q{i}; fma.rn.f32 n, n, {t(0)}, {x(i)}; fma.rn.f32 q{i}, n, {r(0)}, q{i};"] * steps
        so_far = (".and", ", p") if i else ("", "")  # p: every x_i inside [lo, 2**64] (false for NaN)
        lines.append(f"abs.f32 a, {x(i)}; setp.ge{so_far[0]}.f32 p, a, {lo(0)}{so_far[1]}; "
                     "setp.le.and.f32 p, a, 0f5F800000, p;")
    lines.append("@p bra DONE;")  # a branch, taken by whole warps in practice: the division is never speculated
    lines += [f"div.rn.f32 q{i}, {x(i)}, {t(0)};" for i in range(pack)]
    lines.append("DONE:")
    lines += [f"mov.f32 ${i}, q{i};" for i in range(pack)]
    return "\n".join(lines) + " }"


_ONE_STEP, _TWO_STEPS = tl.constexpr(_divide_asm(1)), tl.constexpr(_divide_asm(2))
_OPERANDS = tl.constexpr(",".join(["=f"] * 4 + ["f"] * 16))  # 4 quotients; x, t, r, lo for each


@triton.jit
def _reciprocal(t):
    """A row's divisor t -> (RN(1 / t), lo) for _divide: lo is the smallest |x| taken through the
    fast path, 2**-64, or +inf (none) where |t| is outside [2**-32, 2**32] or NaN."""
    fast = (tl.abs(t) >= 2.3283064365386963e-10) & (tl.abs(t) <= 4294967296.0)
    return tl.div_rn(1.0, tl.where(fast, t, 1.0)), tl.where(fast, 5.421010862427522e-20, float("inf"))


@triton.jit
def _divide(x, t, r, lo, STEPS: tl.constexpr):
    """x / t correctly rounded (IEEE, as div_rn), fp32; r and lo from _reciprocal(t). t, r and lo are
    one value per row: the asm takes each group of 4 adjacent elements with the first one's.

    Where 2**-64 <= |x| <= 2**64 and 2**-32 <= |t| <= 2**32: q = RN(x * r), then STEPS Markstein
    corrections q = RN(q + RN(x - q * t) * r) (one fma each): a multiply and 2 * STEPS fma, no MUFU.
    Every intermediate is then a normal number or exactly 0, so the result depends on the
    significands of x and t alone (a power of two scales every step exactly). One step is exact
    for every 16-bit significand (bf16 8 bits, fp16 11) against every fp32 t: all 2**30 and 2**33
    pairs, checked on the GPU (tests/test_kernels.py). For 24-bit x, RN(x * r) can be 1.04 ulp
    off (not faithful) and its remainder inexact; a first step still leaves q within
    0.5 ulp + 2**-21 ulp (faithful), and the second is exact by Markstein's theorem (r within half
    an ulp of 1/t, q within one ulp of x/t, round to nearest: RN(q + (x - q t) r) = RN(x / t), the
    remainder exact). Anything else (0, subnormal, huge, inf, NaN, t out of range) takes IEEE
    div.rn.f32 under a branch that costs nothing where no lane of a warp takes it. The asm keeps
    every rounding where it is written (no contraction, whatever enable_fp_fusion says)."""
    asm: tl.constexpr = _ONE_STEP if STEPS == 1 else _TWO_STEPS
    return tl.inline_asm_elementwise(asm, _OPERANDS, [x, t, r, lo], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def _score(raw, cols, scale, r, lo, key, floor, PROLOGUE: tl.constexpr, ROUND: tl.constexpr,
           SAMPLE: tl.constexpr, FLOOR: tl.constexpr):
    """What a row is reduced over, fp32. top1_lse: x, x * scale or x / scale
    rounded to ROUND (if not None). sample (scale: the row's temperature, key: its uint32 key):
    x / scale + gumbel(key, column), -inf where x < floor; where scale is not > 0, x. r, lo:
    _reciprocal of the divisor (sample: 1 where scale is not > 0). NaN counts as +inf there, as
    torch.argmax takes it for the largest."""
    x = raw.to(tl.float32)
    STEPS: tl.constexpr = 2 if raw.dtype == tl.float32 else 1
    if SAMPLE:
        greedy = ~(scale > 0)  # NaN too, as the torch implementation
        s = _divide(x, tl.where(greedy, 1.0, scale), r, lo, STEPS) - libdevice.log(-libdevice.log(_uniform(key, cols)))
        if FLOOR:
            s = tl.where(x >= floor, s, float("-inf"))
        s = tl.where(greedy, x, s)
        x = tl.where(s == s, s, float("inf"))
    else:
        if PROLOGUE == 1:
            x = x * scale  # rounded as torch's: an fma can only take it into exp's argument, never into s
        elif PROLOGUE == 2:
            x = _divide(x, scale, r, lo, STEPS)
        if ROUND is not None:
            x = x.to(ROUND).to(tl.float32)  # to nearest even (the interpreter truncates)
    return x


@triton.jit
def _merge(m1, z1, m2, z2):
    """Two lanes' (max, sum(exp(x - max))) as one."""
    m = tl.maximum(m1, m2)
    ref = tl.where(m == float("-inf"), 0.0, m)
    z = z1 * tl.exp2((m1 - ref) * 1.4426950408889634) + z2 * tl.exp2((m2 - ref) * 1.4426950408889634)
    return m, z


@triton.jit
def _chunk_kernel(x_ptr, stride, V, chunk, out_i_ptr, out_m_ptr, out_z_ptr, out_v_ptr, splits,
                  scale_ptr, scale_stride, scalar, key_ptr, floor_ptr,
                  E: tl.constexpr, T: tl.constexpr, VEC: tl.constexpr, FINAL: tl.constexpr, LOG: tl.constexpr,
                  PROLOGUE: tl.constexpr, PER_ROW: tl.constexpr, ROUND: tl.constexpr, SAMPLE: tl.constexpr,
                  FLOOR: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    base = x_ptr + row.to(tl.int64) * stride  # the rest of the index math is int32
    scale = tl.load(scale_ptr + row * scale_stride) if PER_ROW else scalar
    r, lo = _reciprocal(tl.where(scale > 0, scale, 1.0) if SAMPLE else scale)
    key = tl.load(key_ptr + row).to(tl.uint32) if SAMPLE else 0
    floor = tl.load(floor_ptr + row) if FLOOR else 0.0
    start = part * chunk
    end = tl.minimum(start + chunk, V)
    BLOCK: tl.constexpr = E * T
    LANES: tl.constexpr = T // VEC  # one per thread
    offs = (tl.arange(0, LANES)[:, None, None] * VEC + tl.arange(0, E)[None, :, None] * T
            + tl.arange(0, VEC)[None, None, :])
    m = tl.full([LANES], float("-inf"), tl.float32)
    t = tl.zeros([LANES], tl.int32) + start  # a lane of -inf alone: its first tile
    z = tl.zeros([LANES], tl.float32)
    full_end = start + (end - start) // BLOCK * BLOCK
    raw = tl.load(base + start + offs, mask=start < full_end, other=0.0)
    for jj in range(start, full_end, BLOCK):  # whole tiles, each loaded one step ahead
        raw_next = tl.load(base + jj + BLOCK + offs, mask=jj + BLOCK < full_end, other=0.0)
        x = _score(raw, jj + offs, scale, r, lo, key, floor, PROLOGUE, ROUND, SAMPLE, FLOOR)
        m, t, z = _step(x, m, t, z, jj, not SAMPLE)
        raw = raw_next
    if full_end < end:  # the last, partial tile
        cols = full_end + offs
        raw = tl.load(base + cols, mask=cols < end, other=0.0)
        x = tl.where(cols < end, _score(raw, cols, scale, r, lo, key, floor, PROLOGUE, ROUND, SAMPLE, FLOOR), float("-inf"))
        m, t, z = _step(x, m, t, z, full_end, not SAMPLE)
    if SAMPLE:
        top = tl.max(m, 0)
    else:
        top, z = tl.reduce((m, z), 0, _merge)
    # the first position of the max: each lane holding it scores its tile again (NaN never equals)
    cols = _lanes(t) + offs
    lane_has_top = (cols < end) & (_lanes(m) == top)
    raw = tl.load(base + cols, mask=lane_has_top, other=0.0)
    again = tl.where(lane_has_top, _score(raw, cols, scale, r, lo, key, floor, PROLOGUE, ROUND, SAMPLE, FLOOR), float("nan"))
    index = tl.min(tl.min(tl.min(tl.where(again == top, cols, end), 2), 1), 0)
    index = tl.where(index < end, index, start)  # an empty chunk
    if not SAMPLE:
        top = tl.where(z == z, top, float("inf"))  # a NaN or +inf in the chunk: its row's index is 0
    if FINAL:
        if SAMPLE:
            tl.store(out_i_ptr + row, index.to(tl.int64))
        else:
            _store_row(out_i_ptr, out_m_ptr, out_z_ptr, out_v_ptr, row, index.to(tl.int64), top, z, LOG)
    else:
        tl.store(out_i_ptr + row * splits + part, index.to(tl.int64))
        tl.store(out_m_ptr + row * splits + part, top)
        if not SAMPLE:
            tl.store(out_z_ptr + row * splits + part, z)


@triton.jit
def _combine_kernel(part_i_ptr, part_m_ptr, part_z_ptr, splits, out_i_ptr, out_m_ptr, out_lse_ptr, out_v_ptr,
                    BLOCK_S: tl.constexpr, LOG: tl.constexpr, SAMPLE: tl.constexpr):
    row = tl.program_id(0)
    parts = tl.arange(0, BLOCK_S)
    valid = parts < splits
    m = tl.load(part_m_ptr + row * splits + parts, mask=valid, other=float("-inf"))
    i = tl.load(part_i_ptr + row * splits + parts, mask=valid, other=0)
    top = tl.max(m, 0)
    index = tl.min(tl.where((m == top) & valid, i, 2**62), 0)  # chunks are in order: the first
    if SAMPLE:
        tl.store(out_i_ptr + row, index)
    else:
        z = tl.load(part_z_ptr + row * splits + parts, mask=valid, other=0.0)
        total = tl.sum(tl.where(m == float("-inf"), 0.0, z * tl.exp(m - top)), 0)
        _store_row(out_i_ptr, out_m_ptr, out_lse_ptr, out_v_ptr, row, index, top, total, LOG)


@triton.jit
def _store_row(out_i_ptr, out_m_ptr, out_lse_ptr, out_v_ptr, row, index, top, total, LOG: tl.constexpr):
    """A row's outputs from its max and sum(exp(x - max)): softmax's index (0 where the max is
    +inf or NaN, softmax being NaN there), the max, lse (NaN there) and the (log-)probability, in
    the dtype of out_v_ptr."""
    lse = top + tl.log(total)
    shifted = top - lse
    tl.store(out_i_ptr + row, tl.where(top < float("inf"), index, 0))
    tl.store(out_m_ptr + row, top)
    tl.store(out_lse_ptr + row, lse)
    value = shifted if LOG else tl.exp(shifted)
    tl.store(out_v_ptr + row, value.to(out_v_ptr.dtype.element_ty))  # rounded to nearest even


@functools.cache
def _sms(device_index: int) -> int:
    if not torch.cuda.is_available():  # the Triton interpreter (TRITON_INTERPRET=1), on CPU tensors
        return 132
    return torch.cuda.get_device_properties(device_index).multi_processor_count


PROGRAM_BYTES = 2048  # split rows: a chunk of at least this much, up to 8 programs per SM
WHOLE_ROW_BYTES = 128 * 1024  # from a quarter as many rows as SMs, rows this short are read whole


def config_for(rows: int, vocab: int, itemsize: int, sms: int = 132) -> tuple[int, int, int]:
    """(E, num_warps, splits) for rows x vocab logits of `itemsize` bytes (a sweep,
    `benchmarks/sampling.py --configs`, docs/results.md): a row per program, in tiles of 8192
    elements over 16 warps (4-byte tiles of 2048 elements over 4 warps from 8 rows per SM, 16-bit
    logits only), where the rows alone fill the GPU: at least as many as SMs, or a quarter as many
    and no longer than WHOLE_ROW_BYTES (there the second launch of a split costs more than it
    saves). Otherwise 2 KB tiles over 4 warps, each row cut into chunks of PROGRAM_BYTES or more,
    up to 8 programs per SM."""
    vec = max(1, 16 // itemsize)
    if rows >= sms or (4 * rows >= sms and vocab * itemsize <= WHOLE_ROW_BYTES):
        if rows >= 8 * sms and itemsize <= 2:
            return 2, 4, 1
        return max(1, 8192 // (vec * 32 * 16)), 16, 1
    E, warps = 1, 4
    tile = E * vec * 32 * warps
    programs = min(8 * sms, max(1, rows * vocab * itemsize // PROGRAM_BYTES))
    return E, warps, max(1, min(math.ceil(programs / rows), vocab // tile))


def top1_lse(logits: torch.Tensor, log: bool = False, dtype: torch.dtype | None = None,
             scale: torch.Tensor | None = None, scalar: float = 1.0, divide: bool = False,
             rounding: torch.dtype | None = None, config: tuple[int, ...] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(index, top, lse, value) of each row of the prologue's s (kernels/top1.py); `config` =
    (E, num_warps, splits[, num_stages]) overrides config_for (for tuning)."""
    R = logits.shape[0]
    index = logits.new_empty(R, dtype=torch.int64)
    top = logits.new_empty(R, dtype=torch.float32)
    lse = logits.new_empty(R, dtype=torch.float32)
    value = logits.new_empty(R, dtype=dtype or torch.float32)
    prologue = NONE if scale is None and scalar == 1.0 else DIV if divide else MUL
    _reduce(logits, (index, top, lse, value), config, scale=scale, scalar=scalar, LOG=log, PROLOGUE=prologue,
            ROUND=_TRITON_DTYPES[rounding] if rounding is not None else None, SAMPLE=False)
    return index, top, lse, value


def sample(logits: torch.Tensor, temperature: torch.Tensor, key: torch.Tensor, floor: torch.Tensor | None = None,
           config: tuple[int, ...] | None = None) -> torch.Tensor:
    """argmax(x / T + gumbel(key, column)) of each row over x >= floor; x's first arg-max where T is
    not > 0 (kernels/top1.py)."""
    index = logits.new_empty(logits.shape[0], dtype=torch.int64)
    _reduce(logits, (index,), config, scale=temperature, key=key, floor=floor, LOG=False, PROLOGUE=NONE, ROUND=None,
            SAMPLE=True)
    return index


_TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: None}


def _reduce(logits: torch.Tensor, outs: tuple[torch.Tensor, ...], config: tuple[int, ...] | None,
            scale: torch.Tensor | None = None, scalar: float = 1.0, key: torch.Tensor | None = None,
            floor: torch.Tensor | None = None, **flags) -> None:
    """One pass over each row into `outs` (top1_lse: index, top, lse, value; sample: index): one
    launch over whole rows, or chunks of each row and a combining launch (config_for)."""
    R, V = logits.shape
    if R == 0:
        return
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    per_row = scale is not None
    scale, key, floor = (t if t is None else t.contiguous() for t in (scale, key, floor))  # read at row
    sms = _sms(logits.device.index or 0)
    E, warps, splits, *stages = config or config_for(R, V, logits.element_size(), sms)
    vec = max(1, 16 // logits.element_size())
    T = vec * 32 * warps
    chunk = math.ceil(V / max(splits, 1) / (E * T)) * E * T
    splits = math.ceil(V / chunk) if V else 1
    row_args = (scale if per_row else logits, 1 if per_row and scale.numel() > 1 else 0, scalar,
                key if key is not None else logits, floor if floor is not None else logits)
    consts = dict(E=E, T=T, VEC=vec, num_warps=warps, PER_ROW=per_row, FLOOR=floor is not None, **flags,
                  **({"num_stages": stages[0]} if stages else {}))
    index, top, lse, value = outs if len(outs) == 4 else (outs[0],) * 4  # sample writes the index alone
    if splits == 1:
        _chunk_kernel[(R, 1)](logits, logits.stride(0), V, chunk, index, top, lse, value, 1, *row_args, FINAL=True,
                              **consts)
        return
    part_i = logits.new_empty(R, splits, dtype=torch.int64)
    part_m = logits.new_empty(R, splits, dtype=torch.float32)
    part_z = part_m if flags["SAMPLE"] else logits.new_empty(R, splits, dtype=torch.float32)
    _chunk_kernel[(R, splits)](logits, logits.stride(0), V, chunk, part_i, part_m, part_z, value, splits, *row_args,
                               FINAL=False, **consts)
    _combine_kernel[(R,)](part_i, part_m, part_z, splits, index, top, lse, value,
                          BLOCK_S=triton.next_power_of_2(splits), LOG=flags["LOG"], SAMPLE=flags["SAMPLE"])

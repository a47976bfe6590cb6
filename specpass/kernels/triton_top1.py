"""The CUDA implementation of `specpass::top1_lse` (kernels/__init__.py): one pass over each row.

Each row is cut into `splits` chunks, one program each (enough programs to fill the GPU when
there are few rows), and a second, tiny kernel combines the chunks: m = max(m_c), z = sum(z_c *
exp(m_c - m)), the index from the first chunk holding m — the first index on ties, as
torch.argmax. A row of one chunk is finished by the first kernel. Within a program each lane
keeps its own running max, first index and sum, with one exp per element (the bound for bf16
logits is the exp and compare throughput as much as memory).

Triton is imported here only, on the first call on a CUDA tensor.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements of a row read per loop step, per program
MIN_CHUNK = 2 * BLOCK  # a shorter chunk costs more to combine than it saves
LONG_CHUNK = 2**16  # longer chunks leave too few programs to hide memory latency


@triton.jit
def _chunk_kernel(x_ptr, stride, V, chunk, out_i_ptr, out_m_ptr, out_z_ptr, splits,
                  BLOCK: tl.constexpr, FINAL: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    start = part * chunk
    end = tl.minimum(start + chunk, V)
    offsets = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: running max, its first index, and
    i = tl.zeros([BLOCK], tl.int32)  # sum(exp(x - max))
    z = tl.zeros([BLOCK], tl.float32)
    for j in range(start, end, BLOCK):
        cols = j + offsets
        x = tl.load(x_ptr + row * stride + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)  # NaN -> +inf
        bigger = x > m
        # one exp per element: exp(-|x - m|) rescales the sum when x is the new max, else adds to it;
        # a lane that has seen only -inf (NaN difference) adds nothing
        e = tl.where(x == float("-inf"), 0.0, tl.exp(-tl.abs(x - m)))
        z = tl.where(bigger, z * e + 1.0, z + e)
        i = tl.where(bigger, cols, i)  # strictly bigger: a lane keeps its first index
        m = tl.where(bigger, x, m)
    top = tl.max(m, 0)
    # the first index among the lanes holding the maximum
    index = tl.min(tl.where(m == top, i, V), 0).to(tl.int64)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, z * tl.exp(m - top)), 0)
    if FINAL:
        tl.store(out_i_ptr + row, index)
        tl.store(out_m_ptr + row, top)
        tl.store(out_z_ptr + row, top + tl.log(total))
    else:
        tl.store(out_i_ptr + row * splits + part, index)
        tl.store(out_m_ptr + row * splits + part, top)
        tl.store(out_z_ptr + row * splits + part, total)


@triton.jit
def _combine_kernel(part_i_ptr, part_m_ptr, part_z_ptr, splits, out_i_ptr, out_m_ptr, out_lse_ptr,
                    BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    parts = tl.arange(0, BLOCK_S)
    valid = parts < splits
    m = tl.load(part_m_ptr + row * splits + parts, mask=valid, other=float("-inf"))
    z = tl.load(part_z_ptr + row * splits + parts, mask=valid, other=0.0)
    i = tl.load(part_i_ptr + row * splits + parts, mask=valid, other=0)
    top = tl.max(m, 0)
    index = tl.min(tl.where((m == top) & valid, i, 2**62), 0)  # chunks are in order: the first
    total = tl.sum(tl.where(m == float("-inf"), 0.0, z * tl.exp(m - top)), 0)
    tl.store(out_i_ptr + row, index)
    tl.store(out_m_ptr + row, top)
    tl.store(out_lse_ptr + row, top + tl.log(total))


@functools.cache
def _programs_wanted(device_index: int) -> int:
    return 8 * torch.cuda.get_device_properties(device_index).multi_processor_count


def splits_for(rows: int, vocab: int, device_index: int = 0) -> int:
    """Chunks per row: enough programs to fill the GPU (8 per SM), chunks no longer than
    LONG_CHUNK and no shorter than MIN_CHUNK. (Tuned on an H100: docs/results.md.)"""
    wanted = max(math.ceil(_programs_wanted(device_index) / max(rows, 1)), math.ceil(vocab / LONG_CHUNK))
    return max(1, min(wanted, vocab // MIN_CHUNK))


def top1_lse(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    R, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    index = logits.new_empty(R, dtype=torch.int64)
    top = logits.new_empty(R, dtype=torch.float32)
    lse = logits.new_empty(R, dtype=torch.float32)
    splits = splits_for(R, V, logits.device.index or 0)
    chunk = math.ceil(V / splits / BLOCK) * BLOCK
    splits = math.ceil(V / chunk)
    warps = 4 if R * splits >= _programs_wanted(logits.device.index or 0) else 8
    if splits == 1:
        _chunk_kernel[(R, 1)](logits, logits.stride(0), V, chunk, index, top, lse, 1,
                                           BLOCK=BLOCK, FINAL=True, num_warps=warps)
        return index, top, lse
    part_i = logits.new_empty(R, splits, dtype=torch.int64)
    part_m = logits.new_empty(R, splits, dtype=torch.float32)
    part_z = logits.new_empty(R, splits, dtype=torch.float32)
    _chunk_kernel[(R, splits)](logits, logits.stride(0), V, chunk, part_i, part_m, part_z, splits,
                                            BLOCK=BLOCK, FINAL=False, num_warps=warps)
    _combine_kernel[(R,)](part_i, part_m, part_z, splits, index, top, lse,
                                       BLOCK_S=triton.next_power_of_2(splits))
    return index, top, lse

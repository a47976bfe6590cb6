"""The library's split-KV attention kernel (specpass/kernels/triton_attention.py,
`torch.ops.specpass.attend_split`) on a GPU: values against fp32 math at verify and catch-up
shapes, chunks whose slots a row never sees, every chunk count, an expanded mask; and the drafters'
plain-SDPA `attend` rewritten to it by the split_kv pass inside a compiled, CUDA-graphed function.
Skipped without CUDA (CI has none; tests/test_split_kv.py shows the pass firing on the zoo's verify
on fake CUDA tensors): run through the device machine."""

import pytest
import torch
import torch.nn.functional as F

import specpass
from specpass.drafters.attention import attend
from specpass.kernels import attend_folded

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel needs a CUDA GPU and Triton")


def _case(B, T, hq, hk, S, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, hq, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(B, S, hk, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    last = torch.randint(T - 1, S, (B, 1), device="cuda", generator=g)
    last[0] = T - 1  # request 0 sees only the first T slots: every later chunk is hidden from it
    positions = last - T + 1 + torch.arange(T, device="cuda")
    mask = torch.arange(S, device="cuda")[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, S]
    return q, k, v, mask


def _reference(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                          v.transpose(1, 2).float(), attn_mask=mask, scale=scale,
                                          enable_gqa=True).transpose(1, 2)


@cuda
@pytest.mark.parametrize("B,T,hq,hk,S,d", [(16, 5, 32, 8, 4145, 128), (64, 5, 32, 8, 113, 128), (1, 5, 32, 8, 4145, 128),
                                            (3, 9, 32, 8, 700, 128), (2, 2, 8, 2, 300, 64), (4, 3, 4, 4, 200, 32),
                                            # tree verifies: more than 64 rows per K/V head, in blocks of 64
                                            (2, 16, 32, 8, 700, 128), (2, 32, 32, 8, 700, 128), (1, 32, 64, 8, 4145, 128),
                                            (3, 30, 12, 4, 300, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_fp32_math_as_closely_as_sdpa(B, T, hq, hk, S, d, dtype):
    from specpass.kernels.triton_attention import attend_split

    q, k, v, mask = _case(B, T, hq, hk, S, d, dtype)
    scale = d**-0.5
    want = _reference(q, k, v, mask, scale)
    sdpa_err = (attend_folded(q, k, v, mask, scale).float() - want).abs().max().item()
    for splits in (None, 1, 2, 7, 64):  # the chosen count, none, a ragged one, more chunks than blocks
        got = attend_split(q, k, v, mask, scale, splits=splits)
        assert got.shape == q.shape and got.dtype == dtype
        err = (got.float() - want).abs().max().item()
        assert err <= 2 * sdpa_err + 1e-3, (splits, err, sdpa_err)


@cuda
@pytest.mark.parametrize("T", [16, 32])
def test_a_tree_mask_over_blocks_of_rows(T):
    """A tree verify's mask: the prefix, then each node's own ancestors among the T node slots
    (random here), at 4 query heads per K/V head: T * 4 rows in one or two blocks."""
    from specpass.kernels.triton_attention import attend_split

    q, k, v, mask = _case(4, T, 32, 8, 900, 128)
    g = torch.Generator(device="cuda").manual_seed(1)
    n = torch.tensor([40, 300, 1, 700], device="cuda")
    slots = torch.arange(900, device="cuda")
    nodes = torch.rand(4, T, T, device="cuda", generator=g) < 0.3
    at = (slots - n[:, None]).clamp(0, T - 1)  # [B, S] the slot's node
    in_tree = (slots >= n[:, None]) & (slots < n[:, None] + T)
    mask = ((slots < n[:, None])[:, None, :] | (nodes.gather(2, at[:, None, :].expand(4, T, 900))
                                                   & in_tree[:, None, :]))[:, None]  # [B, 1, T, S]
    want = _reference(q, k, v, mask, 128**-0.5)
    err = (attend_split(q, k, v, mask, 128**-0.5).float() - want).abs().max().item()
    assert err <= 2 * (attend_folded(q, k, v, mask, 128**-0.5).float() - want).abs().max().item() + 1e-3


@cuda
def test_expanded_mask_and_strided_query():
    from specpass.kernels.triton_attention import attend_split

    q, k, v, mask = _case(4, 5, 32, 8, 1000, 128)
    q = torch.randn(4, 5, 32, 256, device="cuda", dtype=torch.bfloat16)[..., ::2]  # a non-unit last stride
    shared = mask[:1].expand(4, 1, 5, 1000)  # stride 0 along the batch
    want = _reference(q, k, v, shared, 128**-0.5)
    err = (attend_split(q, k, v, shared, 128**-0.5).float() - want).abs().max().item()
    assert err <= 2 * (attend_folded(q, k, v, shared, 128**-0.5).float() - want).abs().max().item() + 1e-3


@cuda
def test_attend_becomes_the_op_compiled_with_cuda_graphs():
    """`attend` is one SDPA call with enable_gqa; specpass's split_kv pass gives it the kernel."""
    q, k, v, mask = _case(16, 5, 32, 8, 2100, 128)
    scale = 128**-0.5
    report = specpass.explain(attend, q, k, v, mask, scale)
    assert [f.fired for f in report.of("split_kv")] == [True], str(report)
    compiled = torch.compile(attend, backend=specpass.backend(), mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, capture, replay
        out = compiled(q, k, v, mask, scale)
    want = _reference(q, k, v, mask, scale)
    err = (out.float() - want).abs().max().item()
    assert err <= 2 * (attend(q, k, v, mask, scale).float() - want).abs().max().item() + 1e-3, err

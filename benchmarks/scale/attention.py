"""The verify's attention alone per kernel, and a fused round's GPU time per kernel (see the package doc)."""

from __future__ import annotations

import torch

from benchmarks import harness
from specpass.kernels import attend_folded
from specpass.loop import Decoder


def attention_bench(bs: int, queries: int, slots: int, device: torch.device) -> dict[str, float]:
    """One verify-shaped attention call (Llama-3-8B heads) per SDPA backend and FlexAttention: µs,
    CUDA-graph replays; and each one's max error against the math backend in fp32. `*_folded`:
    `specpass.kernels.attend_folded` (GQA folded into the query axis, fold included) on that backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    hq, hk, d = 32, 8, 128
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(bs, hq, queries, d, device=device, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(bs, hk, slots, d, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    start = torch.randint(0, slots - queries, (bs, 1), device=device, generator=g)
    pos = start + torch.arange(queries, device=device)  # [B, T]
    mask = torch.arange(slots, device=device)[None, None, None, :] <= pos[:, None, :, None]  # [B, 1, T, S]

    def sdpa(backend):
        def run():
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return run

    def folded(backend):  # in the caches' layout [B, S, hk, d] (views), out [B, T, hq, d] -> [B, hq, T, d]
        def run():
            with sdpa_kernel([backend]):
                return attend_folded(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
                                     d**-0.5).transpose(1, 2)
        return run

    flex = torch.compile(flex_attention, dynamic=False)

    def flex_run():
        block = create_block_mask(lambda b, h, qi, kv: kv <= pos[b, qi], bs, None, queries, slots, device=device)
        return flex(q, k, v, block_mask=block, enable_gqa=True)

    variants = {"cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
                "math": sdpa(SDPBackend.MATH), "flex": flex_run,
                "cudnn_folded": folded(SDPBackend.CUDNN_ATTENTION),
                "efficient_folded": folded(SDPBackend.EFFICIENT_ATTENTION)}
    with sdpa_kernel([SDPBackend.MATH]):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    return dict(bs=bs, queries=queries, slots=slots, **harness.time_candidates(variants, ref))


def kernel_profile(dec: Decoder, prompts, short: int, long: int) -> dict:
    """A round on the GPU, from a profiled long generate minus a profiled short one: its kernels and
    their summed time, the idle time between them (`harness.gaps_per_round`, the long run's), and
    the kernels by name, the most time first."""
    from torch.profiler import ProfilerActivity, profile

    per_run = []
    for n in (short, long):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            rounds = dec.generate(prompts, n).metrics.rounds
        totals: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                t = totals.setdefault(e.name, [0.0, 0])
                t[0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                t[1] += 1
        per_run.append((rounds, totals))
    (r0, t0), (r1, t1) = per_run
    rows = []
    for name, (us, calls) in t1.items():
        us0, calls0 = t0.get(name, (0.0, 0))
        rows.append(dict(kernel=name[:120], kind=kernel_kind(name), ms=(us - us0) / 1e3 / (r1 - r0),
                         calls=(calls - calls0) / (r1 - r0)))
    rows.sort(key=lambda r: -r["ms"])
    return dict(gpu_ms=sum(r["ms"] for r in rows), kernels=sum(r["calls"] for r in rows),
                gaps=harness.gaps_per_round(prof, r1), top=rows[:40])


def kernel_kind(name: str) -> str:
    """A kernel's kind by its name. Inductor's Triton kernels first: their names list the ops they
    fused (`..._rms_norm_..._embedding_...` holds "mm_"), and only its templates are matmuls."""
    n = name.lower()
    if n.startswith("triton"):
        return "matmul" if n.startswith("triton_tem") else "triton"
    if any(s in n for s in ("fmha", "attention", "attn", "cudnn", "flash", "sdpa")):
        return "attention"
    if any(s in n for s in ("gemm", "gemv", "xmma", "cutlass", "nvjet", "sm90", "matmul", "mm_")):
        return "matmul"
    return "other"

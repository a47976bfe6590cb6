"""The benchmarks' profile figures: the idle time (the gaps between device activities over the
middle 80% of them, per round, on a made-up timeline with known gaps), and a kernel's kind by its
name (names from an H200 profile of a Llama-3-8B step, docs/scale_gemv_8b.json)."""

from types import SimpleNamespace

import pytest

from benchmarks.harness import gaps_per_round


def event(start, end, device="CUDA"):
    return SimpleNamespace(device_type=SimpleNamespace(name=device), time_range=SimpleNamespace(start=start, end=end))


def timeline(rounds, kernels, busy, gap, between):
    """`rounds` rounds of `kernels` kernels each `busy` us long, `gap` us apart inside a round and
    `between` us apart across rounds; a CPU event in every round, which is not the device's."""
    events, t = [], 0.0
    for _ in range(rounds):
        for i in range(kernels):
            events.append(event(t, t + busy))
            t += busy + (gap if i < kernels - 1 else between)
        events.append(event(t - 1, t, device="CPU"))
    return SimpleNamespace(events=lambda: events[::-1])  # any order: sorted by start


def test_gaps_per_round():
    gaps = gaps_per_round(timeline(rounds=200, kernels=10, busy=3.0, gap=0.5, between=20.0), rounds=200)
    # a round: 9 gaps of 0.5 us and one of 20 (the window's edges cut one gap of its 160 rounds)
    assert gaps["idle_us"] == pytest.approx(9 * 0.5 + 20.0, abs=20 / 160 + 0.05)
    assert gaps["long"] == pytest.approx(1.0, abs=0.02) and gaps["long_us"] == pytest.approx(20.0, abs=0.2)
    assert gaps["longest_us"] == 20.0


def test_overlapping_activities_are_no_gap():
    """(5, 8) runs inside (0, 10) on another stream: (9, 20) starts while the device is busy."""
    prof = SimpleNamespace(events=lambda: [event(i * 100 + a, i * 100 + b) for i in range(20)
                                           for a, b in ((0, 10), (5, 8), (9, 20), (30, 40))])
    gaps = gaps_per_round(prof, rounds=20)  # the window: 16 rounds
    assert gaps["longest_us"] == 60.0  # 40 -> the next round's 100
    assert gaps["idle_us"] == pytest.approx(10 + 60, abs=60 / 16 + 0.1)  # 20 -> 30, 40 -> 100; none at 8 -> 9


def test_no_device_activity():
    with pytest.raises(ValueError, match="too few to measure gaps"):
        gaps_per_round(SimpleNamespace(events=lambda: [event(0, 1, device="CPU")]), rounds=1)


@pytest.mark.parametrize("name,kind", [
    ("triton_red_fused__fused_rms_norm__to_copy_add_arange_cat_cos_div_embedding_le_matmul_mul_pow_reciprocal_rms_norm_scalar_", "triton"),
    ("triton_poi_fused__fused_rms_norm__to_copy_add_arange_cat_cos_div_embedding_le_matmul_mul_neg_pow_reciprocal_scalar_tenso", "triton"),
    ("triton_tem_fused_mm_0", "matmul"),
    ("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT", "matmul"),
    ("_gemv", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_3_64x64x64_4x1x1_kernel0_0", "attention"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, __nv_bfloat16>", "other"),
])
def test_kernel_kind(name, kind):
    from benchmarks.scale.attention import kernel_kind

    assert kernel_kind(name) == kind

"""The roofline of attention (``flashtile.bench.roofline``): the committed ceilings, intensities and times."""

from __future__ import annotations

import pytest

from flashtile.bench import roofline, shapes

CEILINGS = {"tflops": 800.0, "tbps": 4.0}


def test_the_committed_ceilings_are_the_anchors_numbers_with_provenance():
    import json

    raw = json.loads((roofline.RESULTS / "ceilings.json").read_text())
    assert raw["ceilings"] == {"matmul_bf16_tflops_8192cube": 788.3, "device_copy_TBps_read_plus_write": 4.27}
    assert "H200" in raw["provenance"]["gpu"] and "h200-sdpa-2026-11-29.json" in raw["provenance"]["source"]
    assert roofline.load_ceilings() == {"tflops": 788.3, "tbps": 4.27}


def test_intensity_is_t_over_two_dense_and_rises_with_gqa():
    for B, H, T, D in [(1, 1, 128, 64), (4, 32, 4096, 128)]:
        assert roofline.arithmetic_intensity(shapes.shape(B, H, T, D, False)) == T / 2
        assert roofline.arithmetic_intensity(shapes.shape(B, H, T, D, True)) == T / 4
    gqa = shapes.shape(1, 32, 1024, 128, False, H_kv=8)
    assert roofline.attention_bytes(gqa) == 2 * 128 * (2 * 32 * 1024 + 2 * 8 * 1024)
    assert roofline.arithmetic_intensity(gqa) == pytest.approx(4 * 1024 / (2 * 2.5))


def test_the_roofline_time_is_the_slower_of_compute_and_memory():
    assert roofline.ridge_intensity(CEILINGS) == 200.0
    short, long = shapes.shape(1, 1, 256, 64, False), shapes.shape(1, 1, 1024, 64, False)  # I = 128 and 512
    assert roofline.roofline_ms(short, CEILINGS) == pytest.approx(1e3 * roofline.attention_bytes(short) / 4e12)
    assert roofline.roofline_ms(long, CEILINGS) == pytest.approx(1e3 * 4 * 1024**2 * 64 / 800e12)


def test_unfused_intensity_follows_the_io_model_and_stays_under_d_over_two():
    for T, d in [(128, 64), (4096, 64), (65536, 256)]:
        assert roofline.standard_attention_intensity(T, d) == pytest.approx(T * d / (2 * (T + d)))
        assert roofline.standard_attention_intensity(T, d) < d / 2

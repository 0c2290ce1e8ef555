"""The ``flashtile_fp8`` provider of the forward tables, on the CPU (FP8 runs on the reference tier there).

Its output is checked against the float32 truth of the original inputs with FP8's tolerance (and that
tolerance still refuses an O(1) error), its E4M3 copies are made once per set of inputs, not on every
timed call, and its rows say what they computed. It is not in the default list: it runs when named.
"""

from __future__ import annotations

import pytest
import torch

import flashtile.fp8
from flashtile.bench import forward, shapes
from flashtile.bench import providers as prov


def test_fp8_is_a_provider_by_name_only():
    assert "flashtile_fp8" in prov.PROVIDERS and "flashtile_fp8" not in prov.DEFAULT_PROVIDERS
    assert prov.provider_dtype("flashtile_fp8", {"dtype": "bf16"}) == "fp8_e4m3"
    assert prov.provider_dtype("flashtile", {"dtype": "bf16"}) == "bf16"


def test_fp8_rows_are_checked_with_fp8_tolerance_and_say_what_they_computed(monkeypatch):
    s = dict(shapes.shape(2, 4, 96, 64, True), dtype="fp32")
    q, k, v = prov.make_inputs(s, "cpu")
    truth = prov.reference_output(q, k, v, True)
    quantized = []
    real = flashtile.fp8.quantize
    monkeypatch.setattr(flashtile.fp8, "quantize", lambda x, *a, **kw: quantized.append(x) or real(x, *a, **kw))
    timed = []
    row = forward.measure_provider("flashtile_fp8", s, q, k, v, truth, device="cpu",
                                   timer=lambda fn: [fn() for _ in range(3)] and timed.append(3) or 1.0)  # fmt: skip
    assert [x is y for x, y in zip(quantized, (q, k, v))] == [True] * 3 and len(quantized) == 3  # once, 4 calls
    assert timed == [3]
    assert row["dtype"] == "fp8_e4m3" and row["input_dtype"] == "fp32" and row["granularity"] == "head"
    o = prov.build("flashtile_fp8", s, "cpu")(q, k, v)
    relative = ((o.float() - truth).norm() / truth.norm()).item()
    assert 1e-3 < relative < prov.TOLERANCE["fp8_e4m3"][1]  # FP8's error: real, and inside its bound
    assert row["max_abs_err_vs_fp32"] == pytest.approx((o.float() - truth).abs().max().item(), rel=1e-2)


def test_fp8_tolerance_refuses_a_wrong_scale():
    truth = torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(prov.WrongAnswer):
        prov.check_output("flashtile_fp8", 1.5 * truth, truth, "fp8_e4m3")
    prov.check_output("flashtile_fp8", truth * (1 + 0.02), truth, "fp8_e4m3")  # within FP8's error: passes

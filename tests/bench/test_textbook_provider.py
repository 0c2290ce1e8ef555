"""The ``flashtile_textbook`` provider in the forward and backward tables, on the CPU (Triton's interpreter).

The forward provider is checked the way a GPU run checks it (``forward.measure``: the float32 truth first,
then a fake timer); the backward provider's gradients against autograd through the float64 formula of
tests/_truth.py. Shapes the textbook kernels do not take become rows that say why, in both tables (the site's
tables show the provider's columns once a run has measured it: tests/hooks/test_render_tables.py).
"""

from __future__ import annotations

import torch

from flashtile.bench import backward, forward, shapes
from flashtile.bench import providers as prov
from tests._truth import truth_with_grads


class CountingTimer:
    def __init__(self):
        self.calls = 0

    def __call__(self, fn) -> float:
        self.calls += 1
        fn()
        return 1.0


def test_the_textbook_provider_is_in_both_tables_by_default():
    assert "flashtile_textbook" in prov.PROVIDERS
    assert "flashtile_textbook" in backward.DEFAULT_PROVIDERS


def test_the_textbook_forward_is_checked_against_the_truth_and_timed():
    """A bthd fp16 causal shape with a ragged T: the provider agrees with the float32 truth, then is timed."""
    s = shapes.shape(1, 2, 70, 40, True, layout="bthd", dtype="fp16")
    timer = CountingTimer()
    rows = forward.measure(s, ["flashtile_textbook", "naive"], timer=timer, device="cpu")
    ours = rows[0]
    assert ours["provider"] == "flashtile_textbook" and ours["ms"] == 1.0 and timer.calls == 2
    assert ours["max_abs_err_vs_fp32"] < prov.TOLERANCE["fp16"][0]


def test_shapes_the_textbook_does_not_take_become_skipped_rows():
    """GQA and D = 256 (both in the model shapes) are rows with a reason, not a stopped run."""
    for s, reason in ((shapes.shape(1, 4, 32, 16, True, H_kv=2), "no GQA"),
                      (shapes.shape(1, 2, 32, 256, True), "head dims up to 128")):  # fmt: skip
        q, k, v = prov.make_inputs(s, device="cpu")
        truth = prov.reference_output(q, k, v, s["causal"])
        row = forward.measure_provider("flashtile_textbook", s, q, k, v, truth, timer=CountingTimer(), device="cpu")
        assert row["ms"] is None and row["error"].startswith("skipped") and reason in row["error"]
        assert prov.textbook_skip(s) == row["error"]
    assert prov.textbook_skip(shapes.shape(1, 2, 32, 128, True)) is None  # control: D = 128 without GQA runs


def test_the_textbook_backward_provider_gives_float64_gradients_through_autograd():
    s = shapes.shape(1, 2, 45, 24, True, dtype="fp32")
    fn = backward.providers(s, ["flashtile_textbook"])["flashtile_textbook"]
    gen = torch.Generator().manual_seed(4)
    q, k, v, do = (torch.randn(1, 2, 45, 24, generator=gen) for _ in range(4))
    leaves, o = backward.gradients(fn, q, k, v, do)
    o_ref, _, grads_ref = truth_with_grads(q, k, v, do, True)
    torch.testing.assert_close(o.detach().double(), o_ref, atol=2e-5, rtol=2e-5)
    for leaf, g in zip(leaves, grads_ref):
        torch.testing.assert_close(leaf.grad.double(), g, atol=1e-4, rtol=1e-4)


def test_the_backward_table_measures_the_textbook_and_skips_what_it_does_not_take(monkeypatch):
    """backward.measure end to end on the CPU: SDPA's flash backend gives the reference gradients, the
    textbook's are checked against them and timed (a fake timer); a GQA shape gives a skipped row."""
    calls = []
    monkeypatch.setattr(backward, "make_inputs", lambda s: prov.make_inputs(s, device="cpu"))
    monkeypatch.setattr(backward, "median_ms", lambda fn, **kw: calls.append(fn()) or 1.0)
    s = shapes.shape(1, 2, 40, 16, True, dtype="fp32", layout="bthd")
    rows = backward.measure(s, ["flashtile_textbook", "sdpa_flash"])
    assert [r["provider"] for r in rows] == ["flashtile_textbook", "sdpa_flash"] and len(calls) == 2
    assert rows[0]["ms"] == 1.0 and rows[0]["max_abs_grad_diff_vs_sdpa"] < 1e-4
    gqa = backward.measure(shapes.shape(1, 4, 40, 16, True, H_kv=2, dtype="fp32"), ["flashtile_textbook"])
    assert gqa[0]["ms"] is None and gqa[0]["error"] == "skipped: the textbook kernel has no GQA" and len(calls) == 2

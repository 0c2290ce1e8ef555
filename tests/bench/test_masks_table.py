"""The mask table's truth and FLOP count, on the CPU: what ``python -m flashtile.bench masks`` checks and divides by."""

import pytest
import torch

from _truth import definition_mask, masked_truth
from flashtile.bench import masks


def test_window_truth_is_the_definitions_softmax_under_the_causal_window():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 70, 16, generator=gen) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # GQA: two query heads per key/value head
    for W in (1, 9, 100):
        keep = definition_mask(70, 70, (W - 1, 0), True, "upper_left")
        expected, _ = masked_truth(q.double(), k.double(), v.double(), keep)
        torch.testing.assert_close(masks.window_truth(q, k, v, W, rows=16).double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("provider", ["flashtile", "sdpa_cudnn"])
def test_rows_count_the_flops_of_the_pairs_their_mask_keeps(provider):
    s = dict(B=1, H=2, H_kv=2, Tq=50, Tk=50, D=8, causal=True, layout="bhtd", dtype="bf16")
    window = (9, 0) if provider == "flashtile" else None  # the window's providers, and full causal
    kept = int(definition_mask(50, 50, window, True, "upper_left").sum())
    fwd, bwd = (masks.row(s, provider, 10, which, ms=1.0) for which in ("forward", "backward"))
    assert fwd["mask"] == ("window:9,0" if window else "causal")
    assert fwd["tflops"] == round(4 * 2 * 8 * kept / 1e-3 / 1e12, 1)
    assert bwd["tflops"] == round(2.5 * 4 * 2 * 8 * kept / 1e-3 / 1e12, 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_the_mask_table_needs_cuda(tmp_path):
    with pytest.raises(SystemExit, match="need a CUDA device"):
        masks.main(["--out", str(tmp_path / "x.json")])

"""The sinks' gradient kernel (``kernels.sinks``) against the float64 sum written here, in the interpreter:
strided rows, a sink of -inf, rows whose lse is -inf, and sinks in float32 and 16-bit dtypes."""

import math

import pytest
import torch

from flashtile.kernels.sinks import sink_gradient


def float64_sum(sinks, lse, delta):
    """-(sum over b and i of exp(sink_h - lse_bhi) * delta_bhi), a sink of -inf counting 0, by loops."""
    B, H, T = lse.shape
    out = []
    for h in range(H):
        sink = float(sinks[h])
        total = 0.0
        if sink != -math.inf:
            for b in range(B):
                for i in range(T):
                    total += math.exp(sink - float(lse[b, h, i])) * float(delta[b, h, i])
        out.append(-total)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T", [5, 1030])  # under one step of rows, and over one (with a partial step)
def test_the_kernel_sums_every_row_of_its_head(dtype, T):
    gen = torch.Generator().manual_seed(T)
    B, H = 2, 3
    sinks = torch.randn(H, generator=gen).to(dtype)
    sinks[1] = -math.inf  # no sink: 0
    # strided (B, H, T), and at least the sink, as a forward with it gives lse
    lse = torch.randn(H, B, T, generator=gen).permute(1, 0, 2) + 2.0
    lse = torch.logaddexp(lse, sinks.float()[None, :, None]).transpose(0, 1).contiguous().transpose(0, 1)
    delta = torch.randn(B, H, T, generator=gen)
    got = sink_gradient(sinks, lse, delta)
    want = float64_sum(sinks.double(), lse.double(), delta.double())
    assert got.dtype == dtype and got[1] == 0
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_rows_without_key_or_sink_count_zero_and_the_kept_launch_serves_again():
    sinks = torch.tensor([0.5, -math.inf])
    lse = torch.tensor([[[1.0, 0.5], [-math.inf, -math.inf]]])  # (1, 2, 2): head 1 has no key and no sink
    delta = torch.tensor([[[2.0, 3.0], [4.0, 5.0]]])
    want = -(math.exp(0.5 - 1.0) * 2.0 + math.exp(0.0) * 3.0)
    for _ in range(2):  # the second call from the launch kept for these layouts
        got = sink_gradient(sinks, lse, delta)
        assert got[1] == 0 and got[0].item() == pytest.approx(want)
    strided = torch.stack([sinks, sinks], 1)[:, 0]  # a view with stride 2
    assert sink_gradient(strided, lse[:, :, :1], delta[:, :, :1])[0].item() == pytest.approx(-math.exp(0.5 - 1.0) * 2)


def test_an_lse_rounded_below_its_huge_sink_counts_the_sink_once_not_inf():
    """A row that saw no key has lse = sink in exact arithmetic; past 2^24 in magnitude the forward's
    float32 rounding may put lse a few units below the sink. p_sink is a probability, at most 1: the row
    counts its delta once, and no e^(sink - lse) overflows into inf or NaN."""
    sinks = torch.tensor([5e9, -1e30])
    below = torch.tensor([5e9 - 512.0, -1e30 - 1e23])  # float32 neighbours under each sink
    assert (below < sinks).all()
    lse = torch.stack([below, torch.tensor([6e9, 1.0])], -1)[None]  # (1, 2, 2): row 1 far above the sink
    delta = torch.tensor([[[0.25, 3.0], [-0.5, 2.0]]])
    got = sink_gradient(sinks, lse, delta)
    assert torch.equal(got, torch.tensor([-0.25, 0.5]))

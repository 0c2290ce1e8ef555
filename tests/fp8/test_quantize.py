"""flashtile.fp8.quantize and hadamard_rotation against float64 formulas written from E4M3's definition."""

from __future__ import annotations

import pytest
import torch

from flashtile.fp8 import GRANULARITIES, hadamard_rotation, quantize

HALF_ULP = 2.0**-4  # 3 mantissa bits: a normal value x in [2^e, 2^(e+1)) is stored to within 2^(e-4) <= 2^-4 |x|
SUBNORMAL_STEP_HALF = 2.0**-10  # below 2^-6 the spacing is 2^-9: within half of it, absolutely


def inputs(*shape, seed=0, dtype=torch.float32, outliers=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    if outliers:  # FlashAttention-3's test inputs: 0.1 % of the entries drawn with standard deviation 10
        pick = torch.rand(*shape, generator=gen, dtype=torch.float64) < 1e-3
        x = torch.where(pick, 10 * torch.randn(*shape, generator=gen, dtype=torch.float64), x)
    return x.to(dtype)


def dequantised(x8, descale):
    return x8.double() * descale.double()[..., None]


def round_trip_bound(x, descale):
    """max(2^-4 |x|, 2^-10 descale): E4M3's rounding error, in x's units, for a value scaled by 1 / descale."""
    return torch.maximum(HALF_ULP * x.double().abs(), SUBNORMAL_STEP_HALF * descale.double()[..., None])


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_round_trip_error_is_within_half_an_e4m3_ulp(granularity, rotate, dtype):
    x = inputs(2, 3, 70, 32, seed=1, dtype=dtype, outliers=True)
    x8, descale = quantize(x, granularity, rotate=rotate)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == x.shape and x8.is_contiguous()
    assert descale.dtype == torch.float32 and descale.shape == x.shape[:-1]
    target = x.double() @ hadamard_rotation(32) if rotate else x.double()
    error = (dequantised(x8, descale) - target).abs()
    ratio = (error / round_trip_bound(target, descale)).max().item()
    assert ratio <= 1 + 1e-6  # float32 arithmetic in the scaling adds a few 2^-24
    assert ratio > 0.8  # the bound is reached (near-ties exist in 13,440 values): it is the bound, not a loose one


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_each_groups_largest_value_lands_on_448(granularity):
    x = inputs(2, 3, 70, 16, seed=2, outliers=True)
    x8, descale = quantize(x, granularity, block=32 if granularity == "block" else None)
    codes = x8.double().abs().amax(dim=-1)  # (B, H, T): per row
    if granularity == "tensor":
        assert codes.max().item() == 448.0 and torch.all(descale == descale.flatten()[0])
    elif granularity == "head":
        assert torch.all(codes.amax(dim=-1) == 448.0)
        assert torch.all(descale == descale[..., :1])
        assert torch.allclose(descale[..., 0].double(), x.double().abs().amax(dim=(2, 3)) / 448, rtol=1e-6)
    else:  # rows 0-31, 32-63, 64-69: the last block is ragged
        for start, end in ((0, 32), (32, 64), (64, 70)):
            assert torch.all(codes[..., start:end].amax(dim=-1) == 448.0)
            assert torch.all(descale[..., start:end] == descale[..., start : start + 1])
            amax = x.double().abs()[..., start:end, :].amax(dim=(2, 3))
            assert torch.allclose(descale[..., start].double(), amax / 448, rtol=1e-6)


def test_a_block_without_the_outlier_gets_a_finer_factor():
    x = inputs(1, 1, 128, 16, seed=3)
    x[0, 0, 5, 3] = 60.0  # one outlier, in the first block of 64 rows
    _, per_tensor = quantize(x, "tensor")
    _, per_block = quantize(x, "block", block=64)
    assert torch.all(per_block[..., :64] == per_tensor[..., :64])
    assert torch.all(per_block[..., 64:] < per_tensor[..., 64:] / 10)


def test_rotation_is_orthonormal_with_entries_plus_or_minus_one_over_sqrt_d():
    for D in (1, 2, 16, 64, 128, 256):
        R = hadamard_rotation(D)
        assert torch.allclose(R @ R.T, torch.eye(D, dtype=torch.float64), rtol=0, atol=1e-14)
        assert torch.allclose(R.abs(), torch.full((D, D), D**-0.5, dtype=torch.float64), rtol=0, atol=1e-15)
        assert torch.equal(hadamard_rotation(D), R)  # one fixed transform per D
    signs = hadamard_rotation(64)[:, 0] * 8  # H_D's first column is all ones: R's is the random signs
    assert torch.all(signs.abs() == 1) and 0 < int((signs > 0).sum()) < 64  # randomized, not plain Hadamard


def test_q_and_k_rotated_in_separate_calls_keep_their_scores():
    q, k = inputs(2, 2, 40, 64, seed=4, dtype=torch.float64), inputs(2, 2, 50, 64, seed=5, dtype=torch.float64)
    R = hadamard_rotation(64)
    scores = torch.einsum("bhid,bhjd->bhij", q, k)
    torch.testing.assert_close(torch.einsum("bhid,bhjd->bhij", q @ R, k @ R), scores, rtol=0, atol=1e-12)
    # quantised in two calls: the scores move only by the rounding of the rotated q and k
    (q8, dq), (k8, dk) = quantize(q, rotate=True), quantize(k, rotate=True)
    qr, kr = q @ R, k @ R
    rounded = torch.einsum("bhid,bhjd->bhij", dequantised(q8, dq), dequantised(k8, dk))
    bound = torch.einsum("bhid,bhjd->bhij", round_trip_bound(qr, dq), kr.abs() + round_trip_bound(kr, dk))
    bound += torch.einsum("bhid,bhjd->bhij", qr.abs(), round_trip_bound(kr, dk))
    assert torch.all((rounded - scores).abs() <= bound * (1 + 1e-6) + 1e-12)


def test_the_rotation_spreads_an_outlier_channel():
    x = inputs(1, 1, 64, 128, seed=6, dtype=torch.float64)
    x[..., 7] *= 30  # one channel 30 times larger
    spread = (x @ hadamard_rotation(128)).abs().amax() / x.abs().amax()
    assert spread < 0.4  # its energy now shared by 128 channels: the group's amax, and its factor, fall


def test_views_and_negative_bits_read_their_values():
    x = inputs(2, 40, 3, 32, seed=7).transpose(1, 2)  # (B, H, T, D) view of a (B, T, H, D) tensor
    expected = quantize(x.contiguous(), "block", block=16)
    for view in (x, torch._neg_view(-x)):  # a negative-bit view holds -(-x) = x
        x8, descale = quantize(view, "block", block=16)
        assert torch.equal(x8.view(torch.uint8), expected[0].view(torch.uint8))
        assert torch.equal(descale, expected[1])


def test_an_all_zero_group_gets_zero_codes_and_a_usable_factor():
    x = inputs(1, 2, 8, 16, seed=8)
    x[:, 1] = 0.0
    x8, descale = quantize(x, "head")
    assert torch.all(x8[:, 1].double() == 0) and torch.all(descale > 0) and torch.all(torch.isfinite(descale))
    torch.testing.assert_close(dequantised(x8, descale)[:, 1], torch.zeros(1, 8, 16, dtype=torch.float64))


BAD = [
    (dict(x=torch.ones(1, 1, 2, 4, dtype=torch.int32)), TypeError, "x must have dtype"),
    (dict(x=torch.ones(1, 1, 2, 4).to(torch.float8_e4m3fn)), TypeError, "x must have dtype"),
    (dict(x=[[1.0]]), TypeError, "x must be a torch.Tensor"),
    (dict(x=torch.ones(2, 4, 8)), ValueError, "rank-4"),
    (dict(x=torch.ones(1, 1, 0, 4)), ValueError, "x is empty"),
    (dict(granularity="row"), ValueError, "granularity must be one of"),
    (dict(granularity=None), ValueError, "granularity must be one of"),
    (dict(rotate=1), TypeError, "rotate must be a bool"),
    (dict(x=torch.ones(1, 1, 2, 48), rotate=True), ValueError, "power of two"),
    (dict(granularity="block", block=0), ValueError, "block must be a positive int"),
    (dict(granularity="block", block=2.5), TypeError, "block must be a positive int"),
    (dict(block=16), ValueError, "block applies only to granularity='block'"),
    (dict(x=torch.tensor([1.0, float("inf")]).view(1, 1, 1, 2)), ValueError, "inf or NaN"),
    (dict(x=torch.tensor([1.0, float("nan")]).view(1, 1, 1, 2)), ValueError, "inf or NaN"),
    (dict(x=torch.full((1, 1, 1, 2), 1e300, dtype=torch.float64)), ValueError, "too large for a float32 factor"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD, ids=[m for _, _, m in BAD])
def test_bad_arguments_are_refused_by_name(kwargs, error, message):
    kwargs = {"x": torch.ones(1, 1, 2, 4), **kwargs}
    with pytest.raises(error, match=message):
        quantize(**kwargs)


@pytest.mark.parametrize("D", [0, 12, -4, 2.0, True])
def test_rotation_needs_a_power_of_two(D):
    with pytest.raises(ValueError, match="D must be a power of two"):
        hadamard_rotation(D)


def test_keys_contiguous_lays_the_same_codes_out_along_t():
    x = torch.randn(2, 3, 40, 16, dtype=torch.float64)
    x8, descale = quantize(x, "block")
    laid_out, descale_again = quantize(x, "block", keys_contiguous=True)
    assert laid_out.stride() == (3 * 16 * 40, 16 * 40, 1, 40)
    assert torch.equal(laid_out.view(torch.uint8), x8.view(torch.uint8)) and torch.equal(descale_again, descale)
    with pytest.raises(TypeError, match="keys_contiguous must be a bool"):
        quantize(x, keys_contiguous="yes")


def test_factors_one_per_head_are_stored_once_per_head():
    """Per tensor and per head, descale is (B, H, T) with stride 0 along T: one value per (batch, head) in memory,
    the layout the FP8 kernel reads as "one factor a head" (its step without a factor on each score or a
    ratio on P); per block, one factor a row, contiguous. The values are the same either way."""
    x = torch.randn(2, 3, 40, 16, generator=torch.Generator().manual_seed(21))
    for granularity in ("tensor", "head"):
        _, descale = quantize(x, granularity)
        assert descale.shape == (2, 3, 40) and descale.stride(-1) == 0, granularity
        assert torch.equal(descale.contiguous(), descale[..., :1].expand(2, 3, 40).contiguous())
    _, descale = quantize(x, "block")
    assert descale.is_contiguous()

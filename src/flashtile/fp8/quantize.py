"""Quantising q, k and v to E4M3 with a float32 factor per row, optionally after a Hadamard rotation.

E4M3 keeps 3 mantissa bits and exponents from 2^-6 to 2^8 (subnormals down to 2^-9), so a value is
stored with a relative error of at most 2^-4, provided it is first scaled into E4M3's range. Scaling
by 448 / amax, amax the largest magnitude of a group of rows, puts the group's largest value at 448,
the format's largest; the factor that undoes it, ``descale = amax / 448``, is kept in float32. The
group is the whole tensor, one (batch, head), or a block of ``block`` consecutive rows of one head.

Whatever the group, ``descale`` comes back with one factor per row, shape (B, H, T): a row's factor
leaves a dot product over the head dimension exactly, q_i · k_j = (q8_i · k8_j) dq_i dk_j, so the
kernel needs no knowledge of the group. Per tensor and per head every row of the group holds the same
factor, stored once per (batch, head) (stride 0 along T), a layout the kernel reads as "one per head";
per block the factors cost 4 bytes a row, 4 / D of the codes' size.

``rotate=True`` multiplies the head dimension by R = diag(signs) H_D / sqrt(D) first, H_D the Sylvester
Hadamard matrix and the signs drawn once from a fixed seed: one R per D, so q and k rotated in separate
calls still give q R (k R)ᵀ = q kᵀ, R being orthonormal. An outlier channel is spread over all D
channels by it (FlashAttention-3's incoherent processing).
"""

from __future__ import annotations

import functools
import math

import torch

from .._checks import FLOAT_DTYPES, check_block, check_flag, check_tensor, resolve_neg_bits
from ..reference.fp8 import E4M3_MAX, to_e4m3, vouch_for_factors

GRANULARITIES = ("tensor", "head", "block")
DEFAULT_BLOCK = 64  # rows per group with granularity="block"
ROTATION_SEED = 34  # the signs of R; one fixed draw, so every call for a given D gets the same R
FLOAT32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32, the smallest factor used


@functools.cache
def _rotation64(D: int) -> torch.Tensor:
    hadamard = torch.ones(1, 1, dtype=torch.float64)
    while hadamard.shape[0] < D:  # Sylvester: H_2n = [[H, H], [H, -H]]
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    generator = torch.Generator().manual_seed(ROTATION_SEED)
    signs = torch.randint(0, 2, (D,), generator=generator, dtype=torch.int64).double() * 2 - 1
    return signs[:, None] * hadamard / math.sqrt(D)


def hadamard_rotation(D: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """R (D, D) = diag(signs) H_D / sqrt(D), orthonormal (R Rᵀ = I); D a power of two. ``x @ R`` rotates
    the head dimension of x, ``y @ R.T`` undoes it. The same R for every call with the same D."""
    if isinstance(D, bool) or not isinstance(D, int) or D < 1 or D & (D - 1):
        raise ValueError(f"D must be a power of two (a Hadamard matrix of that size), got {D!r}")
    return _rotation64(D).to(dtype=dtype, device=device, copy=True)  # a copy: the cached R stays intact


def check_granularity(granularity) -> str:
    if not isinstance(granularity, str) or granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    return granularity


# --8<-- [start:quantize]
def row_amax(x: torch.Tensor, granularity: str, block: int) -> torch.Tensor:
    """(B, H, T): the largest |x| of the group each row belongs to."""
    B, H, T, _ = x.shape
    if granularity == "tensor":
        return x.abs().amax().expand(B, H, T)
    if granularity == "head":
        return x.abs().amax(dim=(2, 3))[..., None].expand(B, H, T)
    per_row = x.abs().amax(dim=-1)  # (B, H, T)
    n_blocks = -(-T // block)
    # |x| >= 0, so zeros change no max
    padded = torch.nn.functional.pad(per_row, (0, n_blocks * block - T))
    return (
        padded.view(B, H, n_blocks, block)
        .amax(dim=-1)
        .repeat_interleave(block, dim=-1)[..., :T]
    )


def quantize(
    x, granularity="tensor", rotate=False, block=None, *, keys_contiguous=False
):
    """E4M3 codes and float32 factors of x (B, H, T, D): x ≈ x8 * descale[..., None].

    Args:
        x: (B, H, T, D), float16, bfloat16, float32 or float64, finite; any strides.
        granularity: "tensor", "head" (one factor per (B, H)) or "block" (per ``block``
            rows along T).
        rotate: multiply the head dimension by ``hadamard_rotation(D)`` first (D a power
            of two).
        block: rows per group for granularity="block" (default 64); only with that
            granularity.
        keys_contiguous: lay x8 out with stride 1 along T (a (B, H, D, T) tensor,
            transposed), the layout the FP8 kernel reads V in; for v, so that no call
            copies it.

    Returns:
        x8 (B, H, T, D) float8_e4m3fn, contiguous (or keys-contiguous), and descale (B,
            H, T) float32, one
        positive finite factor per row, which the FP8 forward takes without reading it
            again. Per tensor and
        per head, descale is a view with stride 0 along T (one value per (batch, head)
            in memory): the FP8
        kernel sees the granularity in that layout and takes its cheaper step.
        |x8 * descale - x| <= max(2^-4 |x|, 2^-10 descale) for every entry (x rotated,
            if asked).
    """
    (x,) = resolve_neg_bits(x)
    check_tensor("x", x, rank=4, dtypes=FLOAT_DTYPES)
    check_granularity(granularity)
    rotate = check_flag("rotate", rotate)
    keys_contiguous = check_flag("keys_contiguous", keys_contiguous)
    if block is not None and granularity != "block":
        raise ValueError(
            f"block applies only to granularity='block', got block={block!r} with "
            f"{granularity!r}"
        )
    block = check_block("block", DEFAULT_BLOCK if block is None else block)
    if x.numel() == 0:
        raise ValueError(
            f"x is empty (shape {tuple(x.shape)}); every dimension must be at least 1"
        )
    if rotate and x.shape[-1] & (x.shape[-1] - 1):
        raise ValueError(
            "rotate=True needs a head dim D that is a power of two, got D = "
            f"{x.shape[-1]}"
        )
    # 16-bit inputs are scaled in float32
    c = torch.float64 if x.dtype == torch.float64 else torch.float32
    x = x.to(c)
    if not bool(torch.isfinite(x).all()):
        raise ValueError(
            "x has inf or NaN entries; E4M3 has no infinity, and one NaN would poison "
            "a whole group"
        )
    if rotate:
        # (B, H, T, D), the outliers spread over D
        x = x @ hadamard_rotation(x.shape[-1], c, x.device)
    amax = row_amax(x, granularity, block)
    # one value per (batch, head): computed once, laid out with stride 0 along T
    if granularity != "block":
        amax = amax[..., :1]
    descale = (amax / E4M3_MAX).float()  # the group's largest value lands on 448
    if not bool(torch.isfinite(descale).all()):
        raise ValueError(
            "x has values too large for a float32 factor (|x| / 448 overflows float32)"
        )
    # an all-zero group (or one below 448 * 2^-126) gets a usable factor
    descale = descale.clamp(min=FLOAT32_TINY)
    # (B, H, T); per tensor or head a view of (B, H, 1), stride 0 along T
    descale = descale.expand(x.shape[:-1])
    # saturating: rounding x / descale up past 448 stays at 448
    x8 = to_e4m3(x / descale[..., None].to(c))
    # positive and finite by construction: the kernel need not read them again
    vouch_for_factors(descale)
    if keys_contiguous:
        # strides (H D T, D T, 1, T)
        return x8.transpose(-1, -2).contiguous().transpose(-1, -2), descale
    return x8.contiguous(), descale
# --8<-- [end:quantize]

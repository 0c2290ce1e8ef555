"""The in-place merge kernel (``kernels.merge.merge_into``) against a float64 formula written here.

The truth: lse = log(e^lse_a + e^lse_b) (torch.logaddexp, float64) and o = e^(lse_a - lse) o_a +
e^(lse_b - lse) o_b, with a row that neither part saw left at o = 0, lse = -inf. On the CPU it runs
through Triton's interpreter; on a GPU, compiled.
"""

from __future__ import annotations

import pytest
import torch

from flashtile._env import is_interpreting
from flashtile.kernels.merge import merge_into

from ._helpers import DEVICE

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or is_interpreting()), reason="needs CUDA or TRITON_INTERPRET=1"
)


def truth(o_a, lse_a, o_b, lse_b):
    o_a, lse_a, o_b, lse_b = (x.double() for x in (o_a, lse_a, o_b, lse_b))
    lse = torch.logaddexp(lse_a, lse_b)
    empty = torch.isneginf(lse)
    shift = torch.where(empty, 0.0, lse)
    o = torch.exp(lse_a - shift)[..., None] * o_a + torch.exp(lse_b - shift)[..., None] * o_b
    return torch.where(empty[..., None], 0.0, o), lse


def random_parts(B, H, T, D, part_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    o_a = torch.randn(B, H, T, D, generator=g)
    o_b = torch.randn(B, H, T, D, generator=g).to(part_dtype)
    lse_a = 3 * torch.randn(B, H, T, generator=g)
    lse_b = 3 * torch.randn(B, H, T, generator=g)
    rows = torch.rand(B, H, T, generator=g)
    rows[..., 0], rows[..., 1 % T], rows[..., 2 % T] = 0.15, 0.05, 0.25  # both parts, a alone, b alone empty
    lse_a[rows < 0.2] = float("-inf")  # the running result saw no key yet (a causal row before its keys)
    lse_b[(rows > 0.1) & (rows < 0.3)] = float("-inf")  # the visiting keys are all hidden from the row
    o_a[torch.isneginf(lse_a)] = 0.0  # what an empty part holds
    o_b[torch.isneginf(lse_b)] = 0.0
    return o_a, lse_a, o_b, lse_b


@pytest.mark.parametrize("part_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B, H, T, D", [(2, 3, 37, 24), (1, 2, 5, 128), (1, 1, 300, 80)])
def test_merge_into_matches_float64_formula(B, H, T, D, part_dtype):
    o_a, lse_a, o_b, lse_b = random_parts(B, H, T, D, part_dtype, seed=T + D)
    assert torch.isneginf(lse_a).any() and torch.isneginf(lse_b).any()
    assert (torch.isneginf(lse_a) & torch.isneginf(lse_b)).any()  # rows neither part saw
    o_true, lse_true = truth(o_a, lse_a, o_b, lse_b)
    o, lse = o_a.clone().to(DEVICE), lse_a.clone().to(DEVICE)  # on the CPU .to would alias o_a
    merge_into(o, lse, o_b.to(DEVICE), lse_b.to(DEVICE))
    assert torch.equal(torch.isneginf(lse).cpu(), torch.isneginf(lse_true))
    torch.testing.assert_close(lse.double().cpu(), lse_true, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(o.double().cpu(), o_true, rtol=1e-5, atol=1e-5)


def test_merge_into_writes_only_its_rows_of_a_larger_buffer():
    """A row slice of the running result (what a ring step with a causal plan merges into), any strides."""
    B, H, T, D = 2, 2, 40, 32
    o_a, lse_a, o_b, lse_b = random_parts(B, H, T, D, torch.float32, seed=7)
    o, lse = o_a.clone().to(DEVICE), lse_a.clone().to(DEVICE)  # on the CPU .to would alias o_a
    rows = slice(T // 2, T)
    part = o_b[..., rows, :].transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, T/2, D) with other strides
    merge_into(o[..., rows, :], lse[..., rows], part.to(DEVICE), lse_b[..., rows].to(DEVICE))
    o_true, lse_true = truth(o_a[..., rows, :], lse_a[..., rows], o_b[..., rows, :], lse_b[..., rows])
    torch.testing.assert_close(o[..., rows, :].double().cpu(), o_true, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[..., rows].double().cpu(), lse_true, rtol=1e-6, atol=1e-6)
    assert torch.equal(o[..., : T // 2, :].cpu(), o_a[..., : T // 2, :])  # the other rows untouched
    assert torch.equal(lse[..., : T // 2].cpu(), lse_a[..., : T // 2])


def test_merge_into_rounds_once_into_a_half_precision_running_result():
    """A running o in fp16 (ring attention with two ranks): computed in fp32, rounded once to fp16."""
    o_a, lse_a, o_b, lse_b = random_parts(2, 2, 33, 40, torch.float16, seed=11)
    o_a = o_a.half()
    o_true, lse_true = truth(o_a, lse_a, o_b, lse_b)
    o, lse = o_a.clone().to(DEVICE), lse_a.clone().to(DEVICE)
    merge_into(o, lse, o_b.to(DEVICE), lse_b.to(DEVICE))
    assert o.dtype == torch.float16
    torch.testing.assert_close(o.double().cpu(), o_true, rtol=1e-3, atol=1e-3)  # one fp16 rounding: 2**-11
    torch.testing.assert_close(lse.double().cpu(), lse_true, rtol=1e-6, atol=1e-6)


def test_merge_into_gives_the_same_bits_on_every_run():
    """The in-place merge reads each row's lse from several warps and writes it from one: the kernel's
    barrier keeps every read before the write. A race would make runs differ; many rows and repeats
    give it many chances to show on a GPU."""
    B, H, T, D = (1, 8, 4096, 128) if DEVICE == "cuda" else (1, 1, 64, 32)
    o_a, lse_a, o_b, lse_b = random_parts(B, H, T, D, torch.float32, seed=5)
    o_b, lse_b = o_b.to(DEVICE), lse_b.to(DEVICE)
    inputs = o_a.to(DEVICE), lse_a.to(DEVICE)
    o_copy, lse_copy = inputs[0].clone(), inputs[1].clone()
    merge_into(o_copy, lse_copy, o_b, lse_b)
    for _ in range(20 if DEVICE == "cuda" else 1):
        o, lse = inputs[0].clone(), inputs[1].clone()
        merge_into(o, lse, o_b, lse_b)
        assert torch.equal(o, o_copy) and torch.equal(lse, lse_copy)


def test_merge_into_keeps_nan():
    o_a, lse_a, o_b, lse_b = random_parts(1, 1, 4, 16, torch.float32, seed=3)
    lse_a[0, 0, 1] = float("nan")
    o_b[0, 0, 2, 5] = float("nan")
    o, lse = o_a.clone().to(DEVICE), lse_a.clone().to(DEVICE)  # on the CPU .to would alias o_a
    merge_into(o, lse, o_b.to(DEVICE), lse_b.to(DEVICE))
    assert torch.isnan(lse[0, 0, 1]) and torch.isnan(o[0, 0, 1]).all()
    lse_b_row = lse_b[0, 0, 2]
    if not torch.isneginf(lse_b_row):  # the NaN element reaches the row only with a nonzero weight
        assert torch.isnan(o[0, 0, 2, 5])


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(o=torch.zeros(1, 1, 4, 16, dtype=torch.float64)), TypeError, "o must have dtype"),
        (dict(lse=torch.zeros(1, 1, 4, dtype=torch.float16)), TypeError, "lse must have dtype"),
        (dict(lse=torch.zeros(1, 1, 5)), ValueError, "lse must have shape"),
        (dict(o_part=torch.zeros(1, 1, 4, 8)), ValueError, "o_part must have the shape"),
        (dict(lse_part=torch.zeros(1, 4)), ValueError, "lse_part must be a rank-3"),
        (dict(o_part=torch.zeros(1, 1, 4, 16, dtype=torch.float64)), TypeError, "o_part must have dtype"),
    ],
)
def test_merge_into_refuses_bad_inputs(change, error, match):
    args = dict(o=torch.zeros(1, 1, 4, 16), lse=torch.zeros(1, 1, 4), o_part=torch.zeros(1, 1, 4, 16),
                lse_part=torch.zeros(1, 1, 4))  # fmt: skip
    args.update(change)
    with pytest.raises(error, match=match):
        merge_into(**{k: v.to(DEVICE) for k, v in args.items()})

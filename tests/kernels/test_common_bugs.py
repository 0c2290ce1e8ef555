"""Four bugs every first FlashAttention kernel has, each caught by a check the shipped kernel passes.

Every test runs the same check twice: on the shipped kernel (it must pass) and on a broken variant
from ``_broken_forward`` (it must fail). A check that a broken variant also passes would prove nothing.
"""

import pytest
import torch

from flashtile.kernels.forward import flash_attention
from tests._truth import attention_truth

from ._broken_forward import forward_all_masked, forward_assuming_contiguous_strides, probe_offsets
from ._helpers import DEVICE, FORWARD_TOL, randn


def _matches_naive(o, q, k, v, causal=False, alignment="upper_left"):
    o_ref, _ = attention_truth(q.double(), k.double(), v.double(), causal=causal, alignment=alignment)
    return torch.allclose(o.double().cpu(), o_ref.cpu(), **FORWARD_TOL[q.dtype])


# --8<-- [start:nan]
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the broken variant's NaN, on purpose
def test_bug_minus_inf_minus_minus_inf_is_nan_on_rows_that_see_no_key():
    # Lower-right with Tq > Tk: the first Tq - Tk rows see no key, so their running max stays -inf.
    q, k, v = randn(1, 2, 40, 32), randn(1, 2, 13, 32), randn(1, 2, 13, 32)
    o, _ = flash_attention(q, k, v, causal=True, alignment="lower_right", block_q=16, block_k=16)
    assert not torch.isnan(o).any() and _matches_naive(o, q, k, v, True, "lower_right")

    broken = forward_all_masked(q, k, v, causal=True, alignment="lower_right", guard_neg_inf=False)
    assert torch.isnan(broken[:, :, : 40 - 13]).all()  # exactly the blind rows turn NaN
    assert not torch.isnan(broken[:, :, 40 - 13 :]).any()
# --8<-- [end:nan]


# --8<-- [start:padded_keys]
def test_bug_padded_keys_scoring_zero_instead_of_minus_inf_dilutes_the_softmax():
    # Tk = 37 in tiles of 16: the last tile holds 11 padded keys loaded as 0.
    q, k, v = randn(1, 2, 20, 32), randn(1, 2, 37, 32), randn(1, 2, 37, 32)
    o, _ = flash_attention(q, k, v, block_q=16, block_k=16)
    assert _matches_naive(o, q, k, v)

    broken = forward_all_masked(q, k, v, causal=False, padded_keys_neg_inf=False)
    assert not torch.isnan(broken).any()  # no crash, no NaN: just quietly wrong
    assert not _matches_naive(broken, q, k, v)
    # Control: with no padding (Tk a multiple of 16) the same broken variant is right.
    assert _matches_naive(forward_all_masked(q, k[:, :, :32], v[:, :, :32], False, padded_keys_neg_inf=False),
                          q, k[:, :, :32], v[:, :, :32])
# --8<-- [end:padded_keys]


# --8<-- [start:unassigned_cast]
def test_bug_a_cast_that_was_never_assigned_lets_offsets_wrap_past_2_to_the_31():
    # Program 2 of a tensor whose batch stride is 2**30 + 1 starts 2**31 + 2 elements in: past int32.
    stride = 2**30 + 1
    expected = torch.arange(3, dtype=torch.int64) * stride
    widened = probe_offsets(torch.zeros(3, dtype=torch.int64, device=DEVICE), stride, widen=True)
    assert torch.equal(widened.cpu(), expected)

    dropped = probe_offsets(torch.zeros(3, dtype=torch.int64, device=DEVICE), stride, widen=False)
    assert dropped[2].item() == expected[2].item() - 2**32  # wrapped around: a negative offset
# --8<-- [end:unassigned_cast]


# --8<-- [start:strides]
def test_bug_assuming_contiguous_strides_reads_transposed_views_wrongly():
    # (B, T, H, D) projections viewed as (B, H, T, D): rows of one head are H * D elements apart.
    B, T, H, D = 1, 37, 2, 32
    q, k, v = (randn(B, T, H, D).transpose(1, 2) for _ in range(3))
    o, _ = flash_attention(q, k, v, causal=True, block_q=16, block_k=16)
    assert _matches_naive(o, q, k, v, causal=True)

    broken, _ = forward_assuming_contiguous_strides(q, k, v, causal=True)
    assert not _matches_naive(broken, q, k, v, causal=True)
    # Control: on contiguous copies the broken launcher is right, so strides are the whole bug.
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    assert _matches_naive(forward_assuming_contiguous_strides(qc, kc, vc, causal=True)[0], qc, kc, vc, causal=True)
# --8<-- [end:strides]

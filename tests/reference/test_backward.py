import pytest
import torch

from flashtile.reference.backward import backward_delta, flash_attention_backward
from flashtile.reference.forward import flash_attention_forward
from tests._truth import attention_truth

ATTN = [(False, "upper_left"), (True, "upper_left"), (True, "lower_right")]


def autograd_gradients(q, k, v, do, causal, scale, alignment):
    """Ground truth: autograd through the dense float64 formula."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o, _ = attention_truth(q, k, v, causal, scale, alignment)
    return torch.autograd.grad(o, (q, k, v), do)


def tiled_gradients(q, k, v, do, causal, scale, block_q, block_k, alignment):
    o, lse = flash_attention_forward(q, k, v, causal, scale, block_q, block_k, alignment)
    return flash_attention_backward(q, k, v, o, lse, do, causal, scale, block_q, block_k, alignment)


def assert_gradients_match(actual, expected):
    for name, a, e in zip(("dq", "dk", "dv"), actual, expected):
        assert not torch.isnan(a).any(), name
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-11, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("block_q,block_k", [(7, 7), (11, 11), (16, 16), (32, 32), (7, 11)])
@pytest.mark.parametrize("causal,alignment", ATTN)
def test_backward_matches_autograd_when_block_does_not_divide_T(rand, block_q, block_k, causal, alignment):
    q, k, v, do = rand(2, 2, 45, 16), rand(2, 2, 45, 16), rand(2, 2, 45, 16), rand(2, 2, 45, 16)
    actual = tiled_gradients(q, k, v, do, causal, None, block_q, block_k, alignment)
    assert_gradients_match(actual, autograd_gradients(q, k, v, do, causal, None, alignment))


@pytest.mark.parametrize("Tq,Tk", [(13, 40), (40, 13), (1, 37), (37, 1)])
@pytest.mark.parametrize("causal,alignment", ATTN)
def test_backward_matches_autograd_when_Tq_differs_from_Tk(rand, Tq, Tk, causal, alignment):
    q, do = rand(1, 3, Tq, 8), rand(1, 3, Tq, 8)
    k, v = rand(1, 3, Tk, 8), rand(1, 3, Tk, 8)
    actual = tiled_gradients(q, k, v, do, causal, 0.7, 7, 11, alignment)
    assert_gradients_match(actual, autograd_gradients(q, k, v, do, causal, 0.7, alignment))


@pytest.mark.parametrize("H,H_kv", [(4, 4), (4, 2), (8, 2), (4, 1)])
@pytest.mark.parametrize("causal,alignment", ATTN)
def test_backward_sums_dk_dv_over_each_gqa_group(rand, H, H_kv, causal, alignment):
    q, do = rand(2, H, 23, 8), rand(2, H, 23, 8)
    k, v = rand(2, H_kv, 30, 8), rand(2, H_kv, 30, 8)
    actual = tiled_gradients(q, k, v, do, causal, None, 7, 11, alignment)
    assert actual[1].shape == k.shape and actual[2].shape == v.shape
    assert_gradients_match(actual, autograd_gradients(q, k, v, do, causal, None, alignment))


def test_off_by_one_T33_bq7_bk11_backward(rand):
    q, k, v, do = (rand(1, 2, 33, 8) for _ in range(4))
    for alignment in ("upper_left", "lower_right"):
        actual = tiled_gradients(q, k, v, do, True, None, 7, 11, alignment)
        assert_gradients_match(actual, autograd_gradients(q, k, v, do, True, None, alignment))


def test_delta_equals_rowsum_of_p_times_dp(rand):
    # D_i = sum_j P_ij dP_ij, computed the expensive way, equals rowsum(dO * O).
    q, k, v, do = rand(1, 2, 9, 5), rand(1, 2, 11, 5), rand(1, 2, 11, 5), rand(1, 2, 9, 5)
    s = q @ k.transpose(-1, -2) / 5**0.5
    p = torch.softmax(s, -1)
    o = p @ v
    dp = do @ v.transpose(-1, -2)
    torch.testing.assert_close(backward_delta(o, do), (p * dp).sum(-1), rtol=0, atol=1e-13)


def test_backward_gives_zero_gradients_for_blind_rows(rand):
    q, k, v, do = rand(1, 1, 9, 4), rand(1, 1, 3, 4), rand(1, 1, 3, 4), rand(1, 1, 9, 4)
    dq, dk, dv = tiled_gradients(q, k, v, do, True, None, 4, 2, "lower_right")
    assert (dq[..., :6, :] == 0).all()
    assert_gradients_match((dq, dk, dv), autograd_gradients(q, k, v, do, True, None, "lower_right"))


def test_backward_without_the_mask_would_be_wrong(rand):
    # The reason the backward must re-apply the mask: dropping it changes dV measurably.
    q, k, v, do = (rand(1, 1, 20, 4) for _ in range(4))
    o, lse = flash_attention_forward(q, k, v, True, None, 8, 8)
    masked = flash_attention_backward(q, k, v, o, lse, do, True, None, 8, 8)
    unmasked = flash_attention_backward(q, k, v, o, lse, do, False, None, 8, 8)
    assert (masked[2] - unmasked[2]).abs().max() > 1e-3

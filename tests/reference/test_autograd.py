import torch

from flashtile.reference.autograd import FlashAttentionFunction, reference_attention
from flashtile.reference.footprint import saved_tensor_shapes
from tests._truth import attention_truth


def test_autograd_function_gradients_match_naive(rand):
    q, k, v = (t.requires_grad_() for t in (rand(2, 4, 19, 8), rand(2, 2, 26, 8), rand(2, 2, 26, 8)))
    do = rand(2, 4, 19, 8)
    o = reference_attention(q, k, v, causal=True, block_q=5, block_k=7, alignment="lower_right")
    got = torch.autograd.grad(o, (q, k, v), do)
    o_ref, _ = attention_truth(q, k, v, True, None, "lower_right")
    want = torch.autograd.grad(o_ref, (q, k, v), do)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)


def test_autograd_function_saves_lse_and_no_T_by_T_tensor(rand):
    B, H, T, D = 2, 3, 40, 8
    q, k, v = (rand(B, H, T, D).requires_grad_() for _ in range(3))
    with saved_tensor_shapes() as saved:
        o, lse = FlashAttentionFunction.apply(q, k, v, True, None, 16, 16, "upper_left")
    assert sorted(saved) == sorted([(B, H, T, D)] * 4 + [(B, H, T)])  # q, k, v, o and lse
    assert not any(len(s) >= 2 and s[-1] == T and s[-2] == T for s in saved)
    assert lse.shape == (B, H, T) and not lse.requires_grad
    o.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None

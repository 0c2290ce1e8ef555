
from flashtile.reference.footprint import largest_tensor, saved_tensor_shapes
from flashtile.reference.forward import flash_attention_forward
from flashtile.reference.naive import naive_attention


def test_largest_tensor_sees_intermediates_that_do_not_survive(rand):
    a = rand(3, 40)
    with largest_tensor() as seen:
        (a[:, :, None] * a[:, None, :]).sum()  # a 3 x 40 x 40 temporary, reduced to a scalar
    assert seen.numel == 3 * 40 * 40


def test_naive_forms_the_score_matrix_and_the_tiled_forward_does_not(rand):
    B, H, T, d = 1, 2, 128, 16
    q, k, v = rand(B, H, T, d), rand(B, H, T, d), rand(B, H, T, d)
    with largest_tensor() as naive:
        naive_attention(q, k, v)
    with largest_tensor() as tiled:
        flash_attention_forward(q, k, v, block_q=16, block_k=16)
    assert naive.numel == B * H * T * T
    assert tiled.numel == B * H * T * d  # o itself; the biggest temporary is one 16 x 16 tile per head


def test_saved_tensor_shapes_records_what_autograd_keeps(rand):
    x = rand(4, 5).requires_grad_()
    w = rand(5, 6).requires_grad_()
    with saved_tensor_shapes() as shapes:
        y = (x @ w).exp()
    assert sorted(shapes) == sorted([(4, 5), (5, 6), (4, 6)])  # x and w for the matmul, exp's output
    y.sum().backward()  # recording does not get in the backward's way
    assert x.grad is not None and w.grad is not None

import math

import pytest
import torch

from flashtile.reference.naive import (
    attention_flops,
    naive_attention,
    naive_hbm_bytes,
    score_matrix_bytes,
    visible_pairs,
)


def test_naive_matches_an_independent_softmax_formula(rand):
    q, k, v = rand(2, 3, 9, 16), rand(2, 3, 12, 16), rand(2, 3, 12, 16)
    o, lse = naive_attention(q, k, v, scale=0.3)
    s = 0.3 * torch.einsum("bhid,bhjd->bhij", q, k)
    torch.testing.assert_close(o, torch.softmax(s, -1) @ v, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=0, atol=1e-13)


@pytest.mark.parametrize("H,H_kv", [(4, 4), (4, 2), (8, 2), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_naive_matches_sdpa_including_gqa(rand, H, H_kv, causal):
    q, k, v = rand(2, H, 10, 8), rand(2, H_kv, 10, 8), rand(2, H_kv, 10, 8)
    o, _ = naive_attention(q, k, v, causal=causal)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=H != H_kv)
    torch.testing.assert_close(o, ref, rtol=0, atol=1e-12)


def test_default_scale_is_one_over_sqrt_d(rand):
    q, k, v = rand(1, 1, 5, 25), rand(1, 1, 5, 25), rand(1, 1, 5, 25)
    torch.testing.assert_close(naive_attention(q, k, v)[0], naive_attention(q, k, v, scale=0.2)[0], rtol=0, atol=0)


def test_rows_that_see_no_key_get_zero_output_and_minus_inf_lse(rand):
    q, k, v = rand(1, 2, 6, 4), rand(1, 2, 2, 4), rand(1, 2, 2, 4)
    o, lse = naive_attention(q, k, v, causal=True, alignment="lower_right")  # offset -4: rows 0..3 blind
    assert torch.isneginf(lse[..., :4]).all() and torch.isfinite(lse[..., 4:]).all()
    assert (o[..., :4, :] == 0).all() and not torch.isnan(o).any()


def test_score_matrix_for_B8_H16_T2048_bf16_is_one_GiB():
    assert score_matrix_bytes(8, 16, 2048, 2048, torch.bfloat16) == 2**30


def test_naive_bytes_count_s_and_p_twice_each():
    B, H, T, D = 8, 16, 2048, 64
    expected = 2 * (4 * B * H * T * D + 4 * B * H * T * T)
    assert naive_hbm_bytes(B, H, T, T, D, torch.bfloat16) == expected


@pytest.mark.parametrize("Tq,Tk,alignment", [(7, 7, "upper_left"), (5, 9, "lower_right"), (9, 5, "lower_right"),
                                             (5, 9, "upper_left"), (9, 5, "upper_left")])
def test_visible_pairs_counts_the_dense_mask(Tq, Tk, alignment):
    from flashtile.reference.causal import causal_mask

    assert visible_pairs(Tq, Tk, True, alignment) == int(causal_mask(Tq, Tk, alignment).sum())


def test_causal_flops_are_just_over_half_of_dense():
    dense = attention_flops(8, 16, 2048, 2048, 64)
    causal = attention_flops(8, 16, 2048, 2048, 64, causal=True)
    assert dense == 4 * 8 * 16 * 2048 * 2048 * 64
    assert causal == dense // 2048 * (2048 + 1) // 2
    assert math.isclose(causal / dense, 0.5, rel_tol=1e-3)

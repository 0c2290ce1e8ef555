import pytest
import torch

from flashtile.reference.causal import TileKind, tile_map
from flashtile.reference.forward import flash_attention_forward
from tests._truth import attention_truth

GQA = [(4, 4), (4, 2), (8, 2), (4, 1)]  # ratios 1, 2, 4 and MQA
ATTN = [(False, "upper_left"), (True, "upper_left"), (True, "lower_right")]


def assert_same_attention(actual, expected):
    (o, lse), (o_ref, lse_ref) = actual, expected
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    torch.testing.assert_close(lse.nan_to_num(neginf=0.0), lse_ref.nan_to_num(neginf=0.0), rtol=0, atol=1e-12)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()


@pytest.mark.parametrize("block_q,block_k", [(7, 7), (11, 11), (16, 16), (32, 32), (7, 11), (32, 7)])
@pytest.mark.parametrize("causal,alignment", ATTN)
def test_forward_matches_naive_when_block_does_not_divide_T(rand, block_q, block_k, causal, alignment):
    T = 45  # divisible by none of 7, 11, 16, 32
    q, k, v = rand(2, 2, T, 16), rand(2, 2, T, 16), rand(2, 2, T, 16)
    actual = flash_attention_forward(q, k, v, causal, None, block_q, block_k, alignment)
    assert_same_attention(actual, attention_truth(q, k, v, causal, None, alignment))


@pytest.mark.parametrize("Tq,Tk", [(13, 40), (40, 13), (1, 37), (37, 1)])
@pytest.mark.parametrize("causal,alignment", ATTN)
def test_forward_matches_naive_when_Tq_differs_from_Tk(rand, Tq, Tk, causal, alignment):
    q, k, v = rand(1, 3, Tq, 8), rand(1, 3, Tk, 8), rand(1, 3, Tk, 8)
    actual = flash_attention_forward(q, k, v, causal, 0.7, 7, 11, alignment)
    assert_same_attention(actual, attention_truth(q, k, v, causal, 0.7, alignment))


@pytest.mark.parametrize("H,H_kv", GQA)
@pytest.mark.parametrize("causal,alignment", ATTN)
def test_forward_matches_naive_for_gqa_and_mqa(rand, H, H_kv, causal, alignment):
    q, k, v = rand(2, H, 23, 8), rand(2, H_kv, 30, 8), rand(2, H_kv, 30, 8)
    actual = flash_attention_forward(q, k, v, causal, None, 7, 11, alignment)
    assert_same_attention(actual, attention_truth(q, k, v, causal, None, alignment))


@pytest.mark.parametrize("alignment", ["upper_left", "lower_right"])
@pytest.mark.parametrize("Tq,Tk", [(33, 33), (20, 45), (45, 20)])
def test_forward_touches_exactly_the_non_skipped_tiles(rand, alignment, Tq, Tk):
    q, k, v = rand(1, 1, Tq, 4), rand(1, 1, Tk, 4), rand(1, 1, Tk, 4)
    seen = {}
    record = lambda i, j, kind: seen.__setitem__((i, j), kind)
    flash_attention_forward(q, k, v, True, None, 7, 11, alignment, on_tile=record)
    expected = {
        (i, j): kind
        for i, row in enumerate(tile_map(Tq, Tk, 7, 11, alignment))
        for j, kind in enumerate(row)
        if kind is not TileKind.SKIP
    }
    assert seen == expected


def test_skipped_tiles_are_never_read(rand):
    # Poison every key/value row that only SKIP tiles would reach for the first query tile: the output
    # of that tile must not change, because the forward never loads them.
    q, k, v = rand(1, 1, 33, 4), rand(1, 1, 33, 4), rand(1, 1, 33, 4)
    o_clean, _ = flash_attention_forward(q, k, v, True, None, 7, 11)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[..., 11:, :] = float("nan")  # query tile 0 (rows 0..6) needs key tile 0 only
    v_bad[..., 11:, :] = float("nan")
    o_bad, _ = flash_attention_forward(q, k_bad, v_bad, True, None, 7, 11)
    assert torch.equal(o_bad[..., :7, :], o_clean[..., :7, :])


def test_forward_handles_blind_rows_without_nan(rand):
    q, k, v = rand(1, 2, 9, 4), rand(1, 2, 3, 4), rand(1, 2, 3, 4)  # lower-right: rows 0..5 blind
    o, lse = flash_attention_forward(q, k, v, True, None, 4, 2, "lower_right")
    assert_same_attention((o, lse), attention_truth(q, k, v, True, None, "lower_right"))
    assert torch.isneginf(lse[..., :6]).all() and (o[..., :6, :] == 0).all()

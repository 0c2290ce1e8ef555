"""decode_attention(..., window=, softcap=) on every CPU tier, against the float64 formula.

The truth for sequence b is ``_truth.masked_truth`` on its first ``length`` keys through the mask built
from the definition (``definition_mask``) with is_causal and the lower-right alignment: the new token
at position p = length - Tq + t sees keys p - left .. p. That is the decode contract stated as the
``flashtile.attention`` call it equals.
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile.api import use_backend
from tests._truth import assert_close_to_truth, definition_mask, masked_truth
from tests.decode._decode_cases import random_decode_inputs, to_pages

TOL = {torch.float64: 1e-12, torch.float32: 2e-5}


def _seqlens(*n):
    return torch.tensor(n, dtype=torch.int32)


def windowed_truth(q, k, v, lengths, window, softcap=None, scale=None):
    """(o, lse) float64: each sequence's new tokens against its first ``length`` keys, causal lower-right,
    through the window and the cap; an empty sequence gives o = 0, lse = -inf."""
    Tq = q.shape[2]
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float64)
    for b, n in enumerate(lengths):
        if n:
            keep = definition_mask(Tq, n, window, True, "lower_right")
            o_b, lse_b = masked_truth(q[b : b + 1].double(), k[b : b + 1, :, :n].double(), v[b : b + 1, :, :n].double(),
                                      keep, scale, softcap)  # fmt: skip
            o[b], lse[b] = o_b[0], lse_b[0]
    return o, lse


# (window, softcap, num_splits): one edge, a window wider than the cache with a right side that the
# causal rule caps, a cap alone, and split counts above and below the window's tiles (zero width: below)
CASES = [
    ((7, 0), None, 3),
    ((20, -1), 2.0, None),
    ((200, 5), None, 3),
    ((-1, -1), 1.5, 5),
]


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("window,softcap,num_splits", CASES)
def test_windowed_decode_matches_the_float64_formula_on_every_tier(backend, window, softcap, num_splits):
    lengths = [61, 0, 4]  # a full cache, an empty slot, only the new tokens
    dtype = torch.float32 if backend == "triton" else torch.float64
    q, k, v = random_decode_inputs(3, 4, 2, 4, 61, 8, dtype, seed=3)
    with use_backend(backend):
        o, lse = flashtile.decode_attention(q, k, v, _seqlens(*lengths), window=window, softcap=softcap,
                                            num_splits=num_splits, return_lse=True)  # fmt: skip
    o_true, lse_true = windowed_truth(q, k, v, lengths, window, softcap)
    assert_close_to_truth(o, o_true, "o", rtol=TOL[dtype], atol=TOL[dtype])
    assert_close_to_truth(lse, lse_true, "lse", rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_paged_windowed_decode_with_negative_scale_and_gqa(backend):
    lengths = [45, 9]
    dtype = torch.float32 if backend == "triton" else torch.float64
    q, k, v = random_decode_inputs(2, 8, 2, 3, 45, 8, dtype, seed=4)
    k_pages, v_pages, table = to_pages(k, v, 8, lengths)  # NaN in every slot no sequence uses
    with use_backend(backend):
        o = flashtile.decode_attention(q, k_pages, v_pages, _seqlens(*lengths), block_table=table, scale=-0.4,
                                       window=(10, 0), softcap=3.0)  # fmt: skip
    o_true, _ = windowed_truth(q, k, v, lengths, (10, 0), 3.0, scale=-0.4)
    assert_close_to_truth(o, o_true, "o", rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_a_window_of_zero_keys_back_returns_each_new_tokens_own_value(backend):
    # window (0, 0): new token t sees its own key only, so o is its value exactly, whatever the scores
    lengths = [50, 3]
    q, k, v = random_decode_inputs(2, 2, 2, 3, 50, 16, torch.float32, seed=5)
    with use_backend(backend):
        o = flashtile.decode_attention(q, k, v, _seqlens(*lengths), window=(0, 0), num_splits=4)
    for b, n in enumerate(lengths):
        assert torch.equal(o[b], v[b, :, n - 3 : n])


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_keys_before_the_window_are_never_read(backend):
    """NaN in every key and value before the window's first tile (a multiple of 64 keys: both tiers' tiles
    start there) never reaches o; the control poisons the first key the window keeps, and NaN arrives."""
    n, Tq, left = 300, 2, 40
    q, k, v = random_decode_inputs(1, 2, 1, Tq, n, 16, torch.float32, seed=6)
    first_seen = n - Tq - left  # row 0's first key
    unread = first_seen // 64 * 64
    k_poison, v_poison = k.clone(), v.clone()
    k_poison[:, :, :unread] = float("nan")
    v_poison[:, :, :unread] = float("nan")
    with use_backend(backend):
        o = flashtile.decode_attention(q, k_poison, v_poison, window=(left, 0), num_splits=3)
        assert torch.isfinite(o).all()
        o_true, _ = windowed_truth(q, k, v, [n], (left, 0))
        assert_close_to_truth(o, o_true, "o", rtol=2e-5, atol=2e-5)
        v_poison[:, :, first_seen] = float("nan")  # control: a key the window keeps
        o = flashtile.decode_attention(q, k_poison, v_poison, window=(left, 0), num_splits=3)
    assert torch.isnan(o[0, :, 0]).all()


def test_the_split_count_is_picked_for_the_keys_the_window_keeps():
    from flashtile.kernels.decode import make_decode_plan

    q, k, v = random_decode_inputs(1, 8, 8, 1, 4096, 16, torch.float32, seed=7)
    plain = make_decode_plan(q, k, v, None, None, scale=None, num_splits=None, window=None, softcap=None)
    windowed = make_decode_plan(q, k, v, None, None, scale=None, num_splits=None, window=(255, 0), softcap=None)
    assert plain.num_splits > 1 and windowed.num_splits == 1  # 256 keys: too few to split


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(window=(True, 0)), TypeError, r"window\[0\] \(left\) must be an int"),
        (dict(window=(3,)), TypeError, "window must be None or a pair"),
        (dict(window=(-2, 0)), ValueError, r"window\[0\] \(left\) must be -1"),
        (dict(softcap=0.0), ValueError, "softcap must be a positive finite number"),
        (dict(softcap="1"), TypeError, "softcap must be a positive real number"),
    ],
)
def test_bad_windows_and_caps_are_refused_by_name_on_every_tier(backend, kwargs, error, match):
    q, k, v = random_decode_inputs(1, 2, 2, 1, 20, 8, seed=8)
    with use_backend(backend), pytest.raises(error, match=match):
        flashtile.decode_attention(q, k, v, **kwargs)
    with use_backend(backend):  # and after a good call has kept its plan
        flashtile.decode_attention(q, k, v, window=(3, 0), softcap=1.0)
        with pytest.raises(error, match=match):
            flashtile.decode_attention(q, k, v, **kwargs)

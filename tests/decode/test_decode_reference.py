"""The reference tier of split-K decoding, in float64, against the independent truth."""

from __future__ import annotations

import itertools

import pytest
import torch

from flashtile.reference.decode import (
    attend_split,
    decode_attention_reference,
    gather_pages,
    split_bounds,
)
from flashtile.reference.merge import merge_partials
from tests._truth import assert_close_to_truth, decode_truth
from tests.decode._decode_cases import poison_past_lengths, random_decode_inputs, to_pages

F64 = dict(rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_splits", [1, 3, 40])  # 40 > the 4 key tiles of the longest sequence
def test_reference_matches_truth_on_ragged_gqa_batches(group, num_splits):
    Tq, T_max = 3, 53
    lengths = [T_max, Tq, 17, 0]  # full, only the new tokens, not a multiple of the tile, an empty slot
    q, k, v = random_decode_inputs(4, 2 * group, 2, Tq, T_max, 24, torch.float64, seed=group)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    k, v = poison_past_lengths(k, v, lengths)  # keys past a length must never be read
    o, lse = decode_attention_reference(q, k, v, seqlens, num_splits=num_splits, block_k=16)
    o_true, lse_true = decode_truth(q, k, v, lengths)
    assert_close_to_truth(o, o_true, "o", **F64)
    assert_close_to_truth(lse, lse_true, "lse", **F64)


def test_split_bounds_cover_the_keys_in_whole_tiles_and_leave_extra_splits_empty():
    for length, num_splits, block_k in itertools.product([0, 1, 15, 16, 17, 100], [1, 2, 3, 7, 20], [1, 16]):
        bounds = split_bounds(length, num_splits, block_k)
        assert len(bounds) == num_splits
        assert bounds[0][0] == 0 and bounds[-1][1] == length
        assert all(end == start for (_, end), (start, _) in zip(bounds, bounds[1:]))  # contiguous, in order
        assert all(start % block_k == 0 or start == length for start, _ in bounds)
    assert split_bounds(40, 8, 16) == [(0, 16), (16, 32), (32, 40)] + [(40, 40)] * 5


def test_any_merge_order_gives_the_same_answer():
    q, k, v = random_decode_inputs(2, 4, 1, 2, 70, 16, torch.float64, seed=3)
    seqlens = torch.tensor([70, 41], dtype=torch.int32)
    o, lse = decode_attention_reference(q, k, v, seqlens, num_splits=5, block_k=8)
    for order in ([4, 3, 2, 1, 0], [2, 0, 4, 1, 3]):
        o2, lse2 = decode_attention_reference(q, k, v, seqlens, num_splits=5, block_k=8, order=order)
        torch.testing.assert_close(o2, o, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(lse2, lse, rtol=1e-14, atol=1e-14)


def test_merge_partials_is_associative_and_commutative_with_an_empty_partial():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 30, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    a, b, c = (attend_split(q, k, v, s, e, 30, 0.5) for s, e in [(0, 10), (10, 25), (25, 30)])
    empty = attend_split(q, k, v, 30, 30, 30, 0.5)
    assert torch.isneginf(empty[1]).all() and (empty[0] == 0).all()
    left = merge_partials(*merge_partials(*a, *b), *c)
    right = merge_partials(*a, *merge_partials(*b, *c))
    swapped = merge_partials(*merge_partials(*c, *empty), *merge_partials(*b, *a))
    whole = attend_split(q, k, v, 0, 30, 30, 0.5)
    for got in (right, swapped, whole):
        torch.testing.assert_close(got[0], left[0], rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(got[1], left[1], rtol=1e-14, atol=1e-14)


def test_merging_two_empty_partials_stays_empty_not_nan():
    o = torch.zeros(1, 2, 4, dtype=torch.float64)
    lse = torch.full((1, 2), float("-inf"), dtype=torch.float64)
    o_m, lse_m = merge_partials(o, lse, o, lse)
    assert (o_m == 0).all() and torch.isneginf(lse_m).all()


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_gather_pages_and_paged_decode_equal_the_contiguous_cache(page_size):
    lengths = [37, 2, 16]
    q, k, v = random_decode_inputs(3, 4, 2, 2, 37, 8, torch.float64, seed=page_size)
    k_pages, v_pages, table = to_pages(k, v, page_size, lengths, seed=page_size)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(gather_pages(k_pages, table[b], n), k[b, :, :n], rtol=0, atol=0)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    o_paged, lse_paged = decode_attention_reference(q, k_pages, v_pages, seqlens, num_splits=3, block_table=table)
    o, lse = decode_attention_reference(q, k, v, seqlens, num_splits=3)
    torch.testing.assert_close(o_paged, o, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(lse_paged, lse, rtol=1e-14, atol=1e-14)


def test_nan_in_one_sequence_stays_in_that_sequence():
    q, k, v = random_decode_inputs(3, 4, 2, 1, 20, 8, torch.float64, seed=7)
    k[1, 0, 5] = float("nan")  # a key every new token of sequence 1 sees, in KV head 0 (query heads 0, 1)
    o, lse = decode_attention_reference(q, k, v, num_splits=4, block_k=4)
    assert torch.isnan(o[1, :2]).all() and torch.isnan(lse[1, :2]).all()
    assert not torch.isnan(o[1, 2:]).any() and not torch.isnan(o[[0, 2]]).any()

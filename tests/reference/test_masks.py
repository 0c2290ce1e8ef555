"""Sliding windows, soft-capping and packed documents on the reference tier.

The truth here is written from the definitions, without flashtile: a dense boolean mask
(query i sees key j iff i + offset - left <= j <= i + offset + right, documents by index ranges), the
float64 formula softmax(softcap * tanh(τ Q Kᵀ / softcap)) V through it, and torch.autograd of that
formula for the gradients. Tile classes and counts are checked against a per-element brute force.
"""

import re

import pytest
import torch

from flashtile.reference.backward import flash_attention_backward
from flashtile.reference.causal import TileKind, tile_ranges
from flashtile.reference.forward import flash_attention_forward
from flashtile.reference.masks import (
    count_visited_document_tiles,
    count_visited_window_tiles,
    document_mask,
    document_tile_maps,
    document_visible_pairs,
    key_tile_range,
    window_band,
    window_mask,
    window_tile_map,
    window_visible_pairs,
)
from flashtile.reference.varlen import varlen_attention_backward, varlen_attention_forward
from tests._grids import covering
from tests._truth import assert_close_to_truth, assert_same_nonfinite, definition_mask, masked_truth, truth_gradients

ALIGNMENTS = ["upper_left", "lower_right"]


# --- the truth, from the definitions ---------------------------------------------------------------


def definition_document_mask(cu_q, cu_k, window, causal, alignment):
    """Block-diagonal: a pair is kept only inside one document, under that document's own window."""
    keep = torch.zeros(cu_q[-1], cu_k[-1], dtype=torch.bool)
    for d in range(len(cu_q) - 1):
        Lq, Lk = cu_q[d + 1] - cu_q[d], cu_k[d + 1] - cu_k[d]
        keep[cu_q[d] : cu_q[d + 1], cu_k[d] : cu_k[d + 1]] = definition_mask(Lq, Lk, window, causal, alignment)
    return keep


def brute_force_kinds(keep, block_q, block_k):
    """The kind of every tile, read off the dense mask element by element."""
    kinds = []
    for qs, qe in tile_ranges(keep.shape[0], block_q):
        row = []
        for ks, ke in tile_ranges(keep.shape[1], block_k):
            tile = keep[qs:qe, ks:ke]
            row.append(TileKind.FULL if tile.all() else TileKind.SKIP if not tile.any() else TileKind.DIAGONAL)
        kinds.append(row)
    return kinds


def assert_attention_close(actual, expected):
    (o, lse), (o_ref, lse_ref) = actual, expected
    assert_close_to_truth(o, o_ref, "o", rtol=0, atol=1e-12)
    assert_close_to_truth(lse, lse_ref, "lse", rtol=0, atol=1e-12)


# --- tile classes and counts ----------------------------------------------------------------------

SHAPES = {"square": (33, 33), "wide": (19, 40), "tall": (40, 19), "one_query": (1, 37)}
BLOCKS = {"7x11": (7, 11), "11x7": (11, 7), "8x8": (8, 8), "1x5": (1, 5)}
LEFTS = [-1, 0, 3, 12, 50]
RIGHTS = [-1, 0, 2, 9]


@pytest.mark.parametrize(
    "Tq,Tk,block_q,block_k,left,right,alignment,causal",
    covering(shape=SHAPES, blocks=BLOCKS, left=LEFTS, right=RIGHTS, alignment=ALIGNMENTS, causal=[False, True]),
)
def test_window_tile_classes_and_counts_match_brute_force(Tq, Tk, block_q, block_k, left, right, alignment, causal):
    window = (left, right)
    keep = definition_mask(Tq, Tk, window, causal, alignment)
    assert torch.equal(window_mask(Tq, Tk, window, causal, alignment), keep)
    kinds = brute_force_kinds(keep, block_q, block_k)
    assert window_tile_map(Tq, Tk, block_q, block_k, window, causal, alignment) == kinds
    visited = sum(kind is not TileKind.SKIP for row in kinds for kind in row)
    assert count_visited_window_tiles(Tq, Tk, block_q, block_k, window, causal, alignment) == visited
    assert window_visible_pairs(Tq, Tk, window, causal, alignment) == int(keep.sum())
    # The tiles a query tile visits are exactly its non-SKIP ones, one contiguous run.
    band = window_band(Tq, Tk, window, causal, alignment)
    for (qs, qe), row in zip(tile_ranges(Tq, block_q), kinds):
        run = key_tile_range(qs, qe, Tk, block_k, band)
        assert [kind is not TileKind.SKIP for kind in row] == [c in run for c in range(len(row))]


@pytest.mark.parametrize("N,block,left,right", [(16, 8, 24, 0), (16, 8, 5, 0), (10, 4, 9, 7), (12, 16, 100, 33)])
def test_square_window_tile_count_closed_form(N, block, left, right):
    # T = N * block, equal tiles: query tile r visits key tiles r - a .. r + b clipped to 0 .. N - 1, with
    # a = ceil(left / block) and b = ceil(right / block), so N (1 + a + b) - a (a + 1) / 2 - b (b + 1) / 2
    # tiles in all (a, b at most N - 1).
    a, b = min(-(-left // block), N - 1), min(-(-right // block), N - 1)
    expected = N * (1 + a + b) - a * (a + 1) // 2 - b * (b + 1) // 2
    assert count_visited_window_tiles(N * block, N * block, block, block, (left, right)) == expected


def test_window_pairs_are_linear_in_T_for_a_fixed_window():
    # A causal window of W keys back keeps W + 1 keys per row once the row is past the first W:
    # T (W + 1) - W (W + 1) / 2 pairs, counted in closed form even at T = 10^9.
    for T, W in [(32768, 4096), (16384, 1024), (10**9, 4096), (100, 500)]:
        W_eff = min(W, T - 1)
        assert window_visible_pairs(T, T, (W, 0)) == T * (W_eff + 1) - W_eff * (W_eff + 1) // 2
        assert window_visible_pairs(T, T, (W, -1), causal=True) == window_visible_pairs(T, T, (W, 0))


DOCUMENTS = {
    "three": ([0, 5, 17, 30], [0, 5, 17, 30]),
    "with_empty": ([0, 9, 9, 20, 21], [0, 9, 9, 20, 21]),
    "ragged_kv": ([0, 4, 4, 15], [0, 10, 13, 20]),  # Lq != Lk, an empty query side, a blind side below
    "no_keys": ([0, 6, 14], [0, 0, 11]),  # document 0 has queries but no keys: its rows are blind
}


@pytest.mark.parametrize(
    "cu_q,cu_k,window,causal,alignment",
    covering(docs=DOCUMENTS, window={"none": None, "3x0": ((3, 0),), "2x4": ((2, 4),)}, causal=[False, True],
             alignment=ALIGNMENTS),  # fmt: skip
)
def test_document_tiles_and_counts_match_brute_force(cu_q, cu_k, window, causal, alignment):
    keep = definition_document_mask(cu_q, cu_k, window, causal, alignment)
    assert torch.equal(document_mask(cu_q, cu_k, window, causal, alignment), keep)
    assert document_visible_pairs(cu_q, cu_k, window, causal, alignment) == int(keep.sum())
    # Tiles start at each document's first token: each document's tile map is its block's brute force,
    # and the tiles between documents are never tiled at all.
    maps = document_tile_maps(torch.tensor(cu_q, dtype=torch.int32), cu_k, 4, 3, window, causal, alignment)
    visited = 0
    for d, tile_map in enumerate(maps):
        block = keep[cu_q[d] : cu_q[d + 1], cu_k[d] : cu_k[d + 1]]
        assert tile_map == (brute_force_kinds(block, 4, 3) if block.numel() else [])
        visited += sum(kind is not TileKind.SKIP for row in tile_map for kind in row)
    assert count_visited_document_tiles(cu_q, cu_k, 4, 3, window, causal, alignment) == visited


# --- forward and backward against the float64 formula ------------------------------------------------

WINDOWS = {"none": None, "4x0": ((4, 0),), "0x3": ((0, 3),), "6x2": ((6, 2),), "unbounded_left_1": ((-1, 1),)}
# (a tuple value spreads over several names in covering(); a window is one value, so it is wrapped once)


@pytest.mark.parametrize(
    "Tq,Tk,window,causal,alignment,softcap,H_kv",
    covering(shape={"square": (23, 23), "wide": (13, 30), "tall": (30, 13)}, window=WINDOWS, causal=[False, True],
             alignment=ALIGNMENTS, softcap=[None, 0.8, 30.0], H_kv=[4, 1]),  # fmt: skip
)
def test_forward_and_backward_match_the_masked_formula(rand, Tq, Tk, window, causal, alignment, softcap, H_kv):
    q, k, v, do = rand(1, 4, Tq, 8, scale=2.0), rand(1, H_kv, Tk, 8), rand(1, H_kv, Tk, 8), rand(1, 4, Tq, 8)
    keep = definition_mask(Tq, Tk, window, causal, alignment)
    o, lse = flash_attention_forward(q, k, v, causal, None, 7, 5, alignment, window=window, softcap=softcap)
    assert_attention_close((o, lse), masked_truth(q, k, v, keep, None, softcap))
    grads = flash_attention_backward(q, k, v, o, lse, do, causal, None, 7, 5, alignment, window=window,
                                     softcap=softcap)  # fmt: skip
    for name, actual, expected in zip(("dq", "dk", "dv"), grads, truth_gradients(q, k, v, do, keep, None, softcap)):
        assert_close_to_truth(actual, expected, name, rtol=1e-10, atol=1e-11)


def test_softcap_changes_the_gradients_so_the_test_above_can_fail(rand):
    # A backward that forgot the cap's derivative 1 - tanh^2 would be off by this much: far beyond 1e-10.
    q, k, v, do = rand(1, 2, 20, 8, scale=3.0), rand(1, 2, 20, 8), rand(1, 2, 20, 8), rand(1, 2, 20, 8)
    keep = definition_mask(20, 20, (5, 0), False, "upper_left")
    capped = truth_gradients(q, k, v, do, keep, 1.0, 0.5)
    o, lse = flash_attention_forward(q, k, v, False, 1.0, 7, 5, window=(5, 0), softcap=0.5)
    grads = flash_attention_backward(q, k, v, o, lse, do, False, 1.0, 7, 5, window=(5, 0), softcap=0.5)
    uncapped_derivative = truth_gradients(q, k, v, do, keep, 1.0, None)
    for actual, right, wrong in zip(grads, capped, uncapped_derivative):
        torch.testing.assert_close(actual, right, rtol=1e-10, atol=1e-11)
        assert (right - wrong).abs().max() > 1e-2


def test_softcap_bounds_every_score_so_lse_is_bounded(rand):
    # |softcap * tanh(x / softcap)| < softcap, so lse <= log(number of kept keys) + softcap, even at τ = 1e6.
    q, k, v = rand(1, 1, 16, 4), rand(1, 1, 16, 4), rand(1, 1, 16, 4)
    o, lse = flash_attention_forward(q, k, v, True, 1e6, 4, 4, window=(3, 0), softcap=5.0)
    kept = definition_mask(16, 16, (3, 0), True, "upper_left").sum(-1)
    assert (lse[0, 0] <= torch.log(kept.double()) + 5.0).all() and torch.isfinite(o).all()


def test_forward_touches_exactly_the_non_skipped_window_tiles(rand):
    q, k, v = rand(1, 1, 40, 4), rand(1, 1, 33, 4), rand(1, 1, 33, 4)
    seen = {}
    record = lambda r, c, kind: seen.__setitem__((r, c), kind)
    flash_attention_forward(q, k, v, False, None, 7, 5, "lower_right", record, window=(6, 2))
    kinds = brute_force_kinds(definition_mask(40, 33, (6, 2), False, "lower_right"), 7, 5)
    expected = {(r, c): kind for r, row in enumerate(kinds) for c, kind in enumerate(row) if kind is not TileKind.SKIP}
    assert seen == expected and any(kind is TileKind.SKIP for row in kinds for kind in row)


def test_skipped_window_tiles_are_never_read(rand):
    # One query tile (4 rows, lower-right against 60 keys, window 5 back): only key tiles 10 and 11 hold
    # visible keys (keys 51..59). Every other key is NaN; the output must stay finite and exact.
    q, k, v = rand(1, 2, 4, 8), rand(1, 2, 60, 8), rand(1, 2, 60, 8)
    keep = definition_mask(4, 60, (5, 0), True, "lower_right")
    expected = masked_truth(q, k, v, keep)
    k_poisoned, v_poisoned = k.clone(), v.clone()
    k_poisoned[..., :50, :] = float("nan")
    v_poisoned[..., :50, :] = float("nan")
    actual = flash_attention_forward(q, k_poisoned, v_poisoned, True, None, 4, 5, "lower_right", window=(5, 0))
    assert_attention_close(actual, expected)
    # Control: one NaN inside a visited tile (key 50, masked for every row) must not arrive either,
    # but one in a visible key (55) must: the mask, not luck, kept the NaNs out.
    k_poisoned[..., 50, :] = float("nan")
    o, _ = flash_attention_forward(q, k_poisoned, v, True, None, 4, 5, "lower_right", window=(5, 0))
    assert torch.isfinite(o).all()
    k_poisoned[..., 55, :] = float("nan")
    o, _ = flash_attention_forward(q, k_poisoned, v, True, None, 4, 5, "lower_right", window=(5, 0))
    assert keep[:, 55].any() and torch.equal(torch.isnan(o).any(dim=-1)[0, 0], keep[:, 55])


def test_nan_key_reaches_exactly_the_rows_whose_window_holds_it(rand):
    q, k, v = rand(1, 1, 25, 4), rand(1, 1, 25, 4), rand(1, 1, 25, 4)
    k[..., 11, :] = float("nan")
    keep = definition_mask(25, 25, (3, 2), False, "upper_left")
    for softcap in (None, 2.0):
        actual = flash_attention_forward(q, k, v, False, None, 4, 6, window=(3, 2), softcap=softcap)
        expected = masked_truth(q, k, v, keep, None, softcap)
        assert_attention_close(actual, expected)
        assert torch.equal(torch.isnan(actual[1][0, 0]), keep[:, 11])  # rows 9..14, and only those


def test_rows_outside_every_window_are_blind_with_zero_gradients(rand):
    # Upper-left, 30 queries against 12 keys, window (0, 0): query i sees key i only, so rows 12..29 see none.
    q, k, v, do = rand(1, 2, 30, 4), rand(1, 2, 12, 4), rand(1, 2, 12, 4), rand(1, 2, 30, 4)
    o, lse = flash_attention_forward(q, k, v, False, None, 8, 5, window=(0, 0))
    assert torch.isneginf(lse[..., 12:]).all() and (o[..., 12:, :] == 0).all() and torch.isfinite(lse[..., :12]).all()
    dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do, False, None, 8, 5, window=(0, 0))
    assert (dq[..., 12:, :] == 0).all()
    keep = definition_mask(30, 12, (0, 0), False, "upper_left")
    for actual, expected in zip((dq, dk, dv), truth_gradients(q, k, v, do, keep)):
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-11)


def test_unbounded_window_is_the_unmasked_and_the_causal_forward(rand):
    q, k, v = rand(1, 2, 21, 8), rand(1, 2, 21, 8), rand(1, 2, 21, 8)
    for causal in (False, True):
        plain = flash_attention_forward(q, k, v, causal, None, 7, 5)
        windowed = flash_attention_forward(q, k, v, causal, None, 7, 5, window=(-1, -1))
        assert torch.equal(plain[0], windowed[0]) and torch.equal(plain[1], windowed[1])
    causal = flash_attention_forward(q, k, v, True, None, 7, 5)
    assert torch.equal(flash_attention_forward(q, k, v, False, None, 7, 5, window=(-1, 0))[0], causal[0])
    assert torch.equal(flash_attention_forward(q, k, v, True, None, 7, 5, window=(-1, 9))[0], causal[0])  # capped


# --- packed documents ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cu_q,cu_k,window,causal,alignment,softcap",
    [
        ([0, 5, 17, 30], [0, 5, 17, 30], None, True, "upper_left", None),
        ([0, 9, 9, 20, 21], [0, 9, 9, 20, 21], (4, 0), False, "upper_left", 1.5),
        ([0, 4, 4, 15], [0, 10, 13, 20], (2, 1), True, "lower_right", None),
        ([0, 6, 14], [0, 0, 11], None, False, "lower_right", 3.0),
    ],
)
def test_varlen_matches_the_block_diagonal_formula(rand, cu_q, cu_k, window, causal, alignment, softcap):
    total_q, total_k = cu_q[-1], cu_k[-1]
    q, do = rand(total_q, 4, 8), rand(total_q, 4, 8)
    k, v = rand(total_k, 2, 8), rand(total_k, 2, 8)
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    o, lse = varlen_attention_forward(q, k, v, cq, ck, causal, None, 4, 3, alignment, window=window, softcap=softcap)
    keep = definition_document_mask(cu_q, cu_k, window, causal, alignment)
    batch = lambda x: x.transpose(0, 1)[None]  # (total, H, D) -> (1, H, total, D)
    o_ref, lse_ref = masked_truth(batch(q), batch(k), batch(v), keep, None, softcap)
    assert_attention_close((batch(o), lse[None]), (o_ref, lse_ref))
    grads = varlen_attention_backward(q, k, v, o, lse, do, cq, ck, causal, None, 4, 3, alignment, window=window,
                                      softcap=softcap)  # fmt: skip
    expected = truth_gradients(batch(q), batch(k), batch(v), batch(do), keep, None, softcap)
    for name, actual, exp in zip(("dq", "dk", "dv"), grads, expected):
        assert_same_nonfinite(batch(actual), exp, name)
        torch.testing.assert_close(batch(actual), exp, rtol=1e-10, atol=1e-11)


# --- validation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"window": 3}, TypeError, "window must be None or a pair"),
        ({"window": (1, 2, 3)}, TypeError, "window must be None or a pair"),
        ({"window": (1.5, 2)}, TypeError, "window[0] (left) must be an int"),
        ({"window": (0, True)}, TypeError, "window[1] (right) must be an int"),
        ({"window": (-2, 0)}, ValueError, "window[0] (left) must be -1 (unbounded) or an int >= 0"),
        ({"softcap": 0}, ValueError, "softcap must be a positive finite number"),
        ({"softcap": -1.0}, ValueError, "softcap must be a positive finite number"),
        ({"softcap": float("inf")}, ValueError, "softcap must be a positive finite number"),
        ({"softcap": "30"}, TypeError, "softcap must be a positive real number or None"),
        ({"softcap": True}, TypeError, "softcap must be a positive real number or None"),
    ],
)
def test_bad_window_or_softcap_is_refused_by_name(kwargs, error, words):
    q = torch.zeros(1, 1, 4, 2)
    o, lse = flash_attention_forward(q, q, q)
    with pytest.raises(error, match=re.escape(words)):
        flash_attention_forward(q, q, q, **kwargs)
    with pytest.raises(error, match=r"window|softcap"):
        flash_attention_backward(q, q, q, o, lse, q, **kwargs)


def test_softcap_float32_cannot_round_to_zero():
    q = torch.zeros(1, 1, 4, 2)
    with pytest.raises(ValueError, match="softcap must lie in"):
        flash_attention_forward(q, q, q, softcap=1e-40)
    flash_attention_forward(q.double(), q.double(), q.double(), softcap=1e-40)  # float64 computes it


@pytest.mark.parametrize(
    "cu_q,cu_k,error,words",
    [
        ([1, 4], [0, 4], ValueError, r"cu_seqlens_q\[0\] must be 0"),
        ([0, 3, 2, 4], [0, 1, 2, 4], ValueError, "cu_seqlens_q must be non-decreasing"),
        ([0, 4], [0, 3], ValueError, r"cu_seqlens_k\[-1\] = 3 must equal the number of packed tokens, 4"),
        ([0, 2, 4], [0, 4], ValueError, "2 documents but cu_seqlens_k 1"),
        ([0], [0], ValueError, "at least 2 entries"),
        ("int64", [0, 4], TypeError, "cu_seqlens_q must have dtype in \\(int32\\)"),
        ("list", [0, 4], TypeError, "cu_seqlens_q must be a torch.Tensor"),
    ],
)
def test_bad_cu_seqlens_is_refused_by_name(cu_q, cu_k, error, words):
    x = torch.zeros(4, 2, 8)
    as_tensor = lambda c: torch.tensor(c, dtype=torch.int32)
    cq = {"int64": torch.tensor([0, 4]), "list": [0, 4]}.get(cu_q) if isinstance(cu_q, str) else as_tensor(cu_q)
    with pytest.raises(error, match=words):
        varlen_attention_forward(x, x, x, cq, as_tensor(cu_k))


def test_varlen_shapes_are_checked_by_name():
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="q must be a rank-3 tensor"):
        varlen_attention_forward(torch.zeros(1, 4, 2, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), cu, cu)
    with pytest.raises(ValueError, match="the number of query heads must be a multiple"):
        varlen_attention_forward(torch.zeros(4, 3, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), cu, cu)
    x = torch.zeros(4, 2, 8)
    o, lse = varlen_attention_forward(x, x, x, cu, cu)
    with pytest.raises(ValueError, match=r"lse must have shape \(H, total_q\)"):
        varlen_attention_backward(x, x, x, o, lse[:, :3], x, cu, cu)


def test_varlen_reads_views_through_their_strides(rand):
    # cu_seqlens as a strided view, q as a transposed view: the same answer as contiguous copies.
    cu = torch.tensor([0, 99, 5, -1, 12, 7, 20], dtype=torch.int32)[::2]  # [0, 5, 12, 20]
    q = rand(4, 20, 8).transpose(0, 1)  # (20, 4, 8), not contiguous
    k, v = rand(20, 2, 8), rand(20, 2, 8)
    viewed = varlen_attention_forward(q, k, v, cu, cu, True, None, 4, 3, window=(3, 0), softcap=2.0)
    contiguous_cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    copied = varlen_attention_forward(q.contiguous(), k, v, contiguous_cu, contiguous_cu, True, None, 4, 3,
                                      window=(3, 0), softcap=2.0)  # fmt: skip
    assert torch.equal(viewed[0], copied[0]) and torch.equal(viewed[1], copied[1])
    negated_view = torch.complex(k, k).conj().imag  # the values -k, held as k's memory with the negative bit
    assert negated_view.is_neg()
    with pytest.raises(ValueError, match="k is a view with the negative bit set"):
        varlen_attention_forward(q, negated_view, v, cu, cu)

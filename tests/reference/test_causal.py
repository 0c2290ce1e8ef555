import pytest
import torch

from flashtile.reference.causal import (
    TileKind,
    causal_mask,
    count_visited_tiles,
    diagonal_offset,
    last_key_tile,
    tile_map,
    tile_ranges,
)


def brute_force_tile_map(Tq, Tk, block_q, block_k, alignment):
    """Classify tiles by looking at the dense mask, independently of classify_tile's formulas."""
    mask = causal_mask(Tq, Tk, alignment)
    kinds = []
    for qs, qe in tile_ranges(Tq, block_q):
        row = []
        for ks, ke in tile_ranges(Tk, block_k):
            tile = mask[qs:qe, ks:ke]
            row.append(TileKind.FULL if tile.all() else TileKind.SKIP if not tile.any() else TileKind.DIAGONAL)
        kinds.append(row)
    return kinds


def test_upper_left_matches_sdpa_is_causal_mask():
    expected = torch.ones(5, 8, dtype=torch.bool).tril(diagonal=0)
    assert torch.equal(causal_mask(5, 8, "upper_left"), expected)


def test_lower_right_last_query_sees_every_key():
    mask = causal_mask(5, 8, "lower_right")
    assert mask[-1].all() and mask[0].sum() == 4  # offset Tk - Tq = 3: query 0 sees keys 0..3
    assert torch.equal(mask, torch.ones(5, 8, dtype=torch.bool).tril(diagonal=3))


def test_lower_right_with_more_queries_than_keys_leaves_first_rows_blind():
    mask = causal_mask(7, 3, "lower_right")
    assert diagonal_offset(7, 3, "lower_right") == -4
    assert not mask[:4].any() and mask[4:].any(dim=1).all()


@pytest.mark.parametrize("alignment", ["upper_left", "lower_right"])
@pytest.mark.parametrize(
    "Tq,Tk,block_q,block_k", [(33, 33, 7, 11), (40, 40, 8, 8), (17, 50, 5, 16), (50, 17, 16, 5), (1, 64, 16, 16)]
)
def test_tile_map_agrees_with_the_dense_mask(Tq, Tk, block_q, block_k, alignment):
    assert tile_map(Tq, Tk, block_q, block_k, alignment) == brute_force_tile_map(Tq, Tk, block_q, block_k, alignment)


@pytest.mark.parametrize("alignment", ["upper_left", "lower_right"])
@pytest.mark.parametrize("Tq,Tk,block_q,block_k", [(33, 33, 7, 11), (29, 61, 4, 9), (61, 29, 9, 4), (64, 64, 16, 32)])
def test_visited_tiles_are_everything_not_skipped(Tq, Tk, block_q, block_k, alignment):
    kinds = brute_force_tile_map(Tq, Tk, block_q, block_k, alignment)
    expected = sum(kind is not TileKind.SKIP for row in kinds for kind in row)
    assert count_visited_tiles(Tq, Tk, block_q, block_k, causal=True, alignment=alignment) == expected
    # No SKIP tile ever sits left of a needed one: the loop bound last_key_tile is enough.
    offset = diagonal_offset(Tq, Tk, alignment)
    for (_, qe), row in zip(tile_ranges(Tq, block_q), kinds):
        n = last_key_tile(qe, Tk, block_k, offset)
        assert all(kind is not TileKind.SKIP for kind in row[:n])
        assert all(kind is TileKind.SKIP for kind in row[n:])


@pytest.mark.parametrize("T,block", [(64, 16), (100, 16), (33, 7), (7, 7), (1, 4)])
def test_square_causal_tile_count_is_triangular(T, block):
    n = -(-T // block)
    assert count_visited_tiles(T, T, block, block, causal=True) == n * (n + 1) // 2


def test_non_causal_visits_every_tile():
    assert count_visited_tiles(33, 50, 7, 11, causal=False) == 5 * 5


def test_off_by_one_T33_bq7_bk11():
    # Query tile 4 holds rows 28..32; row 32 needs key 32, which lives in key tile 32 // 11 = 2.
    # A ceil-based bound (ceil(33 / 11) - 1 = 2 tiles) or q_start-based bound would drop it.
    offset = diagonal_offset(33, 33, "upper_left")
    assert last_key_tile(33, 33, 11, offset) == 3
    assert last_key_tile(28, 33, 11, offset) == 3  # q tile 3 is rows 21..27: row 27 -> key tile 2
    assert last_key_tile(21, 33, 11, offset) == 2  # q tile 2 is rows 14..20: row 20 -> key tile 1
    kinds = tile_map(33, 33, 7, 11)
    assert kinds[4] == [TileKind.FULL, TileKind.FULL, TileKind.DIAGONAL]
    assert kinds[1] == [TileKind.DIAGONAL, TileKind.DIAGONAL, TileKind.SKIP]  # rows 7..13 reach key tile 1
    assert count_visited_tiles(33, 33, 7, 11) == 1 + 2 + 2 + 3 + 3


def test_bad_alignment_and_blocks_raise_clear_errors():
    with pytest.raises(ValueError, match="alignment"):
        causal_mask(4, 4, "diagonal")
    with pytest.raises(ValueError, match="block_q"):
        tile_map(4, 4, 0, 2)
    with pytest.raises(TypeError, match="block_k"):
        count_visited_tiles(4, 4, 2, 2.5)

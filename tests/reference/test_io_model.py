from fractions import Fraction

import pytest

from flashtile.reference.io_model import (
    attention_traffic_lower_bound,
    flash_attention_traffic,
    paper_tile_sizes,
    query_outer_traffic,
    sram_footprint,
    standard_attention_traffic,
    theorem2_bound,
    traffic_ratio_limit,
)

HEAD_DIMS = (32, 64, 128)
MEMORIES = (4096, 25_000, 100_000, 131_072, 262_144)


def theorem_range(T: int, d: int, M: int) -> bool:
    """The range this model and the page use: four d-wide rows fit (4d <= M), a tile is at most T rows (M <= Td)."""
    return 4 * d <= M <= T * d


def test_standard_attention_counts_4Td_plus_4T2():
    t = standard_attention_traffic(1024, 64)
    assert t.total == 4 * 1024 * 64 + 4 * 1024 * 1024


def test_tile_sizes_take_the_floor_so_the_four_blocks_fit():
    assert paper_tile_sizes(M=25_000, d=64) == (64, 97)  # floor(25000/256) = 97; the ceiling, 98, needs 25,088
    assert paper_tile_sizes(M=100_000, d=64) == (64, 390)  # 4 * 391 * 64 = 100,096 > 100,000
    assert paper_tile_sizes(M=4096, d=64) == (16, 16)
    for d in HEAD_DIMS:
        for M in MEMORIES:
            block_q, block_k = paper_tile_sizes(M, d)
            assert 4 * block_k * d <= M < 4 * (block_k + 1) * d  # the largest key tile that fits
            assert block_q == min(block_k, d)


def test_tile_sizes_reject_a_memory_without_room_for_one_row_of_each_block():
    assert paper_tile_sizes(M=256, d=64) == (1, 1)
    with pytest.raises(ValueError, match="4\\*d"):
        paper_tile_sizes(M=255, d=64)


@pytest.mark.parametrize("d", HEAD_DIMS + (256,))
@pytest.mark.parametrize("M", MEMORIES)
def test_tiles_fit_in_five_quarters_of_M(M, d):
    assert sram_footprint(M, d) <= 1.25 * M  # exact with the floor: no rounding slack needed


def test_flash_traffic_stays_in_a_constant_band_of_T2d2_over_M():
    ratios = []
    for T in (1024, 2048, 4096, 8192):
        for d in (32, 64, 128, 256):
            for M in (4 * d * 8, 16_384, 65_536, 262_144):
                if theorem_range(T, d, M):
                    ratios.append(flash_attention_traffic(T, d, M).total / theorem2_bound(T, d, M))
    assert len(ratios) > 40
    assert 12 <= min(ratios) and max(ratios) <= 2 * min(ratios)  # 12 + 16/d + 2M/(Td), times the rounding


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_ratio_is_exactly_12_plus_16_over_d_plus_2M_over_Td_when_nothing_rounds(d):
    M = 4 * d * 512  # 4d divides M: B_c = 512 exactly
    for T in (512 * 8, 512 * 64, 512 * 1024):  # B_c divides T: T_c = T / B_c exactly
        ratio = Fraction(flash_attention_traffic(T, d, M).total * M, T * T * d * d)
        assert ratio == 12 + Fraction(16, d) + Fraction(2 * M, T * d)
    assert traffic_ratio_limit(d, M) == 12 + Fraction(16, d)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("M", [25_000, 100_000])
def test_ratio_tends_to_the_limit_not_to_12(d, M):
    T = 2**24
    ratio = flash_attention_traffic(T, d, M).total / theorem2_bound(T, d, M)
    limit = traffic_ratio_limit(d, M)
    assert abs(ratio - limit) < 0.01
    assert 12 + 16 / d <= limit < (12 + 16 / d) * M / (M - 4 * d)  # the floor can only raise it
    assert ratio - 12 > 0.1  # "tends to 12" is off by 16/d, more than 0.1 for every d here


def test_lower_bound_is_below_every_exact_algorithm_we_can_count():
    for T in (1024, 4096, 16_384):
        for d in HEAD_DIMS:
            for M in (d * d, 8192, 32_768, 100_000, 262_144):
                if not theorem_range(T, d, M):
                    continue
                lower = attention_traffic_lower_bound(T, d, M)
                assert lower <= flash_attention_traffic(T, d, M).total
                assert lower <= standard_attention_traffic(T, d).total


def test_lower_bound_has_the_shape_T2d2_over_M_once_M_is_at_least_d2():
    gaps = {}
    for T in (1024, 4096, 16_384, 65_536):
        for d in HEAD_DIMS:
            for M in (d * d, 8192, 32_768, 100_000):
                if not (theorem_range(T, d, M) and M >= d * d):
                    continue
                lower = attention_traffic_lower_bound(T, d, M)
                assert lower >= theorem2_bound(T, d, M) / 8
                gaps[T, d, M] = flash_attention_traffic(T, d, M).total / lower
    assert max(gaps.values()) < 64  # FlashAttention is optimal up to a constant factor ...
    by_T = [max(g for (T, _, _), g in gaps.items() if T == t) for t in (4096, 16_384, 65_536)]
    assert max(by_T) - min(by_T) < 1  # ... that does not grow with T


def test_lower_bound_loses_the_d2_over_M_shape_below_M_equals_d2():
    T, d = 65_536, 256
    small, large = 8192, 65_536  # M < d^2, then M = d^2
    shape = {M: attention_traffic_lower_bound(T, d, M) / theorem2_bound(T, d, M) for M in (small, large)}
    assert shape[large] > 0.2 and shape[small] < 0.05


def test_standard_traffic_does_not_shrink_with_M_while_flash_does():
    T, d = 4096, 64
    standard = standard_attention_traffic(T, d).total
    flash = [flash_attention_traffic(T, d, M).total for M in (4096, 16_384, 65_536, 262_144)]
    assert all(b < a for a, b in zip(flash, flash[1:]))  # more SRAM, less traffic
    assert flash[-1] < standard / 2  # and at realistic M it wins by a wide margin


def test_win_collapses_when_d_squared_exceeds_M():
    T, d, M = 8192, 1024, 100_000  # d^2 = 1M > M: the tiles are 24 rows
    assert flash_attention_traffic(T, d, M).total > standard_attention_traffic(T, d).total


def walk_tiles(T: int, d: int, outer: int, inner: int, query_outer: bool) -> int:
    """Elements moved by literally running the two tile loops and adding up each load and store.

    Independent of the model's closed forms: it never multiplies by a pass count. Key-outer (the
    paper's Algorithm 1): K_c, V_c loaded per outer step, then per query tile Q_r, O_r, l_r, m_r
    loaded and O_r, l_r, m_r stored. Query-outer: Q_r loaded, K_c, V_c loaded per inner step, then
    O_r and lse_r stored once.
    """
    moved = 0
    for o_start in range(0, T, outer):
        o_rows = min(outer, T - o_start)
        if query_outer:
            moved += o_rows * d  # load Q_r
            for i_start in range(0, T, inner):
                moved += 2 * min(inner, T - i_start) * d  # load K_c, V_c
            moved += o_rows * d + o_rows  # store O_r, lse_r
        else:
            moved += 2 * o_rows * d  # load K_c, V_c
            for i_start in range(0, T, inner):
                rows = min(inner, T - i_start)
                moved += 2 * rows * d + 2 * rows  # load Q_r, O_r, l_r, m_r
                moved += rows * d + 2 * rows  # store O_r, l_r, m_r
    return moved


@pytest.mark.parametrize("T, d, M", [(4096, 64, 100_000), (1000, 64, 25_000), (777, 96, 8192), (300, 32, 4096)])
def test_both_loop_orders_match_a_tile_by_tile_walk(T, d, M):
    B_c = M // (4 * d)  # step 2's floor, written out here rather than taken from the model
    assert flash_attention_traffic(T, d, M).total == walk_tiles(T, d, B_c, min(B_c, d), query_outer=False)
    assert query_outer_traffic(T, d, M).total == walk_tiles(T, d, B_c, min(B_c, d), query_outer=True)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_query_outer_order_tends_to_8_not_12_plus_16_over_d(d):
    M = 4 * d * 512  # nothing rounds: B_r = 512, T a multiple of it
    for T in (512 * 8, 512 * 64):
        ratio = Fraction(query_outer_traffic(T, d, M).total * M, T * T * d * d)
        assert ratio == 8 + Fraction(2 * M, T * d) + Fraction(M, T * d * d)  # K, V per pass | Q, O once | lse
        assert query_outer_traffic(T, d, M).total < flash_attention_traffic(T, d, M).total


def test_io_model_rejects_non_positive_sizes():
    with pytest.raises(ValueError, match="M"):
        flash_attention_traffic(1024, 64, 0)
    with pytest.raises(TypeError, match="d"):
        standard_attention_traffic(1024, 64.0)
    with pytest.raises(ValueError, match="T"):
        attention_traffic_lower_bound(0, 64, 100_000)
    with pytest.raises(ValueError, match="T"):
        query_outer_traffic(0, 64, 100_000)
    with pytest.raises(ValueError, match="4\\*d"):
        query_outer_traffic(1024, 64, 255)

import pytest

from flashtile.reference.io_model import (
    flash_attention_traffic,
    paper_tile_sizes,
    sram_footprint,
    standard_attention_traffic,
    theorem2_bound,
)


def test_standard_attention_counts_4Td_plus_4T2():
    t = standard_attention_traffic(1024, 64)
    assert t.total == 4 * 1024 * 64 + 4 * 1024 * 1024


def test_paper_tile_sizes():
    assert paper_tile_sizes(M=25_000, d=64) == (64, 98)  # B_c = ceil(25000/256) = 98, B_r = min(98, 64)
    assert paper_tile_sizes(M=4096, d=64) == (16, 16)


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("M", [4096, 25_000, 100_000])
def test_tiles_fit_in_a_constant_multiple_of_M(M, d):
    assert sram_footprint(M, d) <= 1.25 * M + 4 * d * d  # 5M/4 up to the ceil's rounding


def test_flash_traffic_stays_in_a_constant_band_of_T2d2_over_M():
    ratios = []
    for T in (1024, 2048, 4096, 8192):
        for d in (32, 64, 128, 256):
            for M in (4 * d * 8, 16_384, 65_536, 262_144):
                if not 4 * d <= M <= T * d:  # Theorem 2's range: the tiles are at least 1 row, less than T
                    continue
                ratios.append(flash_attention_traffic(T, d, M).total / theorem2_bound(T, d, M))
    assert len(ratios) > 40
    assert 12 <= min(ratios) and max(ratios) <= 2 * min(ratios)  # a constant band: 12 + 16/d + 2M/(Td) + ceil


def test_standard_traffic_does_not_shrink_with_M_while_flash_does():
    T, d = 4096, 64
    standard = standard_attention_traffic(T, d).total
    flash = [flash_attention_traffic(T, d, M).total for M in (4096, 16_384, 65_536, 262_144)]
    assert all(b < a for a, b in zip(flash, flash[1:]))  # more SRAM, less traffic
    assert flash[-1] < standard / 2  # and at realistic M it wins by a wide margin


def test_win_collapses_when_d_squared_exceeds_M():
    T, d, M = 8192, 1024, 100_000  # d^2 = 1M > M: the tiles are 25 columns wide
    assert flash_attention_traffic(T, d, M).total > standard_attention_traffic(T, d).total


def test_io_model_rejects_non_positive_sizes():
    with pytest.raises(ValueError, match="M"):
        flash_attention_traffic(1024, 64, 0)
    with pytest.raises(TypeError, match="d"):
        standard_attention_traffic(1024, 64.0)

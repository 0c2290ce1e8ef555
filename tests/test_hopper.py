"""flashtile.hopper: the occupancy and wave counts the primer teaches."""

from __future__ import annotations

import pytest

from flashtile.hopper import H200, programs_per_sm, waves
from flashtile.kernels._host import resident_programs


def test_a_255_register_thread_is_allocated_256_so_one_8_warp_program_fills_the_register_file():
    assert programs_per_sm(8, 255, 0) == (1, "registers")
    assert programs_per_sm(8, 248, 0) == (1, "registers")  # 8 * 32 * 248 = 63,488: still only one
    assert programs_per_sm(8, 128, 0) == (2, "registers")


def test_occupancy_agrees_with_the_launchers_register_count():
    for num_warps in (4, 8):
        for cap in (64, 128, 255):
            assert programs_per_sm(num_warps, cap, 0)[0] == resident_programs(num_warps, None if cap == 255 else cap)


def test_the_scarcest_resource_sets_occupancy():
    assert programs_per_sm(8, 128, 120 * 1024) == (1, "shared memory")
    assert programs_per_sm(1, 8, 0) == (32, "programs")  # at most 32 programs an SM, however small
    with pytest.raises(ValueError, match="spills past 255"):
        programs_per_sm(8, 256, 0)


def test_waves_round_up_and_divide_by_the_sms_times_the_programs_each_holds():
    assert waves(H200.sms, 1) == 1 and waves(H200.sms + 1, 1) == 2
    assert waves(2048, 1) == 16 and waves(2048, 2) == 8 and waves(1, 4) == 1

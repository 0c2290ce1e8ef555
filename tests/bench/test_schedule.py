"""The list-scheduling model of a causal launch, on cases small enough to work out by hand."""

from flashtile.bench.schedule import causal_key_tiles, launch_order, makespan, predicted_speedup


def test_causal_key_tiles_count_the_tiles_each_query_tile_folds():
    assert causal_key_tiles(256, 128, 64) == [2, 4]  # rows 0-127 see keys 0-127: two tiles of 64
    assert causal_key_tiles(200, 64, 64) == [1, 2, 3, 4]  # the ragged last tile sees keys up to 199
    assert causal_key_tiles(256, 64, 128) == [1, 1, 2, 2]


def test_launch_orders_put_the_longest_tiles_first_within_a_head_or_across_a_chunk():
    assert launch_order(3, 2) == [2, 1, 0, 2, 1, 0]
    assert launch_order(3, 2, chunk=2) == [2, 2, 1, 1, 0, 0]
    assert launch_order(2, 3, chunk=2) == [1, 1, 0, 0, 1, 0]  # a last chunk of one head


def test_makespan_is_greedy_list_scheduling():
    assert makespan([3, 1, 1, 1], slots=2) == 3  # the three short ones share the second slot
    assert makespan([1, 1, 3], slots=2) == 4  # the long one starts last, at 1, and ends alone
    assert makespan([2, 2], slots=8) == 2


def test_longest_first_across_heads_shortens_the_tail():
    # Three heads whose tiles take 1 and 3 units, on two slots. Plain order 3,1 | 3,1 | 3,1: slot A runs
    # 3 (0-3), slot B 1 (0-1) then 3 (1-4); A takes 1 (3-4); the third head's 3 starts at 4 and ends at 7.
    # Longest first 3,3,3,1,1,1: A and B run 3 (0-3), A the third 3 (3-6), B the three 1s (3-6): 6.
    work = [1, 3]
    assert makespan([work[t] for t in launch_order(2, 3)], 2) == 7
    assert makespan([work[t] for t in launch_order(2, 3, chunk=3)], 2) == 6
    assert predicted_speedup(2048, 32, 128, 64, slots=264, chunk=32) > 1.3  # the D = 64, B = 2 forward

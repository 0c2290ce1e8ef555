"""shard_sequence / unshard_sequence, and the ring's step plan against the causal tile rules."""

import pytest
import torch

from flashtile.distributed import n_chunks, rank_chunks, shard_positions, shard_sequence, step_plan, unshard_sequence
from flashtile.reference.causal import TileKind, classify_tile


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_zigzag_rank_r_holds_chunks_r_and_2w_minus_1_minus_r(world_size):
    T = 2 * world_size * 3
    for rank in range(world_size):
        assert rank_chunks(world_size, rank, is_causal=True) == (rank, 2 * world_size - 1 - rank)
        mirror = 2 * world_size - 1 - rank
        expected = [*range(3 * rank, 3 * rank + 3), *range(3 * mirror, 3 * mirror + 3)]
        assert shard_positions(T, world_size, rank, is_causal=True).tolist() == expected
        assert shard_positions(T, world_size, rank).tolist() == list(range(6 * rank, 6 * rank + 6))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shard_then_unshard_is_the_identity_and_shards_partition_t(world_size, is_causal):
    T = 24
    x = torch.arange(T, dtype=torch.float64).view(1, 1, T, 1).expand(2, 3, T, 5).contiguous()
    shards = [shard_sequence(x, world_size, r, is_causal) for r in range(world_size)]
    assert all(s.shape == (2, 3, T // world_size, 5) and s.is_contiguous() for s in shards)
    assert torch.equal(unshard_sequence(shards, is_causal), x)
    positions = torch.cat([shard_positions(T, world_size, r, is_causal) for r in range(world_size)])
    assert sorted(positions.tolist()) == list(range(T))
    for r, s in enumerate(shards):  # each shard holds exactly the positions shard_positions names
        assert s[0, 0, :, 0].tolist() == shard_positions(T, world_size, r, is_causal).double().tolist()


def test_t_not_divisible_raises_value_error_naming_the_multiple():
    x = torch.zeros(1, 1, 10, 4)
    with pytest.raises(ValueError, match="multiple of 3"):
        shard_sequence(x, 3, 0, is_causal=False)
    with pytest.raises(ValueError, match="multiple of 4"):
        shard_sequence(torch.zeros(1, 1, 6, 4), 2, 0, is_causal=True)  # 6 = 3 * 2, not a multiple of 2W = 4
    with pytest.raises(ValueError, match="rank"):
        shard_sequence(torch.zeros(1, 1, 8, 4), 2, 2)
    with pytest.raises(ValueError, match="even"):
        unshard_sequence([torch.zeros(1, 1, 3, 4)] * 2, is_causal=True)
    with pytest.raises(ValueError, match="shape"):
        unshard_sequence([torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 2, 4)])
    with pytest.raises(TypeError, match="list"):
        unshard_sequence(torch.zeros(1, 1, 4, 4))


def causal_work(T, world_size, rank, is_causal_layout):
    """Visible (query, key) pairs of rank's queries under a causal mask over the whole sequence."""
    return int((shard_positions(T, world_size, rank, is_causal_layout) + 1).sum())


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_zigzag_gives_every_rank_the_same_causal_work_and_contiguous_does_not(world_size):
    T = 2 * world_size * 16
    zigzag = {causal_work(T, world_size, r, True) for r in range(world_size)}
    contiguous = [causal_work(T, world_size, r, False) for r in range(world_size)]
    assert len(zigzag) == 1
    assert contiguous == sorted(contiguous) and contiguous[-1] / contiguous[0] > 2 * world_size - 2


def plan_mask(plan, T_local):
    """(T_local, T_local) bool: the (local query, local key) pairs a step computes unmasked."""
    rows = torch.zeros(T_local, dtype=torch.bool)
    keys = torch.zeros(T_local, dtype=torch.bool)
    rows[plan.q_rows], keys[plan.k_rows] = True, True
    mask = rows[:, None] & keys[None, :]
    if plan.causal:
        mask &= torch.ones(T_local, T_local, dtype=torch.bool).tril()
    return mask


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_step_plan_computes_exactly_the_visible_pairs(world_size):
    c = 4
    T_local, T = 2 * c, 2 * c * world_size
    for rank in range(world_size):
        q_pos = shard_positions(T, world_size, rank, True)
        for source in range(world_size):
            k_pos = shard_positions(T, world_size, source, True)
            visible = k_pos[None, :] <= q_pos[:, None]  # the causal mask over the whole sequence
            assert torch.equal(plan_mask(step_plan(rank, source, T_local, True), T_local), visible)
            assert torch.equal(plan_mask(step_plan(rank, source, T_local, False), T_local),
                               torch.ones(T_local, T_local, dtype=torch.bool))  # fmt: skip


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("is_causal", [False, True])
def test_the_own_step_covers_every_local_row(world_size, is_causal):
    """ring_forward starts its running result from step 0's partial, so step 0 must attend every row."""
    T_local = 8
    for rank in range(world_size):
        assert step_plan(rank, rank, T_local, is_causal).q_rows == slice(0, T_local)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_only_the_own_step_holds_diagonal_chunk_pairs(world_size):
    """Each (query chunk, key chunk) pair is a tile under classify_tile: a step without the mask may
    hold FULL and SKIP pairs only; the DIAGONAL ones are all in the step with the rank's own keys."""
    c = 4
    for rank in range(world_size):
        for source in range(world_size):
            plan = step_plan(rank, source, 2 * c, True)
            kinds = {
                classify_tile(q * c, (q + 1) * c, k * c, (k + 1) * c, 0)
                for q in rank_chunks(world_size, rank, True)
                for k in rank_chunks(world_size, source, True)
            }
            assert (TileKind.DIAGONAL in kinds) == plan.causal == (source == rank)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_causal_step_computes_the_same_work_up_to_the_diagonal(world_size):
    c = 8
    for rank in range(world_size):
        for source in range(world_size):
            pairs = int(plan_mask(step_plan(rank, source, 2 * c, True), 2 * c).sum())
            assert pairs == (2 * c * c + c if source == rank else 2 * c * c)
    assert n_chunks(world_size, True) == 2 * world_size

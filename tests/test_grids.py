"""The pairwise covering arrays of tests/_grids.py: every pair of values of any two axes is in some case."""

import itertools
import random

import pytest

from tests._grids import covering, covering_indices, covering_rows


@pytest.mark.parametrize("sizes", [[3, 4, 2, 2], [3, 3, 2, 2], [3, 2, 2, 2], [2, 3, 3], [5, 2, 4], [4, 4, 4, 4, 4]])
def test_every_pair_of_values_is_covered_by_fewer_cases_than_the_grid(sizes):
    cases = covering_indices(sizes, full=False)
    assert len(set(cases)) == len(cases) and all(len(c) == len(sizes) for c in cases)
    for a, b in itertools.combinations(range(len(sizes)), 2):
        seen = {(c[a], c[b]) for c in cases}
        assert seen == set(itertools.product(range(sizes[a]), range(sizes[b]))), (a, b)
    largest_two = sorted(sizes)[-2:]
    assert largest_two[0] * largest_two[1] <= len(cases) < len(list(itertools.product(*map(range, sizes))))


def test_random_grids_are_covered_and_the_choice_is_the_same_every_time():
    rng = random.Random(0)
    for _ in range(20):
        sizes = [rng.randint(1, 4) for _ in range(rng.randint(2, 5))]
        cases = covering_indices(sizes, full=False)
        for a, b in itertools.combinations(range(len(sizes)), 2):
            assert {(c[a], c[b]) for c in cases} == set(itertools.product(range(sizes[a]), range(sizes[b])))
        assert cases == covering_indices(sizes, full=False)


def test_the_full_grid_and_the_params_unpack_tuples_with_readable_ids():
    assert len(covering_indices([3, 4, 2], full=True)) == 24
    params = covering(mask={"full": (False, "upper_left"), "causal": (True, "upper_left")}, T=[(16, 16), (37, 23)])
    assert {p.id for p in params} == {"full-16x16", "full-37x23", "causal-16x16", "causal-37x23"}
    assert all(len(p.values) == 4 for p in params)


def test_rows_keep_every_pair_of_features_some_row_has():
    rows = [(d, t, causal) for d in (64, 128, 256) for t in ("bf16", "fp16") for causal in (False, True)]
    rows += [(80, "bf16", False), (96, "fp16", True)]
    kept = covering_rows(rows, lambda r: r)
    assert len(kept) < len(rows) and set(kept) <= set(rows)
    for a, b in itertools.combinations(range(3), 2):
        assert {(r[a], r[b]) for r in kept} == {(r[a], r[b]) for r in rows}

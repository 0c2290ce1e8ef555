"""Parameter grids for pytest: every pair of values by default, the whole cartesian grid on request.

A grid of four axes of 3, 4, 2 and 2 values has 48 cases; most bugs need one value of one axis, or one
pair of values of two axes, to show. ``covering`` keeps a set of cases in which every pair of values of
any two axes appears at least once (12 cases for the grid above), chosen greedily in a fixed order, so
the same cases run every time. ``make test-long`` (FLASHTILE_TEST_LONG=1) runs the whole grid instead.
``covering_rows`` does the same for a hand-made list of cases, pairing the features each case has.
"""

from __future__ import annotations

import itertools
import os

import pytest

LONG = os.environ.get("FLASHTILE_TEST_LONG", "") not in ("", "0")


def _pairs(case: tuple[int, ...]) -> set[tuple[int, int, int, int]]:
    """The (axis, index, axis, index) pairs one case of value indices covers."""
    return {(a, case[a], b, case[b]) for a, b in itertools.combinations(range(len(case)), 2)}


def covering_indices(sizes: list[int], full: bool = LONG) -> list[tuple[int, ...]]:
    """Cases (tuples of value indices, one per axis) that cover every pair of values of any two axes.

    Greedy: from the full product, in order, take the case that covers the most pairs not yet covered,
    until none is left. With ``full`` (or one axis) the whole product."""
    product = list(itertools.product(*(range(n) for n in sizes)))
    if full or len(sizes) < 2:
        return product
    uncovered = set().union(*(_pairs(c) for c in product))
    chosen = []
    while uncovered:
        best = max(product, key=lambda c: len(_pairs(c) & uncovered))  # the first of the best, in order
        chosen.append(best)
        uncovered -= _pairs(best)
    return sorted(chosen)


def covering_rows(rows: list, features) -> list:
    """The rows (in their order) of a subset of ``rows`` in which every pair of feature values that some
    row has is still had by some kept row; ``features(row)`` is a tuple of hashable values, the same
    length for every row. For a hand-made list of cases, where the full product would not make sense.
    With FLASHTILE_TEST_LONG, every row."""
    if LONG:
        return list(rows)
    pairs = []
    for f in map(features, rows):
        singles = {(a, f[a]) for a in range(len(f))}  # a value no other value pairs with still counts
        pairs.append(singles | {(a, f[a], b, f[b]) for a, b in itertools.combinations(range(len(f)), 2)})
    uncovered, kept = set().union(*pairs), set()
    while uncovered:
        best = max(range(len(rows)), key=lambda n: len(pairs[n] & uncovered))
        kept.add(best)
        uncovered -= pairs[best]
    return [row for n, row in enumerate(rows) if n in kept]


def covering(**axes: list | dict) -> list:
    """pytest params for ``parametrize`` over the axes, in keyword order, each value unpacked in place.

    An axis is a list of values (id: the value, a tuple's items joined by x) or a dict {id: value}; a
    tuple value spreads over several argument names: ``covering(mask={"full": (False, "upper_left")},
    dtype=[...])`` fills ``"causal,alignment,dtype"``."""
    label = lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v)
    named = [list(a.items()) if isinstance(a, dict) else [(label(v), v) for v in a] for a in axes.values()]
    params = []
    for case in covering_indices([len(a) for a in named]):
        values, ids = [], []
        for axis, index in zip(named, case):
            name, value = axis[index]
            values.extend(value if isinstance(value, tuple) else (value,))
            ids.append(name)
        params.append(pytest.param(*values, id="-".join(ids)))
    return params

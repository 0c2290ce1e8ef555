"""A model of how a causal launch's programs fill the GPU: list scheduling, for predicting the tail.

The GPU keeps ``slots`` programs running at once (SMs times the programs one SM holds) and starts the
next program of the launch order whenever a slot frees up. Under a causal mask query tile i of a head
folds about i + 1 key tiles (``causal_key_tiles``), so the programs differ in length, and the order in
which they start decides how long the last slots run alone at the end. ``makespan`` plays that out
for a given order; ``launch_order`` writes out the two orders of ``kernels._jit.program_tile`` in
plain Python. The model knows nothing of caches or of programs slowing each other down: it predicts
the tail's share of the time, not the traffic that an order costs (bench/PERF_LOG.md compares it with
the H200).
"""

from __future__ import annotations

import heapq


# --8<-- [start:schedule]
def causal_key_tiles(T: int, block_q: int, block_k: int) -> list[int]:
    """Key tiles each query tile of a causal (upper-left, Tq = Tk = T) head folds, tile
    0 first."""
    n_query_tiles = -(-T // block_q)
    return [
        min(-(-T // block_k), ((i + 1) * block_q - 1) // block_k + 1)
        for i in range(n_query_tiles)
    ]


def launch_order(n_tiles: int, pairs: int, chunk: int = 0) -> list[int]:
    """The query tile of each program in launch order, for ``pairs`` heads of
    ``n_tiles`` tiles each.

    chunk 0: the plain order, each head's tiles together, the longest (last) first.
    chunk > 0: heaviest first inside chunks of ``chunk`` heads, every head's longest
    tile before any head's second longest.
    """
    longest_first = list(range(n_tiles))[::-1]
    if chunk == 0:
        return longest_first * pairs
    order = []
    for first in range(0, pairs, chunk):
        size = min(chunk, pairs - first)
        order += [tile for tile in longest_first for _ in range(size)]
    return order


def makespan(work: list[float], slots: int) -> float:
    """When the last program ends if each starts, in list order, on the first slot that
    is free."""
    free_at = [0.0] * min(slots, len(work))
    for w in work:
        start = heapq.heappop(free_at)
        heapq.heappush(free_at, start + w)
    return max(free_at)
# --8<-- [end:schedule]


def predicted_speedup(T: int, pairs: int, block_q: int, block_k: int, slots: int, chunk: int,
                      overhead: float = 1.0) -> float:  # fmt: skip
    """Plain-order time over heaviest-first time, a program costing ``overhead`` plus its key tiles."""
    tiles = causal_key_tiles(T, block_q, block_k)

    def time(order):
        return makespan([overhead + tiles[t] for t in order], slots)

    return time(launch_order(len(tiles), pairs)) / time(launch_order(len(tiles), pairs, chunk))

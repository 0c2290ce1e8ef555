"""How many elements cross HBM: standard attention against FlashAttention (Theorem 2), and a floor under both.

Everything is counted in *elements* for one (batch, head) of sequence length T and head dim d, with
an on-chip memory (SRAM) of M elements. Multiply by bytes per element and by B*H for a whole call.
The paper's tile sizes B_r (query rows) and B_c (key rows) are `block_q` and `block_k` here, as in
the rest of flashtile.

Standard attention (three kernels: S = QK^T, P = softmax(S), O = PV):
    reads  Q, K (2Td), S (T^2), P (T^2), V (Td)
    writes S (T^2), P (T^2), O (Td)
    total  4Td + 4T^2                                     = Theta(Td + T^2), whatever M is.

FlashAttention, Algorithm 1 of the paper (key/value tiles outer, query tiles inner), for 4d <= M:
    B_c = floor(M / 4d) rows per key tile (the largest with 4 B_c d <= M), B_r = min(B_c, d) rows per
    query tile, T_c = ceil(T / B_c) outer steps. K and V are read once (2Td). For every outer step the
    inner loop reads all of Q and O (2Td) and the statistics l, m (2T), and writes O, l, m back (Td + 2T):
    total  2Td + T_c * (3Td + 4T)  ->  (12 + 16/d) T^2 d^2 / M as T grows (4d dividing M).

The FlashAttention-2 order (query tiles outer, key/value tiles inner), the order flashtile's forward runs:
    B_r = floor(M / 4d), T_r = ceil(T / B_r); Q read once and O, lse written once (2Td + T); K and V
    read on every pass: total  2Td + T + T_r * 2Td  ->  8 T^2 d^2 / M as T grows (4d dividing M).

Unequal head dims (``*_qk_v``): Q and K are d_qk wide, V and O d_v wide. Every term above that moves
a row of Q or K counts d_qk, a row of V or O d_v; the four blocks fit when 2 B_c (d_qk + d_v) <= M.
With d_qk = d_v = d every count is the one above.

Lower bound: any exact attention that forms each score from its d products moves at least
max(4Td, M * (ceil(T^2 d / (floor(r^2/4) d + 3Md)) - 1)) elements, r = floor(2M/d); for M >= d^2 that is
Omega(T^2 d^2 / M), the same shape as FlashAttention's count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from .._checks import check_block


@dataclass(frozen=True)
class Traffic:
    """HBM element traffic of one algorithm for one (batch, head)."""

    reads: int
    writes: int

    @property
    def total(self) -> int:
        return self.reads + self.writes


# --8<-- [start:standard]
def standard_attention_traffic(T: int, d: int) -> Traffic:
    """Elements moved by unfused attention; independent of the on-chip memory size."""
    check_block("T", T)
    check_block("d", d)
    reads = 2 * T * d + T * T + T * T + T * d  # Q, K | S | P, V
    writes = T * T + T * T + T * d  # S | P | O
    return Traffic(reads, writes)
# --8<-- [end:standard]


# --8<-- [start:tiles]
def paper_tile_sizes(M: int, d: int) -> tuple[int, int]:
    """(block_q, block_k), the paper's (B_r, B_c), of Algorithm 1 for an on-chip memory
    of M elements.

    Four d-wide blocks must fit in M elements: K_j and V_j (block_k x d each) plus Q_i
    and O_i (block_q x d each, and block_q <= block_k). The largest key tile with
    4 * block_k * d <= M is the floor of M / 4d; the paper writes a ceiling, which
    overshoots M whenever 4d does not divide it. block_q is further capped at d so that
    the block_q x block_k score tile is at most M/4 too.
    """
    check_block("M", M)
    check_block("d", d)
    if M < 4 * d:
        raise ValueError(
            f"M must hold one row of each of K_j, V_j, Q_i, O_i: M >= 4*d = {4 * d}, "
            f"got {M}"
        )
    block_k = M // (4 * d)  # B_c = floor(M / 4d)
    block_q = min(block_k, d)  # B_r = min(B_c, d)
    return block_q, block_k
# --8<-- [end:tiles]


def sram_footprint(M: int, d: int) -> int:
    """Elements held on chip at once by Algorithm 1: K_j, V_j, Q_i, O_i and the S_ij tile."""
    block_q, block_k = paper_tile_sizes(M, d)
    return 2 * block_k * d + 2 * block_q * d + block_q * block_k


# --8<-- [start:flash]
def flash_attention_traffic(T: int, d: int, M: int) -> Traffic:
    """Elements moved by Algorithm 1 with the paper's tile sizes for on-chip memory M
    (elements)."""
    check_block("T", T)
    _block_q, block_k = paper_tile_sizes(M, d)
    # T_c: one pass over all query tiles per key/value tile
    outer_steps = math.ceil(T / block_k)
    # K, V once | Q, O, l, m every pass
    reads = 2 * T * d + outer_steps * (2 * T * d + 2 * T)
    writes = outer_steps * (T * d + 2 * T)  # O, l, m every pass
    return Traffic(reads, writes)
# --8<-- [end:flash]


# --8<-- [start:query_outer]
def query_outer_traffic(T: int, d: int, M: int) -> Traffic:
    """Elements moved with the query tiles outside (the FlashAttention-2 order of
    Part A's forward and the kernels).

    The same four d-wide blocks fit in M, with the roles exchanged: the query tile Q_r
    and its accumulator stay on chip for the whole inner loop, so
    block_q = floor(M / 4d) and block_k = min(block_q, d). Q is read once and O and lse
    written once; K and V are read once per query tile.
    """
    check_block("T", T)
    # the larger tile goes to the loop that stays on chip
    _small, block_q = paper_tile_sizes(M, d)
    # T_r: one pass over all key tiles per query tile
    outer_steps = math.ceil(T / block_q)
    reads = T * d + outer_steps * 2 * T * d  # Q once | K, V every pass
    writes = T * d + T  # O and lse, once
    return Traffic(reads, writes)
# --8<-- [end:query_outer]


# --8<-- [start:head_dims]
def tile_sizes_qk_v(M: int, d_qk: int, d_v: int) -> tuple[int, int]:
    """(block_q, block_k) of Algorithm 1 when Q, K are d_qk wide and V, O are d_v wide.

    K_c and Q_r are d_qk wide, V_c and O_r d_v wide: with block_q <= block_k the four
    fit when 2 * block_k * (d_qk + d_v) <= M. block_q is capped at the mean width, so
    the score tile stays within M/4. With d_qk = d_v = d this is paper_tile_sizes.
    """
    check_block("M", M)
    check_block("d_qk", d_qk)
    check_block("d_v", d_v)
    width = d_qk + d_v  # a row of K_c and a row of V_c (or of Q_r and O_r)
    if M < 2 * width:
        raise ValueError(
            f"M must hold a row of each of K, V, Q, O: M >= {2 * width}, got {M}"
        )
    block_k = M // (2 * width)
    return min(block_k, width // 2), block_k


def standard_traffic_qk_v(T: int, d_qk: int, d_v: int) -> Traffic:
    """Unfused attention: Q, K read at d_qk; V read and O written at d_v."""
    for name, n in (("T", T), ("d_qk", d_qk), ("d_v", d_v)):
        check_block(name, n)
    reads = 2 * T * d_qk + T * T + T * T + T * d_v  # Q, K | S | P, V
    writes = T * T + T * T + T * d_v  # S | P | O
    return Traffic(reads, writes)


def flash_traffic_qk_v(T: int, d_qk: int, d_v: int, M: int) -> Traffic:
    """Algorithm 1 (key tiles outer): each pass reads Q (d_qk) and O (d_v)."""
    check_block("T", T)
    _block_q, block_k = tile_sizes_qk_v(M, d_qk, d_v)
    outer_steps = math.ceil(T / block_k)  # T_c
    # K, V once | Q, O, l, m every pass
    reads = T * (d_qk + d_v) + outer_steps * (T * d_qk + T * d_v + 2 * T)
    writes = outer_steps * (T * d_v + 2 * T)  # O, l, m every pass
    return Traffic(reads, writes)


def query_outer_traffic_qk_v(T: int, d_qk: int, d_v: int, M: int) -> Traffic:
    """FlashAttention-2's order: K (d_qk) and V (d_v) read once per query tile."""
    check_block("T", T)
    _small, block_q = tile_sizes_qk_v(M, d_qk, d_v)  # the larger tile stays on chip
    outer_steps = math.ceil(T / block_q)  # T_r
    reads = T * d_qk + outer_steps * T * (d_qk + d_v)  # Q once | K, V every pass
    writes = T * d_v + T  # O and lse, once
    return Traffic(reads, writes)
# --8<-- [end:head_dims]


def theorem2_bound(T: int, d: int, M: int) -> float:
    """T^2 d^2 / M: the shape of FlashAttention's traffic (up to a constant) for 4d <= M <= Td."""
    return T * T * d * d / M


# --8<-- [start:limit]
def traffic_ratio_limit(d: int, M: int) -> Fraction:
    """lim over T -> infinity of flash traffic / (T^2 d^2 / M), exactly.

    traffic / T^2 = 2d/T + ceil(T / B_c) (3d + 4) / T  ->  (3d + 4) / B_c, so the ratio
    tends to (3d + 4) M / (d^2 B_c). With B_c = M / 4d exactly (4d divides M) that is
    12 + 16/d; otherwise the floor makes B_c a little smaller and the limit a little
    larger.
    """
    _block_q, block_k = paper_tile_sizes(M, d)
    return Fraction((3 * d + 4) * M, d * d * block_k)
# --8<-- [end:limit]


# --8<-- [start:lower]
def attention_traffic_lower_bound(T: int, d: int, M: int) -> int:
    """Fewest HBM accesses of any exact attention that builds each score from its d
    products.

    Cut a run into segments of M accesses. In one segment the chip can use at most 2M
    elements of Q and K (M held at the start, M read), so a + b <= 2M/d whole rows, and
    at most a * b <= r^2 / 4 scores (r = floor(2M/d)) get all d products there. Any
    other score worked on in the segment carries a partial sum across one of its ends:
    on chip (at most M at each end) or through HBM (at most M accesses), so at most 3M
    of them, d products each. All T^2 d products need that many segments; every segment
    but the last is full. Reading Q, K, V and writing O (4Td) is a floor on its own.
    """
    check_block("T", T)
    check_block("d", d)
    check_block("M", M)
    r = 2 * M // d
    per_segment = (r * r // 4) * d + 3 * M * d  # products one segment can contribute
    segments = -(-T * T * d // per_segment)  # ceil(T^2 d / per_segment)
    return max(4 * T * d, M * (segments - 1))
# --8<-- [end:lower]

"""How many elements cross HBM: standard attention against FlashAttention (Theorem 2).

Everything is counted in *elements* for one (batch, head) of sequence length T and head dim d, with
an on-chip memory (SRAM) of M elements. Multiply by bytes per element and by B*H for a whole call.

Standard attention (three kernels: S = QK^T, P = softmax(S), O = PV):
    reads  Q, K (2Td), S (T^2), P (T^2), V (Td)
    writes S (T^2), P (T^2), O (Td)
    total  4Td + 4T^2                                     = Theta(Td + T^2), whatever M is.

FlashAttention, Algorithm 1 of the paper (key/value tiles outer, query tiles inner):
    B_c = ceil(M / 4d) columns per key tile, B_r = min(B_c, d) rows per query tile,
    T_c = ceil(T / B_c) outer steps. K and V are read once (2Td). For every outer step the inner loop
    reads all of Q and O (2Td) and the statistics l, m (2T), and writes O, l, m back (Td + 2T):
    total  2Td + T_c * (3Td + 4T)  ~  12 T^2 d^2 / M       = Theta(T^2 d^2 / M).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    """(B_r, B_c) of Algorithm 1.

    Four d-wide blocks must fit in M elements: K_j and V_j (B_c x d each) plus Q_i and O_i
    (B_r x d each, and B_r <= B_c), hence B_c = ceil(M / 4d). B_r is further capped at d so that the
    B_r x B_c score tile is at most d * M/4d = M/4 elements too.
    """
    check_block("M", M)
    check_block("d", d)
    block_c = math.ceil(M / (4 * d))
    block_r = min(block_c, d)
    return block_r, block_c
# --8<-- [end:tiles]


def sram_footprint(M: int, d: int) -> int:
    """Elements held on chip at once by Algorithm 1: K_j, V_j, Q_i, O_i and the S_ij tile."""
    block_r, block_c = paper_tile_sizes(M, d)
    return 2 * block_c * d + 2 * block_r * d + block_r * block_c


# --8<-- [start:flash]
def flash_attention_traffic(T: int, d: int, M: int) -> Traffic:
    """Elements moved by Algorithm 1 with the paper's tile sizes for on-chip memory M (elements)."""
    check_block("T", T)
    _block_r, block_c = paper_tile_sizes(M, d)
    outer_steps = math.ceil(T / block_c)  # T_c: one pass over all query tiles per key/value tile
    reads = 2 * T * d + outer_steps * (2 * T * d + 2 * T)  # K, V once | Q, O, l, m every pass
    writes = outer_steps * (T * d + 2 * T)  # O, l, m every pass
    return Traffic(reads, writes)
# --8<-- [end:flash]


def theorem2_bound(T: int, d: int, M: int) -> float:
    """T^2 d^2 / M: the shape of FlashAttention's traffic (up to a constant) when d <= M."""
    return T * T * d * d / M

"""Causal masking and tile skipping, the one place both tiers take their rules from.

Two alignments are in common use when the query length Tq and the key length Tk differ:

* ``"upper_left"``: query i sees keys j <= i. The mask's diagonal starts at the top-left corner.
  This is what ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` does.
* ``"lower_right"``: query i sees keys j <= i + (Tk - Tq). The diagonal ends at the bottom-right
  corner, so the last query sees every key. Decoding (Tq = 1 new token against a long cache) and
  chunked prefill need this one.

Both are "j <= i + offset" with a different ``offset``; everything below is written in terms of it.
When the offset is negative, the first -offset queries see no key at all; they get o = 0 and
lse = -inf by convention.

For tiles, the query tile [q_start, q_end) and key tile [k_start, k_end) are:

* FULL when every pair is visible: the key tile's last column k_end - 1 is visible from the tile's
  first row, ``k_end - 1 <= q_start + offset``. No mask is needed.
* SKIP when no pair is visible: the key tile's first column is beyond the tile's last row,
  ``k_start > q_end - 1 + offset``. Such a tile is never loaded.
* DIAGONAL otherwise: some pairs are visible, so the tile is computed with the mask applied.
"""

from __future__ import annotations

from enum import Enum

import torch

from .._checks import check_alignment, check_block


class TileKind(str, Enum):
    FULL = "full"
    DIAGONAL = "diagonal"
    SKIP = "skip"


# --8<-- [start:offset]
def diagonal_offset(Tq: int, Tk: int, alignment: str = "upper_left") -> int:
    """The offset in "query i sees key j iff j <= i + offset"."""
    check_alignment(alignment)
    return 0 if alignment == "upper_left" else Tk - Tq


def causal_mask(
    Tq: int, Tk: int, alignment: str = "upper_left", device=None
) -> torch.Tensor:
    """Boolean (Tq, Tk) mask, True where query i may attend to key j."""
    offset = diagonal_offset(Tq, Tk, alignment)
    i = torch.arange(Tq, device=device)[:, None]
    j = torch.arange(Tk, device=device)[None, :]
    return j <= i + offset
# --8<-- [end:offset]


# --8<-- [start:classify]
def classify_tile(
    q_start: int, q_end: int, k_start: int, k_end: int, offset: int
) -> TileKind:
    """Classify the tile rows [q_start, q_end) x columns [k_start, k_end) under
    j <= i + offset."""
    # the tile's top-right pair is visible, so all are
    if k_end - 1 <= q_start + offset:
        return TileKind.FULL
    # the tile's bottom-left pair is hidden, so all are
    if k_start > q_end - 1 + offset:
        return TileKind.SKIP
    return TileKind.DIAGONAL
# --8<-- [end:classify]


def tile_ranges(T: int, block: int) -> list[tuple[int, int]]:
    """[start, end) of each tile of size ``block`` over 0..T; the last one may be short."""
    check_block("block", block)
    return [(s, min(s + block, T)) for s in range(0, T, block)]


def tile_map(Tq: int, Tk: int, block_q: int, block_k: int, alignment: str = "upper_left") -> list[list[TileKind]]:
    """The kind of every (query tile, key tile) pair; row = query tile, column = key tile."""
    check_block("block_q", block_q)
    check_block("block_k", block_k)
    offset = diagonal_offset(Tq, Tk, alignment)
    return [
        [classify_tile(qs, qe, ks, ke, offset) for ks, ke in tile_ranges(Tk, block_k)]
        for qs, qe in tile_ranges(Tq, block_q)
    ]


# --8<-- [start:last_key_tile]
def last_key_tile(q_end: int, Tk: int, block_k: int, offset: int) -> int:
    """Number of key tiles a query tile ending at ``q_end`` needs (tiles 0 .. n-1).

    The tile's last row q_end - 1 sees keys up to q_end - 1 + offset, so the last key
    tile it needs is the one holding that column. Integer floor division, not rounding:
    this is the off-by-one that bites when the block sizes do not divide T.
    """
    check_block("block_k", block_k)
    last_visible_key = q_end - 1 + offset
    if last_visible_key < 0:  # the whole tile sees no key (lower-right with Tq > Tk)
        return 0
    n_tiles = -(-Tk // block_k)
    return min(n_tiles, last_visible_key // block_k + 1)
# --8<-- [end:last_key_tile]


def count_visited_tiles(
    Tq: int, Tk: int, block_q: int, block_k: int, causal: bool = True, alignment: str = "upper_left"
) -> int:
    """How many (query tile, key tile) pairs the forward computes: everything not SKIP."""
    check_block("block_q", block_q)
    check_block("block_k", block_k)
    n_k = -(-Tk // block_k)
    if not causal:
        return -(-Tq // block_q) * n_k
    offset = diagonal_offset(Tq, Tk, alignment)
    return sum(last_key_tile(qe, Tk, block_k, offset) for _, qe in tile_ranges(Tq, block_q))

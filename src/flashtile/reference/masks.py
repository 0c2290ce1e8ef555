"""Which (query, key) pairs a mask keeps, tile by tile: sliding windows and packed documents.

A window (left, right) lets query i see key j when

    i + offset - left <= j <= i + offset + right,

with ``offset = diagonal_offset(Tq, Tk, alignment)`` as for causal masks (``reference.causal``): 0 for
"upper_left", Tk - Tq for "lower_right". A side of -1 is unbounded; ``causal=True`` caps the right
side at 0, so causal is the window (-1, 0). Everything below is written in terms of the *band* of
diagonals the mask keeps, lo <= j - i <= hi, with lo = offset - left and hi = offset + right. An
unbounded side becomes an edge no pair reaches: j - i lies in [-(Tq - 1), Tk - 1], so lo = -Tq and
hi = Tk keep every pair on that side. Clamping both edges into [-Tq, Tk] changes no pair and keeps
the numbers small.

For the tile rows [q_start, q_end) x columns [k_start, k_end), j - i runs over every integer from
k_start - (q_end - 1) (bottom-left pair) to (k_end - 1) - q_start (top-right pair), and the tile is

* FULL when that whole range lies inside [lo, hi]: no mask is needed;
* SKIP when it misses [lo, hi]: the tile is never loaded;
* DIAGONAL otherwise: one of the band's two edges crosses it, so it is computed with the mask. (The
  causal chapter's name for a partial tile; a band has a diagonal edge on each side.)

For one query tile the key tiles to visit are one contiguous run, ``first_key_tile`` up to
``last_key_tile`` (``reference.causal``, with the band's right edge hi as its offset).

Packed documents (``cu_seqlens_q``, ``cu_seqlens_k``: cumulative lengths starting at 0) keep only
pairs of the same document, each document with its own window and its own alignment offset; the tiles
start at each document's first token, so no tile spans two documents: the packed mask is
block-diagonal and its off-diagonal blocks are never tiled at all.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._checks import (
    UNBOUNDED,
    check_block,
    check_causal,
    check_cumulative_lengths,
    check_int,
    check_tensor,
    check_window,
)
from .causal import TileKind, diagonal_offset, last_key_tile, tile_ranges


class Band(NamedTuple):
    """The diagonals a mask keeps: query i sees key j iff lo <= j - i <= hi."""

    lo: int
    hi: int


# --8<-- [start:band]
def window_band(
    Tq: int, Tk: int, window=None, causal: bool = False, alignment: str = "upper_left"
) -> Band:
    """The band (lo, hi) of the window (left, right) on a (Tq, Tk) score matrix; -1 is
    unbounded."""
    left, right = check_window(window) or (UNBOUNDED, UNBOUNDED)
    if check_causal(causal):
        right = 0  # causal caps the right side: no key after the diagonal
    offset = diagonal_offset(Tq, Tk, alignment)
    # j - i >= -(Tq - 1) always holds
    lo = -Tq if left == UNBOUNDED else max(offset - left, -Tq)
    # j - i <= Tk - 1 always holds
    hi = Tk if right == UNBOUNDED else min(offset + right, Tk)
    return Band(lo, hi)


def band_keeps(i: torch.Tensor, j: torch.Tensor, band: Band) -> torch.Tensor:
    """True where query i sees key j (broadcasting i against j)."""
    return (band.lo <= j - i) & (j - i <= band.hi)


def window_mask(
    Tq: int,
    Tk: int,
    window=None,
    causal: bool = False,
    alignment: str = "upper_left",
    device=None,
):
    """Boolean (Tq, Tk) mask, True where query i may attend to key j."""
    band = window_band(Tq, Tk, window, causal, alignment)
    i = torch.arange(Tq, device=device)[:, None]
    j = torch.arange(Tk, device=device)[None, :]
    return band_keeps(i, j, band)
# --8<-- [end:band]


# --8<-- [start:classify]
def classify_band_tile(
    q_start: int, q_end: int, k_start: int, k_end: int, band: Band
) -> TileKind:
    """Classify the tile rows [q_start, q_end) x columns [k_start, k_end) under
    lo <= j - i <= hi."""
    lowest = k_start - (q_end - 1)  # j - i at the tile's bottom-left pair
    highest = (k_end - 1) - q_start  # j - i at the tile's top-right pair
    # both extreme pairs inside the band, so all are
    if band.lo <= lowest and highest <= band.hi:
        return TileKind.FULL
    if highest < band.lo or lowest > band.hi:  # the tile's diagonals all miss the band
        return TileKind.SKIP
    return TileKind.DIAGONAL
# --8<-- [end:classify]


# --8<-- [start:first_key_tile]
def first_key_tile(q_start: int, Tk: int, block_k: int, lo: int) -> int:
    """Index of the first key tile a query tile starting at ``q_start`` needs.

    The tile's first row q_start sees keys from q_start + lo on, the smallest visible
    key of the whole tile, so the first key tile needed is the one holding that column
    (key 0's when it is negative). When that column is past the last key (not merely
    past the last full tile: a short last tile ends at Tk), the tile needs none and the
    answer is the number of key tiles, so that
    ``range(first_key_tile(...), last_key_tile(...))`` is empty.
    """
    check_block("block_k", block_k)
    first_visible_key = max(q_start + lo, 0)
    # the whole tile sees no key (a window that starts past the last key)
    if first_visible_key > Tk - 1:
        return -(-Tk // block_k)
    return first_visible_key // block_k


def key_tile_range(
    q_start: int, q_end: int, Tk: int, block_k: int, band: Band
) -> range:
    """The key tiles the query tile [q_start, q_end) visits: every one that is not SKIP,
    in order."""
    return range(
        first_key_tile(q_start, Tk, block_k, band.lo),
        last_key_tile(q_end, Tk, block_k, band.hi),
    )
# --8<-- [end:first_key_tile]


def window_tile_map(
    Tq: int, Tk: int, block_q: int, block_k: int, window=None, causal: bool = False, alignment: str = "upper_left"
) -> list[list[TileKind]]:
    """The kind of every (query tile, key tile) pair; row = query tile, column = key tile."""
    check_block("block_q", block_q)
    check_block("block_k", block_k)
    band = window_band(Tq, Tk, window, causal, alignment)
    return [
        [classify_band_tile(qs, qe, ks, ke, band) for ks, ke in tile_ranges(Tk, block_k)]
        for qs, qe in tile_ranges(Tq, block_q)
    ]


# --8<-- [start:counts]
def count_visited_window_tiles(
    Tq: int,
    Tk: int,
    block_q: int,
    block_k: int,
    window=None,
    causal: bool = False,
    alignment: str = "upper_left",
) -> int:
    """How many (query tile, key tile) pairs the forward computes: the length of each
    query tile's run."""
    check_block("block_q", block_q)
    check_block("block_k", block_k)
    band = window_band(Tq, Tk, window, causal, alignment)
    return sum(
        len(key_tile_range(qs, qe, Tk, block_k, band))
        for qs, qe in tile_ranges(Tq, block_q)
    )


def pairs_on_or_below(Tq: int, Tk: int, h: int) -> int:
    """#{(i, j) : 0 <= i < Tq, 0 <= j < Tk, j - i <= h}, in closed form.

    Row i keeps clamp(i + h + 1, 0, Tk) keys, so the count is the sum of clamp(x, 0, Tk)
    over x = h + 1 .. h + Tq, which is C(h + Tq) - C(h) with C(n) = sum over x = 1..n of
    min(x, Tk).
    """

    def C(n: int) -> int:
        if n <= 0:
            return 0
        if n <= Tk:
            return n * (n + 1) // 2
        return Tk * (Tk + 1) // 2 + (n - Tk) * Tk

    return C(h + Tq) - C(h)


def window_visible_pairs(
    Tq: int, Tk: int, window=None, causal: bool = False, alignment: str = "upper_left"
) -> int:
    """Number of (query, key) pairs the window keeps: those with j - i <= hi, less those
    with j - i < lo."""
    Tq, Tk = check_int("Tq", Tq), check_int("Tk", Tk)
    band = window_band(Tq, Tk, window, causal, alignment)
    return pairs_on_or_below(Tq, Tk, band.hi) - pairs_on_or_below(Tq, Tk, band.lo - 1)
# --8<-- [end:counts]


def window_attention_flops(
    B: int, H: int, Tq: int, Tk: int, D: int, window=None, causal: bool = False, alignment: str = "upper_left"
) -> int:
    """Matmul FLOPs of the forward on the kept pairs: 2*D for S = Q K^T and 2*D for O = P V per pair."""
    B, H, D = check_int("B", B), check_int("H", H), check_int("D", D)
    return 4 * B * H * D * window_visible_pairs(Tq, Tk, window, causal, alignment)


# --- packed documents ---------------------------------------------------------------------------------


def _lengths(name: str, cu_seqlens) -> list[int]:
    """Cumulative lengths from a list of ints or a 1-D int tensor (read through its strides)."""
    if isinstance(cu_seqlens, torch.Tensor):
        check_tensor(name, cu_seqlens, rank=1, dtypes=(torch.int32, torch.int64))
        cu_seqlens = cu_seqlens.tolist()
    return check_cumulative_lengths(name, cu_seqlens)


# --8<-- [start:documents]
def document_ranges(
    cu_seqlens_q, cu_seqlens_k
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """((q_start, q_end), (k_start, k_end)) of every document, from the cumulative
    lengths."""
    cu_q, cu_k = (
        _lengths("cu_seqlens_q", cu_seqlens_q),
        _lengths("cu_seqlens_k", cu_seqlens_k),
    )
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seqlens_q describes {len(cu_q) - 1} documents "
            f"but cu_seqlens_k {len(cu_k) - 1}"
        )
    return [
        ((cu_q[d], cu_q[d + 1]), (cu_k[d], cu_k[d + 1])) for d in range(len(cu_q) - 1)
    ]


def document_mask(
    cu_seqlens_q,
    cu_seqlens_k,
    window=None,
    causal=False,
    alignment="upper_left",
    device=None,
):
    """Boolean (total_q, total_k) mask: block-diagonal, each document's block its own
    window mask."""
    documents = document_ranges(cu_seqlens_q, cu_seqlens_k)
    mask = torch.zeros(
        documents[-1][0][1], documents[-1][1][1], dtype=torch.bool, device=device
    )
    for (qs, qe), (ks, ke) in documents:
        if qe > qs and ke > ks:  # an empty document keeps no pair
            mask[qs:qe, ks:ke] = window_mask(
                qe - qs, ke - ks, window, causal, alignment, device
            )
    return mask
# --8<-- [end:documents]


def document_tile_maps(
    cu_seqlens_q, cu_seqlens_k, block_q: int, block_k: int, window=None, causal=False, alignment="upper_left"
) -> list[list[list[TileKind]]]:
    """Each document's tile map, its tiles starting at the document's first query and first key."""
    return [
        window_tile_map(qe - qs, ke - ks, block_q, block_k, window, causal, alignment) if qe > qs and ke > ks else []
        for (qs, qe), (ks, ke) in document_ranges(cu_seqlens_q, cu_seqlens_k)
    ]


def count_visited_document_tiles(
    cu_seqlens_q, cu_seqlens_k, block_q: int, block_k: int, window=None, causal=False, alignment="upper_left"
) -> int:
    """Tiles computed over every document: the sum of each document's count (no tile spans two)."""
    return sum(
        count_visited_window_tiles(qe - qs, ke - ks, block_q, block_k, window, causal, alignment)
        for (qs, qe), (ks, ke) in document_ranges(cu_seqlens_q, cu_seqlens_k)
        if qe > qs and ke > ks
    )


def document_visible_pairs(cu_seqlens_q, cu_seqlens_k, window=None, causal=False, alignment="upper_left") -> int:
    """Pairs kept over every document, each in closed form."""
    return sum(
        window_visible_pairs(qe - qs, ke - ks, window, causal, alignment)
        for (qs, qe), (ks, ke) in document_ranges(cu_seqlens_q, cu_seqlens_k)
        if qe > qs and ke > ks
    )

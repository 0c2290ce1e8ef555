"""Drills: the paged-KV gather, then split-KV decode and the merge of partials. Read part-c/decode.

gather_pages reads one sequence's keys out of a pool of pages through its block table.
decode_attention_reference attends a few new tokens per sequence to its cache: it splits each
sequence's keys into num_splits slices, attends each slice on its own (a partial (o_s, lse_s)), and
merges the partials; a slice with no key (a short sequence) has lse_s = -inf and must count for
nothing. Check with:
    python -m flashtile.practice check DIR --step paged
    python -m flashtile.practice check DIR --step decode
"""

from __future__ import annotations

import torch


def gather_pages(pages: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` keys of one paged sequence, contiguous.

    Args:
        pages: (num_pages, H_kv, page_size, D), the pool.
        table_row: (max_pages,) int; entry j is the page holding keys j * page_size .. (j + 1) * page_size - 1.
        length: the sequence's number of keys; the last page may be partly filled.

    Returns:
        (H_kv, length, D).
    """
    raise NotImplementedError("TODO: key t is pages[table_row[t // page_size], :, t % page_size]")


def decode_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    num_splits: int | None = None,
    block_table: torch.Tensor | None = None,
):
    """Attention of the new tokens to each sequence's cache, split over the keys and merged.

    Args:
        query: (B, H, Tq, D), the Tq new tokens of each sequence; they are its last Tq positions, so
            new token t sees key j iff j <= t + length - Tq (causal, lower-right).
        key_cache, value_cache: (B, H_kv, capacity, D); with block_table, pools of pages
            (num_pages, H_kv, page_size, D) read with gather_pages.
        cache_seqlens: (B,) int32, each sequence's length (None: capacity).
        scale: τ; 1/sqrt(D) when None. num_splits: slices of the keys per sequence (None: your choice).
        block_table: (B, max_pages) int32, or None for contiguous caches.

    Returns:
        o: (B, H, Tq, D); lse: (B, H, Tq), float64 for float64 inputs.
    """
    raise NotImplementedError("TODO: a partial (o_s, lse_s) per slice, then lse = logsumexp(lse_s), o = Σ w_s o_s")

"""Inputs for the decode tests, without flashtile. Their float64 truth is ``_truth.decode_truth``: each
sequence's new tokens against its first ``length`` keys (einsum + torch.softmax in float64, lower-right
causal); a sequence of length 0 gives o = 0 and lse = -inf by the package's convention.
"""

from __future__ import annotations

import torch


def random_decode_inputs(B, H, H_kv, Tq, T_max, D, dtype=torch.float32, seed=0):
    """q (B, H, Tq, D) and contiguous k, v (B, H_kv, T_max, D), normal, rounded to ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=gen).to(dtype)
    k = torch.randn(B, H_kv, T_max, D, generator=gen).to(dtype)
    v = torch.randn(B, H_kv, T_max, D, generator=gen).to(dtype)
    return q, k, v


def to_pages(k, v, page_size, lengths, seed=0, spare_pages=3, pad=-1):
    """The paged form of contiguous caches: pages in a shuffled order, unused table entries ``pad``.

    Returns (k_pages, v_pages, block_table): pages (num_pages, H_kv, page_size, D) where every slot no
    sequence uses (spare pages, the tail of a sequence's last page) holds NaN, so a read of memory the
    kernel must not touch shows up as a NaN in the output; block_table (B, max_pages) int32.
    """
    B, H_kv, T_max, D = k.shape
    max_pages = -(-T_max // page_size)
    num_pages = B * max_pages + spare_pages
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    k_pages = torch.full((num_pages, H_kv, page_size, D), float("nan"), dtype=k.dtype)
    v_pages = torch.full_like(k_pages, float("nan"))
    table = torch.full((B, max_pages), pad, dtype=torch.int32)
    for b, n in enumerate(lengths):
        for j in range(-(-n // page_size)):
            page = int(order[b * max_pages + j])
            keys = slice(j * page_size, min((j + 1) * page_size, n))
            width = keys.stop - keys.start
            k_pages[page, :, :width] = k[b, :, keys]
            v_pages[page, :, :width] = v[b, :, keys]
            table[b, j] = page
    return k_pages, v_pages, table


def poison_past_lengths(k, v, lengths):
    """Copies of k, v with NaN in every slot at or past each sequence's length."""
    k, v = k.clone(), v.clone()
    for b, n in enumerate(lengths):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    return k, v

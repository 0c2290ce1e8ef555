"""Inputs for the decode tests, without flashtile. Their float64 truth is ``_truth.decode_truth``: each
sequence's new tokens against its first ``length`` keys (einsum + torch.softmax in float64, lower-right
causal); a sequence of length 0 gives o = 0 and lse = -inf by the package's convention. With sinks,
windows, soft-caps or a value head dim of its own, the truth is ``sink_decode_truth`` below.
"""

from __future__ import annotations

import math

import torch


def random_decode_inputs(B, H, H_kv, Tq, T_max, D, dtype=torch.float32, seed=0, D_v=None):
    """q (B, H, Tq, D) and contiguous k (B, H_kv, T_max, D), v (B, H_kv, T_max, D_v), normal, rounded to
    ``dtype``; D_v defaults to D."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=gen).to(dtype)
    k = torch.randn(B, H_kv, T_max, D, generator=gen).to(dtype)
    v = torch.randn(B, H_kv, T_max, D if D_v is None else D_v, generator=gen).to(dtype)
    return q, k, v


def to_pages(k, v, page_size, lengths, seed=0, spare_pages=3, pad=-1):
    """The paged form of contiguous caches: pages in a shuffled order, unused table entries ``pad``.

    Returns (k_pages, v_pages, block_table): pages (num_pages, H_kv, page_size, D or D_v) where every slot no
    sequence uses (spare pages, the tail of a sequence's last page) holds NaN, so a read of memory the
    kernel must not touch shows up as a NaN in the output; block_table (B, max_pages) int32.
    """
    B, H_kv, T_max, D = k.shape
    max_pages = -(-T_max // page_size)
    num_pages = B * max_pages + spare_pages
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    k_pages = torch.full((num_pages, H_kv, page_size, D), float("nan"), dtype=k.dtype)
    v_pages = torch.full((num_pages, H_kv, page_size, v.shape[-1]), float("nan"), dtype=v.dtype)
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


def sink_decode_truth(q, k, v, lengths, *, scale=None, window=None, softcap=None, sinks=None):
    """(o, lse) float64 on the CPU, one row at a time from the definition: new token t of sequence b sits
    at p = lengths[b] - Tq + t and sees keys max(p - left, 0) .. p of the contiguous caches k (B, H_kv,
    T_max, d_qk) and v (B, H_kv, T_max, d_v); its scores x = scale * q . k (scale 1/sqrt(d_qk) by
    default) become softcap * tanh(x / softcap) with a cap; the softmax runs over those scores and one
    more column, the head's sink (none where sinks is None or the sink is -inf), whose value is zero.
    lse is the log of the whole normaliser; a row with no key and no sink gets o = 0, lse = -inf."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    B, H, Tq, d_qk = q.shape
    group = H // k.shape[1]
    scale = 1 / math.sqrt(d_qk) if scale is None else scale
    left = -1 if window is None else window[0]
    o = torch.zeros(B, H, Tq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((B, H, Tq), float("-inf"), dtype=torch.float64)
    for b, n in enumerate(lengths):
        for h in range(H):
            for t in range(Tq):
                p = n - Tq + t  # an empty sequence (n = 0) has no key: first = end = 0
                first, end = (0 if left == -1 else max(p - left, 0), p + 1) if n else (0, 0)
                x = scale * (k[b, h // group, first:end] @ q[b, h, t])  # the row's scores
                if softcap is not None:
                    x = softcap * torch.tanh(x / softcap)
                sink = float("-inf") if sinks is None else float(sinks[h])
                column = torch.cat([x, torch.tensor([sink], dtype=torch.float64)])
                if torch.isneginf(column).all():
                    continue
                lse[b, h, t] = torch.logsumexp(column, 0)
                o[b, h, t] = torch.exp(x - lse[b, h, t]) @ v[b, h // group, first:end]
    return o, lse

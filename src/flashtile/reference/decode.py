"""Split-K decoding (FlashDecoding) in plain PyTorch: a few new tokens against a long KV cache.

One sequence's keys are cut into ``num_splits`` slices. Each slice is attended to on its own, giving
a partial output and its log-sum-exp, (o_s, lse_s); the partials are then combined by
``merge.merge_partials``, the same rescale identity that ``online_softmax.merge`` applies to two (m, l)
states. A normalised partial (o_s, lse_s) is the state m = lse_s, l = 1, acc = o_s, because
lse_s = m_s + log l_s, so

    lse = log sum_s exp(lse_s)            and            o = sum_s exp(lse_s - lse) * o_s.

Both sums are associative and commutative in exact arithmetic, so the slices may be merged in any
order and grouping; in floating point the orders differ only by rounding. The Triton kernels in
``flashtile.kernels.decode`` compute the same slices (``split_bounds``) with the same names.

The cache is either contiguous, (B, H_kv, T_max, D), or paged, (num_pages, H_kv, page_size, D) with
a block table; ``gather_pages`` turns one paged sequence into the contiguous keys it stands for. The
values may be narrower or wider than the keys (d_v != d_qk): the slices' scores contract over d_qk,
their partials o_s and the output are d_v wide.

Attention sinks (``reference.sinks``, one logit per query head, no value) join every row's softmax
once: the sink is the partial of one key whose value is zero, o = 0 and lse = sink, so the merge
starts from it instead of from the empty state (o = 0, lse = -inf), and no slice sees it. Counted in
each slice instead, it would be counted num_splits times.

Which keys a new token sees is a band (``decode_band``): new token t of a sequence of ``length`` keys
sits at position p_t = t + length - Tq (lower-right, per sequence) and sees key j iff
p_t + lo <= j <= p_t + hi. Decoding proper has hi = 0 (causal) and lo = -left for a sliding window
(left, 0), or no left edge; ``flashtile.attention`` routes its short calls here with any band of its
own masks. Only the key tiles some row sees are cut into slices (``decode_keys``, ``split_bounds``):
the tiles wholly outside a window are never read.
"""

from __future__ import annotations

import torch

from .._checks import (
    MAX_SPLITS,
    check_block,
    check_decode_inputs,
    check_num_splits,
    check_softcap,
    check_window,
    resolve_scale,
    stats_dtype,
)
from .._env import H200_SM_COUNT, sm_count
from .forward import masked_pv, softcap_scores
from .masks import window_band
from .merge import merge_partials
from .naive import expand_kv_heads
from .online_softmax import lse_from_stats, safe_exp_diff
from .sinks import check_sinks

REFERENCE_BLOCK_K = 64  # the key tile the splits are counted in; any value gives the same answer
MIN_KEYS_PER_SPLIT = 256  # a split reads at least this many keys, so the merge stays a small fraction


# --8<-- [start:bytes]
def kv_cache_bytes(lengths, H_kv: int, D: int, itemsize: int) -> int:
    """Bytes of K and V one decode step must read: every valid key and value of every KV
    head, once.

    Divided by the memory bandwidth it is a lower bound on the step's time, whatever the
    kernel: the new tokens' few rows of Q and O are negligible next to it.
    """
    return 2 * H_kv * sum(int(n) for n in lengths) * D * itemsize  # 2: K and V
# --8<-- [end:bytes]


# --8<-- [start:band]
def decode_band(
    Tq: int, Tk: int, window=None, causal: bool = True, alignment: str = "lower_right"
) -> tuple[int, int]:
    """(lo, hi): new token t sees key j iff lo <= j - (t + Tk - Tq) <= hi, the mask
    ``reference.masks`` keeps on a (Tq, Tk) score matrix, measured from the lower-right
    diagonal j = t + Tk - Tq.

    ``decode_attention``'s own band is (-left, 0) for a window (left, right) (right
    capped at 0: the new tokens are causal), and (-Tk, 0) without a left edge: -Tk
    reaches before key 0 from any row. Applied to a sequence of ``length`` <= Tk keys,
    the band keeps its place against that sequence's own diagonal (lower-right per
    sequence): row t sees keys t + length - Tq + lo .. t + length - Tq + hi.
    """
    # lo <= j - t <= hi, clamped into [-Tq, Tk]
    lo, hi = window_band(Tq, Tk, window, causal, alignment)
    shift = Tk - Tq  # the lower-right diagonal's j - t
    return lo - shift, hi - shift


def decode_keys(length: int, Tq: int, band: tuple[int, int]) -> tuple[int, int]:
    """[first, end): the keys of a sequence of ``length`` keys that at least one new
    token sees.

    Row 0 sees the lowest keys (from length - Tq + lo), row Tq - 1 the highest (up to
    length - 1 + hi).
    """
    lo, hi = band
    first = max(length - Tq + lo, 0)
    end = min(length + hi, length)
    return first, max(end, first)


def decode_span(capacity: int, Tq: int, band: tuple[int, int]) -> int:
    """The most keys one sequence's new tokens see together (at least 1): what the split
    count is picked for."""
    first, end = decode_keys(capacity, Tq, band)
    return max(end - first, 1)
# --8<-- [end:band]


# --8<-- [start:split_bounds]
def split_bounds(
    length: int, num_splits: int, block_k: int, first: int = 0
) -> list[tuple[int, int]]:
    """[start, end) of each of ``num_splits`` key slices of the keys first .. length - 1
    of one sequence.

    Slices are whole key tiles, counted from the tile that holds key ``first`` (the
    tiles before it are never read; the last tile may be short), the same number of
    tiles each, so a slice starts on a tile boundary. With more splits than tiles the
    trailing slices are empty (start = end).
    """
    first_tile = first // block_k
    n_tiles = max(-(-length // block_k) - first_tile, 0)
    tiles_per_split = -(-n_tiles // num_splits)
    bounds = []
    for split in range(num_splits):
        k_start = min((first_tile + split * tiles_per_split) * block_k, length)
        k_end = min(k_start + tiles_per_split * block_k, length)
        bounds.append((k_start, k_end))
    return bounds
# --8<-- [end:split_bounds]


# --8<-- [start:num_splits]
def pick_num_splits(programs: int, capacity: int, sm_count: int = H200_SM_COUNT) -> int:
    """How many slices to cut each sequence's keys into, when ``programs`` programs
    exist without splits.

    Enough programs already fill the GPU: 1. Otherwise the split count whose programs
    fill the last wave best (waves / ceil(waves), ties to fewer splits), keeping at
    least MIN_KEYS_PER_SPLIT keys per split so that the merge reads and writes little
    next to the cache.
    """
    if programs >= sm_count:
        return 1
    most = max(1, min(MAX_SPLITS, capacity // MIN_KEYS_PER_SPLIT))

    def wave_efficiency(s: int) -> float:
        waves = programs * s / sm_count
        return waves / -(-waves // 1)

    return max(range(1, most + 1), key=lambda s: (round(wave_efficiency(s), 3), -s))
# --8<-- [end:num_splits]


# --8<-- [start:gather_pages]
def gather_pages(
    pages: torch.Tensor, table_row: torch.Tensor, length: int
) -> torch.Tensor:
    """The first ``length`` keys of one paged sequence, contiguous: (H_kv, length, D).

    pages: (num_pages, H_kv, page_size, D); table_row: (max_pages,) int, entry j is the
    page holding keys j * page_size ... (j + 1) * page_size - 1. Only the first
    ceil(length / page_size) entries are read.
    """
    page_size = pages.shape[2]
    # the pages this sequence's keys lie in
    used = table_row[: -(-length // page_size)].long()
    picked = pages[used]  # (used, H_kv, page_size, D), in the sequence's order
    # (H_kv, used * page_size, D), cut to length
    return picked.transpose(0, 1).flatten(1, 2)[:, :length]
# --8<-- [end:gather_pages]


# --8<-- [start:partial]
def attend_split(
    q,
    k,
    v,
    k_start: int,
    k_end: int,
    length: int,
    scale: float,
    band=None,
    softcap=None,
):
    """Partial (o_s, lse_s) of the new tokens q (H, Tq, d_qk) over keys [k_start, k_end)
    of one sequence.

    k: (H, length, d_qk), v: (H, length, d_v); o_s is (H, Tq, d_v). New token t sees
    key j iff lo <= j - (t + length - Tq) <= hi (``decode_band``; None: causal), so a
    slice may hide every key from a row: o_s = 0, lse_s = -inf, which merges as
    nothing. A key or value the row does not see never
    reaches it (``forward.masked_pv``); lse_s is float64.
    """
    Tq = q.shape[-2]
    lo, hi = (-length, 0) if band is None else band
    # (H, Tq, keys), float64: see forward
    s = scale * (q @ k[:, k_start:k_end].transpose(-1, -2)).double()
    # unchanged without a cap; the mask's -inf comes after it
    s = softcap_scores(s, softcap)
    # each new token's own key
    position = torch.arange(Tq, device=q.device)[:, None] + length - Tq
    j = torch.arange(k_start, k_end, device=q.device)[None, :]
    keep = (j - position >= lo) & (j - position <= hi)  # the band, lower-right
    s = s.masked_fill(~keep, float("-inf"))
    m = (
        s.amax(dim=-1)
        if s.shape[-1]
        else torch.full(s.shape[:-1], float("-inf"), dtype=s.dtype, device=s.device)
    )
    # (H, Tq, keys); rows that see nothing give 0, not NaN
    p = safe_exp_diff(s, m[..., None])
    l = p.sum(dim=-1)
    # (H, Tq, d_v); a hidden value never reaches a row
    acc = masked_pv(p.to(q.dtype), v[:, k_start:k_end], keep)
    empty = (l == 0)[..., None]
    o_s = torch.where(
        empty, 0.0, acc / torch.where(empty, 1.0, l.to(acc.dtype)[..., None])
    )
    # lse_s float64: merged so, rounded once at the end
    return o_s, lse_from_stats(m, l)
# --8<-- [end:partial]


def sequence_keys(key_cache, value_cache, b: int, length: int, block_table, H: int, dtype):
    """Keys and values of sequence b, contiguous and expanded to the H query heads: (H, length, d_qk) and
    (H, length, d_v)."""
    if block_table is None:
        k, v = key_cache[b, :, :length], value_cache[b, :, :length]
    else:
        k, v = gather_pages(key_cache, block_table[b], length), gather_pages(value_cache, block_table[b], length)
    return expand_kv_heads(k[None].to(dtype), H)[0], expand_kv_heads(v[None].to(dtype), H)[0]


# --8<-- [start:reference]
def decode_attention_reference(
    query,
    key_cache,
    value_cache,
    cache_seqlens=None,
    *,
    scale=None,
    num_splits=None,
    block_table=None,
    block_k: int = REFERENCE_BLOCK_K,
    order=None,
    window=None,
    softcap=None,
    sinks=None,
):
    """``flashtile.decode_attention`` on the reference tier: split, attend each slice,
    merge, starting from the sinks.

    Arguments as in ``flashtile.decode_attention``; ``block_k`` is the tile the slices
    are counted in and ``order`` an optional permutation of range(num_splits), the order
    the partials are merged in (to show that it does not matter). Returns (o, lse): o
    (B, H, Tq, d_v) in query's dtype, lse float32 (float64 for float64 inputs); 16-bit
    inputs are computed in float32, like the kernels' accumulators.
    """
    shape = check_decode_inputs(
        query, key_cache, value_cache, cache_seqlens, block_table
    )
    check_sinks(sinks, shape, query)  # (H,), finite or -inf
    block_k = check_block("block_k", block_k)
    num_splits = check_num_splits(num_splits)
    softcap = check_softcap(softcap, query.dtype)
    # causal, lower-right, per sequence
    band = decode_band(shape.Tq, shape.capacity, check_window(window))
    if num_splits is None:
        num_splits = pick_num_splits(
            shape.B * shape.H_kv,
            decode_span(shape.capacity, shape.Tq, band),
            sm_count(query.device),
        )
    scale = resolve_scale(scale, shape.D, query.dtype)
    c = stats_dtype(query.dtype)
    lengths = (
        [shape.capacity] * shape.B if cache_seqlens is None else cache_seqlens.tolist()
    )
    order = range(num_splits) if order is None else list(order)
    if sorted(order) != list(range(num_splits)):
        raise ValueError(
            f"order must be a permutation of range(num_splits) = range({num_splits}), "
            f"got {order}"
        )

    o = torch.empty(
        (*query.shape[:-1], shape.D_v), dtype=query.dtype, device=query.device
    )
    lse = torch.empty(query.shape[:-1], dtype=c, device=query.device)
    # where each row's merge starts: the sink, a partial with o = 0 and lse = sink,
    # counted once; without sinks the empty state, lse = -inf
    start = torch.full(
        query.shape[1:-1], float("-inf"), dtype=torch.float64, device=query.device
    )
    if sinks is not None:
        start = sinks.double()[:, None].expand_as(start)
    # ragged: each sequence has its own length and its own slices
    for b, length in enumerate(lengths):
        k, v = sequence_keys(key_cache, value_cache, b, length, block_table, shape.H, c)
        q = query[b].to(c)  # (H, Tq, D)
        # the keys some new token sees: no other tile is read
        first, end = decode_keys(length, shape.Tq, band)
        bounds = split_bounds(end, num_splits, block_k, first)
        # the start state: o = 0, lse = the sink (-inf without one); lse rounded once
        o_b = torch.zeros(shape.H, shape.Tq, shape.D_v, dtype=c, device=q.device)
        lse_b = start
        for split in order:
            o_s, lse_s = attend_split(
                q, k, v, *bounds[split], length, scale, band, softcap
            )
            o_b, lse_b = merge_partials(o_b, lse_b, o_s, lse_s)
        o[b], lse[b] = o_b.to(query.dtype), lse_b
    return o, lse
# --8<-- [end:reference]

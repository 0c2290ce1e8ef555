"""``flashtile.decode_attention``: attention for a few new tokens against a long KV cache (FlashDecoding).

What it computes: for each sequence b of the batch, the ``Tq`` new query tokens (1 to 16) attend to
the first ``cache_seqlens[b]`` keys and values of that sequence's cache, causally, aligned lower-right
to that sequence's own length: new token t sees keys j <= t + cache_seqlens[b] - Tq. The caller has
already written the new tokens' keys and values into the cache, so the last new token sees every key.

Decisions of the contract (the same for every tier):

* ``cache_seqlens`` is an int32 tensor of B lengths; each is 0 (an empty slot of a serving batch,
  whose rows give o = 0 and lse = -inf) or lies in [Tq, capacity], where the capacity is T_max for a
  contiguous cache and max_pages * page_size for a paged one. ``None`` means every sequence is full.
* A paged cache is ``(num_pages, H_kv, page_size, D)`` with ``block_table`` (B, max_pages) int32:
  ``block_table[b, j]`` is the page that holds keys j * page_size ... (j + 1) * page_size - 1 of
  sequence b. page_size may be any positive int (a power of two turns the kernel's // and % into
  shifts, but nothing requires it). Only the entries that cover a sequence's keys are checked and
  read: the rest of a row may hold anything (-1 padding, stale pages).
* The values of ``cache_seqlens`` and ``block_table`` are checked here, which copies them to the host
  once per call (a synchronisation on CUDA). The kernel launcher ``flashtile.kernels.decode`` checks
  shapes only and trusts the values: benchmarks and CUDA graphs call it directly.
* Decoding is inference: the output carries no gradient, on every tier. It computes in the inputs'
  dtype and ignores ``torch.autocast`` (cast the inputs first if you want autocast's dtype). Meta
  tensors give outputs of the right shapes without computing (and without the value checks).

What runs is chosen as in ``flashtile.attention``: CUDA tensors run the Triton kernels; CPU tensors
run them through Triton's interpreter when ``TRITON_INTERPRET`` is on and the dtype is not bfloat16
(Triton issue 11584); float64 inputs, and every other CPU case, run ``flashtile.reference.decode``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._checks import (
    FLOAT_DTYPES,
    MAX_HEAD_DIM,
    check_flag,
    check_int,
    check_same,
    check_tensor,
    resolve_scale,
    stats_dtype,
)
from ._env import H200_SM_COUNT
from .api import no_autocast, pick_backend

MAX_NEW_TOKENS = 16  # Tq: a decode step (1) or a short speculative / chunked step (up to 16)
MIN_KEYS_PER_SPLIT = 256  # a split reads at least this many keys, so the merge stays a small fraction
MAX_SPLITS = 128


class DecodeShape(NamedTuple):
    """Sizes of one decode call. ``page_size`` is None for a contiguous cache."""

    B: int
    H: int
    H_kv: int
    Tq: int
    D: int
    capacity: int  # the most keys a sequence can hold: T_max, or max_pages * page_size
    page_size: int | None
    num_pages: int

    @property
    def group(self) -> int:
        """Query heads per key/value head (g = H / H_kv)."""
        return self.H // self.H_kv


def check_decode_inputs(
    query, key_cache, value_cache, cache_seqlens=None, block_table=None, *, dtypes=FLOAT_DTYPES, check_values=True
) -> DecodeShape:
    """Validate every argument of a decode call; return its sizes. ``check_values`` also reads
    ``cache_seqlens`` and ``block_table`` on the host (one copy of B + B * max_pages int32s)."""
    check_tensor("query", query, rank=4, dtypes=dtypes)
    check_tensor("key_cache", key_cache, rank=4, dtypes=dtypes)
    check_tensor("value_cache", value_cache, rank=4, dtypes=dtypes)
    check_same("key_cache", key_cache, "query", query)
    check_same("value_cache", value_cache, "query", query)
    if tuple(value_cache.shape) != tuple(key_cache.shape):
        raise ValueError(f"value_cache must have the shape of key_cache {tuple(key_cache.shape)}, got "
                         f"{tuple(value_cache.shape)}")
    for name, t in (("query", query), ("key_cache", key_cache)):
        if t.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); every dimension must be at least 1")
    B, H, Tq, D = query.shape
    n0, H_kv, slots, Dk = key_cache.shape
    if Tq > MAX_NEW_TOKENS:
        raise ValueError(f"query has {Tq} new tokens (dim 2); decode_attention takes 1 to {MAX_NEW_TOKENS}: "
                         "use flashtile.attention(..., is_causal=True, alignment='lower_right') for a prefill")
    if Dk != D:
        raise ValueError(f"key_cache has head dim {Dk} but query has {D}; the head dim (dim 3) must match")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"query has head dim {D}; flashtile supports head dims 1 to {MAX_HEAD_DIM}")
    if H % H_kv:
        raise ValueError(f"query has {H} heads but key_cache has {H_kv}; the number of query heads must be a "
                         "multiple of the number of key/value heads (GQA)")
    if block_table is None:
        if n0 != B:
            raise ValueError(f"key_cache has batch size {n0} but query has {B}; without a block_table the cache "
                             "is (B, H_kv, T_max, D)")
        shape = DecodeShape(B, H, H_kv, Tq, D, capacity=slots, page_size=None, num_pages=0)
    else:
        check_tensor("block_table", block_table, rank=2, dtypes=(torch.int32,))
        if block_table.device != query.device:
            raise ValueError(f"block_table is on {block_table.device} but query is on {query.device}")
        if block_table.shape[0] != B or block_table.shape[1] == 0:
            raise ValueError(f"block_table must have shape (B, max_pages) = ({B}, >= 1), got "
                             f"{tuple(block_table.shape)}")
        shape = DecodeShape(B, H, H_kv, Tq, D, block_table.shape[1] * slots, page_size=slots, num_pages=n0)
    if cache_seqlens is not None:
        check_tensor("cache_seqlens", cache_seqlens, rank=1, dtypes=(torch.int32,))
        if cache_seqlens.device != query.device:
            raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but query is on {query.device}")
        if cache_seqlens.shape[0] != B:
            raise ValueError(f"cache_seqlens must have B = {B} entries, got {cache_seqlens.shape[0]}")
    elif shape.capacity < Tq:
        raise ValueError(f"the cache holds {shape.capacity} keys but query has {Tq} new tokens, whose keys the "
                         "cache must already hold")
    if check_values:
        check_decode_values(shape, cache_seqlens, block_table)
    return shape


def check_decode_values(shape: DecodeShape, cache_seqlens, block_table) -> None:
    """The value checks: lengths 0 or in [Tq, capacity]; block table entries in the page pool."""
    lengths = [shape.capacity] * shape.B if cache_seqlens is None else cache_seqlens.tolist()
    for b, n in enumerate(lengths):
        if n != 0 and not shape.Tq <= n <= shape.capacity:
            raise ValueError(
                f"cache_seqlens[{b}] = {n}: each length must be 0 (an empty slot) or in [Tq, capacity] = "
                f"[{shape.Tq}, {shape.capacity}] (the new tokens' own keys are part of the cache; the capacity is "
                + ("T_max)" if shape.page_size is None else "max_pages * page_size)")
            )
    if block_table is None:
        return
    table = block_table.tolist()
    for b, n in enumerate(lengths):
        used = -(-n // shape.page_size)  # pages that hold keys 0 .. n - 1
        for j, page in enumerate(table[b][:used]):
            if not 0 <= page < shape.num_pages:
                raise ValueError(f"block_table[{b}, {j}] = {page} is outside the page pool [0, {shape.num_pages}) "
                                 f"(sequence {b} has {n} keys, so its first {used} entries are read)")


def check_num_splits(num_splits) -> int | None:
    """None (let ``pick_num_splits`` choose) or an int from 1 to MAX_SPLITS."""
    if num_splits is None:
        return None
    num_splits = check_int("num_splits", num_splits)
    if num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits must be at most {MAX_SPLITS}, got {num_splits}")
    return num_splits


# --8<-- [start:num_splits]
def pick_num_splits(programs: int, capacity: int, sm_count: int = H200_SM_COUNT) -> int:
    """How many slices to cut each sequence's keys into, when ``programs`` programs exist without splits.

    Enough programs already fill the GPU: 1. Otherwise the split count whose programs fill the last
    wave best (waves / ceil(waves), ties to fewer splits), keeping at least MIN_KEYS_PER_SPLIT keys
    per split so that the merge reads and writes little next to the cache.
    """
    if programs >= sm_count:
        return 1
    most = max(1, min(MAX_SPLITS, capacity // MIN_KEYS_PER_SPLIT))

    def wave_efficiency(s: int) -> float:
        waves = programs * s / sm_count
        return waves / -(-waves // 1)

    return max(range(1, most + 1), key=lambda s: (round(wave_efficiency(s), 3), -s))
# --8<-- [end:num_splits]


# --8<-- [start:decode_attention]
def decode_attention(
    query, key_cache, value_cache, cache_seqlens=None, *, scale=None, num_splits=None, block_table=None,
    return_lse=False,
):
    """Attention of Tq new tokens against each sequence's KV cache, split along the keys.

    Args:
        query: (B, H, Tq, D), 1 <= Tq <= 16, 1 <= D <= 256; fp16, bf16, fp32 or float64; any strides.
        key_cache, value_cache: (B, H_kv, T_max, D), or pages (num_pages, H_kv, page_size, D) with
            ``block_table``; H a multiple of H_kv (GQA); query's dtype and device; any strides.
        cache_seqlens: (B,) int32, keys held by each sequence, the new tokens' included; each 0 or in
            [Tq, capacity]. None: every sequence holds ``capacity`` keys.
        scale: τ, multiplies q·k; defaults to 1/sqrt(D). Zero and negative values are allowed.
        num_splits: slices of each sequence's keys, 1 to 128; None picks from the capacity, B * H_kv
            and the SM count (``pick_num_splits``). Any value gives the same answer up to rounding.
        block_table: (B, max_pages) int32, or None for a contiguous cache.
        return_lse: also return lse (B, H, Tq), natural log, float32 (float64 for float64 inputs).

    Returns:
        o (B, H, Tq, D) in query's dtype, or (o, lse). Rows of an empty sequence: o = 0, lse = -inf.
    """
    meta = isinstance(query, torch.Tensor) and query.device.type == "meta"  # shapes only, nothing computed
    shape = check_decode_inputs(query, key_cache, value_cache, cache_seqlens, block_table, check_values=not meta)
    scale = resolve_scale(scale, shape.D, query.dtype)
    num_splits = check_num_splits(num_splits)
    return_lse = check_flag("return_lse", return_lse)
    if meta:
        o, lse = query.new_empty(query.shape), query.new_empty(query.shape[:-1], dtype=stats_dtype(query.dtype))
        return (o, lse) if return_lse else o
    with torch.no_grad(), no_autocast(query.device.type):  # inference only; the tiers choose their precision
        if pick_backend(query) == "triton":  # the dispatch of flashtile.attention, use_backend included
            from .kernels.decode import flash_decode

            o, lse = flash_decode(query, key_cache, value_cache, cache_seqlens, scale=scale,
                                  num_splits=num_splits, block_table=block_table)
        else:
            from .reference.decode import decode_attention_reference

            o, lse = decode_attention_reference(query, key_cache, value_cache, cache_seqlens, scale=scale,
                                                num_splits=num_splits, block_table=block_table)
    return (o, lse) if return_lse else o
# --8<-- [end:decode_attention]

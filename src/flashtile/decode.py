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
* The values of ``cache_seqlens`` and ``block_table`` are checked here (``flashtile._checks``), which
  copies them to the host once per call (a synchronisation on CUDA). Any view of either is read
  through its strides, by the check and by the kernel alike: what is checked is what is read. The
  kernel launcher ``flashtile.kernels.decode`` checks shapes only and trusts the values: benchmarks
  and CUDA graphs call it directly.
* A view with the negative bit set (``x.is_neg()``) counts as its values on every tier; complex
  tensors are refused (TypeError naming the argument).
* Decoding is inference: the output carries no gradient, on every tier. It computes in the inputs'
  dtype and ignores ``torch.autocast`` (cast the inputs first if you want autocast's dtype). Meta
  tensors give outputs of the right shapes without computing (and without the value checks).

What runs is chosen as in ``flashtile.attention``: CUDA tensors run the Triton kernels; CPU tensors
run them through Triton's interpreter when ``TRITON_INTERPRET`` is on and the dtype is not bfloat16
(Triton issue 11584); float64 inputs, and every other CPU case, run ``flashtile.reference.decode``.
"""

from __future__ import annotations

import torch

from ._checks import (
    MAX_NEW_TOKENS,
    MAX_SPLITS,
    DecodeShape,
    check_decode_inputs,
    check_decode_values,
    check_flag,
    check_num_splits,
    resolve_neg_bits,
    resolve_scale,
    stats_dtype,
)
from ._env import H200_SM_COUNT
from .api import no_autocast, pick_backend
from .reference.decode import MIN_KEYS_PER_SPLIT, pick_num_splits

__all__ = [  # the checks live in _checks and the split heuristic in reference.decode; named here too
    "H200_SM_COUNT",
    "MAX_NEW_TOKENS",
    "MAX_SPLITS",
    "MIN_KEYS_PER_SPLIT",
    "DecodeShape",
    "check_decode_inputs",
    "check_decode_values",
    "check_num_splits",
    "decode_attention",
    "pick_num_splits",
]


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
    # a view's negative bit is a flag, not memory: the kernels would read the memory, so resolve it first
    query, key_cache, value_cache, cache_seqlens, block_table = resolve_neg_bits(
        query, key_cache, value_cache, cache_seqlens, block_table
    )
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

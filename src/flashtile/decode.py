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
* Windows and soft-caps: ``window=(left, right)`` keeps, for the new token at position
  p = cache_seqlens[b] - Tq + t of its sequence, the keys p - left .. p (right is capped at 0: the new
  tokens are causal; -1 is unbounded), exactly ``flashtile.attention(..., is_causal=True,
  alignment="lower_right", window=(left, right))`` on that sequence's keys; ``softcap`` s replaces each
  scaled score x by s * tanh(x / s) before the mask. Only the key tiles some new token sees are cut
  into slices: the cache before a window is never read, and the split count is picked for the window.
* Sinks and head dims: ``sinks`` (H,) joins each row's softmax as ``flashtile.attention``'s does (after
  the scale and the cap, no value; lse includes e^sink; a row that sees no key gives o = 0, lse = sink)
  and is counted once: the merge of the slices starts from it (with one slice, the slice does). The
  values may have their own head dim d_v (1 to 256): o is (B, H, Tq, d_v), the default scale 1/sqrt(d_qk).
* Host work per call: the shape and flag checks run once per layout of the tensors and flag values
  (``DecodeCall`` in ``flashtile._dispatch.decode``, kept by ``_plans.cached_plan``) and so does the kernels'
  plan (``DecodePlan``); a later call with the same layout checks the values (where there are any), allocates
  o (and lse, and one workspace where the keys are split) and launches. Without ``cache_seqlens`` and
  ``block_table`` nothing is read back to the host.
* Under ``torch.compile`` (``fullgraph=True`` included) a call is one opaque node, the custom op
  ``flashtile::decode_attention``: the checks of layouts and flags run at trace time, and the node runs the
  eager call, whose value checks read ``cache_seqlens`` and ``block_table`` when the graph runs (a bad
  value raises there, with the eager error). Nothing is traced into the kernels and nothing guards on data.
  (``flashtile.attention_varlen`` instead reads cu_seqlens while tracing: a graph break there, by design.)
* Decoding is inference: the output carries no gradient, on every tier. It computes in the inputs'
  dtype and ignores ``torch.autocast`` (cast the inputs first if you want autocast's dtype). Meta
  tensors give outputs of the right shapes without computing (and without the value checks).

What runs is chosen as in ``flashtile.attention``: CUDA tensors run the Triton kernels; CPU tensors
run them through Triton's interpreter when ``TRITON_INTERPRET`` is on and the dtype is not bfloat16
(Triton issue 11584); float64 inputs, and every other CPU case, run ``flashtile.reference.decode``.
"""

from __future__ import annotations

from ._checks import (
    MAX_NEW_TOKENS,
    MAX_SPLITS,
    DecodeShape,
    check_decode_inputs,
    check_decode_values,
    check_num_splits,
    check_window,
    resolve_neg_bits,
)
from ._dispatch.decode import DecodeCall, check_decode_call, decode_op, run_decode
from ._env import H200_SM_COUNT
from .reference.decode import MIN_KEYS_PER_SPLIT, pick_num_splits

__all__ = [  # the checks live in _checks and the split heuristic in reference.decode; named here too
    "H200_SM_COUNT",
    "MAX_NEW_TOKENS",
    "MAX_SPLITS",
    "MIN_KEYS_PER_SPLIT",
    "DecodeCall",
    "DecodeShape",
    "check_decode_call",
    "check_decode_inputs",
    "check_decode_values",
    "check_num_splits",
    "decode_attention",
    "decode_op",
    "pick_num_splits",
]


# --8<-- [start:decode_attention]
def decode_attention(
    query, key_cache, value_cache, cache_seqlens=None, *, scale=None, num_splits=None,
    block_table=None,
    return_lse=False, window=None, softcap=None, sinks=None,
):
    """Attention of Tq new tokens against each sequence's KV cache, split along the
    keys.

    Args:
        query: (B, H, Tq, d_qk), 1 <= Tq <= 16, 1 <= d_qk <= 256; fp16, bf16, fp32 or
            float64; any strides.
        key_cache: (B, H_kv, T_max, d_qk), or pages (num_pages, H_kv, page_size, d_qk)
            with ``block_table``; H a multiple of H_kv (GQA); query's dtype and device;
            any strides.
        value_cache: key_cache's shape but for the last dim, d_v (1 to 256).
        cache_seqlens: (B,) int32, keys held by each sequence, the new tokens' included;
            each 0 or in [Tq, capacity]. None: every sequence holds ``capacity`` keys.
        scale: τ, multiplies q·k; defaults to 1/sqrt(d_qk). Zero and negative values
            are allowed.
        num_splits: slices of each sequence's keys, 1 to 128; None picks from the keys a
            new token can see, B * H_kv and the SM count (``pick_num_splits``). Any
            value gives the same answer up to rounding.
        block_table: (B, max_pages) int32, or None for a contiguous cache.
        return_lse: also return lse (B, H, Tq), natural log, float32 (float64 for
            float64 inputs).
        window: None or (left, right), ints, each -1 (unbounded) or >= 0: the new token
            at position p of its sequence (p = length - Tq + t) sees keys p - left .. p;
            right is capped at 0 (the new tokens are causal). A sliding window of W keys
            is (W - 1, 0). The tiles before the window are never read.
        softcap: None or s > 0: each scaled score x becomes s * tanh(x / s) before the
            mask and the softmax.
        sinks: None or (H,), float32 or query's dtype, finite or -inf (no sink), within
            ``flashtile.attention``'s limit on their magnitude: one logit per query head
            that joins every row's softmax after the scale and the cap, with a value of
            zero; counted once, however many slices.

    The same as ``flashtile.attention(q_b, k_b, v_b, is_causal=True,
    alignment="lower_right", window=window, softcap=softcap)`` on each sequence b's
    first cache_seqlens[b] keys.

    Returns:
        o (B, H, Tq, d_v) in query's dtype, or (o, lse). Rows of an empty sequence:
            o = 0, lse = -inf (lse = the sink with one). With sinks, lse is the log of
            the whole normaliser, e^sink included. No gradient: decoding is inference.
    """
    # a view's negative bit is a flag, not memory: the kernels would read the memory, so
    # resolve it first
    query, key_cache, value_cache, cache_seqlens, block_table, sinks = resolve_neg_bits(
        query, key_cache, value_cache, cache_seqlens, block_table, sinks
    )
    # checked before it keys the plans: (True, 0) and (1, 0) hash alike
    if window is not None:
        window = check_window(window)
    return run_decode(
        query, key_cache, value_cache, cache_seqlens, block_table, sinks, scale=scale,
        num_splits=num_splits, return_lse=return_lse, window=window, softcap=softcap,
    )  # fmt: skip
# --8<-- [end:decode_attention]

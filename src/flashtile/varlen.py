"""``flashtile.attention_varlen``: packed documents, FlashAttention-2's varlen layout, registered as custom ops.

Training without padding concatenates the documents of a batch into one row of tokens: query, key and
value are (total_tokens, H, D), and ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32, 0 first, one entry more
than there are documents) say where each document starts. A query sees the keys of its own document
only, under the same mask rules as ``flashtile.attention`` (causal, window, alignment, softcap), each
document with its own Tq and Tk.

What runs is what ``flashtile.attention`` runs (``pick_backend``, ``use_backend``): CUDA tensors
take the Triton kernels' varlen mode (``kernels.forward.flash_attention_varlen``, ``kernels.backward.
flash_attention_varlen_backward``: one program per (document, query tile), no padding); CPU tensors take
the same kernels under ``TRITON_INTERPRET`` and the reference tier (``reference.varlen``) otherwise;
float64 and bf16 CPU tensors always take the reference tier.

The forward and the backward are two custom ops, ``flashtile::attention_varlen_fwd`` and
``flashtile::attention_varlen_bwd`` (``flashtile._dispatch.varlen``), each one opaque node under
``torch.compile``; every call goes through them (a varlen call's host work, its checks read cu_seqlens on the
host, dwarfs the dispatcher's). The checks read cu_seqlens on the host: under ``torch.compile`` that is a
graph break before the op, by design.

Supported: GQA (H a multiple of H_kv, always on, as in FlashAttention-2's varlen function), a value head
dim d_v of its own (o is d_v wide), attention sinks (``sinks``, as ``flashtile.attention`` takes them), empty
documents, documents with queries but no keys (their rows: o = 0, lse = -inf, zero gradients), one
reverse-mode backward. Not supported: double backward, forward-mode AD and ``torch.func`` transforms (each
raises), dropout and arbitrary masks.
"""

from __future__ import annotations

import torch

from ._checks import AttentionShape, check_max_seqlen, check_sink_values, check_varlen_inputs, resolve_neg_bits
from ._dispatch.tiers import (
    autocast_inputs,
    autocast_on,
    autocast_sinks,
    no_autocast,
    pick_backend,
    refuse_unsupported_autograd_modes,
)
from ._dispatch.varlen import attention_varlen_bwd, attention_varlen_fwd, clamp_band
from ._spec import check_spec

__all__ = ["attention_varlen", "attention_varlen_bwd", "attention_varlen_fwd"]


def attention_varlen(
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    is_causal=False,
    scale=None,
    window=None,
    softcap=None,
    alignment="upper_left",
    return_lse=False,
    sinks=None,
):
    """Softmax attention within each packed document, differentiable, on (total_tokens, H, D) tensors.

    Args:
        query: (total_q, H, D); key: (total_k, H_kv, D); value: (total_k, H_kv, d_v), H a multiple of H_kv,
            1 <= D, d_v <= 256. fp16, bf16, fp32, float64; any strides; CUDA or CPU (see the module docstring
            for which tier runs). scale defaults to 1/sqrt(D).
        cu_seqlens_q, cu_seqlens_k: int32 1-D tensors on the tokens' device, [0, n_1, n_1 + n_2, ..., total],
            non-decreasing, the same number of entries: document d owns queries cu_seqlens_q[d] ..
            cu_seqlens_q[d + 1] - 1 and keys cu_seqlens_k[d] .. cu_seqlens_k[d + 1] - 1.
        max_seqlen_q, max_seqlen_k: ints at least the longest document's query and key counts (a smaller one
            is refused). A larger bound is accepted and changes nothing: the checks read cu_seqlens anyway, so
            every tier works from the longest document itself (the kernels' grid is sized by it).
        is_causal, scale, window, softcap, alignment: as ``flashtile.attention``, applied to each document on
            its own (its own Tq and Tk, so with "lower_right" each document's last query sees its last key).
        return_lse: also return lse (H, total_q), natural log, float32 (float64 for float64 inputs), as
            FlashAttention-2's varlen function lays it out; it carries no gradient. With sinks, the log of
            the whole normaliser, e^sink included.
        sinks: None or (H,), as ``flashtile.attention`` takes them: one logit per query head that joins every
            row's softmax, in every document, with a value of zero; float32 or query's dtype, finite or -inf
            (no sink); differentiable.

    Returns:
        o (total_q, H, d_v) in query's dtype, contiguous; or (o, lse) if return_lse. A query of a document
        without keys gets o = 0 and lse = -inf (its head's sink, with sinks).
    """
    query, key, value, sinks = resolve_neg_bits(query, key, value, sinks)
    H, _, D, documents = check_varlen_inputs(query, key, value, cu_seqlens_q, cu_seqlens_k,
                                             names=("query", "key", "value"))  # fmt: skip
    # max_seqlen must bound the documents (as FlashAttention-2's varlen function requires); a larger bound is
    # accepted, but every tier works from the longest document itself, which the checks just read: the
    # kernels' grid is sized by it, so an oversized bound costs no time (a bound of 2**40 no endless grid)
    longest_q = max((e - s for (s, e), _ in documents), default=0)
    longest_k = max((e - s for _, (s, e) in documents), default=0)
    check_max_seqlen("max_seqlen_q", max_seqlen_q, longest_q)
    check_max_seqlen("max_seqlen_k", max_seqlen_k, longest_k)
    spec = check_spec(AttentionShape(1, H, key.shape[1], query.shape[0], key.shape[0], D), query.dtype,
                      causal=is_causal, scale=scale, alignment=alignment, window=window, softcap=softcap,
                      return_lse=return_lse, sinks=sinks, device=query.device)  # fmt: skip
    if sinks is not None and not torch.compiler.is_compiling():  # the layout is checked; now the values
        check_sink_values(sinks, spec.sink_limit)
    # the band's sides clamped to the longest document: the same keys, and no int32 overflow in the kernels
    mask = clamp_band(spec.mask, max(longest_q, longest_k))
    refuse_unsupported_autograd_modes()
    device = query.device.type
    if autocast_on(device):
        query, key, value = autocast_inputs(query, key, value, device)  # the scale was resolved before the cast
        sinks = autocast_sinks(sinks, query.dtype)
    backend = pick_backend(query)
    with no_autocast(device):  # the tiers choose their own precision
        o, lse, _stats = attention_varlen_fwd(query, key, value, cu_seqlens_q, cu_seqlens_k, longest_q, longest_k,
                                              spec.scale, mask.alignment, mask.left, mask.right, spec.softcap,
                                              backend, sinks)  # fmt: skip
    return (o, lse) if spec.return_lse else o



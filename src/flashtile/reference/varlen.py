"""Packed documents: attention on (total_tokens, H, D) tensors, within each document only.

Training without padding concatenates documents into one long row of tokens and says where each one
starts with cumulative lengths, ``cu_seqlens_q`` and ``cu_seqlens_k`` (the layout of FlashAttention-2's
varlen functions): document d owns the queries cu_seqlens_q[d] .. cu_seqlens_q[d + 1] - 1 and the keys
cu_seqlens_k[d] .. cu_seqlens_k[d + 1] - 1. A query sees keys of its own document only, under the same
mask rules as a single sequence (causal, window, alignment), each document with its own Tq and Tk.

The reference runs the tiled forward and backward once per document, its tiles starting at the
document's first token (``reference.masks``: no tile spans two documents). A document with queries
but no keys leaves them blind: o = 0, lse = -inf, zero gradients; one with no queries contributes
nothing. lse is returned as (H, total_q), FlashAttention-2's varlen layout.

v and o may have a head dim d_v of their own (``reference.head_dims``), and a (H,) tensor of sinks
(``reference.sinks``) joins every row's softmax in every document: a row of a document without keys
then gets o = 0 and lse = its head's sink.
"""

from __future__ import annotations

import torch

from .._checks import (
    AttentionShape,
    check_like,
    check_sinks,
    check_softcap,
    check_tensor,
    check_varlen_inputs,
    check_window,
    stats_dtype,
)
from .backward import backward_delta, flash_attention_backward
from .forward import flash_attention_forward
from .sinks import sink_gradient


def as_batch(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Tokens start .. end - 1 of a packed (total, H, D) tensor as a (1, H, end - start, D) view."""
    return x[start:end].transpose(0, 1).unsqueeze(0)


# --8<-- [start:forward]
def varlen_attention_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None,
    block_q=16, block_k=16, alignment="upper_left", *, window=None, softcap=None,
    sinks=None,
):  # fmt: skip
    """Attention within each packed document.

    Args:
        q: (total_q, H, D); k: (total_k, H_kv, D); v: (total_k, H_kv, d_v), H a
            multiple of H_kv.
        cu_seqlens_q, cu_seqlens_k: int32 (n_documents + 1,), 0 first, non-decreasing,
            ending at total_q and total_k.
        causal, scale, block_q, block_k, alignment, window, softcap, sinks: as
            ``flash_attention_forward``, applied to each document on its own.

    Returns:
        o (total_q, H, d_v) in q's dtype and lse (H, total_q) in
        ``stats_dtype(q.dtype)``.
    """
    H, H_kv, D, documents = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    window, softcap = check_window(window), check_softcap(softcap, q.dtype)
    shape = AttentionShape(1, H, H_kv, q.shape[0], k.shape[0], D)
    sinks = check_sinks(sinks, shape, q)
    c = stats_dtype(q.dtype)
    # a row without keys keeps o = 0 ...
    o = torch.zeros((*q.shape[:2], v.shape[2]), dtype=q.dtype, device=q.device)
    # ... and lse = -inf, or its head's sink: the one term of its normaliser
    lse = torch.full((H, q.shape[0]), float("-inf"), dtype=c, device=q.device)
    if sinks is not None:
        lse[:] = sinks.to(c)[:, None]
    for (q_start, q_end), (k_start, k_end) in documents:
        # no queries, or queries that see no key
        if q_end == q_start or k_end == k_start:
            continue
        o_d, lse_d = flash_attention_forward(
            as_batch(q, q_start, q_end),
            as_batch(k, k_start, k_end),
            as_batch(v, k_start, k_end),
            causal, scale, block_q, block_k, alignment, window=window, softcap=softcap,
            sinks=sinks,
        )  # fmt: skip
        o[q_start:q_end] = o_d[0].transpose(0, 1)
        lse[:, q_start:q_end] = lse_d[0]
    return o, lse
# --8<-- [end:forward]


def varlen_attention_backward(
    q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None, block_q=16, block_k=16,
    alignment="upper_left", *, window=None, softcap=None,
):  # fmt: skip
    """Gradients (dq like q, dk like k, dv like v) of ``varlen_attention_forward``, document by document.

    o and do are (total_q, H, d_v); lse is (H, total_q) from the forward (with the sinks' terms in it if the
    forward had sinks: dq, dk and dv are then as without them, and ``varlen_sink_gradient`` gives the
    sinks' own). Keys of a document without queries get zero gradients, as do the queries of a document
    without keys.
    """
    H, _, _, documents = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    check_like("o", o, "q", q, head_dim=v.shape[2])
    check_like("do", do, "q", q, head_dim=v.shape[2])
    check_tensor("lse", lse, rank=2, dtypes=(stats_dtype(q.dtype),))
    if tuple(lse.shape) != (H, q.shape[0]):
        raise ValueError(f"lse must have shape (H, total_q) = {(H, q.shape[0])}, got {tuple(lse.shape)}")
    window, softcap = check_window(window), check_softcap(softcap, q.dtype)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (q_start, q_end), (k_start, k_end) in documents:
        if q_end == q_start or k_end == k_start:
            continue
        grads = flash_attention_backward(
            as_batch(q, q_start, q_end), as_batch(k, k_start, k_end), as_batch(v, k_start, k_end),
            as_batch(o, q_start, q_end), lse[None, :, q_start:q_end], as_batch(do, q_start, q_end),
            causal, scale, block_q, block_k, alignment, window=window, softcap=softcap,
        )  # fmt: skip
        for packed, grad, (start, end) in zip(
            (dq, dk, dv), grads, ((q_start, q_end), (k_start, k_end), (k_start, k_end))
        ):
            packed[start:end] = grad[0].transpose(0, 1)
    return dq, dk, dv


def varlen_sink_gradient(sinks: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, do: torch.Tensor):
    """dsinks (H,) of packed documents: ``reference.sinks.sink_gradient`` over every packed row, with
    lse (H, total_q) from the forward with these sinks and D = rowsum(dO * O) of the (total_q, H, d_v)
    o and do. A row of a document without keys has o = 0, so D = 0 there and it adds nothing."""
    delta = backward_delta(o.to(lse.dtype), do.to(lse.dtype)).transpose(0, 1)  # (H, total_q)
    return sink_gradient(sinks, lse[None], delta[None])

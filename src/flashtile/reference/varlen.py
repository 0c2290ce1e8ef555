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
"""

from __future__ import annotations

import torch

from .._checks import check_like, check_softcap, check_tensor, check_varlen_inputs, check_window, stats_dtype
from .backward import flash_attention_backward
from .forward import flash_attention_forward


def as_batch(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Tokens start .. end - 1 of a packed (total, H, D) tensor as a (1, H, end - start, D) view."""
    return x[start:end].transpose(0, 1).unsqueeze(0)


# --8<-- [start:forward]
def varlen_attention_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None,
    block_q=16, block_k=16, alignment="upper_left", *, window=None, softcap=None,
):  # fmt: skip
    """Attention within each packed document.

    Args:
        q: (total_q, H, D); k, v: (total_k, H_kv, D), H a multiple of H_kv.
        cu_seqlens_q, cu_seqlens_k: int32 (n_documents + 1,), 0 first, non-decreasing,
            ending at total_q and total_k.
        causal, scale, block_q, block_k, alignment, window, softcap: as
            ``flash_attention_forward``, applied to each document on its own.

    Returns:
        o (total_q, H, D) in q's dtype and lse (H, total_q) in ``stats_dtype(q.dtype)``.
    """
    H, _, _, documents = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    window, softcap = check_window(window), check_softcap(softcap, q.dtype)
    # a blind row keeps o = 0 ...
    o = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    # ... lse = -inf
    lse = torch.full(
        (H, q.shape[0]), float("-inf"), dtype=stats_dtype(q.dtype), device=q.device
    )
    for (q_start, q_end), (k_start, k_end) in documents:
        # no queries, or queries that see no key
        if q_end == q_start or k_end == k_start:
            continue
        o_d, lse_d = flash_attention_forward(
            as_batch(q, q_start, q_end),
            as_batch(k, k_start, k_end),
            as_batch(v, k_start, k_end),
            causal, scale, block_q, block_k, alignment, window=window, softcap=softcap,
        )  # fmt: skip
        o[q_start:q_end] = o_d[0].transpose(0, 1)
        lse[:, q_start:q_end] = lse_d[0]
    return o, lse
# --8<-- [end:forward]


def varlen_attention_backward(
    q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None, block_q=16, block_k=16,
    alignment="upper_left", *, window=None, softcap=None,
):  # fmt: skip
    """Gradients (dq like q, dk and dv like k) of ``varlen_attention_forward``, document by document.

    o and do are (total_q, H, D) like q; lse is (H, total_q) from the forward. Keys of a document
    without queries get zero gradients, as do the queries of a document without keys.
    """
    H, _, _, documents = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    check_like("o", o, "q", q)
    check_like("do", do, "q", q)
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

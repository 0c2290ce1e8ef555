"""The float64 truth for packed documents, from dense masked attention: no flashtile import.

The packed (total_q, total_k) mask keeps query i and key j when both belong to the same document d and,
inside it, (i - q_start_d, j - k_start_d) passes the single-sequence rule (``_truth.definition_mask``).
Attention over the whole packed row through that mask is then the same as attention per document.
"""

from __future__ import annotations

import torch

from tests._truth import definition_mask, masked_truth, truth_gradients


def packed_keep(cu_q, cu_k, window=None, causal=False, alignment="upper_left") -> torch.Tensor:
    """(total_q, total_k) bool: the block-diagonal mask of the documents, each block its own window rule."""
    cu_q, cu_k = [int(x) for x in cu_q], [int(x) for x in cu_k]
    keep = torch.zeros(cu_q[-1], cu_k[-1], dtype=torch.bool)
    for d in range(len(cu_q) - 1):
        (qs, qe), (ks, ke) = (cu_q[d], cu_q[d + 1]), (cu_k[d], cu_k[d + 1])
        if qe > qs and ke > ks:
            keep[qs:qe, ks:ke] = definition_mask(qe - qs, ke - ks, window, causal, alignment)
    return keep


def as_dense(x: torch.Tensor) -> torch.Tensor:
    """(total, H, D) -> (1, H, total, D) float64."""
    return x.detach().double().transpose(0, 1).unsqueeze(0)


def varlen_truth(q, k, v, cu_q, cu_k, window=None, causal=False, alignment="upper_left", scale=None, softcap=None):
    """(o (total_q, H, D), lse (H, total_q)) in float64."""
    keep = packed_keep(cu_q, cu_k, window, causal, alignment)
    o, lse = masked_truth(as_dense(q), as_dense(k), as_dense(v), keep, scale, softcap)
    return o[0].transpose(0, 1), lse[0]


def varlen_truth_grads(q, k, v, do, cu_q, cu_k, window=None, causal=False, alignment="upper_left", scale=None,
                       softcap=None):  # fmt: skip
    """(dq, dk, dv) in float64, packed like q, k, v."""
    keep = packed_keep(cu_q, cu_k, window, causal, alignment)
    grads = truth_gradients(as_dense(q), as_dense(k), as_dense(v), as_dense(do), keep, scale, softcap)
    return tuple(g[0].transpose(0, 1) for g in grads)


def varlen_truth_by_document(q, k, v, cu_q, cu_k, window=None, causal=False, alignment="upper_left", scale=None,
                             softcap=None, do=None):  # fmt: skip
    """``varlen_truth`` (and with ``do``, ``varlen_truth_grads``) one document at a time, on q's device: for
    packed rows too long for one dense (total_q, total_k) matrix. Returns (o, lse) or (o, lse, dq, dk, dv)."""
    cu_q, cu_k = [int(x) for x in cu_q], [int(x) for x in cu_k]
    H = q.shape[1]
    o = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full((H, q.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
    grads = [torch.zeros(x.shape, dtype=torch.float64, device=x.device) for x in (q, k, v)]
    for d in range(len(cu_q) - 1):
        (qs, qe), (ks, ke) = (cu_q[d], cu_q[d + 1]), (cu_k[d], cu_k[d + 1])
        if qe == qs or ke == ks:
            continue
        keep = definition_mask(qe - qs, ke - ks, window, causal, alignment).to(q.device)
        dense = [as_dense(x) for x in (q[qs:qe], k[ks:ke], v[ks:ke])]
        o_d, lse_d = masked_truth(*dense, keep, scale, softcap)
        o[qs:qe], lse[:, qs:qe] = o_d[0].transpose(0, 1), lse_d[0]
        if do is not None:
            g = truth_gradients(*dense, as_dense(do[qs:qe]), keep, scale, softcap)
            for packed, g_d, (s, e) in zip(grads, g, ((qs, qe), (ks, ke), (ks, ke))):
                packed[s:e] = g_d[0].transpose(0, 1)
    return (o, lse) if do is None else (o, lse, *grads)

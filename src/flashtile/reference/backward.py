"""The FlashAttention backward pass, tile by tile, in plain PyTorch.

With S = scale * Q K^T, P = softmax(S) row-wise and O = P V, the gradients given dO are

    dV = P^T dO
    dP = dO V^T
    dS = P * (dP - D)        where D_i = sum_j P_ij dP_ij = rowsum(dO * O)_i
    dQ = scale * dS K
    dK = scale * dS^T Q

P is never stored: each tile recomputes it from the saved log-sum-exp as P = exp(S - lse), which is
exactly softmax(S) because lse is the log of the row's normaliser. D is one number per query row,
computed once up front from dO and O (which has only Tq x D entries), instead of from dP and P (which
would need the whole row of P). In code D is called ``delta``, since D is also the head dimension.

Loop order: key tiles outer, query tiles inner. dK and dV of one key tile then accumulate in one
place and are written once; dQ collects a contribution from every key tile (the GPU version gives
dQ its own kernel with the opposite loop order so that nothing is written twice).

v, o, dO and dV may be d_v wide while q, k, dQ and dK are D wide (``reference.head_dims``): D sums
over d_v and dP = dO V^T contracts over it. With a sink (``reference.sinks``) nothing here changes:
the saved lse already holds it, and its own gradient is ``sinks.sink_gradient``.
"""

from __future__ import annotations

import torch

from .._checks import (
    check_alignment,
    check_block,
    check_causal,
    check_lse,
    check_softcap,
    check_window,
    resolve_scale,
    stats_dtype,
)
from .causal import TileKind, tile_ranges
from .forward import softcap_scores
from .head_dims import check_head_dims, check_output_like
from .masks import band_keeps, classify_band_tile, window_band
from .naive import expand_kv_heads


# --8<-- [start:delta]
def backward_delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dO * O), shape (B, H, Tq): the only per-row quantity the backward
    needs besides lse."""
    return (do * o).sum(dim=-1)
# --8<-- [end:delta]


# --8<-- [start:recompute_p]
def recompute_p(
    s: torch.Tensor, lse_tile: torch.Tensor, visible: torch.Tensor | None
) -> torch.Tensor:
    """P = exp(S - lse) for one tile, zero where the forward masked the score (or the
    row saw nothing).

    Without the mask, a hidden key would get exp(S - lse) > 0 here although the forward
    gave it probability 0: the same mask must be applied in both directions. Only
    lse = -inf (a row that saw no key) means P = 0; a NaN or +inf lse must reach P, so
    the row that saw a NaN gets NaN gradients.
    """
    keep = ~torch.isneginf(lse_tile)[..., None].expand_as(s)
    if visible is not None:
        keep = keep & visible
    return torch.where(
        keep, torch.exp(s - torch.where(keep, lse_tile[..., None], 0.0)), 0.0
    )
# --8<-- [end:recompute_p]


# --8<-- [start:softcap_backward]
def softcap_backward(
    ds: torch.Tensor, x: torch.Tensor, softcap: float | None
) -> torch.Tensor:
    """The gradient with respect to the uncapped score x, given ds with respect to
    s = softcap * tanh(x / softcap).

    ds/dx = softcap * (1 - tanh^2(x / softcap)) / softcap = 1 - tanh^2(x / softcap):
    1 for small scores, near 0 where the cap saturates. Without a cap, ds is the answer.
    """
    if softcap is None:
        return ds
    t = torch.tanh(x / softcap)
    return ds * (1 - t * t)
# --8<-- [end:softcap_backward]


def flash_attention_backward(
    q,
    k,
    v,
    o,
    lse,
    do,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = 16,
    block_k: int = 16,
    alignment: str = "upper_left",
    *,
    window=None,
    softcap: float | None = None,
):
    """Gradients of attention from the saved (q, k, v, o, lse) and the incoming dO.

    Args:
        q: (B, H, Tq, D); k: (B, H_kv, Tk, D); v: (B, H_kv, Tk, d_v); o, do: (B, H, Tq, d_v);
            lse: (B, H, Tq) from the forward (with a sink's term in it if the forward had sinks).
        causal, scale, alignment, window, softcap: as in the forward; the mask and the cap must be the same.
        block_q, block_k: tile sizes, any positive ints.

    Returns:
        dq like q, and dk, dv like k. For GQA (H_kv < H) dk and dv are summed over the query heads
        that share each key/value head. 16-bit inputs are computed in float32 and the gradients cast back.
    """
    shape, d_v = check_head_dims(q, k, v)
    check_output_like("o", o, q, d_v)
    check_output_like("do", do, q, d_v)
    check_lse(lse, shape, q)
    check_causal(causal)
    check_alignment(alignment)
    window, softcap = check_window(window), check_softcap(softcap, q.dtype)
    check_block("block_q", block_q)
    check_block("block_k", block_k)
    scale = resolve_scale(scale, shape.D, q.dtype)
    B, H, H_kv, Tq, Tk, D = shape
    band = window_band(Tq, Tk, window, causal, alignment)
    dtype, c = q.dtype, stats_dtype(q.dtype)  # compute in float32 for 16-bit inputs, like the kernels
    q, o, do = q.to(c), o.to(c), do.to(c)
    k_rep, v_rep = expand_kv_heads(k.to(c), H), expand_kv_heads(v.to(c), H)

    delta = backward_delta(o, do)
    dq = torch.zeros_like(q)
    dk_rep = torch.empty_like(k_rep)
    dv_rep = torch.empty_like(v_rep)
    # --8<-- [start:tile_loop]
    # outer: one key tile, its dK and dV stay local
    for k_start, k_end in tile_ranges(Tk, block_k):
        k_tile, v_tile = k_rep[..., k_start:k_end, :], v_rep[..., k_start:k_end, :]
        dk = torch.zeros_like(k_tile)
        dv = torch.zeros_like(v_tile)
        # inner: every query tile that sees it
        for q_start, q_end in tile_ranges(Tq, block_q):
            kind = classify_band_tile(q_start, q_end, k_start, k_end, band)
            if kind is TileKind.SKIP:
                continue
            visible = None
            if kind is TileKind.DIAGONAL:
                i = torch.arange(q_start, q_end, device=q.device)[:, None]
                j = torch.arange(k_start, k_end, device=q.device)[None, :]
                visible = band_keeps(i, j, band)
            q_tile, do_tile = q[..., q_start:q_end, :], do[..., q_start:q_end, :]
            # the scaled scores, before any cap
            x = scale * (q_tile @ k_tile.transpose(-1, -2))
            s = softcap_scores(x, softcap)
            p = recompute_p(s, lse[..., q_start:q_end], visible)
            dv += p.transpose(-1, -2) @ do_tile  # dV = P^T dO
            dp = do_tile @ v_tile.transpose(-1, -2)  # dP = dO V^T
            ds = p * (dp - delta[..., q_start:q_end, None])  # dS = P * (dP - D)
            # through the cap: dX = dS * (1 - tanh^2(x / softcap))
            ds = softcap_backward(ds, x, softcap)
            # a hidden pair has dS = 0, even when its row's D is NaN
            if visible is not None:
                ds = torch.where(visible, ds, 0.0)
            dq[..., q_start:q_end, :] += scale * (ds @ k_tile)  # dQ = scale * dS K
            dk += scale * (ds.transpose(-1, -2) @ q_tile)  # dK = scale * dS^T Q
        dk_rep[..., k_start:k_end, :] = dk
        dv_rep[..., k_start:k_end, :] = dv
    # --8<-- [end:tile_loop]
    # --8<-- [start:gqa_sum]
    # Query heads h = g * group + r all read key/value head g, so their gradients add up
    # there.
    dk = dk_rep.view(B, H_kv, H // H_kv, Tk, D).sum(dim=2)
    dv = dv_rep.view(B, H_kv, H // H_kv, Tk, d_v).sum(dim=2)
    # --8<-- [end:gqa_sum]
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)

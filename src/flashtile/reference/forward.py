"""The FlashAttention forward pass, tile by tile, in plain PyTorch.

Each query tile of ``block_q`` rows keeps three running quantities while it walks over the key tiles
of ``block_k`` columns:

* ``m``   (block_q,)        the largest score seen so far in each row;
* ``l``   (block_q,)        sum of exp(score - m) over the keys seen so far;
* ``acc`` (block_q, d_v)    sum of exp(score - m) * v over the keys seen so far (unnormalised O).

q and k are D wide, v, acc and O are d_v wide: usually d_v = D, but nothing below needs it
(``reference.head_dims``). A sink (``reference.sinks``) changes only where (m, l) starts.

After the last tile, O = acc / l and lse = m + log l. Nothing of size Tq x Tk is ever formed: the
largest temporary is one (block_q, block_k) tile of scores. The Triton kernel in
``flashtile.kernels.forward`` runs this same loop with the same names.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._checks import (
    check_alignment,
    check_block,
    check_causal,
    check_sinks,
    check_softcap,
    check_window,
    resolve_scale,
    stats_dtype,
)
from .causal import TileKind, tile_ranges
from .head_dims import check_head_dims
from .masks import band_keeps, classify_band_tile, key_tile_range, window_band
from .naive import expand_kv_heads
from .online_softmax import lse_from_stats, safe_exp_diff
from .sinks import sink_start_state

# Called as on_tile(query_tile_index, key_tile_index, kind) for every tile the forward computes.
TileCallback = Callable[[int, int, TileKind], None]


# --8<-- [start:softcap]
def softcap_scores(s: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Soft-capping (Gemma-2): each scaled score x becomes softcap * tanh(x / softcap),
    in (-softcap, softcap).

    Applied before the mask, so a hidden pair's -inf is set after it and stays -inf.
    """
    return s if softcap is None else softcap * torch.tanh(s / softcap)
# --8<-- [end:softcap]


def masked_pv(p: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """p @ v over the kept pairs only: sum over the keys j row i keeps of p_ij v_j, as the formula has it.

    A plain p @ v also multiplies a hidden pair's p = 0 by its value, and 0 * NaN = NaN, 0 * inf = NaN.
    So the finite values go through the matmul (a hidden one adds 0 * finite = 0) and the non-finite ones
    are counted per row over the kept pairs only, with 0/1 matmuls that hold no NaN: a kept NaN, a kept
    +-inf times p = 0, or both signs of inf make the row's entry NaN; one sign of inf makes it that inf.
    keep: (block_q, block_k) bool, broadcast over the batch and head dims of p.
    """
    finite = torch.isfinite(v)
    out = p @ torch.where(finite, v, 0.0)
    kept = keep.to(p.dtype)
    seen_zero, seen_positive = kept * (p == 0), kept * (p != 0)
    pos_inf, neg_inf = torch.isposinf(v).to(p.dtype), torch.isneginf(v).to(p.dtype)
    nan = (kept @ torch.isnan(v).to(p.dtype) + seen_zero @ (pos_inf + neg_inf)) > 0
    pos, neg = (seen_positive @ pos_inf) > 0, (seen_positive @ neg_inf) > 0
    signed = torch.where(pos, float("inf"), torch.where(neg, float("-inf"), 0.0))
    extra = torch.where(nan | (pos & neg), float("nan"), signed)
    return out + extra.to(out.dtype)


# --8<-- [start:tile_loop]
def forward_query_tile(
    q_tile,
    k,
    v,
    q_start,
    q_end,
    scale,
    block_k,
    band,
    on_tile=None,
    q_index=0,
    softcap=None,
    start=None,
):
    """Run one query tile [q_start, q_end) over the key tiles it needs;
    return its (m, l, acc).

    ``band`` is the mask as the diagonals it keeps, lo <= j - i <= hi
    (``reference.masks``): causal is (-Tq, offset), no mask (-Tq, Tk), where every tile
    is FULL. The scores and (m, l) are float64 (the dot itself is q_tile's dtype): a
    score past float32's range, which τ near its limit gives, stays finite. ``start`` is
    the (m, l) the rows begin from: None for (-inf, 0), no key seen; a sink's (sink, 1).
    """
    Tk = k.shape[-2]
    # --8<-- [start:state]
    m = torch.full(
        q_tile.shape[:-1], float("-inf"), dtype=torch.float64, device=q_tile.device
    )
    l = torch.zeros_like(m)
    # (..., block_q, d_v): as wide as v
    acc = q_tile.new_zeros((*q_tile.shape[:-1], v.shape[-1]))
    if start is not None:
        # a sink: the rows have seen one key already, whose value is zero
        m, l = start
    # --8<-- [end:state]
    # Key tiles outside the band are SKIP: the loop runs from first_key_tile and stops
    # at last_key_tile.
    for k_index in key_tile_range(q_start, q_end, Tk, block_k, band):
        k_start, k_end = k_index * block_k, min((k_index + 1) * block_k, Tk)
        kind = classify_band_tile(q_start, q_end, k_start, k_end, band)
        if on_tile is not None:
            on_tile(q_index, k_index, kind)
        # (..., block_q, block_k)
        s = scale * (q_tile @ k[..., k_start:k_end, :].transpose(-1, -2)).double()
        s = softcap_scores(s, softcap)  # s unchanged without a cap
        keep = None
        # --8<-- [start:mask]
        # only tiles crossing an edge of the band pay for a mask
        if kind is TileKind.DIAGONAL:
            i = torch.arange(q_start, q_end, device=s.device)[:, None]
            j = torch.arange(k_start, k_end, device=s.device)[None, :]
            keep = band_keeps(i, j, band)
            s = s.masked_fill(~keep, float("-inf"))
        # --8<-- [end:mask]
        # --8<-- [start:rescale]
        m_new = torch.maximum(m, s.amax(dim=-1))
        alpha = safe_exp_diff(m, m_new)  # shrink what we had onto the new max
        p = safe_exp_diff(s, m_new[..., None])  # this tile's unnormalised probabilities
        l = alpha * l + p.sum(dim=-1)
        p, v_tile = p.to(acc.dtype), v[..., k_start:k_end, :]
        # a hidden value never reaches a row
        pv = p @ v_tile if keep is None else masked_pv(p, v_tile, keep)
        acc = alpha.to(acc.dtype)[..., None] * acc + pv
        m = m_new
        # --8<-- [end:rescale]
    return m, l, acc
# --8<-- [end:tile_loop]


def flash_attention_forward(
    q,
    k,
    v,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = 16,
    block_k: int = 16,
    alignment: str = "upper_left",
    on_tile: TileCallback | None = None,
    *,
    window=None,
    softcap: float | None = None,
    sinks=None,
):
    """Tiled attention forward; returns (o, lse) exactly as ``naive_attention`` does.

    Args:
        q: (B, H, Tq, D). k: (B, H_kv, Tk, D), v: (B, H_kv, Tk, d_v), H a multiple of H_kv; d_v may
            differ from D (``reference.head_dims``).
        causal, alignment: the causal mask (see ``flashtile.reference.causal``).
        window: None or (left, right): query i sees keys i + offset - left .. i + offset + right, -1
            unbounded, the right side capped at 0 when causal (see ``flashtile.reference.masks``).
        softcap: None or s > 0: each scaled score x becomes s * tanh(x / s) before the softmax.
        sinks: None or (H,), float32 or q's dtype: one logit per query head that joins every row's
            softmax after the scale and the cap, with a value of zero (``reference.sinks``); -inf is no sink.
        scale: τ, multiplies Q K^T; defaults to 1/sqrt(D). Zero and negative values are allowed.
        block_q, block_k: tile sizes, any positive ints (they need not divide Tq or Tk).
        on_tile: optional callback ``on_tile(q_index, k_index, kind)`` for every tile computed; the
            site and the tests use it to see which tiles were touched.

    Returns:
        o (B, H, Tq, d_v) in q's dtype and lse (B, H, Tq) in float32 (float64 for float64 inputs): 16-bit
        inputs are computed in float32, like the kernels' accumulators (the scores and (m, l) in float64).
        Rows that see no key get o = 0, lse = -inf (lse = the sink with one); a row that sees a NaN gets NaN.
        With sinks, lse is the log of the whole normaliser, e^sink included. A key or value a row
        does not see never reaches it, whatever it holds (``masked_pv``): o_i is the formula's sum over
        the keys row i sees, exactly, on this tier.
    """
    shape, d_v = check_head_dims(q, k, v)
    check_causal(causal)
    check_alignment(alignment)
    window, softcap = check_window(window), check_softcap(softcap, q.dtype)
    block_q, block_k = check_block("block_q", block_q), check_block("block_k", block_k)
    sinks = check_sinks(sinks, shape, q)
    scale = resolve_scale(scale, shape.D, q.dtype)
    c = stats_dtype(q.dtype)
    k, v = expand_kv_heads(k.to(c), shape.H), expand_kv_heads(v.to(c), shape.H)
    band = window_band(shape.Tq, shape.Tk, window, causal, alignment)

    o = torch.empty((*q.shape[:-1], d_v), dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=c, device=q.device)
    # --8<-- [start:epilogue]
    for q_index, (q_start, q_end) in enumerate(tile_ranges(shape.Tq, block_q)):
        q_tile = q[..., q_start:q_end, :].to(c)
        start = (
            None
            if sinks is None
            else sink_start_state(sinks, (shape.B, shape.H, q_end - q_start))
        )
        m, l, acc = forward_query_tile(
            q_tile,
            k,
            v,
            q_start,
            q_end,
            scale,
            block_k,
            band,
            on_tile,
            q_index,
            softcap,
            start,
        )
        # a row that saw no key keeps acc = 0: o = 0, not 0 / 0 (a NaN l stays NaN)
        empty = (l == 0)[..., None]
        l_c = l.to(acc.dtype)
        o[..., q_start:q_end, :] = torch.where(
            empty, 0.0, acc / torch.where(empty, 1.0, l_c[..., None])
        ).to(q.dtype)
        # float64, rounded once into lse's dtype
        lse[..., q_start:q_end] = lse_from_stats(m, l)
    # --8<-- [end:epilogue]
    return o, lse

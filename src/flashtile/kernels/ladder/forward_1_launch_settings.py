"""Forward rung 1: the textbook kernel, launched with tiles, warps and stages chosen per shape.

The kernel is ``kernels.textbook``'s, unchanged; only its launch changes. The textbook takes 64 x 64 tiles, 4
warps and 2 pipeline stages for every 16-bit shape. This rung takes the package's settings for loads through
pointers, by head dim, mask and length (``kernels.forward.forward_config`` with ``tma=False``): 128-row query
tiles, which halve the K and V re-reads, with 8 warps to hold their accumulator; 3 stages, so that the next
tiles load while this one is folded; and at head dims up to 64 a cap of 128 registers a thread, so that two
programs share an SM. fp32 keeps the textbook's small tiles (16 x 32, 16 x 16 at d > 64): its dots run on the
CUDA cores, and the package's fp32 tiles (128 x 64 with 8 warps) spill registers in these kernels compiled
for sm_90.

Same contract as the textbook kernel (``textbook_forward``): fp16, bf16 (CUDA only) and fp32, any strides,
any Tq and Tk, 1 <= D <= 128, no GQA, both causal alignments, any finite scale; o (B, H, Tq, D) in q's dtype,
lse (B, H, Tq) float32, natural log; a row that sees no key gets o = 0 and lse = -inf. The settings were
measured with the package's kernel, not with this one; the ladder's benchmark times this rung as it is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._checks import resolve_neg_bits
from .._host import dot_precision, head_batch_grid, head_dim_pad
from .._jit import full_key_tiles, last_key_tile
from ..textbook import LN2, LOG2E, _check

IDEA = "Tiles, warps, stages and a register cap chosen per head dim, dtype, mask and length, not one for all."


# --8<-- [start:rung]
@triton.jit
def key_tile_counts(q_start, Tq, Tk, offset, CAUSAL: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """(n_full, n_visit): key tiles 0 .. n_full - 1 are FULL for every row of the
    query tile starting at q_start, tiles n_full .. n_visit - 1 need the mask (DIAGONAL,
    or the ragged last tile), the rest are SKIP (Part A's tile classes)."""
    if CAUSAL:
        q_end = tl.minimum(q_start + BLOCK_Q, Tq)
        n_full = full_key_tiles(q_start, Tk, BLOCK_K, offset)
        return n_full, last_key_tile(q_end, Tk, BLOCK_K, offset)
    return Tk // BLOCK_K, tl.cdiv(Tk, BLOCK_K)


@triton.jit
def fold_key_tile(acc, l, m, q, K, V, stride_kt, stride_kd, stride_vt, stride_vd,
                  i, d, k_start, Tk, offset, qk_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr,
                  MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """One online-softmax step: fold keys k_start .. + BLOCK_K - 1 into (m, l, acc)."""
    j = k_start + tl.arange(0, BLOCK_K).to(tl.int64)  # the key columns of this tile
    # zeros past the keys and past the head dim
    kv_mask = (j[:, None] < Tk) & (d[None, :] < HEAD_DIM)
    k_ptrs = K + j[:, None] * stride_kt + d[None, :] * stride_kd
    v_ptrs = V + j[:, None] * stride_vt + d[None, :] * stride_vd
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # (BLOCK_K, HEAD_DIM_PAD)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # log2 units
    if MASKED:  # a padded key, or one past the diagonal, must score -inf (p = 0), not 0
        visible = j[None, :] < Tk
        if CAUSAL:
            visible = visible & (j[None, :] <= i[:, None] + offset)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))  # (BLOCK_Q,)
    # A row that has seen no key yet keeps m_new = -inf, and -inf - (-inf) is NaN:
    # subtract 0 instead, which gives alpha = 0 and p = 0 for that row.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m - m_safe)  # rescales what the row had onto the new max
    p = tl.math.exp2(s - m_safe[:, None])  # this tile's unnormalised probabilities
    l = alpha * l + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l, m_new


@triton.jit
def forward_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    H, Tq, Tk, offset, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One program: query tile q_index of head h of batch b.
    Grid: (cdiv(Tq, BLOCK_Q), H, B)."""
    q_index, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h, b = h.to(tl.int64), b.to(tl.int64)  # so that b * stride never wraps
    q_start = q_index * BLOCK_Q
    i = q_start + tl.arange(0, BLOCK_Q).to(tl.int64)  # the query rows, int64 as well
    d = tl.arange(0, HEAD_DIM_PAD).to(tl.int64)  # the head dim, padded to a power of 2
    Q += b * stride_qb + h * stride_qh  # each pointer now at this (batch, head)
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    O += b * stride_ob + h * stride_oh
    q_mask = (i[:, None] < Tq) & (d[None, :] < HEAD_DIM)
    q_ptrs = Q + i[:, None] * stride_qt + d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)  # (BLOCK_Q, HEAD_DIM_PAD)

    m = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)  # running row max of s
    l = tl.zeros([BLOCK_Q], dtype=tl.float32)  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)  # sum of exp2(s - m) v
    n_full, n_visit = key_tile_counts(q_start, Tq, Tk, offset, CAUSAL, BLOCK_Q, BLOCK_K)
    for k_index in range(0, n_full):  # FULL tiles: every pair visible, no mask
        acc, l, m = fold_key_tile(
            acc, l, m, q, K, V, stride_kt, stride_kd, stride_vt, stride_vd, i, d,
            k_index * BLOCK_K, Tk, offset, qk_scale, HEAD_DIM, BLOCK_K, CAUSAL, False,
            DOT_PRECISION)  # fmt: skip
    for k_index in range(n_full, n_visit):  # DIAGONAL tiles and a ragged last tile
        acc, l, m = fold_key_tile(
            acc, l, m, q, K, V, stride_kt, stride_kd, stride_vt, stride_vd, i, d,
            k_index * BLOCK_K, Tk, offset, qk_scale, HEAD_DIM, BLOCK_K, CAUSAL, True,
            DOT_PRECISION)  # fmt: skip
    # SKIP tiles (n_visit on) never come

    empty = l == 0.0  # a row that saw no key: o = 0 (acc is 0), lse = -inf
    l_safe = tl.where(empty, 1.0, l)  # divide by 1, not 0, for such a row
    o = acc / l_safe[:, None]  # (BLOCK_Q, HEAD_DIM_PAD)
    lse = (m + tl.math.log2(l_safe)) * LN2  # back from log2 units: natural log
    lse = tl.where(empty, float("-inf"), lse)
    o_ptrs = O + i[:, None] * stride_ot + d[None, :] * stride_od
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=q_mask)
    tl.store(LSE + (b * H + h) * Tq + i, lse, mask=i < Tq)  # lse is (B, H, Tq), dense


def launch_settings(D, dtype, causal, Tq):
    """Tiles, warps, stages and a register cap for one call, by head dim, dtype, mask
    and length, as measured on the H200 (the package's settings for pointer loads)."""
    pad = head_dim_pad(D)
    if dtype == torch.float32:  # fp32 dots: the textbook's tiles; larger ones spill
        tiles = (16, 32, 4, 2, None) if pad <= 64 else (16, 16, 4, 2, None)
    elif pad <= 64:  # two 8-warp programs share an SM only at <= 128 registers a thread
        tiles = (128, 64, 8, 3, 128)
    elif Tq <= 512 or (Tq <= 1024 and causal):  # few query tiles: smaller programs
        tiles = (64, 64, 4, 3, None)
    else:  # 128 x 128: half the K and V re-reads of 64-row tiles
        tiles = (128, 128, 8, 3, None)
    names = ("BLOCK_Q", "BLOCK_K", "num_warps", "num_stages", "maxnreg")
    return dict(zip(names, tiles))


def forward(q, k, v, causal=False, scale=None, *, alignment="upper_left"):
    """(o, lse): o (B, H, Tq, D) in q's dtype; lse (B, H, Tq) float32, natural log."""
    q, k, v = resolve_neg_bits(q, k, v)  # a negative view's memory holds -x
    (B, H, _, Tq, Tk, D), scale, offset = _check(q, k, v, causal, scale, alignment)
    o = torch.empty((B, H, Tq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
    settings = launch_settings(D, q.dtype, causal, Tq)
    forward_kernel[head_batch_grid(triton.cdiv(Tq, settings["BLOCK_Q"]), H, B)](
        q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        H, Tq, Tk, offset, scale * LOG2E, HEAD_DIM=D, HEAD_DIM_PAD=head_dim_pad(D),
        CAUSAL=causal, DOT_PRECISION=dot_precision(q.dtype), **settings,
    )  # fmt: skip
    return o, lse
# --8<-- [end:rung]

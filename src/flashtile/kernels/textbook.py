"""The textbook FlashAttention kernels: forward and backward written to be read whole, before any tuning.

These are the kernels a chapter shows first. They mirror ``flashtile.reference.forward`` and
``flashtile.reference.backward`` line for line, and add only what a GPU forces: pointers and strides,
masks for padded tiles, exp2 in place of exp, and 16-bit tiles fed to tensor-core dots with float32
accumulation. There is no switch in them that exists for speed.

What they support:

* q, k, v of shape (B, H, T, D), any strides (views read in place), fp16, bf16 or fp32 (bf16 on CUDA
  only: Triton's interpreter computes bf16 wrongly), any Tq and Tk (ragged last tiles are masked),
  1 <= D <= 128 (padded to ``HEAD_DIM_PAD``, a power of two >= 16, with masks);
* ``causal`` with the package's alignments: "upper_left" by default (query i sees keys j <= i, as
  SDPA's ``is_causal``), "lower_right" on request. A row that sees no key gets o = 0 and lse = -inf;
* ``scale`` τ: 1/sqrt(D) by default, any finite value (zero and negative too);
* lse as ``flashtile.attention`` returns it: (B, H, Tq) float32, natural log; the textbook backward runs
  on the package's (o, lse) as on its own.

What they do not do (the package's kernels, ``flashtile.kernels.forward`` and ``.backward``, do):

* grouped-query attention (H_kv < H) and head dims above 128 are refused with a ValueError;
* no TMA, no launch order, no autotuning, no fused multiply-add trick: fixed tiles, stated below;
* the scale is folded into the score before the max is taken (s = τ log2(e) q·k), so a score of
  magnitude 1e7 keeps fewer digits than in the package's kernels, which take the max of raw dots;
* NaN and inf inputs are not part of their contract (the package's kernels define and test them).

Launch settings, one plain choice: 4 warps, 2 pipeline stages, and BLOCK_Q x BLOCK_K tiles of
64 x 64 for fp16 and bf16. At D > 64 the backward takes 64 x 32: its dK/dV program holds k, v, dk
and dv of its key tile in registers. fp32 multiplies in full fp32 on the CUDA cores, not in tf32 on
the tensor cores, and needs far more registers: 16 x 32 tiles, 16 x 16 at D > 64. Compiled for
sm_90 (the H200) none of these spills registers (tests/kernels/test_textbook.py compiles them).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._checks import (
    check_alignment,
    check_attention_inputs,
    check_causal,
    check_like,
    check_lse,
    resolve_neg_bits,
    resolve_scale,
)
from ..reference.causal import diagonal_offset
from ._host import KERNEL_DTYPES, check_kernel_device, dot_precision, head_batch_grid, head_dim_pad
from ._jit import first_query_row, full_key_tiles, last_key_tile

TEXTBOOK_MAX_HEAD_DIM = 128
LOG2E = math.log2(math.e)
LN2 = tl.constexpr(math.log(2.0))  # a constexpr global, so the jit functions may read it
LOG2E_JIT = tl.constexpr(LOG2E)


# --8<-- [start:textbook-forward]
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
def textbook_forward_kernel(
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
# --8<-- [end:textbook-forward]


# --8<-- [start:textbook-backward]
@triton.jit
def load_rows(X, rows, d, stride_t, stride_d, n_rows, HEAD_DIM: tl.constexpr):
    """X[rows, d], a (len(rows), HEAD_DIM_PAD) tile: zeros past n_rows and HEAD_DIM."""
    mask = (rows[:, None] < n_rows) & (d[None, :] < HEAD_DIM)
    ptrs = X + rows[:, None] * stride_t + d[None, :] * stride_d
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def textbook_delta_kernel(
    O, DO, DELTA,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_dob, stride_doh, stride_dot, stride_dod,
    H, Tq, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
):  # fmt: skip
    """delta = rowsum(dO * O) of one query tile, float32: the paper's D, one per row."""
    q_index = tl.program_id(0)
    h, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    i = q_index * BLOCK_Q + tl.arange(0, BLOCK_Q).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_PAD).to(tl.int64)
    O += b * stride_ob + h * stride_oh
    DO += b * stride_dob + h * stride_doh
    o = load_rows(O, i, d, stride_ot, stride_od, Tq, HEAD_DIM)
    do = load_rows(DO, i, d, stride_dot, stride_dod, Tq, HEAD_DIM)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + (b * H + h) * Tq + i, delta, mask=i < Tq)


@triton.jit
def dkdv_step(
    dk, dv, k, v, Q, DO, LSE, DELTA, stride_qt, stride_qd, stride_dot, stride_dod,
    j, d, q_start, Tq, offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Add one query tile's share to dK and dV of the key tile, in the transposed domain
    (S^T = K Q^T)."""
    i = q_start + tl.arange(0, BLOCK_Q).to(tl.int64)
    # rows past Tq load q = dO = 0: they add nothing
    q = load_rows(Q, i, d, stride_qt, stride_qd, Tq, HEAD_DIM)
    do = load_rows(DO, i, d, stride_dot, stride_dod, Tq, HEAD_DIM)
    lse = tl.load(LSE + i, mask=i < Tq, other=0.0) * LOG2E_JIT  # in log2 units like s
    delta = tl.load(DELTA + i, mask=i < Tq, other=0.0)
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # S^T
    p_t = tl.math.exp2(s_t - lse[None, :])  # P^T, recomputed, never stored
    if MASKED:  # the forward's mask: a hidden pair (or a row that sees no key) gets 0
        p_t = tl.where(j[:, None] <= i[None, :] + offset, p_t, 0.0)
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)  # dV += P^T dO
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # dP^T = V dO^T
    ds_t = p_t * (dp_t - delta[None, :])  # dS^T = P^T * (dP^T - D), per query column
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)  # dK += dS^T Q
    return dk, dv


@triton.jit
def textbook_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    H, Tq, Tk, offset, scale, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One program: key tile k_index of head h of batch b, its dK and dV; the query
    tiles stream past."""
    k_index = tl.program_id(0)
    h, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    k_start = k_index * BLOCK_K
    j = k_start + tl.arange(0, BLOCK_K).to(tl.int64)  # the key rows of this tile
    d = tl.arange(0, HEAD_DIM_PAD).to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    DO += b * stride_dob + h * stride_doh
    LSE += (b * H + h) * Tq  # lse, delta, dk, dv: contiguous
    DELTA += (b * H + h) * Tq
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    k = load_rows(K, j, d, stride_kt, stride_kd, Tk, HEAD_DIM)  # held throughout
    v = load_rows(V, j, d, stride_vt, stride_vd, Tk, HEAD_DIM)
    dk = tl.zeros([BLOCK_K, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_K, HEAD_DIM_PAD], dtype=tl.float32)
    # The tile classes seen from a key tile: query tiles above the first row that sees
    # key k_start are SKIP; then come DIAGONAL tiles, up to the first tile whose first
    # row sees the tile's last key; every tile from there on is FULL (all, unmasked).
    n_q_tiles = tl.cdiv(Tq, BLOCK_Q)
    first, first_full = 0, 0
    if CAUSAL:
        first = first_query_row(k_start, offset) // BLOCK_Q
        last_key_row = first_query_row(k_start + BLOCK_K - 1, offset)
        first_full = tl.minimum(tl.cdiv(last_key_row, BLOCK_Q), n_q_tiles)
    for q_index in range(first, first_full):
        dk, dv = dkdv_step(dk, dv, k, v, Q, DO, LSE, DELTA, stride_qt, stride_qd,
                           stride_dot, stride_dod, j, d, q_index * BLOCK_Q, Tq, offset,
                           qk_scale, HEAD_DIM, BLOCK_Q, True, DOT_PRECISION)
    for q_index in range(first_full, n_q_tiles):
        dk, dv = dkdv_step(dk, dv, k, v, Q, DO, LSE, DELTA, stride_qt, stride_qd,
                           stride_dot, stride_dod, j, d, q_index * BLOCK_Q, Tq, offset,
                           qk_scale, HEAD_DIM, BLOCK_Q, False, DOT_PRECISION)
    out = (b * H + h) * Tk * HEAD_DIM + j[:, None] * HEAD_DIM + d[None, :]
    kv_mask = (j[:, None] < Tk) & (d[None, :] < HEAD_DIM)
    dk = dk * scale  # dK = τ dS^T Q
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def dq_step(
    dq, q, do, lse, delta, K, V, stride_kt, stride_kd, stride_vt, stride_vd,
    i, d, k_start, Tk, offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Add one key tile's share to dQ of the query tile."""
    j = k_start + tl.arange(0, BLOCK_K).to(tl.int64)
    k = load_rows(K, j, d, stride_kt, stride_kd, Tk, HEAD_DIM)
    v = load_rows(V, j, d, stride_vt, stride_vd, Tk, HEAD_DIM)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    p = tl.math.exp2(s - lse[:, None])  # as in the forward, with its lse
    if MASKED:  # the forward's mask: padded keys and keys past the diagonal have p = 0
        visible = j[None, :] < Tk
        if CAUSAL:
            visible = visible & (j[None, :] <= i[:, None] + offset)
        p = tl.where(visible, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # dP = dO V^T
    ds = p * (dp - delta[:, None])  # dS = P * (dP - D)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)  # dQ += dS K


@triton.jit
def textbook_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    H, Tq, Tk, offset, scale, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One program: query tile q_index of head h of batch b, its dQ; the key tiles
    stream past, in the forward's order and classes."""
    q_index = tl.program_id(0)
    h, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    q_start = q_index * BLOCK_Q
    i = q_start + tl.arange(0, BLOCK_Q).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_PAD).to(tl.int64)
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    LSE += (b * H + h) * Tq
    DELTA += (b * H + h) * Tq
    Q += b * stride_qb + h * stride_qh
    DO += b * stride_dob + h * stride_doh
    q = load_rows(Q, i, d, stride_qt, stride_qd, Tq, HEAD_DIM)
    do = load_rows(DO, i, d, stride_dot, stride_dod, Tq, HEAD_DIM)
    lse = tl.load(LSE + i, mask=i < Tq, other=0.0) * LOG2E_JIT  # log2 units
    delta = tl.load(DELTA + i, mask=i < Tq, other=0.0)
    dq = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
    n_full, n_visit = key_tile_counts(q_start, Tq, Tk, offset, CAUSAL, BLOCK_Q, BLOCK_K)
    for k_index in range(0, n_full):
        dq = dq_step(dq, q, do, lse, delta, K, V, stride_kt, stride_kd, stride_vt,
                     stride_vd, i, d, k_index * BLOCK_K, Tk, offset, qk_scale, HEAD_DIM,
                     BLOCK_K, CAUSAL, False, DOT_PRECISION)
    for k_index in range(n_full, n_visit):
        dq = dq_step(dq, q, do, lse, delta, K, V, stride_kt, stride_kd, stride_vt,
                     stride_vd, i, d, k_index * BLOCK_K, Tk, offset, qk_scale, HEAD_DIM,
                     BLOCK_K, CAUSAL, True, DOT_PRECISION)
    out = (b * H + h) * Tq * HEAD_DIM + i[:, None] * HEAD_DIM + d[None, :]
    mask = (i[:, None] < Tq) & (d[None, :] < HEAD_DIM)
    tl.store(DQ + out, (dq * scale).to(DQ.dtype.element_ty), mask=mask)  # dQ = τ dS K
# --8<-- [end:textbook-backward]


def _check(q, k, v, causal, scale, alignment):
    """The package's checks (``flashtile._checks``, the errors ``flashtile.attention`` raises), then what
    only the textbook kernels add: no GQA, D <= 128, a device Triton runs on."""
    shape = check_attention_inputs(q, k, v)
    check_causal(causal)
    check_alignment(alignment)
    scale = resolve_scale(scale, shape.D, q.dtype)
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(
            f"q has dtype {str(q.dtype)[6:]}; the textbook kernels take float16, bfloat16 and float32 "
            "(flashtile.attention runs float64 on its reference tier)"
        )
    if shape.H_kv != shape.H:
        raise ValueError(
            f"q has {shape.H} heads but k and v have {shape.H_kv}: the textbook kernels take one key/value head "
            "per query head (no GQA); use flashtile.attention(..., enable_gqa=True)"
        )
    if shape.D > TEXTBOOK_MAX_HEAD_DIM:
        raise ValueError(
            f"q has head dim {shape.D}; the textbook kernels take head dims 1 to {TEXTBOOK_MAX_HEAD_DIM}; "
            "use flashtile.attention for head dims up to 256"
        )
    check_kernel_device("q", q)
    return shape, scale, diagonal_offset(shape.Tq, shape.Tk, alignment)


def textbook_blocks(head_dim: int, dtype: torch.dtype, backward: bool = False) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_K) of the forward, or of the backward's dK/dV and dQ kernels (module docstring)."""
    pad = head_dim_pad(head_dim)
    if dtype == torch.float32:  # full-fp32 dots on the CUDA cores: small tiles, or registers spill
        return (16, 32) if pad <= 64 else (16, 16)
    return (64, 32) if backward and pad > 64 else (64, 64)


NUM_WARPS, NUM_STAGES = 4, 2


# --8<-- [start:textbook-launch]
# --8<-- [start:textbook-forward-launch]
def textbook_forward(q, k, v, causal=False, scale=None, *, alignment="upper_left"):
    """(o, lse): o (B, H, Tq, D) in q's dtype; lse (B, H, Tq) float32, natural log."""
    q, k, v = resolve_neg_bits(q, k, v)  # a negative view's memory holds -x
    (B, H, _, Tq, Tk, D), scale, offset = _check(q, k, v, causal, scale, alignment)
    o = torch.empty((B, H, Tq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
    BLOCK_Q, BLOCK_K = textbook_blocks(D, q.dtype)
    textbook_forward_kernel[head_batch_grid(triton.cdiv(Tq, BLOCK_Q), H, B)](
        q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        H, Tq, Tk, offset, scale * LOG2E, HEAD_DIM=D, HEAD_DIM_PAD=head_dim_pad(D),
        BLOCK_Q=BLOCK_Q, BLOCK_K=BLOCK_K, CAUSAL=causal, num_warps=NUM_WARPS,
        DOT_PRECISION=dot_precision(q.dtype), num_stages=NUM_STAGES,
    )  # fmt: skip
    return o, lse
# --8<-- [end:textbook-forward-launch]


# --8<-- [start:textbook-backward-launch]
def textbook_backward(q, k, v, o, lse, do, causal=False, scale=None, *,
                      alignment="upper_left"):  # fmt: skip
    """(dq, dk, dv), each contiguous in its input's dtype, from the forward's o and lse
    and the incoming dO."""
    q, k, v, o, lse, do = resolve_neg_bits(q, k, v, o, lse, do)
    shape, scale, offset = _check(q, k, v, causal, scale, alignment)
    check_like("o", o, "q", q)
    check_like("do", do, "q", q)
    check_lse(lse, shape, q)
    B, H, _, Tq, Tk, D = shape
    lse = lse.contiguous()  # the kernels index lse as (B, H, Tq), contiguous
    delta = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
    dq, dk, dv = (x.new_empty(x.shape) for x in (q, k, v))  # contiguous, any x
    BLOCK_Q, BLOCK_K = textbook_blocks(D, q.dtype, backward=True)
    sizes = dict(HEAD_DIM=D, HEAD_DIM_PAD=head_dim_pad(D), BLOCK_Q=BLOCK_Q)
    textbook_delta_kernel[head_batch_grid(triton.cdiv(Tq, BLOCK_Q), H, B)](
        o, do, delta, *o.stride(), *do.stride(), H, Tq, **sizes, num_warps=NUM_WARPS)
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    common = (*strides, H, Tq, Tk, offset, scale, scale * LOG2E)
    sizes.update(BLOCK_K=BLOCK_K, CAUSAL=causal, DOT_PRECISION=dot_precision(q.dtype))
    launch = dict(num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    textbook_dkdv_kernel[head_batch_grid(triton.cdiv(Tk, BLOCK_K), H, B)](
        q, k, v, do, lse, delta, dk, dv, *common, **sizes, **launch)
    textbook_dq_kernel[head_batch_grid(triton.cdiv(Tq, BLOCK_Q), H, B)](
        q, k, v, do, lse, delta, dq, *common, **sizes, **launch)
    return dq, dk, dv
# --8<-- [end:textbook-backward-launch]
# --8<-- [end:textbook-launch]

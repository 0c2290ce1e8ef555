"""Backward rung 1: tiles and warps per kernel.

The textbook backward (``kernels.textbook.textbook_backward``) with one idea changed: each kernel
gets its own tiles, warps and pipeline stages, by head dim, instead of one choice for all three:
the package's 16-bit settings (``kernels.backward.backward_config``) where they compile without
register spills in this kernel, the nearest that does where they do not. Everything else is the
textbook's: its contract and checks (fp16, bf16, fp32; D <= 128; no GQA; both causal alignments;
rows that see no key get zero gradients) and its three kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._checks import check_like, check_lse, resolve_neg_bits
from .._host import dot_precision, head_batch_grid, head_dim_pad
from .._jit import first_query_row
from ..textbook import LOG2E, LOG2E_JIT, _check, key_tile_counts, textbook_blocks

IDEA = "Each kernel gets its own tiles, warps and pipeline stages, by head dim."


# --8<-- [start:rung]
@triton.jit
def load_rows(X, rows, d, stride_t, stride_d, n_rows, HEAD_DIM: tl.constexpr):
    """X[rows, d], a (len(rows), HEAD_DIM_PAD) tile: zeros past n_rows and HEAD_DIM."""
    mask = (rows[:, None] < n_rows) & (d[None, :] < HEAD_DIM)
    ptrs = X + rows[:, None] * stride_t + d[None, :] * stride_d
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def delta_kernel(
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
def dkdv_kernel(
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
def dq_kernel(
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


def settings(head_dim, dtype):
    """{"dkdv": (BLOCK_Q, BLOCK_K, warps, stages), "dq": (...)}. A dK/dV program
    holds k, v, dk, dv of BLOCK_K keys while query tiles stream past, a dQ program
    q, do, dq of BLOCK_Q rows: short query tiles for the one, tall ones for the other,
    as large as compile without spilling registers on sm_90. fp32 (dots on the CUDA
    cores) keeps the textbook's small tiles."""
    if dtype == torch.float32:
        tiles = (*textbook_blocks(head_dim, dtype, backward=True), 4, 2)
        return dict(dkdv=tiles, dq=tiles)
    if head_dim_pad(head_dim) <= 64:
        return dict(dkdv=(64, 64, 4, 3), dq=(64, 64, 4, 3))
    return dict(dkdv=(32, 64, 4, 3), dq=(128, 64, 8, 2))


def backward(q, k, v, o, lse, do, causal=False, scale=None, *,
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
    tiles = settings(D, q.dtype)
    dkdv_q, dkdv_k, dkdv_warps, dkdv_stages = tiles["dkdv"]
    dq_q, dq_k, dq_warps, dq_stages = tiles["dq"]
    sizes = dict(HEAD_DIM=D, HEAD_DIM_PAD=head_dim_pad(D))
    delta_kernel[head_batch_grid(triton.cdiv(Tq, dq_q), H, B)](
        o, do, delta, *o.stride(), *do.stride(), H, Tq, **sizes, BLOCK_Q=dq_q)
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    common = (*strides, H, Tq, Tk, offset, scale, scale * LOG2E)
    sizes.update(CAUSAL=causal, DOT_PRECISION=dot_precision(q.dtype))
    dkdv_kernel[head_batch_grid(triton.cdiv(Tk, dkdv_k), H, B)](
        q, k, v, do, lse, delta, dk, dv, *common, **sizes, BLOCK_Q=dkdv_q,
        BLOCK_K=dkdv_k, num_warps=dkdv_warps, num_stages=dkdv_stages)
    dq_kernel[head_batch_grid(triton.cdiv(Tq, dq_q), H, B)](
        q, k, v, do, lse, delta, dq, *common, **sizes, BLOCK_Q=dq_q, BLOCK_K=dq_k,
        num_warps=dq_warps, num_stages=dq_stages)
    return dq, dk, dv
# --8<-- [end:rung]

"""Backward rung 3: TMA for the streamed tiles.

Rung 2 (``backward_2_row_terms_in_dq``) with one idea changed: the tiles that stream past a
program (q and dO in the dK/dV kernel, k and v in the dQ kernel) reach the kernels as host-built
TMA descriptors, and each load names its tile by coordinates (b, h, row, 0): the copy engine
fetches it, with zeros past T and past the head dim, and no tile of 64-bit addresses is computed
or held in registers. The device and the layout decide, as in the package (``_host.use_tma``: a
GPU of compute capability 9.0 or newer, or the interpreter, which emulates descriptors; a
contiguous head dim and 16-byte-aligned strides), and only from 1k tokens on, where the package
measured TMA faster; elsewhere the loads go through pointers as in rung 2. The gradients are the
same either way. Contract, checks and tiles as rung 2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._checks import check_like, check_lse, resolve_neg_bits
from .._host import dot_precision, head_batch_grid, head_dim_pad, tile_descriptor, use_tma
from .._jit import first_query_row
from ..textbook import LOG2E, LOG2E_JIT, _check, key_tile_counts, textbook_blocks

IDEA = "The tiles that stream past a program are fetched by the copy engine through TMA descriptors."


# --8<-- [start:rung]
@triton.jit
def load_rows(X, rows, d, stride_t, stride_d, n_rows, HEAD_DIM: tl.constexpr):
    """X[rows, d], a (len(rows), HEAD_DIM_PAD) tile: zeros past n_rows and HEAD_DIM."""
    mask = (rows[:, None] < n_rows) & (d[None, :] < HEAD_DIM)
    ptrs = X + rows[:, None] * stride_t + d[None, :] * stride_d
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def dkdv_step(
    dk, dv, k, v, Q, DO, LSE, DELTA, stride_qt, stride_qd, stride_dot, stride_dod,
    j, d, q_start, Tq, offset, qk_scale, b, h,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    MASKED: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Add one query tile's share to dK and dV of the key tile, in the transposed domain
    (S^T = K Q^T)."""
    i = q_start + tl.arange(0, BLOCK_Q).to(tl.int64)
    if USE_TMA:  # fetched by coordinates; rows past Tq come as q = dO = 0, as below
        q = Q.load([b, h, q_start, 0]).reshape(BLOCK_Q, HEAD_DIM_PAD)
        do = DO.load([b, h, q_start, 0]).reshape(BLOCK_Q, HEAD_DIM_PAD)
    else:  # rows past Tq load q = dO = 0: they add nothing
        q = load_rows(Q, i, d, stride_qt, stride_qd, Tq, HEAD_DIM)
        do = load_rows(DO, i, d, stride_dot, stride_dod, Tq, HEAD_DIM)
    lse = tl.load(LSE + i, mask=i < Tq, other=0.0)  # in log2 units like s, as stored
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
    Q, K, V, DO, ROWS, DK, DV,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    H, Tq, Tk, offset, scale, qk_scale, n_rows,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One program: key tile k_index of head h of batch b, its dK and dV; the query
    tiles stream past."""
    k_index, h32, b32 = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h, b = h32.to(tl.int64), b32.to(tl.int64)
    k_start = k_index * BLOCK_K
    j = k_start + tl.arange(0, BLOCK_K).to(tl.int64)  # the key rows of this tile
    d = tl.arange(0, HEAD_DIM_PAD).to(tl.int64)
    if not USE_TMA:  # descriptors address whole tensors; pointers move to this head
        Q += b * stride_qb + h * stride_qh
        DO += b * stride_dob + h * stride_doh
    DELTA = ROWS + (b * H + h) * Tq  # ROWS: (2, B, H, Tq), delta, then log2 lse
    LSE = DELTA + n_rows
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
                           qk_scale, b32, h32, HEAD_DIM, HEAD_DIM_PAD, BLOCK_Q, True,
                           USE_TMA, DOT_PRECISION)
    for q_index in range(first_full, n_q_tiles):
        dk, dv = dkdv_step(dk, dv, k, v, Q, DO, LSE, DELTA, stride_qt, stride_qd,
                           stride_dot, stride_dod, j, d, q_index * BLOCK_Q, Tq, offset,
                           qk_scale, b32, h32, HEAD_DIM, HEAD_DIM_PAD, BLOCK_Q, False,
                           USE_TMA, DOT_PRECISION)
    out = (b * H + h) * Tk * HEAD_DIM + j[:, None] * HEAD_DIM + d[None, :]
    kv_mask = (j[:, None] < Tk) & (d[None, :] < HEAD_DIM)
    dk = dk * scale  # dK = τ dS^T Q
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def dq_step(
    dq, q, do, lse, delta, K, V, stride_kt, stride_kd, stride_vt, stride_vd,
    i, d, k_start, Tk, offset, qk_scale, b, h,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Add one key tile's share to dQ of the query tile."""
    j = k_start + tl.arange(0, BLOCK_K).to(tl.int64)
    if USE_TMA:  # fetched by coordinates, zeros past Tk and the head dim
        k = K.load([b, h, k_start, 0]).reshape(BLOCK_K, HEAD_DIM_PAD)
        v = V.load([b, h, k_start, 0]).reshape(BLOCK_K, HEAD_DIM_PAD)
    else:
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
    Q, K, V, DO, O, LSE, ROWS, DQ,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_ob, stride_oh, stride_ot, stride_od,
    H, Tq, Tk, offset, scale, qk_scale, n_rows,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One program: query tile q_index of head h of batch b, its dQ; the key tiles
    stream past, in the forward's order and classes. It runs first, and stores its rows'
    delta and lse (log2 units) into ROWS for the dK/dV kernel."""
    q_index, h32, b32 = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h, b = h32.to(tl.int64), b32.to(tl.int64)
    q_start = q_index * BLOCK_Q
    i = q_start + tl.arange(0, BLOCK_Q).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_PAD).to(tl.int64)
    if not USE_TMA:
        K += b * stride_kb + h * stride_kh
        V += b * stride_vb + h * stride_vh
    LSE += (b * H + h) * Tq
    ROWS += (b * H + h) * Tq
    Q += b * stride_qb + h * stride_qh
    DO += b * stride_dob + h * stride_doh
    O += b * stride_ob + h * stride_oh
    q = load_rows(Q, i, d, stride_qt, stride_qd, Tq, HEAD_DIM)
    do = load_rows(DO, i, d, stride_dot, stride_dod, Tq, HEAD_DIM)
    o = load_rows(O, i, d, stride_ot, stride_od, Tq, HEAD_DIM)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # the paper's D, per row
    lse = tl.load(LSE + i, mask=i < Tq, other=0.0) * LOG2E_JIT  # log2 units
    tl.store(ROWS + i, delta, mask=i < Tq)  # for the dK/dV kernel, which runs next
    tl.store(ROWS + n_rows + i, lse, mask=i < Tq)
    dq = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
    n_full, n_visit = key_tile_counts(q_start, Tq, Tk, offset, CAUSAL, BLOCK_Q, BLOCK_K)
    for k_index in range(0, n_full):
        dq = dq_step(dq, q, do, lse, delta, K, V, stride_kt, stride_kd, stride_vt,
                     stride_vd, i, d, k_index * BLOCK_K, Tk, offset, qk_scale, b32, h32,
                     HEAD_DIM, HEAD_DIM_PAD, BLOCK_K, CAUSAL, False, USE_TMA,
                     DOT_PRECISION)
    for k_index in range(n_full, n_visit):
        dq = dq_step(dq, q, do, lse, delta, K, V, stride_kt, stride_kd, stride_vt,
                     stride_vd, i, d, k_index * BLOCK_K, Tk, offset, qk_scale, b32, h32,
                     HEAD_DIM, HEAD_DIM_PAD, BLOCK_K, CAUSAL, True, USE_TMA,
                     DOT_PRECISION)
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
    rows = torch.empty((2, B, H, Tq), dtype=torch.float32, device=q.device)
    dq, dk, dv = (x.new_empty(x.shape) for x in (q, k, v))  # contiguous, any x
    tiles = settings(D, q.dtype)
    dkdv_q, dkdv_k, dkdv_warps, dkdv_stages = tiles["dkdv"]
    dq_q, dq_k, dq_warps, dq_stages = tiles["dq"]
    sizes = dict(HEAD_DIM=D, HEAD_DIM_PAD=head_dim_pad(D))
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    scalars = (H, Tq, Tk, offset, scale, scale * LOG2E, B * H * Tq)
    # TMA where the device and the layout allow it, from 1k tokens on; else pointers
    tma = use_tma("auto", q, do, k, v) if max(Tq, Tk) >= 1024 else None
    q_in, do_in, k_in, v_in = q, do, k, v
    if tma is not None:  # descriptors of (1, 1, rows, HEAD_DIM_PAD) tiles
        pad = sizes["HEAD_DIM_PAD"]
        q_in, do_in = (tile_descriptor(x, s, dkdv_q, pad) for x, s in zip((q, do), tma))
        k_in, v_in = (tile_descriptor(x, s, dq_k, pad) for x, s in zip((k, v), tma[2:]))
    sizes.update(CAUSAL=causal, DOT_PRECISION=dot_precision(q.dtype))
    sizes["USE_TMA"] = tma is not None
    dq_kernel[head_batch_grid(triton.cdiv(Tq, dq_q), H, B)](  # first: stores rows
        q, k_in, v_in, do, o, lse, rows, dq, *strides, *o.stride(), *scalars, **sizes,
        BLOCK_Q=dq_q, BLOCK_K=dq_k, num_warps=dq_warps, num_stages=dq_stages)
    dkdv_kernel[head_batch_grid(triton.cdiv(Tk, dkdv_k), H, B)](
        q_in, k, v, do_in, rows, dk, dv, *strides, *scalars, **sizes, BLOCK_Q=dkdv_q,
        BLOCK_K=dkdv_k, num_warps=dkdv_warps, num_stages=dkdv_stages)
    return dq, dk, dv
# --8<-- [end:rung]

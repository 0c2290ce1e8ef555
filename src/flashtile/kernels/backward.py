"""FlashAttention backward in Triton: dQ with query tiles outer (storing delta), then dK/dV with key tiles outer.

Mirrors ``flashtile.reference.backward``: same names in the same order (delta, p, dp, ds, dq, dk, dv, lse,
offset). What differs is what the GPU forces: pointers and masks instead of slices, float32
accumulators, the probabilities cast back to the input dtype before they enter a matmul, and two kernels
instead of one loop nest, because a GPU program may only write what it owns.

Why two kernels: dK and dV for key tile j are sums over query tiles, dQ for query tile i is a sum over key
tiles. A program that owns key tile j can hold dk and dv in registers and write them once; it cannot do the
same for dq, which every key tile touches. Writing dq from there would need floating-point atomics, whose
order (and so whose rounding) changes from run to run. So a second kernel owns query tiles and loops over
key tiles, recomputing S and P, and the backward stays bitwise deterministic.

The hand-off from the forward: P is rebuilt as exp2((u - m) · qk_scale - log2 l) from the forward's own
final (m, l) and the same raw dots u = (sign · q)·k, in the same units (``_host.KernelScale``). The largest
score of a row then gives exactly 1 / l at any magnitude of the logits. Given only a natural-log lse (from
elsewhere: a merge across devices, say), the backward uses m = lse / |τ| and l = 1, which is as exact as
lse itself: its rounding, relative to |lse|, becomes an error in P of the same relative size times |lse|.

Unequal head dims: q, k, dq and dk are HEAD_DIM = d_qk wide, v, o, do and dv HEAD_DIM_V = d_v wide, each
padded to its own power of two (``cols`` and ``cols_v``): S = Q K^T, dQ and dK contract or carry d_qk,
dP = dO V^T contracts over d_v, dV carries it, and delta = rowsum(dO * O) sums over it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._checks import (
    AttentionShape,
    check_attention_inputs,
    check_flag,
    check_int,
    check_like,
    check_lse,
    check_max_seqlen,
    check_tensor,
    check_varlen_inputs,
    check_window,
)
from .._env import is_interpreting, sm_count
from .._layouts import contiguous_strides, empty_like_layout, strides_like
from .._plans import cached_plan
from .._spec import AttentionSpec, check_spec
from ..reference.masks import window_visible_pairs
from ._host import (
    KERNEL_DTYPES,
    LOG2E,
    KernelLaunch,
    check_kernel_device,
    check_launch,
    check_tile_size,
    document_order,
    dot_precision,
    head_batch_grid,
    head_dim_pad,
    heaviest_first_chunk,
    kernel_mask,
    kernel_scale,
    resident_programs,
    tile_descriptor,
    use_tma,
)
from ._jit import (
    apply_sign,
    band_full_key_tiles,
    band_query_tiles,
    first_key_tile,
    first_query_row,
    full_key_tiles,
    in_band,
    last_key_tile,
    program_tile,
    soft_cap,
    store_tile,
    varlen_program,
)
from .backward_preprocess import backward_preprocess, load_stats, preprocess_launch, row_terms, store_row_terms
from .sinks import sink_gradient


# --8<-- [start:row_stats]
@triton.jit
def load_row_terms(M, LOG2_L, DELTA, rows, Tq, MASKED: tl.constexpr):
    """(m, log2 l, delta) for ``rows``, as the dQ (or the preprocess) kernel stored
    them, ready for p = exp2((u - m) * qk_scale - log2 l). Rows past Tq (only in MASKED
    tiles) read m = +inf and log2 l = 0, so p = 0: no contribution, as for a row that
    sees no key."""
    if MASKED:
        m = tl.load(M + rows, mask=rows < Tq, other=float("inf"))
        log2_l = tl.load(LOG2_L + rows, mask=rows < Tq, other=0.0)
        delta = tl.load(DELTA + rows, mask=rows < Tq, other=0.0)
    else:  # an interior tile: every row is real
        m = tl.load(M + rows)
        log2_l = tl.load(LOG2_L + rows)
        delta = tl.load(DELTA + rows)
    return m, log2_l, delta


@triton.jit
def visible(rows, keys, Tq, Tk, offset, band_lo, band_hi, CAUSAL: tl.constexpr,
            BAND: tl.constexpr):  # fmt: skip
    """Which (row, key) pairs contribute: rows inside [0, Tq), keys inside [0, Tk) and,
    if causal, j <= i + offset; with BAND (a window), band_lo <= j - i <= band_hi
    instead. ``rows`` and ``keys`` come already shaped for the tile: (1, BLOCK_Q)
    against (BLOCK_K, 1) in the dK/dV kernel, which works on transposed tiles,
    (BLOCK_Q, 1) against (1, BLOCK_K) in the dQ kernel. Padding rows load q = 0, and
    0 * inf is NaN: they must give P = 0 explicitly."""
    ok = (rows < Tq) & (keys < Tk)
    if BAND:
        ok = ok & in_band(rows, keys, band_lo, band_hi)
    elif CAUSAL:
        ok = ok & (keys <= rows + offset)
    return ok


# --8<-- [start:p_from_raw_dots]
@triton.jit
def p_from_raw_dots(u, m, log2_l, qk_scale):
    """P for one tile from the raw dots u and the forward's (m, log2 l), shaped to
    broadcast against u: the kernels' form of ``reference.backward.recompute_p`` (which
    takes S and lse), in raw-dot units.

    The caller masks P itself, not u, and only on tiles that need it: a row whose
    statistics are NaN must still give 0, not NaN, for the keys it never saw.
    """
    return tl.math.exp2((u - m) * qk_scale - log2_l)
# --8<-- [end:p_from_raw_dots]
# --8<-- [end:row_stats]


# --8<-- [start:loads]
@triton.jit
def tile_offsets(rows, cols, stride_t, stride_d, WIDE: tl.constexpr):
    """rows * stride_t + cols * stride_d for the rows and columns of one tile, counted
    from the tile's first row. The kernels add that row's own offset in 64 bits, so
    these stay below BLOCK * stride_t + HEAD_DIM_PAD * stride_d: int32 unless the
    launcher finds that this can pass 2**31 (WIDE, a head dim stored as an outer axis,
    say)."""
    if WIDE:
        rows = rows.to(tl.int64)
        cols = cols.to(tl.int64)
    return rows * stride_t + cols * stride_d


@triton.jit
def load_masked(ptrs, row_ok, col_ok, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """tl.load with zeros where a row or a column is out of range. A mask known at
    compile time to be all True is left out: a full tile of a head dim that is a power
    of two loads with no mask at all."""
    if MASK_ROWS and MASK_COLS:
        x = tl.load(ptrs, mask=row_ok & col_ok, other=0.0)
    elif MASK_ROWS:
        x = tl.load(ptrs, mask=row_ok, other=0.0)
    elif MASK_COLS:
        x = tl.load(ptrs, mask=col_ok, other=0.0)
    else:
        x = tl.load(ptrs)
    return x
# --8<-- [end:loads]


# --8<-- [start:dkdv]
@triton.jit
def dkdv_query_tiles(
    dk, dv, k, v, Q, DO, M, L, DELTA, DQ_ACC,
    q_offsets, do_offsets, acc_offsets, rows0, cols, cols_v, keys,
    stride_qt, stride_dot, first, end, jump_at, jump_by,
    Tq, Tk, offset, scale, qk_scale, b, h,
    band_lo, band_hi, unit, softcap,
    BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, SIGN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, INTERPRETED: tl.constexpr, USE_TMA: tl.constexpr,
    BAND: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    DQ_REDUCE: tl.constexpr = False,
):  # fmt: skip
    """Fold query tiles t = first .. end - 1 of one head into (dk, dv), on transposed
    tiles; a t from jump_at on stands for tile t + jump_by, so one loop can walk two
    separate runs of tiles.

    Every (BLOCK_K, BLOCK_Q) tile here is the transpose of the forward's: uT = K Q^T,
    pT, dpT, dsT. Then dV = P^T dO and dK = dS^T Q are plain products, and Q arrives
    as qT, a (HEAD_DIM_PAD, BLOCK_Q) load through transposed pointers; no register
    tile is ever transposed. MASKED is a compile-time switch: the tiles on the causal
    diagonal or past Tq or Tk pay for the mask, the interior tiles load and compute
    without one.

    With USE_TMA, Q and DO are tensor descriptors of the whole (B, H, Tq, D) and
    (B, H, Tq, d_v) tensors and the copy engine fetches each (BLOCK_Q, HEAD_DIM_PAD) or
    (BLOCK_Q, HEAD_DIM_V_PAD) tile by its coordinates (b, h, q_start, 0), with zeros
    past Tq and the head dim: no tile of pointers is computed or kept in registers,
    and no load needs a mask. cols are the columns of q and k (d_qk), cols_v those of
    v and dO (d_v).

    BAND masks with the window's band instead of the causal bound (``visible``);
    SOFTCAP rebuilds P from the capped scores, as the forward did, and multiplies dS by
    the cap's derivative 1 - tanh^2.
    """
    for t in range(first, end):
        q_index = tl.where(t < jump_at, t, t + jump_by)
        q_start = q_index * BLOCK_Q
        rows = q_start + rows0
        if USE_TMA:
            # a view of the tile
            qT = tl.trans(Q.load([b, h, q_start, 0]).reshape(BLOCK_Q, HEAD_DIM_PAD))
            do = DO.load([b, h, q_start, 0]).reshape(BLOCK_Q, HEAD_DIM_V_PAD)
        else:
            q_at = Q + q_start.to(tl.int64) * stride_qt + q_offsets
            qT = load_masked(q_at, rows[None, :] < Tq, cols[:, None] < HEAD_DIM,
                             MASKED, HEAD_DIM != HEAD_DIM_PAD)  # fmt: skip
            do_at = DO + q_start.to(tl.int64) * stride_dot + do_offsets
            do = load_masked(do_at, rows[:, None] < Tq, cols_v[None, :] < HEAD_DIM_V,
                             MASKED, HEAD_DIM_V != HEAD_DIM_V_PAD)  # fmt: skip
        qT = apply_sign(qT, SIGN)  # sign(τ) · q, as in the forward
        m, log2_l, delta = load_row_terms(M, L, DELTA, rows, Tq, MASKED)
        # uT = K Q^T: the forward's raw dots, transposed; the same sums on the GPU
        lhs, rhs = k, qT
        # numpy's matmul rounds k·q and q·k differently: multiply as the forward did
        if INTERPRETED:
            lhs, rhs = tl.trans(qT), tl.trans(k)
        uT = tl.dot(lhs, rhs, input_precision=DOT_PRECISION)
        if INTERPRETED:
            uT = tl.trans(uT)
        if SOFTCAP:  # the forward's capped scores, natural units (qk_scale = log2 e)
            uT, tT = soft_cap(uT, unit, softcap)
        # never stored
        pT = p_from_raw_dots(uT, m[None, :], log2_l[None, :], qk_scale)
        if MASKED:
            keep = visible(rows[None, :], keys[:, None], Tq, Tk, offset,
                           band_lo, band_hi, CAUSAL, BAND)  # fmt: skip
            pT = tl.where(keep, pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PRECISION)
        # through the cap, d s / d x = 1 - tanh^2(x / softcap), folded into P now
        # that dV has it: tT dies here, one tile fewer held across the next matmul
        if SOFTCAP:
            pT = pT * (1.0 - tT * tT)
        # trans of a loaded tile: a view
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dsT = pT * (dpT - delta[None, :])
        if MASKED:
            dsT = tl.where(keep, dsT, 0.0)  # a hidden pair: 0, even if its row is NaN
        dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT), input_precision=DOT_PRECISION)
        # this key tile's share of dQ = τ dS K; other key tiles add theirs concurrently
        if ATOMIC_DQ:
            dq_share = tl.dot(tl.trans(dsT.to(k.dtype)), k,
                              input_precision=DOT_PRECISION) * scale  # fmt: skip
            # DQ_ACC is a descriptor: the copy engine adds the whole tile (rows past
            # Tq dropped)
            if DQ_REDUCE:
                tile = dq_share.reshape(1, 1, BLOCK_Q, HEAD_DIM_PAD)
                DQ_ACC.atomic_add([b, h, q_start, 0], tile)
            else:
                dq_ptrs = DQ_ACC + q_start.to(tl.int64) * HEAD_DIM_PAD + acc_offsets
                # the buffer is HEAD_DIM_PAD wide: only rows past Tq are out of range
                if MASKED:
                    tl.atomic_add(dq_ptrs, dq_share, mask=rows[:, None] < Tq,
                                  sem="relaxed")  # fmt: skip
                else:
                    tl.atomic_add(dq_ptrs, dq_share, sem="relaxed")
    return dk, dv


@triton.jit
def backward_dkdv_kernel(
    Q, K, V, DO, ROWS, DK, DV, DQ_ACC,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_dvb, stride_dvh, stride_dvt, stride_dvd,
    H, H_kv, Tq, Tk, n_rows, unit, scale, qk_scale, offset, chunk,
    band_lo, band_hi, softcap,
    CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_PAD: tl.constexpr, SIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    WIDE: tl.constexpr, INTERPRETED: tl.constexpr, USE_TMA: tl.constexpr,
    SPLIT: tl.constexpr, HEAVIEST_FIRST: tl.constexpr, BAND: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CU_Q=None, CU_K=None, ORDER=None, VARLEN: tl.constexpr = False,
    DQ_REDUCE: tl.constexpr = False,
):  # fmt: skip
    """One program per (key tile, kv head, batch): dk, dv for that tile, summed over
    the group's heads. ROWS is (3, B, H, Tq) float32, planes n_rows = B * H * Tq apart:
    delta, m, log2 l of every query row, as the dQ kernel (or, with ATOMIC_DQ, the
    preprocess kernel) stored them before this kernel runs.

    With SPLIT > 1 the group's query heads are shared out over SPLIT programs per (key
    tile, kv head): program (.., kv_head * SPLIT + part, ..) sums heads
    part * group / SPLIT onwards, and writes its partial dk, dv to plane
    kv_head * SPLIT + part of DK, DV, float32 buffers that the launcher then sums over
    the parts in a fixed order. More programs for a grid too small to fill the GPU.

    With ATOMIC_DQ the same program also adds this key tile's share of dq, τ dS K, into
    DQ_ACC, a float32 (B, H, Tq, HEAD_DIM_PAD) buffer, with atomic adds: one kernel and
    five matmuls per tile instead of seven over two kernels, at the price of a
    summation order that changes from run to run. With DQ_REDUCE (USE_TMA on a GPU)
    DQ_ACC is a TMA descriptor of that buffer, and each share goes in as one bulk add
    of the whole tile, done in L2 by the copy engine, instead of one atomic instruction
    per element.

    With VARLEN (packed documents) the batch axis is the document
    (``_jit.varlen_program``): Tq, Tk, the offset and the band become the document's,
    the tensors start at its first token, and ROWS is (3, H, total_q),
    n_rows = H * total_q. SPLIT is 1 and ATOMIC_DQ off there."""
    # under causal, key tile 0 has the most work: it launches first
    k_index, plane, b = program_tile(chunk, HEAVY_TILE_LAST=False,
                                     HEAVIEST_FIRST=HEAVIEST_FIRST)  # fmt: skip
    # packed documents: this program's key tile of document b, the tensors moved
    # to its first token
    if VARLEN:
        k_index, q_doc, k_doc, Tq, Tk, offset, band_lo, band_hi = varlen_program(
            CU_Q, CU_K, ORDER, b, Tq, Tk, offset, band_lo, band_hi, BLOCK_K,
            OWN_KEYS=True, HEAVY_TILE_LAST=False)  # fmt: skip
        if k_index < 0:
            return
        Q += q_doc.to(tl.int64) * stride_qt
        DO += q_doc.to(tl.int64) * stride_dot
        K += k_doc.to(tl.int64) * stride_kt
        V += k_doc.to(tl.int64) * stride_vt
        DK += k_doc.to(tl.int64) * stride_dkt
        DV += k_doc.to(tl.int64) * stride_dvt
    k_start = k_index * BLOCK_K
    plane = plane.to(tl.int64)  # kv_head * SPLIT + part: where this program's dk, dv go
    h_kv = plane // SPLIT  # the kv head: query heads h_kv * group + r read it
    b = b.to(tl.int64)
    group = H // H_kv
    # this program's share of the group: all of it unless SPLIT
    first_head = (plane % SPLIT) * (group // SPLIT)
    keys = k_start + tl.arange(0, BLOCK_K)
    rows0 = tl.arange(0, BLOCK_Q)
    cols = tl.arange(0, HEAD_DIM_PAD)  # of q, k, dq, dk: d_qk
    cols_v = tl.arange(0, HEAD_DIM_V_PAD)  # of v, do, dv: d_v
    key_ok = keys[:, None] < Tk
    col_ok, col_v_ok = cols[None, :] < HEAD_DIM, cols_v[None, :] < HEAD_DIM_V
    k_offsets = tile_offsets(keys[:, None] - k_start, cols[None, :],
                             stride_kt, stride_kd, WIDE)  # fmt: skip
    v_offsets = tile_offsets(keys[:, None] - k_start, cols_v[None, :],
                             stride_vt, stride_vd, WIDE)  # fmt: skip
    k_at = K + b * stride_kb + h_kv * stride_kh + k_start.to(tl.int64) * stride_kt
    v_at = V + b * stride_vb + h_kv * stride_vh + k_start.to(tl.int64) * stride_vt
    k_tile = load_masked(k_at + k_offsets, key_ok, col_ok, True,
                         HEAD_DIM != HEAD_DIM_PAD)  # fmt: skip
    v_tile = load_masked(v_at + v_offsets, key_ok, col_v_ok, True,
                         HEAD_DIM_V != HEAD_DIM_V_PAD)  # fmt: skip
    # qT: (HEAD_DIM_PAD, BLOCK_Q)
    q_offsets = tile_offsets(rows0[None, :], cols[:, None], stride_qt, stride_qd, WIDE)
    do_offsets = tile_offsets(rows0[:, None], cols_v[None, :], stride_dot, stride_dod,
                              WIDE)  # fmt: skip
    # DQ_ACC: contiguous along the head dim
    acc_offsets = rows0[:, None] * HEAD_DIM_PAD + cols[None, :]
    # lives in registers for the whole program
    dk = tl.zeros((BLOCK_K, HEAD_DIM_PAD), dtype=tl.float32)
    dv = tl.zeros((BLOCK_K, HEAD_DIM_V_PAD), dtype=tl.float32)
    # Query tiles [lo, mid) straddle the diagonal, [mid, hi) see every key of this
    # tile, [hi, n) hold rows past Tq. The masked body is compiled once, for both
    # masked runs: each copy of it costs registers.
    n = tl.cdiv(Tq, BLOCK_Q)
    lo = 0
    mid = 0
    # a window: [lo, n) are the query tiles its band reaches, [mid, hi) the FULL
    # ones among them
    if BAND:
        lo, mid, hi, n = band_query_tiles(k_start, Tq, Tk, BLOCK_Q, BLOCK_K,
                                          band_lo, band_hi)  # fmt: skip
    else:
        # from the tile of the first query that sees key k_start (step 8) to the
        # first that sees them all
        if CAUSAL:
            lo = tl.minimum(first_query_row(k_start, offset) // BLOCK_Q, n)
            last = first_query_row(k_start + BLOCK_K - 1, offset)
            mid = tl.minimum(tl.cdiv(last, BLOCK_Q), n)
        # a ragged key tile masks its padding keys everywhere
        mid = tl.where(k_start + BLOCK_K > Tk, n, mid)
        hi = tl.maximum(mid, Tq // BLOCK_Q)
    # in a fixed order: no atomics
    for r in range(first_head, first_head + group // SPLIT):
        h = h_kv * group + r
        # descriptors: tiles are addressed by coordinates inside dkdv_query_tiles
        if USE_TMA:
            q_ptr, do_ptr = Q, DO
        else:
            q_ptr = Q + b * stride_qb + h * stride_qh
            do_ptr = DO + b * stride_dob + h * stride_doh
        # each plane of ROWS is (B, H, Tq), contiguous; DQ_ACC is (B, H, Tq, pad)
        row_base = (b * H + h) * Tq
        if VARLEN:  # ROWS planes are (H, total_q): the document's rows from q_doc on
            row_base = h * (n_rows // H) + q_doc
        delta_ptr = ROWS + row_base
        m_ptr = ROWS + n_rows + row_base
        l_ptr = ROWS + 2 * n_rows + row_base
        # a descriptor: tiles by coordinates
        acc_ptr = DQ_ACC if DQ_REDUCE else DQ_ACC + row_base * HEAD_DIM_PAD
        dk, dv = dkdv_query_tiles(  # the interior, unmasked
            dk, dv, k_tile, v_tile, q_ptr, do_ptr, m_ptr, l_ptr, delta_ptr, acc_ptr,
            q_offsets, do_offsets, acc_offsets, rows0, cols, cols_v, keys,
            stride_qt, stride_dot, mid, hi, hi, 0, Tq, Tk, offset,
            scale, qk_scale, b.to(tl.int32), h.to(tl.int32),
            band_lo, band_hi, unit, softcap, BLOCK_Q, HEAD_DIM,
            HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, False, CAUSAL, SIGN,
            DOT_PRECISION, ATOMIC_DQ, INTERPRETED, USE_TMA, BAND, SOFTCAP, DQ_REDUCE,
        )  # fmt: skip
        # one masked loop: the band [lo, mid), then the tail [hi, n)
        dk, dv = dkdv_query_tiles(
            dk, dv, k_tile, v_tile, q_ptr, do_ptr, m_ptr, l_ptr, delta_ptr, acc_ptr,
            q_offsets, do_offsets, acc_offsets, rows0, cols, cols_v, keys,
            stride_qt, stride_dot, lo, mid + n - hi, mid, hi - mid, Tq, Tk, offset,
            scale, qk_scale, b.to(tl.int32), h.to(tl.int32),
            band_lo, band_hi, unit, softcap, BLOCK_Q, HEAD_DIM,
            HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, True, CAUSAL, SIGN,
            DOT_PRECISION, ATOMIC_DQ, INTERPRETED, USE_TMA, BAND, SOFTCAP, DQ_REDUCE,
        )  # fmt: skip
    dk = dk * unit  # S = τ Q K^T = unit (sign Q) K^T, so dK = unit * dS^T (sign Q)
    dk_at = DK + b * stride_dkb + plane * stride_dkh
    dv_at = DV + b * stride_dvb + plane * stride_dvh
    store_tile(dk_at, stride_dkt, stride_dkd, keys, cols, Tk, HEAD_DIM, dk)
    store_tile(dv_at, stride_dvt, stride_dvd, keys, cols_v, Tk, HEAD_DIM_V, dv)
# --8<-- [end:dkdv]


# --8<-- [start:dq]
@triton.jit
def dq_key_tiles(
    dq, q, do, m, log2_l, delta, K, V, kT_offsets, vT_offsets, rows, keys0, cols,
    cols_v, stride_kt, stride_vt, first, end, Tq, Tk, offset, qk_scale, b, h_kv,
    band_lo, band_hi, unit, softcap, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, BAND: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):  # fmt: skip
    """Fold key tiles first .. end - 1 into dq. K and V arrive as kT, vT,
    (HEAD_DIM_PAD, BLOCK_K) loads through transposed pointers, so S = Q K^T and
    dP = dO V^T are plain products; dQ = dS K reads kT as a transposed view of the
    loaded tile. With USE_TMA, K and V are tensor descriptors and each tile is fetched
    by its coordinates (b, h_kv, k_start, 0), with zeros past Tk and the head dim. cols
    are the columns of k (d_qk), cols_v those of v (d_v)."""
    for k_index in range(first, end):
        k_start = k_index * BLOCK_K
        keys = k_start + keys0
        if USE_TMA:
            kT = tl.trans(K.load([b, h_kv, k_start, 0]).reshape(BLOCK_K, HEAD_DIM_PAD))
            vT = V.load([b, h_kv, k_start, 0]).reshape(BLOCK_K, HEAD_DIM_V_PAD)
            vT = tl.trans(vT)
        else:
            kT = load_masked(K + k_start.to(tl.int64) * stride_kt + kT_offsets,
                             keys[None, :] < Tk, cols[:, None] < HEAD_DIM, MASKED,
                             HEAD_DIM != HEAD_DIM_PAD)  # fmt: skip
            vT = load_masked(V + k_start.to(tl.int64) * stride_vt + vT_offsets,
                             keys[None, :] < Tk, cols_v[:, None] < HEAD_DIM_V, MASKED,
                             HEAD_DIM_V != HEAD_DIM_V_PAD)  # fmt: skip
        u = tl.dot(q, kT, input_precision=DOT_PRECISION)
        if SOFTCAP:
            u, t = soft_cap(u, unit, softcap)
        p = p_from_raw_dots(u, m[:, None], log2_l[:, None], qk_scale)
        if MASKED:
            keep = visible(rows[:, None], keys[None, :], Tq, Tk, offset, band_lo,
                           band_hi, CAUSAL, BAND)  # fmt: skip
            p = tl.where(keep, p, 0.0)
        # the cap's derivative 1 - tanh^2 folded into P first: t dies before the next
        # matmul
        if SOFTCAP:
            p = p * (1.0 - t * t)
        dp = tl.dot(do, vT, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if MASKED:
            ds = tl.where(keep, ds, 0.0)
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=DOT_PRECISION)
    return dq


@triton.jit
def backward_dq_kernel(
    Q, K, V, DO, O, STATS, ROWS, DQ,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    H, H_kv, Tq, Tk, n_rows, scale, qk_scale, offset, chunk, band_lo, band_hi, unit,
    softcap, CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_PAD: tl.constexpr, SIGN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDE: tl.constexpr, USE_TMA: tl.constexpr, HEAVIEST_FIRST: tl.constexpr,
    BAND: tl.constexpr, SOFTCAP: tl.constexpr,
    CU_Q=None, CU_K=None, ORDER=None, VARLEN: tl.constexpr = False,
):  # fmt: skip
    """One program per (query tile, head, batch): dq for that tile, a sum over its key
    tiles.

    It runs before the dK/dV kernel and first works out its rows' terms (``row_terms``:
    delta from its o and do tiles, m and log2 l from the forward's STATS), uses them,
    and stores them into ROWS for the dK/dV kernel: the backward needs no separate
    preprocess launch.

    With VARLEN (packed documents) the batch axis is the document, as in the forward
    (``_jit.varlen_program``); STATS and ROWS planes are (H, total_q),
    n_rows = H * total_q."""
    # later query tiles see more keys: under causal they launch first, so the short ones
    # fill the tail
    q_index, h, b = program_tile(chunk, HEAVY_TILE_LAST=CAUSAL,
                                 HEAVIEST_FIRST=HEAVIEST_FIRST)  # fmt: skip
    # packed documents: this program's query tile of document b, the tensors moved to
    # its first token
    if VARLEN:
        q_index, q_doc, k_doc, Tq, Tk, offset, band_lo, band_hi = varlen_program(
            CU_Q, CU_K, ORDER, b, Tq, Tk, offset, band_lo, band_hi, BLOCK_Q,
            OWN_KEYS=False, HEAVY_TILE_LAST=CAUSAL,
        )
        if q_index < 0:
            return
        Q += q_doc.to(tl.int64) * stride_qt
        DO += q_doc.to(tl.int64) * stride_dot
        O += q_doc.to(tl.int64) * stride_ot
        DQ += q_doc.to(tl.int64) * stride_dqt
        K += k_doc.to(tl.int64) * stride_kt
        V += k_doc.to(tl.int64) * stride_vt
    q_start = q_index * BLOCK_Q
    h = h.to(tl.int64)
    b = b.to(tl.int64)
    # the kv head this query head reads: K and V are indexed, never repeated
    h_kv = h // (H // H_kv)
    rows = q_start + tl.arange(0, BLOCK_Q)
    keys0 = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, HEAD_DIM_PAD)  # of q, k, dq: d_qk
    cols_v = tl.arange(0, HEAD_DIM_V_PAD)  # of v, o, do: d_v
    # each plane of STATS and ROWS is (B, H, Tq), contiguous
    row_base = (b * H + h) * Tq
    if VARLEN:  # (H, total_q) planes: the document's rows from q_doc on
        row_base = h * (n_rows // H) + q_doc
    row_ok = rows[:, None] < Tq
    col_ok, col_v_ok = cols[None, :] < HEAD_DIM, cols_v[None, :] < HEAD_DIM_V
    q_ptr = Q + b * stride_qb + h * stride_qh + q_start.to(tl.int64) * stride_qt
    q_offsets = tile_offsets(rows[:, None] - q_start, cols[None, :], stride_qt,
                             stride_qd, WIDE)  # fmt: skip
    q_tile = load_masked(q_ptr + q_offsets, row_ok, col_ok, True,
                         HEAD_DIM != HEAD_DIM_PAD)  # fmt: skip
    q_tile = apply_sign(q_tile, SIGN)  # sign(τ) · q, as in the forward
    do_ptr = DO + b * stride_dob + h * stride_doh + q_start.to(tl.int64) * stride_dot
    do_offsets = tile_offsets(rows[:, None] - q_start, cols_v[None, :], stride_dot,
                              stride_dod, WIDE)  # fmt: skip
    do_tile = load_masked(do_ptr + do_offsets, row_ok, col_v_ok, True,
                          HEAD_DIM_V != HEAD_DIM_V_PAD)  # fmt: skip
    o_ptr = O + b * stride_ob + h * stride_oh + q_start.to(tl.int64) * stride_ot
    o_offsets = tile_offsets(rows[:, None] - q_start, cols_v[None, :], stride_ot,
                             stride_od, WIDE)  # fmt: skip
    o_tile = load_masked(o_ptr + o_offsets, row_ok, col_v_ok, True,
                         HEAD_DIM_V != HEAD_DIM_V_PAD)  # fmt: skip
    m, l = load_stats(STATS, row_base, rows, Tq, n_rows)
    delta, m, log2_l = row_terms(o_tile, do_tile, m, l)
    # for the dK/dV kernel, which runs next
    store_row_terms(ROWS, row_base, rows, Tq, n_rows, delta, m, log2_l)
    dq = tl.zeros((BLOCK_Q, HEAD_DIM_PAD), dtype=tl.float32)
    # a window: the run of key tiles its band reaches, the FULL ones in its middle
    # without a mask
    if BAND:
        q_end = tl.minimum(q_start + BLOCK_Q, Tq)
        first = first_key_tile(q_start, Tk, BLOCK_K, band_lo)
        n = tl.maximum(last_key_tile(q_end, Tk, BLOCK_K, band_hi), first)
        full_first, full_end = band_full_key_tiles(q_start, q_end, Tk, BLOCK_K, band_lo,
                                                   band_hi, first, n)  # fmt: skip
    else:
        # key tiles [0, n_full) are visible from every row, [n_full, n) cross the
        # diagonal (step 9)
        if CAUSAL:
            n_full = full_key_tiles(q_start, Tk, BLOCK_K, offset)
            n = last_key_tile(tl.minimum(q_start + BLOCK_Q, Tq), Tk, BLOCK_K, offset)
        else:  # every key tile but a ragged last one
            n_full = Tk // BLOCK_K
            n = tl.cdiv(Tk, BLOCK_K)
    if USE_TMA:  # descriptors: tiles are addressed by coordinates inside dq_key_tiles
        k_ptr, v_ptr = K, V
    else:
        k_ptr = K + b * stride_kb + h_kv * stride_kh
        v_ptr = V + b * stride_vb + h_kv * stride_vh
    # (HEAD_DIM_PAD, BLOCK_K)
    kT_offsets = tile_offsets(keys0[None, :], cols[:, None], stride_kt, stride_kd, WIDE)
    vT_offsets = tile_offsets(keys0[None, :], cols_v[:, None], stride_vt, stride_vd,
                              WIDE)  # fmt: skip
    if BAND:
        # the band's left edge
        dq = dq_key_tiles(
            dq, q_tile, do_tile, m, log2_l, delta, k_ptr, v_ptr, kT_offsets, vT_offsets,
            rows, keys0, cols, cols_v, stride_kt, stride_vt, first, full_first, Tq, Tk,
            offset, qk_scale, b.to(tl.int32), h_kv.to(tl.int32), band_lo, band_hi, unit,
            softcap, BLOCK_K, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, True,
            False, DOT_PRECISION, USE_TMA, True, SOFTCAP,
        )  # fmt: skip
        # FULL
        dq = dq_key_tiles(
            dq, q_tile, do_tile, m, log2_l, delta, k_ptr, v_ptr, kT_offsets, vT_offsets,
            rows, keys0, cols, cols_v, stride_kt, stride_vt, full_first, full_end, Tq,
            Tk, offset, qk_scale, b.to(tl.int32), h_kv.to(tl.int32), band_lo, band_hi,
            unit, softcap, BLOCK_K, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD,
            False, False, DOT_PRECISION, USE_TMA, True, SOFTCAP,
        )  # fmt: skip
        # the right edge, and a ragged last key tile
        dq = dq_key_tiles(
            dq, q_tile, do_tile, m, log2_l, delta, k_ptr, v_ptr, kT_offsets, vT_offsets,
            rows, keys0, cols, cols_v, stride_kt, stride_vt, full_end, n, Tq, Tk,
            offset, qk_scale, b.to(tl.int32), h_kv.to(tl.int32), band_lo, band_hi, unit,
            softcap, BLOCK_K, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, True,
            False, DOT_PRECISION, USE_TMA, True, SOFTCAP,
        )  # fmt: skip
    else:
        # the full tiles first, then the diagonal band and a ragged last tile, masked
        dq = dq_key_tiles(
            dq, q_tile, do_tile, m, log2_l, delta, k_ptr, v_ptr, kT_offsets, vT_offsets,
            rows, keys0, cols, cols_v, stride_kt, stride_vt, 0, n_full, Tq, Tk, offset,
            qk_scale, b.to(tl.int32), h_kv.to(tl.int32), band_lo, band_hi, unit,
            softcap, BLOCK_K, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, False,
            CAUSAL, DOT_PRECISION, USE_TMA, False, SOFTCAP,
        )  # fmt: skip
        dq = dq_key_tiles(
            dq, q_tile, do_tile, m, log2_l, delta, k_ptr, v_ptr, kT_offsets, vT_offsets,
            rows, keys0, cols, cols_v, stride_kt, stride_vt, n_full, n, Tq, Tk, offset,
            qk_scale, b.to(tl.int32), h_kv.to(tl.int32), band_lo, band_hi, unit,
            softcap, BLOCK_K, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, True,
            CAUSAL, DOT_PRECISION, USE_TMA, False, SOFTCAP,
        )  # fmt: skip
    dq = dq * scale  # dQ = τ dS K, with the signed τ
    store_tile(DQ + b * stride_dqb + h * stride_dqh, stride_dqt, stride_dqd, rows, cols,
               Tq, HEAD_DIM, dq)  # fmt: skip
# --8<-- [end:dq]


# --8<-- [start:split_sum]
@triton.jit
def sum_split_kernel(
    PARTIALS, DK, DV, plane, H_kv, B, width, head_dim_k, head_dim_v,
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_dvb, stride_dvh, stride_dvt, stride_dvd,
    SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """With a GQA split, dk and dv from their float32 partials, cast to the inputs'
    dtype: one launch for both.

    PARTIALS is (2, B, H_kv * SPLIT, Tk, width) contiguous, width = max(d_qk, d_v), and
    plane = Tk * width; DK is (B, H_kv, Tk, head_dim_k) and DV (B, H_kv, Tk,
    head_dim_v), with any strides (a partial's columns past its own head dim are never
    written, read or stored). Program (tile, h_kv, which * B + b) adds the SPLIT planes
    of its kv head in the order s = 0, 1, ..., so every run rounds the same way."""
    inner = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h_kv = tl.program_id(1).to(tl.int64)
    which_b = tl.program_id(2).to(tl.int64)  # which * B + b; which = 0 for dk, 1 for dv
    b = which_b % B
    t = (inner // width).to(tl.int64)
    d = inner % width
    # a partial's columns past its own head dim hold nothing: neither read nor stored
    if which_b < B:
        ok = (inner < plane) & (d < head_dim_k)
    else:
        ok = (inner < plane) & (d < head_dim_v)
    first = (which_b * H_kv + h_kv) * SPLIT  # the first partial plane of this kv head
    acc = tl.load(PARTIALS + first * plane + inner, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(PARTIALS + (first + s) * plane + inner, mask=ok, other=0.0)
    if which_b < B:
        out = DK + b * stride_dkb + h_kv * stride_dkh + t * stride_dkt + d * stride_dkd
        tl.store(out, acc.to(DK.dtype.element_ty), mask=ok)
    else:
        out = DV + b * stride_dvb + h_kv * stride_dvh + t * stride_dvt + d * stride_dvd
        tl.store(out, acc.to(DV.dtype.element_ty), mask=ok)


SPLIT_SUM_BLOCK = 1024  # elements per program: a plain streaming sum, 4 warps


def split_sum_launch(B: int, H_kv: int, Tk: int, *, head_dims: tuple[int, int],
                     kv_split: int, dk_strides: tuple,
                     dv_strides: tuple) -> KernelLaunch | None:  # fmt: skip
    """The launch that sums the split's partials into dk and dv (part of the backward's
    plan); None without a split. ``head_dims``: (d_qk, d_v), dk's and dv's widths; the
    partials are max(d_qk, d_v) wide."""
    if kv_split == 1:
        return None
    width = max(head_dims)
    plane = Tk * width
    grid = head_batch_grid(-(-plane // SPLIT_SUM_BLOCK), H_kv, 2 * B)
    # plan_keyed: its tensors are all allocated per call
    return KernelLaunch(sum_split_kernel, grid=grid,
                        scalars=(plane, H_kv, B, width, *head_dims, *dk_strides,
                                 *dv_strides),
                        constexprs=dict(SPLIT=kv_split, BLOCK=SPLIT_SUM_BLOCK),
                        num_warps=4, num_stages=1,
                        plan_keyed=True)  # fmt: skip
# --8<-- [end:split_sum]


# --8<-- [start:config]
# B * H * Tq * Tk * D (halved under causal) below which the backward loads through
# pointers
TMA_MIN_WORK = 8e9
# the atomic mode's dK/dV settings with bulk dQ adds, by head-dim pad (at least 64),
# 16-bit: the fastest of four per head dim in sweeps/atomic-dq-reduce.json (D = 256:
# 64 x 64 needs 271 KB of shared memory)
ATOMIC_BULK_DKDV = {64: (64, 64, 4, 2), 128: (64, 128, 8, 2), 256: (32, 64, 8, 2)}


def backward_config(head_dim: int, dtype: torch.dtype, seq_len: int = 0,
                    atomic_dq: bool = False, work: float = float("inf"),
                    head_dim_v: int | None = None) -> dict:  # fmt: skip
    """(block_q, block_k, num_warps, num_stages) for each kernel, and whether to load
    through TMA, by head dim, dtype, the longer of Tq and Tk, and the dQ mode.

    The dK/dV kernel keeps k, v, dk and dv of BLOCK_K keys resident while query tiles of
    BLOCK_Q rows stream past, the dQ kernel keeps q, do and dq of BLOCK_Q queries while
    key tiles stream past. The 16-bit settings are the fastest of sweeps on the H200
    (bench/results/sweeps/backward-v2-configs.json, then backward-tma-configs-2.json
    after the row terms moved to the preprocess kernel). Every dK/dV setting sits at the
    255-register limit and spills a little (ptxas, sm_90); the 8-warp tiles ran slower.
    From 1k tokens on, loading the streamed tiles through TMA ("auto": where the device
    and layout allow) was faster, and so were 64-row query tiles at D = 128; below 1k
    the causal backward ran slower through TMA, so short sequences keep the pointer path
    (sweeps/backward-dq-long.json). So do calls with little work (``work`` = B * H * Tq
    * Tk * D, halved under causal, below ``TMA_MIN_WORK``): there the descriptors cost
    the host more than they save the GPU, timed through autograd, where the backward
    runs on autograd's device thread and every host call is slower
    (bench/results/backward-models.json, sweeps/backward-descriptor-host-cost.json). The
    atomic-dQ kernel also holds a dQ tile: through pointers, with 64-row query tiles at
    D = 128 it spills 764 bytes, so it keeps 32; where TMA loads the tiles it also adds
    each dQ share as one bulk add (``DQ_REDUCE``), and larger tiles ran fastest
    (``ATOMIC_BULK_DKDV``, sweeps/atomic-dq-reduce.json). At D = 256 a search
    (sweeps/backward-d256-configs.json) found 64 x 64 dK/dV tiles on 8 warps and 128 x
    64 dQ tiles in one stage 2.2-2.4x faster than the 16 x 32 tiles kept before. fp32
    inputs multiply on the CUDA cores, not the tensor cores, and need far smaller tiles.
    The interpreter runs programs one after another: fewer, larger tiles are faster
    there. ``head_dim`` is d_qk, ``head_dim_v`` the value head dim d_v where the call
    has one (None: d_qk). At 192/128 (DeepSeek-V3's prefill) a search at 8k tokens
    found 32 x 128 dK/dV tiles and 128 x 64 dQ tiles in 2 stages, through pointers,
    x1.40 faster than the D = 256 settings (x1.36 at 2k; an H100,
    sweeps/unequal-configs.json). Any other pair takes the settings of the wider of the
    two, whose equal-dims call holds at least its tiles (128/64 and 64/128: D = 128's).
    """
    # --8<-- [start:bwd_settings]
    pad_v = head_dim_pad(head_dim if head_dim_v is None else head_dim_v)
    pad = max(head_dim_pad(head_dim), pad_v)
    if is_interpreting():
        return dict(dkdv=(32, 32, 4, 1), dq=(32, 32, 4, 1), tma=False)
    if dtype == torch.float32:
        dkdv = (32, 32, 4, 2) if pad <= 64 else (16, 32, 8, 2)
        return dict(dkdv=dkdv, dq=(32, 32, 4, 2), tma=False)
    long = seq_len >= 1024
    tma = "auto" if long and work >= TMA_MIN_WORK else False
    # dQ shares as bulk adds through TMA (DQ_REDUCE): larger dK/dV tiles fit; dq: the
    # preprocess's rows
    if atomic_dq and tma:
        return dict(dkdv=ATOMIC_BULK_DKDV[max(pad, 64)], dq=(64, 64, 4, 3), tma=tma)
    # below 1k tokens, 64 x 64 dK/dV tiles (sweeps/backward-d64-rung-settings.json)
    if pad <= 64:
        short = not long and not atomic_dq
        dkdv = (64, 64, 4, 3) if short else (32, 128, 4, 3)
        return dict(dkdv=dkdv, dq=(64, 64, 4, 3), tma=tma)
    if pad == 128:
        dkdv = (64, 64, 4, 2) if long and not atomic_dq else (32, 64, 4, 3)
        return dict(dkdv=dkdv, dq=(128, 64, 8, 3), tma=tma)
    # D = 256 through pointers: the per-element adds' dQ tile leaves room for small
    # tiles only
    if atomic_dq:
        return dict(dkdv=(16, 32, 4, 2), dq=(64, 32, 8, 2), tma=False)
    # q and k 256 wide, v 128 (192/128; sweeps/unequal-configs.json)
    if pad_v < pad:
        return dict(dkdv=(32, 128, 8, 2), dq=(128, 64, 8, 2), tma=False)
    # D = 256 (sweeps/backward-d256-configs.json)
    return dict(dkdv=(64, 64, 8, 2), dq=(128, 64, 8, 1), tma=tma)
    # --8<-- [end:bwd_settings]


# below this many dK/dV programs per SM, split GQA groups (see pick_kv_split)
PROGRAMS_PER_SM = 4


# --8<-- [start:kv_split]
def pick_kv_split(group: int, programs: int, device: torch.device) -> int:
    """How many dK/dV programs share one (key tile, kv head): a divisor of the GQA group
    size.

    1 without GQA, on the CPU, or when the grid already has PROGRAMS_PER_SM programs per
    SM; otherwise the smallest divisor of the group that gets there (or the whole
    group): on the H200, a grid of one program per SM left the dK/dV kernel far slower
    than the same work over four times the programs (sweeps/backward-kv-split.json). A
    split writes float32 partials, which the launcher sums in a fixed order: still
    bitwise reproducible, rounded differently from no split.
    """
    if group == 1 or device.type != "cuda":
        return 1
    enough = PROGRAMS_PER_SM * sm_count(device)
    divisors = (d for d in range(1, group + 1) if group % d == 0)
    return next((d for d in divisors if programs * d >= enough), group)
# --8<-- [end:kv_split]


# --8<-- [end:config]


def check_config(config) -> dict:
    """A ``backward_config``-shaped dict: {"dkdv": (bq, bk, warps, stages), "dq": (...)}, each value valid."""
    if not isinstance(config, dict) or set(config) != {"dkdv", "dq"}:
        raise ValueError(f'config must be a dict with exactly the keys "dkdv" and "dq", got {config!r}')
    checked = {}
    for name, value in config.items():
        if not isinstance(value, (tuple, list)) or len(value) != 4:
            raise ValueError(f'config["{name}"] must be (block_q, block_k, num_warps, num_stages), got {value!r}')
        bq, bk, warps, stages = value
        bq = check_tile_size(f'config["{name}"] block_q', bq)
        bk = check_tile_size(f'config["{name}"] block_k', bk)
        checked[name] = (bq, bk, *check_launch(warps, stages))
    return checked


def stats_from_lse(lse: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor:
    """(m, l) for the kernels from a natural-log lse alone: m = lse / |τ| in raw-dot units, l = 1; with a
    softcap, whose scores the kernels keep in natural units (``_jit.soft_cap``), m = lse.

    exp2((u - m) * qk_scale) is then exp(S - lse). A row with lse = -inf becomes (m, l) = (-inf, 0).
    """
    m = lse.float() if softcap is not None else lse.float() / kernel_scale(scale).unit
    l = torch.where(torch.isneginf(lse), 0.0, 1.0).to(torch.float32)
    return torch.stack([m, l])


def wide_offsets(rows: int, pad: int, *tensors: torch.Tensor) -> bool:
    """Whether an offset inside one tile, row * stride_t + col * stride_d with row < ``rows`` and
    col < ``pad``, can pass 2**31 - 1 in any of the (B, H, T, D) ``tensors``: then the kernels compute
    in-tile offsets in int64 (their WIDE switch). Each tile's first row and each (batch, head) are
    always offset in int64; this only decides the per-element part."""
    return any(rows * x.stride(2) + pad * x.stride(3) >= 2**31 for x in tensors)


NO_DOCUMENTS = dict(CU_Q=None, CU_K=None, ORDER=None, VARLEN=False)  # the kernels' varlen switches off: compiled out


class BackwardPlan(NamedTuple):
    """The launches of one backward call, worked out once per layout (see ``_plans.cached_plan``)."""

    scale: float
    softcap: float | None  # with a cap, the kernels' scores, and so m, are in natural units
    pad: int  # the q and k tiles' width: d_qk padded (``_host.head_dim_pad``)
    pad_v: int  # the v and do tiles' width: d_v padded
    deterministic: bool
    preprocess: KernelLaunch | None  # the atomic mode's row terms (the deterministic mode's dQ kernel stores them)
    dkdv: KernelLaunch  # one program per key tile: dK, dV (and with atomics, its share of dQ)
    dq: KernelLaunch  # one program per query tile: dQ, and the row terms (delta, m, log2 l) of its rows
    tma_dkdv: tuple | None  # (strides of q, strides of do, tile rows): descriptors the dK/dV kernel loads through
    tma_dq: tuple | None  # (strides of k, strides of v, tile rows): likewise for the dQ kernel
    dq_reduce_rows: int  # atomic mode through TMA: the rows of the dQ accumulator's descriptor tiles; 0 without
    kv_split: int  # programs per (key tile, kv head): > 1 writes float32 partials of dk, dv (see the kernel)
    split_sum: KernelLaunch | None  # with kv_split > 1: the partials summed into dk and dv
    grad_strides: tuple  # of dq, dk, dv: each laid out like its input where that is dense (``strides_like``)
    grads_like_inputs: tuple  # (dq, dk, dv): whether torch.empty_like of its input gives those strides
    stats_contiguous: bool  # whether the stats passed in are contiguous already (None: made contiguous)
    rows_shape: tuple  # (3, B, H, Tq): the row terms (delta, m, log2 l)
    device: torch.device  # q's, kept: reading q.device makes a new device object on every call

    def run(self, q, k, v, o, do, stats, rows=None) -> tuple:
        """``backward_with_plan(self, q, k, v, o, do, stats, rows)``."""
        return backward_with_plan(self, q, k, v, o, do, stats, rows)


def make_backward_plan(q, k, v, o, lse, do, stats, *, spec: AttentionSpec, deterministic: bool, block_q=None,
                       block_k=None, config=None, tma=None) -> BackwardPlan:  # fmt: skip
    """Derive one backward call's launches from its checked options (``_spec.check_spec``); raises on a layout,
    a device or a setting the kernels cannot take."""
    shape = check_attention_inputs(q, k, v, dtypes=KERNEL_DTYPES, unequal_head_dims=True)
    d_v = v.shape[3]  # v, o, do and dv: d_v wide; q, k, dq and dk: D = d_qk
    check_like("o", o, "q", q, head_dim=d_v)
    check_like("do", do, "q", q, head_dim=d_v)
    check_lse(lse, shape, q)
    offset = spec.mask.offset(shape.Tq, shape.Tk)
    mask = kernel_mask(spec.mask, shape.Tq, shape.Tk)
    softcap, scale = spec.softcap, spec.scale
    causal = mask.causal  # a window that is plain causal (or no mask) runs as such
    check_kernel_device("q", q)
    block_q = None if block_q is None else check_tile_size("block_q", block_q)
    block_k = None if block_k is None else check_tile_size("block_k", block_k)
    width = max(shape.D, d_v)
    if config is None:
        mean_dim = (shape.D + d_v) / 2  # the work per pair is (3 d_qk + 2 d_v) * 2 FLOPs: D for equal dims
        work = shape.B * shape.H * shape.Tq * shape.Tk * mean_dim * (0.5 if causal else 1.0)
        if mask.banded:  # the pairs the window keeps
            work = shape.B * shape.H * mean_dim * window_visible_pairs(shape.Tq, shape.Tk, spec.mask.window, False,
                                                                       spec.mask.alignment)  # fmt: skip
        config = backward_config(shape.D, q.dtype, max(shape.Tq, shape.Tk), atomic_dq=not deterministic, work=work,
                                 head_dim_v=d_v)  # fmt: skip
    else:  # a caller's config loads through pointers unless tma says otherwise
        config = dict(check_config(config), tma=False)
    tma = config["tma"] if tma is None else check_flag("tma", tma)
    strides = use_tma(tma, q, do, k, v)  # the streamed tiles: q and do for dK/dV, k and v for dQ
    if not deterministic and config["tma"] and strides is None:  # it picked TMA's settings, and TMA is out:
        config = backward_config(width, q.dtype, 0, atomic_dq=True)  # the settings of per-element dQ adds
    if stats is not None:
        check_tensor("stats", stats, rank=4, dtypes=(torch.float32,))
        if tuple(stats.shape) != (2, *lse.shape) or stats.device != q.device:
            raise ValueError(f"stats must be (2, B, H, Tq) = {(2, *lse.shape)} on {q.device}, got "
                             f"{tuple(stats.shape)}")  # fmt: skip
    units = kernel_scale(scale)
    qk_scale = units.qk_scale if softcap is None else LOG2E  # capped scores are in natural units (soft_cap)
    cap = (*mask.band, 1.0 if softcap is None else softcap)  # band_lo, band_hi, softcap
    pad, pad_v = head_dim_pad(shape.D), head_dim_pad(d_v)
    tiles = config["dkdv"][:2] + config["dq"][:2] + (block_q or 0, block_k or 0)
    common = dict(CAUSAL=causal, HEAD_DIM=shape.D, HEAD_DIM_PAD=pad, HEAD_DIM_V=d_v, HEAD_DIM_V_PAD=pad_v,
                  SIGN=units.sign, DOT_PRECISION=dot_precision(q.dtype),
                  WIDE=wide_offsets(max(tiles), max(pad, pad_v), q, k, v, do, o))
    masks = dict(BAND=mask.banded, SOFTCAP=softcap is not None)
    dkdv_q, dkdv_k, dkdv_warps, dkdv_stages = config["dkdv"]
    dkdv_q, dkdv_k = block_q or dkdv_q, block_k or dkdv_k
    n_key_tiles = -(-shape.Tk // dkdv_k)
    kv_split = pick_kv_split(shape.group, n_key_tiles * shape.H_kv * shape.B, q.device)
    grad_strides = (strides_like(q), strides_like(k), strides_like(v))  # dq, dk, dv: laid out like q, k, v
    partials = contiguous_strides((shape.B, shape.H_kv * kv_split, shape.Tk, width))
    dk_dv_strides = (*grad_strides[1], *grad_strides[2]) if kv_split == 1 else (*partials, *partials)
    dq_q, dq_k, dq_warps, dq_stages = config["dq"]
    dq_q, dq_k = block_q or dq_q, block_k or dq_k
    sizes = (shape.H, shape.H_kv, shape.Tq, shape.Tk)
    n_rows = shape.B * shape.H * shape.Tq  # the distance between the planes of stats and of the row terms
    tma_dkdv = None if strides is None else (strides[0], strides[1], dkdv_q)
    tma_dq = None if strides is None else (strides[2], strides[3], dq_k)
    # the atomic mode's dQ shares as bulk adds: TMA on a GPU (the interpreter has no bulk add; it adds per element)
    dq_reduce = not deterministic and tma_dkdv is not None and q.device.type == "cuda"
    # heaviest tiles first, in chunks of heads whose streamed tiles fit in L2: a dK/dV program streams q and
    # do of its share of the group's query heads, a dQ program k and v of the kv head its group shares
    share_bytes = (shape.D + d_v) * q.element_size()
    dkdv_pairs, dq_pairs, n_query_tiles = shape.B * shape.H_kv * kv_split, shape.B * shape.H, -(-shape.Tq // dq_q)
    dkdv_chunk = heaviest_first_chunk(causal, share_bytes * shape.Tq * shape.group // kv_split,
                                      dkdv_pairs, dkdv_pairs * n_key_tiles, resident_programs(dkdv_warps, None),
                                      q.device)  # fmt: skip
    dq_chunk = heaviest_first_chunk(causal, share_bytes * shape.Tk // shape.group, dq_pairs,
                                    dq_pairs * n_query_tiles, resident_programs(dq_warps, None), q.device,
                                    shape.group)  # fmt: skip
    return BackwardPlan(
        scale=scale,
        softcap=softcap,
        pad=pad,
        pad_v=pad_v,
        deterministic=deterministic,
        preprocess=None if deterministic else preprocess_launch(o, do, block_q or config["dq"][0]),
        dkdv=KernelLaunch(
            backward_dkdv_kernel,
            grid=head_batch_grid(n_key_tiles, shape.H_kv * kv_split, shape.B),
            scalars=(*q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk_dv_strides, *sizes, n_rows,
                     units.unit, scale, qk_scale, offset, max(dkdv_chunk, 1), *cap),  # fmt: skip
            constexprs=dict(BLOCK_Q=dkdv_q, BLOCK_K=dkdv_k, **common, ATOMIC_DQ=not deterministic, SPLIT=kv_split,
                            INTERPRETED=q.device.type == "cpu", USE_TMA=tma_dkdv is not None,
                            HEAVIEST_FIRST=dkdv_chunk > 0, **masks, **NO_DOCUMENTS, DQ_REDUCE=dq_reduce),  # fmt: skip
            num_warps=dkdv_warps,
            num_stages=dkdv_stages,
            plan_keyed=True,  # kept under every input's layout (flash_attention_backward, attention's kept call)
        ),
        dq=KernelLaunch(
            backward_dq_kernel,
            grid=head_batch_grid(n_query_tiles, shape.H, shape.B),
            scalars=(*q.stride(), *k.stride(), *v.stride(), *do.stride(), *o.stride(), *grad_strides[0], *sizes,
                     n_rows, scale, qk_scale, offset, max(dq_chunk, 1), *mask.band, units.unit, cap[2]),  # fmt: skip
            constexprs=dict(BLOCK_Q=dq_q, BLOCK_K=dq_k, **common, USE_TMA=tma_dq is not None,
                            HEAVIEST_FIRST=dq_chunk > 0, **masks, **NO_DOCUMENTS),
            num_warps=dq_warps,
            num_stages=dq_stages,
            plan_keyed=True,
        ),
        tma_dkdv=tma_dkdv,
        tma_dq=tma_dq,
        dq_reduce_rows=dkdv_q if dq_reduce else 0,
        kv_split=kv_split,
        split_sum=split_sum_launch(shape.B, shape.H_kv, shape.Tk, head_dims=(shape.D, d_v), kv_split=kv_split,
                                   dk_strides=grad_strides[1], dv_strides=grad_strides[2]),  # fmt: skip
        grad_strides=grad_strides,
        # torch.empty_like(x) is the cheapest allocation (no shape, strides, dtype or device to pass), and for
        # a dense plain tensor it gives exactly x's strides, which are then what strides_like chose
        grads_like_inputs=tuple(type(x) in (torch.Tensor, torch.nn.Parameter) and s == tuple(x.stride())
                                for x, s in zip((q, k, v), grad_strides)),  # fmt: skip
        stats_contiguous=stats is None or stats.is_contiguous(),
        rows_shape=(3, shape.B, shape.H, shape.Tq),
        device=q.device,
    )


LAUNCHER_OPTIONS = ("causal", "scale", "alignment", "window", "softcap", "deterministic", "block_q", "block_k",
                    "config", "tma")  # checked_backward_plan's, as flash_attention_backward keys its plans


def checked_backward_plan(q, k, v, o, lse, do, stats, *, causal, scale, alignment, window, softcap, deterministic,
                          block_q, block_k, config, tma) -> BackwardPlan:  # fmt: skip
    """``flash_attention_backward``'s plan: its arguments checked into one spec (``_spec.check_spec``), then
    ``make_backward_plan``; raises on anything the kernels cannot take."""
    shape = check_attention_inputs(q, k, v, dtypes=KERNEL_DTYPES, unequal_head_dims=True)
    spec = check_spec(shape, q.dtype, causal=causal, scale=scale, alignment=alignment, window=window,
                      softcap=softcap, causal_name="causal")  # fmt: skip
    return make_backward_plan(q, k, v, o, lse, do, stats, spec=spec, deterministic=check_flag("deterministic",
                              deterministic), block_q=block_q, block_k=block_k, config=config, tma=tma)  # fmt: skip


def backward_with_spec(q, k, v, o, lse, do, stats, *, spec: AttentionSpec, sinks=None) -> tuple:
    """(dq, dk, dv, dsinks) of a call whose options are checked already (``flashtile.attention``'s), from the
    forward's (m, l) ``stats``: the deterministic plan, kept per layout and spec. With ``sinks`` (H,), the
    forward's (m, l) and lse hold the sink already, so dq, dk, dv are computed as without one, and dsinks
    from the row terms the dQ kernel stores (``kernels.sinks.sink_gradient``); dsinks is None without sinks."""
    plan = cached_plan(make_backward_plan, (q, k, v, o, lse, do, stats), spec, True, names=("spec", "deterministic"))
    stats = stats if plan.stats_contiguous else stats.contiguous()
    if sinks is None:
        return (*backward_with_plan(plan, q, k, v, o, do, stats), None)
    rows = torch.empty(plan.rows_shape, dtype=torch.float32, device=plan.device)  # the dQ kernel fills it
    dq, dk, dv = backward_with_plan(plan, q, k, v, o, do, stats, rows)
    return dq, dk, dv, sink_gradient(sinks, lse, rows[0])




# --8<-- [start:launcher]
def flash_attention_backward(
    q, k, v, o, lse, do, *, causal=False, scale=None, block_q=None, block_k=None,
    alignment="upper_left", stats=None, config=None, deterministic=True, tma=None,
    window=None, softcap=None,
):
    """Gradients of attention from the forward's o and lse, with two Triton launches.

    Args:
        q: (B, H, Tq, D); k: (B, H_kv, Tk, D), v: (B, H_kv, Tk, d_v), H a multiple of
            H_kv; fp16, bf16 or fp32, any strides. o, do: (B, H, Tq, d_v) (do may be
            non-contiguous). lse: (B, H, Tq) float32 from the forward.
        causal, scale, alignment: as in the forward (keywords, as every option here).
            block_q, block_k override both kernels' tile sizes (powers of two >= 16);
            None picks per kernel.
        stats: the forward's (2, B, H, Tq) final (m, l), from
            ``flash_attention(..., return_stats=True)``: the exact hand-off. Without it,
            (m, l) are derived from lse (``stats_from_lse``).
        config: replaces ``backward_config``'s choice,
            {"dkdv": (bq, bk, warps, stages), "dq": (...)}; for tuning sweeps.
        deterministic: True (the default) computes dQ in its own kernel, bitwise the
            same on every run; False adds it up with float32 atomics inside the dK/dV
            kernel (two launches, five matmuls per tile instead of seven), whose
            summation order, and so whose last bits, vary between runs.
        tma: True loads the streamed tiles (q and do in the dK/dV kernel, k and v in the
            dQ kernel) through TMA descriptors, and raises where the device or a layout
            cannot have them (see ``_host.use_tma``); False loads through pointers; None
            (the default) takes ``backward_config``'s choice: TMA where possible from 1k
            tokens on, measured faster there on the H200. Either way the results are
            bitwise the same.
        window, softcap: as in the forward, and the same values: the dK/dV programs
            visit only the query tiles whose band reaches their key tile, the dQ
            programs only the key tiles in range, and dS is multiplied by the cap's
            derivative 1 - tanh^2.

    Returns:
        dq like q; dk like k, dv like v: each laid out like its input in memory where
        that input is dense (``flashtile._layouts.strides_like``; a (B, H, T, D) view of
        (B, T, H, D) storage gets a gradient of the same layout, which autograd then
        keeps without a copy), contiguous otherwise; accumulated in float32 and cast to
        the input dtype.
    """
    # checked before it keys the plans: (True, 0) and (1, 0) hash alike
    if window is not None:
        window = check_window(window)
    plan = cached_plan(checked_backward_plan, (q, k, v, o, lse, do, stats), causal,
                       scale, alignment, window, softcap, deterministic, block_q,
                       block_k, config, tma, names=LAUNCHER_OPTIONS)  # fmt: skip
    if stats is None:
        stats = stats_from_lse(lse, plan.scale, plan.softcap)
    # the plan knows: contiguous() is a dispatched call even when it returns stats
    elif not plan.stats_contiguous:
        stats = stats.contiguous()
    return backward_with_plan(plan, q, k, v, o, do, stats)


def backward_with_plan(plan: BackwardPlan, q, k, v, o, do, stats, rows=None) -> tuple:
    """Run one backward call's kernels from its plan: (dq, dk, dv). ``stats`` is the
    forward's (m, l), (2, B, H, Tq) float32, contiguous; ``rows``, where given, a new
    (3, B, H, Tq) float32 contiguous tensor for the deterministic mode's row terms (a
    caller holding the forward's row statistics makes it with ``torch.empty_like``, the
    cheapest allocation). Every tensor is allocated from what the plan kept (shapes,
    strides, the device), not read again from the inputs."""
    like_q, like_k, like_v = plan.grads_like_inputs
    # dQ first: its kernel also stores every row's (delta, m, log2 l) for the dK/dV
    # kernel
    if plan.deterministic:
        if rows is None:
            rows = torch.empty(plan.rows_shape, dtype=torch.float32, device=plan.device)
        dq = (torch.empty_like(q) if like_q
              else empty_like_layout(q, plan.grad_strides[0]))
        k_tiles, v_tiles = k, v
        if plan.tma_dq is not None:
            pads = (plan.pad, plan.pad_v)
            k_tiles, v_tiles = tile_descriptors(plan.tma_dq, k, v, pads)
        plan.dq(q, k_tiles, v_tiles, do, o, stats, rows, dq)
        dq_acc = dq_acc_arg = dq  # the dK/dV kernel ignores this argument
    # the row terms from their own kernel, and a float32 dQ accumulator that every key
    # tile adds into
    else:
        rows = backward_preprocess(o, do, stats, plan.preprocess)
        dq_acc = dq_acc_arg = torch.zeros((*q.shape[:3], plan.pad), dtype=torch.float32,
                                          device=plan.device)  # fmt: skip
        # the kernel adds whole tiles into it through a descriptor
        if plan.dq_reduce_rows:
            dq_acc_arg = tile_descriptor(dq_acc, list(dq_acc.stride()),
                                         plan.dq_reduce_rows, plan.pad)  # fmt: skip
    # dk and dv: two tensors, never views of one buffer (a custom op's outputs may not
    # share memory)
    dk = torch.empty_like(k) if like_k else empty_like_layout(k, plan.grad_strides[1])
    dv = torch.empty_like(v) if like_v else empty_like_layout(v, plan.grad_strides[2])
    dk_out, dv_out = dk, dv  # where the dK/dV kernel writes
    # float32 partials of dk and dv in one buffer (as wide as the wider): one allocation
    if plan.kv_split > 1:
        B, H_kv, Tk, D = k.shape
        shape = (2, B, H_kv * plan.kv_split, Tk, max(D, v.shape[3]))
        partials = torch.empty(shape, dtype=torch.float32, device=plan.device)
        dk_out, dv_out = partials[0], partials[1]
    q_tiles, do_tiles = q, do
    if plan.tma_dkdv is not None:
        pads = (plan.pad, plan.pad_v)
        q_tiles, do_tiles = tile_descriptors(plan.tma_dkdv, q, do, pads)
    plan.dkdv(q_tiles, k, v, do_tiles, rows, dk_out, dv_out, dq_acc_arg)
    # the partials of each kv head, summed in a fixed order and cast, in one launch
    if plan.kv_split > 1:
        plan.split_sum(partials, dk, dv)
    if not plan.deterministic:  # cast as it copies
        dq = empty_like_layout(q, plan.grad_strides[0]).copy_(dq_acc[..., : q.shape[3]])
    return dq, dk, dv


def tile_descriptors(tma: tuple, x, y, pads: tuple[int, int]) -> tuple:
    """Host-built TMA descriptors of x (d_qk wide: q or k) and y (d_v wide: do or v)
    for (1, 1, rows, pad) tiles, from a plan's (strides, strides, rows) and the two
    pads."""
    x_strides, y_strides, rows = tma
    return (tile_descriptor(x, x_strides, rows, pads[0]),
            tile_descriptor(y, y_strides, rows, pads[1]))


# --8<-- [end:launcher]


def flash_attention_varlen_backward(
    q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, scale=None,
    alignment="upper_left", block_q=None, block_k=None, stats=None, window=None, softcap=None, checked=False,
):  # fmt: skip
    """Gradients of ``kernels.forward.flash_attention_varlen``: the deterministic backward's two kernels with
    the document mapping of the forward (``_jit.varlen_program``), dQ first (it also stores the row terms),
    then dK/dV, one program per (key tile, kv head, document) summing its GQA group in a fixed order.

    Args:
        q: (total_q, H, D); k: (total_k, H_kv, D); v: (total_k, H_kv, d_v); o, do: (total_q, H, d_v); lse
            (H, total_q) float32 from the forward.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, alignment, window, softcap,
            checked: as the forward's.
        block_q, block_k: override both kernels' tile sizes; defaults from ``backward_config``.
        stats: the forward's (2, H, total_q) final (m, l), the exact hand-off; without it, from lse.

    Returns:
        (dq, dk, dv), contiguous, in the inputs' dtype; zero for the queries of a document without keys and
        the keys of a document without queries.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, rank=3, dtypes=KERNEL_DTYPES)
    check_like("o", o, "q", q, head_dim=v.shape[2])
    check_like("do", do, "q", q, head_dim=v.shape[2])
    if not checked:
        _, _, _, documents = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
        check_max_seqlen("max_seqlen_q", max_seqlen_q, max((e - s for (s, e), _ in documents), default=0))
        check_max_seqlen("max_seqlen_k", max_seqlen_k, max((e - s for _, (s, e) in documents), default=0))
    max_q = check_int("max_seqlen_q", max_seqlen_q, minimum=1)
    max_k = check_int("max_seqlen_k", max_seqlen_k, minimum=1)
    total_q, H, D = q.shape
    total_k, H_kv, _ = k.shape
    check_tensor("lse", lse, rank=2, dtypes=(torch.float32,))
    if tuple(lse.shape) != (H, total_q):
        raise ValueError(f"lse must have shape (H, total_q) = {(H, total_q)}, got {tuple(lse.shape)}")
    spec = check_spec(AttentionShape(1, H, H_kv, total_q, total_k, D), q.dtype, causal=causal, scale=scale,
                      alignment=alignment, window=window, softcap=softcap, causal_name="causal")  # fmt: skip
    dq, dk, dv, _ = varlen_backward_with_spec(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_q,
                                              max_seqlen_k=max_k, spec=spec, block_q=block_q, block_k=block_k,
                                              stats=stats)  # fmt: skip
    return dq, dk, dv


def varlen_backward_with_spec(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q: int,
                              max_seqlen_k: int, spec: AttentionSpec, block_q=None, block_k=None, stats=None,
                              sinks=None):  # fmt: skip
    """``flash_attention_varlen_backward`` on inputs and cu_seqlens checked already (``flashtile.attention_varlen``'s),
    with the call's checked options: (dq, dk, dv, dsinks), dsinks (H,) from the row terms with ``sinks`` (the
    (H,) sinks of the forward whose lse this is: ``kernels.sinks.sink_gradient``), None without."""
    total_q, H, D = q.shape
    total_k, H_kv, _ = k.shape
    d_v = v.shape[2]
    max_q, max_k = max_seqlen_q, max_seqlen_k
    scale, softcap = spec.scale, spec.softcap
    check_kernel_device("q", q)
    block_q = None if block_q is None else check_tile_size("block_q", block_q)
    block_k = None if block_k is None else check_tile_size("block_k", block_k)
    mask = kernel_mask(spec.mask)  # the sides: each document's programs work out its own band
    causal_mask, banded, (left, right) = mask.causal, mask.banded, mask.band
    # The pointer path's settings, those of short sequences: on the packed case (8 documents in 16k, D = 128)
    # 32 x 64 dK/dV tiles ran 5 % faster than the 64 x 64 that long sequences take through TMA, and no dQ
    # setting beat the default (bench/results/sweeps/varlen-configs.json)
    config = backward_config(max(D, d_v), q.dtype, 0, atomic_dq=False)
    units = kernel_scale(scale)
    qk_scale = units.qk_scale if softcap is None else LOG2E
    stats = stats_from_lse(lse, scale, softcap) if stats is None else stats.contiguous()
    if tuple(stats.shape) != (2, H, total_q) or stats.dtype != torch.float32:
        raise ValueError(f"stats must be float32 (2, H, total_q) = {(2, H, total_q)}, got {tuple(stats.shape)}")
    n_docs = cu_seqlens_q.shape[0] - 1
    rows = torch.empty((3, H, total_q), dtype=torch.float32, device=q.device)  # delta, m, log2 l
    dq = torch.empty((total_q, H, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((total_k, H_kv, D), dtype=k.dtype, device=k.device)
    dv = torch.empty((total_k, H_kv, d_v), dtype=v.dtype, device=v.device)

    def strides(x):  # (total, heads, D) seen as (1, heads, total, D): the batch stride is never stepped
        return 0, x.stride(1), x.stride(0), x.stride(2)

    pad, pad_v = head_dim_pad(D), head_dim_pad(d_v)
    dkdv_q, dkdv_k, dkdv_warps, dkdv_stages = config["dkdv"]
    dq_q, dq_k, dq_warps, dq_stages = config["dq"]
    dkdv_q, dkdv_k, dq_q, dq_k = block_q or dkdv_q, block_k or dkdv_k, block_q or dq_q, block_k or dq_k
    as_4d = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v, do, o)]
    precision = dot_precision(q.dtype)  # the forward's (spelled apart from the plan's: tests/test_mutants.py)
    common = dict(CAUSAL=causal_mask, HEAD_DIM=D, HEAD_DIM_PAD=pad, HEAD_DIM_V=d_v, HEAD_DIM_V_PAD=pad_v,
                  SIGN=units.sign, DOT_PRECISION=precision,
                  WIDE=wide_offsets(max(dkdv_q, dkdv_k, dq_q, dq_k), max(pad, pad_v), *as_4d),
                  USE_TMA=False, HEAVIEST_FIRST=False, BAND=banded, SOFTCAP=softcap is not None, CU_Q=cu_seqlens_q,
                  CU_K=cu_seqlens_k, ORDER=document_order(cu_seqlens_q, cu_seqlens_k), VARLEN=True)  # fmt: skip
    sizes = (H, H_kv, total_q, total_k)
    alignment_flag = int(spec.mask.alignment == "lower_right")  # the kernels' offset under VARLEN (varlen_program)
    cap = 1.0 if softcap is None else softcap
    backward_dq_kernel[head_batch_grid(-(-max_q // dq_q), H, n_docs)](
        q, k, v, do, o, stats, rows, dq, *strides(q), *strides(k), *strides(v), *strides(do), *strides(o), *strides(dq),
        *sizes, H * total_q, scale, qk_scale, alignment_flag, 1, left, right, units.unit, cap,
        BLOCK_Q=dq_q, BLOCK_K=dq_k, **common, num_warps=dq_warps, num_stages=dq_stages,
    )  # fmt: skip
    backward_dkdv_kernel[head_batch_grid(-(-max_k // dkdv_k), H_kv, n_docs)](
        q, k, v, do, rows, dk, dv, dq, *strides(q), *strides(k), *strides(v), *strides(do), *strides(dk),
        *strides(dv), *sizes, H * total_q, units.unit, scale, qk_scale, alignment_flag, 1, left, right, cap,
        BLOCK_Q=dkdv_q, BLOCK_K=dkdv_k, **common, ATOMIC_DQ=False, INTERPRETED=q.device.type == "cpu", SPLIT=1,
        num_warps=dkdv_warps, num_stages=dkdv_stages,
    )  # fmt: skip
    if sinks is None:
        return dq, dk, dv, None
    # lse (H, total_q) holds the sinks, and rows[0] is every row's delta: as (1, H, total_q), one batch
    return dq, dk, dv, sink_gradient(sinks, lse[None], rows[0][None])

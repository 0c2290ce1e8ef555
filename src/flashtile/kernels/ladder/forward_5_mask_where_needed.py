"""Forward rung 5: the mask compiled only where a tile needs it, one compare per score.

Rung 4 with one idea changed: what a tile pays for the mask. The textbook compiles its masked loop for every
call, and a loop that runs no step still costs its set-up; here it is compiled only where some tile may need
the mask, under causal or with Tk not a multiple of the key tile (``MASKED_TILES``), as in the package. On the
pointer path a FULL tile whose head dim needs no padding loads without masks. Inside the masked tiles, the
textbook's two tests on absolute indices (j < Tk, and j <= i + offset) make the compiler build two index
tiles and combine two masks; here they are folded into one bound per row on the tile's own column j0 = j -
k_start, j0 <= min(i + offset - k_start, Tk - 1 - k_start), so that each score costs one compare against a
row value (the package's ``row_bound``).

Same contract as the textbook kernel (``kernels.textbook.textbook_forward``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._checks import resolve_neg_bits
from .._host import dot_precision, head_batch_grid, head_dim_pad, kernel_scale, tile_descriptor, use_tma
from .._jit import apply_sign, full_key_tiles, last_key_tile
from ..textbook import LN2, _check

IDEA = "The masked loop compiled only where some tile needs it, and the mask as one compare per score."


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
def tile_offsets(b, h, rows, cols, stride_b, stride_h, stride_t, stride_d):
    """Offsets of the tile [rows, cols] of batch b, head h; int64, so none wraps."""
    b, h = b.to(tl.int64), h.to(tl.int64)
    rows, cols = rows.to(tl.int64), cols.to(tl.int64)
    head = b * stride_b + h * stride_h
    return head + rows[:, None] * stride_t + cols[None, :] * stride_d


@triton.jit
def fold_key_tile(acc, l, m, shift, q, K, V, stride_kt, stride_vt, b, h, i, j0, d,
                  k_start, Tk, offset, qk_scale,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                  BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                  USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """One online-softmax step: fold keys k_start .. + BLOCK_K - 1 into (acc, l, m),
    in raw-dot units: m is the row max of u = sign(τ) q·k, shift = fl(m qk_scale)."""
    j = k_start + j0  # the key columns of this tile
    if USE_TMA:  # the copy engine fetches the (BLOCK_K, HEAD_DIM_PAD) box, 0 outside
        k = K.load([b, h, k_start, 0]).reshape(BLOCK_K, HEAD_DIM_PAD)
        v = V.load([b, h, k_start, 0]).reshape(BLOCK_K, HEAD_DIM_PAD)
    else:  # K, V point at key 0 of every element of a tile: one add moves them
        step = tl.cast(k_start, tl.int64)  # so that step * stride never wraps
        if MASKED or HEAD_DIM != HEAD_DIM_PAD:  # zeros past Tk and D
            kv_mask = (j[:, None] < Tk) & (d[None, :] < HEAD_DIM)
            k = tl.load(K + step * stride_kt, mask=kv_mask, other=0.0)
            v = tl.load(V + step * stride_vt, mask=kv_mask, other=0.0)
        else:  # a FULL tile, and no padded head dim: nothing to mask
            k = tl.load(K + step * stride_kt)
            v = tl.load(V + step * stride_vt)
    u = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # raw dots, unscaled
    if MASKED:  # a padded key, or one past the diagonal, must score -inf (p = 0), not 0
        # Key j = k_start + j0 is visible from row i when j0 <= last: one bound per row
        # on the tile's own column, so that each score costs one compare
        last = Tk - 1 - k_start  # the last column inside the keys
        if CAUSAL:
            last = tl.minimum(i + (offset - k_start), last)  # and the last row i sees
            u = tl.where(j0[None, :] <= last[:, None], u, float("-inf"))
        else:
            u = tl.where(j0[None, :] <= last, u, float("-inf"))
    m_new = tl.maximum(m, tl.max(u, 1))  # (BLOCK_Q,)
    shift_new = m_new * qk_scale  # the max in log2 units, rounded once per row
    # A row that has seen no key yet keeps m_new = -inf, and -inf - (-inf) is NaN:
    # subtract 0 instead, which gives alpha = 0 and p = 0 for that row.
    shift_safe = tl.where(m_new == float("-inf"), 0.0, shift_new)
    alpha = tl.math.exp2(shift - shift_safe)  # both shifts as rounded: exact rescaling
    p = tl.math.exp2(u * qk_scale - shift_safe[:, None])  # one multiply-add a score
    l = alpha * l + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l, m_new, shift_new


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
    CAUSAL: tl.constexpr, SIGN: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MASKED_TILES: tl.constexpr,
):  # fmt: skip
    """One program: query tile q_index of head h of batch b.
    Grid: (cdiv(Tq, BLOCK_Q), H, B)."""
    q_index, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = q_index * BLOCK_Q
    i = q_start + tl.arange(0, BLOCK_Q)  # the query rows
    j0 = tl.arange(0, BLOCK_K)  # a key tile's own columns
    d = tl.arange(0, HEAD_DIM_PAD)  # the head dim, padded to a power of 2
    q_mask = (i[:, None] < Tq) & (d[None, :] < HEAD_DIM)
    if USE_TMA:  # Q, K, V are TMA descriptors of the (B, H, T, D) tensors
        q = Q.load([b, h, q_start, 0]).reshape(BLOCK_Q, HEAD_DIM_PAD)
    else:  # pointers: the addresses of a tile, worked out once, before the loops
        Q += tile_offsets(b, h, i, d, stride_qb, stride_qh, stride_qt, stride_qd)
        K += tile_offsets(b, h, j0, d, stride_kb, stride_kh, stride_kt, stride_kd)
        V += tile_offsets(b, h, j0, d, stride_vb, stride_vh, stride_vt, stride_vd)
        q = tl.load(Q, mask=q_mask, other=0.0)  # (BLOCK_Q, HEAD_DIM_PAD)
    q = apply_sign(q, SIGN)  # sign(τ) q: the raw dots u rank keys as the scores do

    m = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)  # running row max of u
    shift = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)  # fl(m * qk_scale)
    l = tl.zeros([BLOCK_Q], dtype=tl.float32)  # running sum of p = exp2(u c - shift)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)  # sum of p v
    n_full, n_visit = key_tile_counts(q_start, Tq, Tk, offset, CAUSAL, BLOCK_Q, BLOCK_K)
    for k_index in range(0, n_full):  # FULL tiles: every pair visible, no mask
        acc, l, m, shift = fold_key_tile(
            acc, l, m, shift, q, K, V, stride_kt, stride_vt, b, h, i, j0, d,
            k_index * BLOCK_K, Tk, offset, qk_scale, HEAD_DIM, HEAD_DIM_PAD, BLOCK_K,
            CAUSAL, False, USE_TMA, DOT_PRECISION)  # fmt: skip
    if MASKED_TILES:  # causal, or a ragged Tk; else not compiled: an empty loop costs
        for k_index in range(n_full, n_visit):  # DIAGONAL tiles and a ragged last one
            acc, l, m, shift = fold_key_tile(
                acc, l, m, shift, q, K, V, stride_kt, stride_vt, b, h, i, j0, d,
                k_index * BLOCK_K, Tk, offset, qk_scale, HEAD_DIM, HEAD_DIM_PAD,
                BLOCK_K, CAUSAL, True, USE_TMA, DOT_PRECISION)  # fmt: skip
    # SKIP tiles (n_visit on) never come

    empty = l == 0.0  # a row that saw no key: o = 0 (acc is 0), lse = -inf
    l_safe = tl.where(empty, 1.0, l)  # divide by 1, not 0, for such a row
    o = acc / l_safe[:, None]  # (BLOCK_Q, HEAD_DIM_PAD)
    lse = (shift + tl.math.log2(l_safe)) * LN2  # l is relative to 2^shift: natural log
    lse = tl.where(empty, float("-inf"), lse)
    O += tile_offsets(b, h, i, d, stride_ob, stride_oh, stride_ot, stride_od)
    tl.store(O, o.to(O.dtype.element_ty), mask=q_mask)
    LSE += (b * H + h).to(tl.int64) * Tq  # lse is (B, H, Tq), dense
    tl.store(LSE + i, lse, mask=i < Tq)


def launch_settings(D, dtype, causal, Tq, tma):
    """Tiles, warps, stages, a register cap and the load path for one call, by head dim,
    dtype, mask and length, as measured on the H200 (the package's settings); ``tma``:
    whether the device and the layout allow descriptors."""
    pad = head_dim_pad(D)
    if dtype == torch.float32:  # fp32 dots: the textbook's tiles; larger ones spill
        tiles = (16, 32, 4, 2, None) if pad <= 64 else (16, 16, 4, 2, None)
        tma = False  # twice the bytes a tile: pointers
    elif pad == 64 and tma and not causal:  # 128 keys a step: no spill through TMA
        tiles = (128, 128, 8, 3, 128)
    elif pad <= 64:  # two 8-warp programs share an SM only at <= 128 registers a thread
        tiles = (128, 64, 8, 3, 128)
        tma = False  # as fast as TMA here, and cheaper for the host
    elif Tq <= 512 or (Tq <= 1024 and causal):  # few query tiles: smaller programs
        tiles = (64, 64, 4, 3, None)
    else:  # 128 x 128: half the K and V re-reads of 64-row tiles
        tiles = (128, 128, 8, 3, None)
    names = ("BLOCK_Q", "BLOCK_K", "num_warps", "num_stages", "maxnreg")
    return dict(zip(names, tiles), USE_TMA=tma)


def forward(q, k, v, causal=False, scale=None, *, alignment="upper_left"):
    """(o, lse): o (B, H, Tq, D) in q's dtype; lse (B, H, Tq) float32, natural log."""
    q, k, v = resolve_neg_bits(q, k, v)  # a negative view's memory holds -x
    (B, H, _, Tq, Tk, D), scale, offset = _check(q, k, v, causal, scale, alignment)
    units = kernel_scale(scale)  # τ = sign * unit; qk_scale = unit * log2(e) > 0
    o = torch.empty((B, H, Tq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
    strides = use_tma("auto", q, k, v)  # None where the device or the layout has no TMA
    settings = launch_settings(D, q.dtype, causal, Tq, tma=strides is not None)
    loads = (q, k, v)
    if settings["USE_TMA"]:  # descriptors of (1, 1, rows, HEAD_DIM_PAD) tiles
        rows = (settings["BLOCK_Q"], settings["BLOCK_K"], settings["BLOCK_K"])
        pad = head_dim_pad(D)
        loads = [tile_descriptor(x, s, n, pad) for x, s, n in zip(loads, strides, rows)]
    forward_kernel[head_batch_grid(triton.cdiv(Tq, settings["BLOCK_Q"]), H, B)](
        *loads, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        H, Tq, Tk, offset, units.qk_scale, HEAD_DIM=D, HEAD_DIM_PAD=head_dim_pad(D),
        CAUSAL=causal, SIGN=units.sign, DOT_PRECISION=dot_precision(q.dtype),
        MASKED_TILES=causal or Tk % settings["BLOCK_K"] != 0, **settings,
    )  # fmt: skip
    return o, lse
# --8<-- [end:rung]

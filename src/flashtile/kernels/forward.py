"""The FlashAttention forward pass as one Triton kernel, mirroring ``flashtile.reference.forward``.

One program owns BLOCK_Q query rows of one (batch, head). It loads its Q tile once, walks the K/V
tiles it needs while keeping the running max ``m``, the running sum ``l`` and the unnormalised
output ``acc`` in fp32 registers, and writes O and lse once. Nothing of size Tq x Tk touches HBM.

Compared with the PyTorch tier, the kernel adds only what the GPU forces on it:

* masks, because tiles are powers of two and Tq, Tk and the head dim need not be;
* pointer arithmetic from strides, so any layout works without a copy, in 64 bits;
* dtype handling: tensor-core dots in the input dtype with fp32 accumulation;
* base-2 exponentials, because the hardware computes 2**x: log2(e) is folded into the scale;
* raw-dot units: ``m`` is the max of the raw dots u = (sign · q)·k, and the scale is applied to the
  difference, p = exp2((u - m) · qk_scale). The largest score then gives exactly exp2(0) = 1 at any
  magnitude, and the backward, which recomputes u with the same dot, rebuilds the same P from the
  saved (m, l) (see ``flashtile.kernels._host.KernelScale``);
* one multiply-add per score in the loops: p = exp2(u · qk_scale - shift) with shift = fl(m · qk_scale),
  the shift's rounding taken out of l before it is stored, and an exact rerun of the program in the
  rare case of scores past about 1e7 (``fused_softmax_step``).

NaN and inf follow the package's one rule (docs: "flashtile.attention"): a row that sees a NaN or an
infinite score comes out NaN (lse NaN, or +inf for a +inf score, as torch.logsumexp gives); a row
that sees no key gives o = 0 and lse = -inf.

Attention sinks (``SINK``, one logit per query head in ``SINKS``): every row starts from the state after
one key whose score is its head's sink and whose value is zero (``sink_start``), as the reference tier's
``reference.sinks.sink_start_state``; the loops and the epilogue are unchanged. A row that sees no key then
gives o = 0 and lse = sink, and a sink of -inf is the empty start state, bit for bit. The entry points
pass them (``forward_with_spec``, ``varlen_forward_with_spec``); the launchers ``flash_attention`` and
``flash_attention_varlen`` take none.

Unequal head dims: q and k are HEAD_DIM = d_qk wide, v, acc and o HEAD_DIM_V = d_v wide, each padded to
its own power of two (``_host.head_dim_pad``): the QK^T dot contracts over d_qk's columns ``d``, the PV dot
carries d_v's columns ``dv`` (``reference.head_dims``).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._checks import (
    AttentionShape,
    check_attention_inputs,
    check_flag,
    check_int,
    check_max_seqlen,
    check_tensor,
    check_varlen_inputs,
    check_window,
)
from .._plans import cached_plan
from .._spec import AttentionSpec, check_spec, output_strides
from ._host import (
    KERNEL_DTYPES,
    LOG2E,
    KernelLaunch,
    check_kernel_device,
    document_order,
    dot_precision,
    head_batch_grid,
    head_dim_pad,
    heaviest_first_chunk,
    kernel_mask,
    kernel_scale,
    launch_settings,
    resident_programs,
    tile_descriptor,
    use_tma,
)
from ._jit import (
    SHIFT_LIMIT,
    apply_sign,
    band_full_key_tiles,
    delta_of_shift,
    first_key_tile,
    full_key_tiles,
    fused_softmax_step,
    last_key_tile,
    multiply_subtract,
    online_softmax_step,
    program_offset,
    program_tile,
    soft_cap,
    varlen_program,
)

LN2 = tl.constexpr(math.log(2.0))  # a constexpr global, so the jit function may read it


# --8<-- [start:inner]
@triton.jit
def _attend_key_tiles(
    acc, l, m, shift, largest, q,
    K, V, b, h_kv, stride_kt, stride_kd, stride_vt, stride_vd,
    i, d, dv, first_k_index, end_k_index, Tk, offset, qk_scale, band_lo, band_hi, unit,
    softcap, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FUSED: tl.constexpr, INTERPRETED: tl.constexpr, BAND: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    """Fold key tiles first_k_index .. end_k_index - 1 into (acc, l, m); i holds the
    query rows, d the columns of q and k (HEAD_DIM of them, d_qk), dv those of v and acc
    (HEAD_DIM_V, d_v).

    FUSED takes ``fused_softmax_step`` (one multiply-add per score; it also carries
    shift and largest), otherwise ``online_softmax_step`` (exact at any magnitude; shift
    and largest pass through).

    MASKED is a compile-time switch: the FULL tiles run the branch-free body, and only
    the tiles that straddle the diagonal or the end of the keys pay for the mask. With
    USE_TMA, K and V are tensor descriptors and the copy engine fetches each tile (zeros
    past Tk and D, no address arithmetic in the loop); otherwise they point at this
    (batch, KV head) and the tile's addresses are one 64-bit add away from offsets
    computed once, before the loop.

    BAND is the window's own masked body: tiles an edge of the band
    band_lo <= j - i <= band_hi (``reference.masks``) crosses are masked on both edges
    and at the end of the keys, two bounds per row on the tile's own column, in place of
    MASKED's (which the window's calls leave off; the exact rerun sets both). SOFTCAP
    replaces the raw dots by the capped scores in natural units (``soft_cap``), before
    the mask, and the caller passes qk_scale = log2(e). Both are compiled out when off.
    """
    j0 = tl.arange(0, BLOCK_K)
    k_offsets = (d[:, None].to(tl.int64) * stride_kd  # the K^T tile
                 + j0[None, :].to(tl.int64) * stride_kt)
    v_offsets = (j0[:, None].to(tl.int64) * stride_vt
                 + dv[None, :].to(tl.int64) * stride_vd)
    for k_index in range(first_k_index, end_k_index):
        k_start = k_index * BLOCK_K
        j = k_start + j0  # the key columns of this tile
        # --8<-- [start:tma_load]
        # (1, 1, BLOCK_K, pad) boxes of the (B, H_kv, Tk, D) tensors, zeros outside
        if USE_TMA:
            k = K.load([b, h_kv, k_start, 0]).reshape(BLOCK_K, HEAD_DIM_PAD)
            k = tl.trans(k)  # the K^T tile
            v = V.load([b, h_kv, k_start, 0]).reshape(BLOCK_K, HEAD_DIM_V_PAD)
        # --8<-- [end:tma_load]
        elif MASKED or BAND or HEAD_DIM != HEAD_DIM_PAD or HEAD_DIM_V != HEAD_DIM_V_PAD:
            # zeros past the keys and the head dims
            k_mask = (d[:, None] < HEAD_DIM) & (j[None, :] < Tk)
            v_mask = (j[:, None] < Tk) & (dv[None, :] < HEAD_DIM_V)
            k_at = K + k_start.to(tl.int64) * stride_kt + k_offsets
            v_at = V + k_start.to(tl.int64) * stride_vt + v_offsets
            k = tl.load(k_at, mask=k_mask, other=0.0)
            v = tl.load(v_at, mask=v_mask, other=0.0)
        else:
            # (HEAD_DIM_PAD, BLOCK_K) and (BLOCK_K, HEAD_DIM_V_PAD)
            k = tl.load(K + k_start.to(tl.int64) * stride_kt + k_offsets)
            v = tl.load(V + k_start.to(tl.int64) * stride_vt + v_offsets)
        # (BLOCK_Q, BLOCK_K) fp32 raw dots; S = unit * u
        u = tl.dot(q, k, input_precision=DOT_PRECISION)
        # the cap acts on the scaled score, before the mask: u becomes
        # s = c tanh(unit u / c)
        if SOFTCAP:
            u, _t = soft_cap(u, unit, softcap)
        # --8<-- [start:row_bound]
        if MASKED:  # padded keys, and keys past the diagonal, must score -inf, not 0
            # Key j is visible from row i when j < Tk and (causal) j <= i + offset: one
            # bound per row on the tile's own column 0..BLOCK_K-1, so that each score
            # costs one compare against a row value
            last = Tk - 1 - k_start  # the last column inside the keys
            if CAUSAL:
                # and the last one row i sees
                last = tl.minimum(i + (offset - k_start), last)
                u = tl.where(j0[None, :] <= last[:, None], u, float("-inf"))
            else:
                u = tl.where(j0[None, :] <= last, u, float("-inf"))
        # --8<-- [end:row_bound]
        # a tile the window's band crosses: both its edges, and the end of the keys, as
        # bounds per row on the tile's own column, like the causal bound above
        if BAND:
            first = i + (band_lo - k_start)
            last = tl.minimum(i + (band_hi - k_start), Tk - 1 - k_start)
            inside = (j0[None, :] >= first[:, None]) & (j0[None, :] <= last[:, None])
            u = tl.where(inside, u, float("-inf"))
        if FUSED:
            acc, l, m, shift, largest = fused_softmax_step(
                acc, l, m, shift, largest, u, v, qk_scale, DOT_PRECISION, INTERPRETED)
        else:
            acc, l, m = online_softmax_step(acc, l, m, u, v, qk_scale, DOT_PRECISION)
    return acc, l, m, shift, largest
# --8<-- [end:inner]


# --8<-- [start:sink_start]
@triton.jit
def sink_start(sink, unit, qk_scale, BLOCK_Q: tl.constexpr, SOFTCAP: tl.constexpr,
               INTERPRETED: tl.constexpr):  # fmt: skip
    """(m, l, shift, largest) of rows that have seen their head's ``sink`` (float32,
    loaded at the program's start) and no key: the state after one column whose score is
    the sink and whose value is zero (acc stays 0).

    m is in the loop's units: raw dots u with S = unit * u, so m = sink / unit; with a
    softcap the loop runs on capped scores in natural units, and the sink (never capped)
    is m = sink. l is the sink's p as ``fused_softmax_step`` counts it, relative to
    2^shift: exp2(m * qk_scale - shift) = 2^delta, 1 in the units of lse. A sink of -inf
    gives (-inf, 0, -inf, 0): the empty state, bit for bit.
    """
    if not SOFTCAP:
        sink = sink / unit  # natural units to raw dots: S = unit * u
    m = tl.full([BLOCK_Q], 0.0, dtype=tl.float32) + sink
    shift = m * qk_scale  # fl(m * qk_scale), as the loop rounds it
    shift_safe = tl.where(m == float("-inf"), 0.0, shift)  # -inf: p = 0, l = 0
    l = tl.math.exp2(multiply_subtract(m, qk_scale, shift_safe, INTERPRETED))
    return m, l, shift, tl.abs(shift_safe)
# --8<-- [end:sink_start]


@triton.jit
def _forward_kernel(
    Q, K, V, O, ROW_STATS, SINKS,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    H, group, Tq, Tk, offset, qk_scale, n_rows, chunk, band_lo, band_hi, unit, softcap,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, SIGN: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
    HEAVIEST_FIRST: tl.constexpr, MASKED_TILES: tl.constexpr, BAND: tl.constexpr, SOFTCAP: tl.constexpr,
    CU_Q=None, CU_K=None, ORDER=None, VARLEN: tl.constexpr = False, STATS: tl.constexpr = True,
    SINK: tl.constexpr = False,
):
    # --8<-- [start:program]
    # under causal, the longest query tiles (most key tiles) launch first, so the short
    # ones fill the tail
    q_index, h, b = program_tile(chunk, HEAVY_TILE_LAST=CAUSAL,
                                 HEAVIEST_FIRST=HEAVIEST_FIRST)
    h_kv = h // group  # GQA: query head h reads the key/value head of its group, no copy
    q_start = q_index * BLOCK_Q
    q_end = tl.minimum(q_start + BLOCK_Q, Tq)
    i = q_start + tl.arange(0, BLOCK_Q)  # the query rows of this tile
    d = tl.arange(0, HEAD_DIM_PAD)  # the columns of q and k
    dv = tl.arange(0, HEAD_DIM_V_PAD)  # of v, acc and o: d_v may differ from d_qk
    # --8<-- [end:program]
    # --8<-- [start:varlen]
    # packed documents: the grid's third axis is the document, read from cu_seqlens
    # (varlen_program)
    if VARLEN:
        q_index, q_doc, k_doc, Tq, Tk, offset, band_lo, band_hi = varlen_program(
            CU_Q, CU_K, ORDER, b, Tq, Tk, offset, band_lo, band_hi, BLOCK_Q,
            OWN_KEYS=False, HEAVY_TILE_LAST=CAUSAL)
        # past this document's query tiles (or a document without queries): nothing to do
        if q_index < 0:
            return
        q_start = q_index * BLOCK_Q
        q_end = tl.minimum(q_start + BLOCK_Q, Tq)
        i = q_start + tl.arange(0, BLOCK_Q)
        # the document's first token becomes token 0: b's strides are 0
        Q += q_doc.to(tl.int64) * stride_qt
        O += q_doc.to(tl.int64) * stride_ot
        K += k_doc.to(tl.int64) * stride_kt
        V += k_doc.to(tl.int64) * stride_vt
    # --8<-- [end:varlen]
    if SINK:  # the head's sink, loaded before q's tile so that its latency hides behind it
        sink = tl.load(SINKS + h).to(tl.float32)

    # --8<-- [start:pointers]
    q_mask = (i[:, None] < Tq) & (d[None, :] < HEAD_DIM)
    # Q, K, V are TMA descriptors of the (B, H, T, D) tensors: tiles by coordinates
    if USE_TMA:
        q = Q.load([b, h, q_start, 0]).reshape(BLOCK_Q, HEAD_DIM_PAD)
        k_base = K
        v_base = V
    else:  # Q, K, V are pointers: move them to this (batch, head) in 64 bits
        q_base = Q + program_offset(b, stride_qb) + program_offset(h, stride_qh)
        k_base = K + program_offset(b, stride_kb) + program_offset(h_kv, stride_kh)
        v_base = V + program_offset(b, stride_vb) + program_offset(h_kv, stride_vh)
        q_ptrs = (q_base + i[:, None].to(tl.int64) * stride_qt
                  + d[None, :].to(tl.int64) * stride_qd)
        # loaded once, reused for every key tile
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    # sign(τ) · q, so that the raw dots u order the scores as S = τ q·k does
    q = apply_sign(q, SIGN)
    # --8<-- [end:pointers]

    # --8<-- [start:state]
    m = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM_V_PAD], dtype=tl.float32)  # as wide as v
    # fl(m * qk_scale), what p subtracts
    shift = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    # max |shift| a row has used, for the check below
    largest = tl.zeros([BLOCK_Q], dtype=tl.float32)
    if SINK:  # the rows have seen one key already, the sink, whose value is zero
        m, l, shift, largest = sink_start(sink, unit, qk_scale, BLOCK_Q, SOFTCAP,
                                          INTERPRETED)
    # --8<-- [end:state]

    first_k_index = 0
    if BAND:  # a window: the run first .. last of key tiles; the FULL ones in its middle, unmasked
        first_k_index = first_key_tile(q_start, Tk, BLOCK_K, band_lo)  # tiles before it are never loaded
        n_key_tiles = tl.maximum(last_key_tile(q_end, Tk, BLOCK_K, band_hi), first_k_index)  # nor after it
        full_first, full_end = band_full_key_tiles(q_start, q_end, Tk, BLOCK_K, band_lo, band_hi, first_k_index,
                                                   n_key_tiles)  # fmt: skip
        acc, l, m, shift, largest = _attend_key_tiles(  # the band's left edge crosses these
            acc, l, m, shift, largest, q, k_base, v_base, b, h_kv, stride_kt, stride_kd, stride_vt, stride_vd,
            i, d, dv, first_k_index, full_first, Tk, offset, qk_scale, band_lo, band_hi, unit, softcap,
            BLOCK_K, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD,
            MASKED=False, CAUSAL=False, USE_TMA=USE_TMA, DOT_PRECISION=DOT_PRECISION,
            FUSED=True, INTERPRETED=INTERPRETED, BAND=True, SOFTCAP=SOFTCAP,
        )
        acc, l, m, shift, largest = _attend_key_tiles(  # FULL: no mask
            acc, l, m, shift, largest, q, k_base, v_base, b, h_kv, stride_kt, stride_kd, stride_vt, stride_vd,
            i, d, dv, full_first, full_end, Tk, offset, qk_scale, band_lo, band_hi, unit, softcap,
            BLOCK_K, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD,
            MASKED=False, CAUSAL=False, USE_TMA=USE_TMA,
            DOT_PRECISION=DOT_PRECISION, FUSED=True, INTERPRETED=INTERPRETED, SOFTCAP=SOFTCAP,
        )
        acc, l, m, shift, largest = _attend_key_tiles(  # the right edge, and a ragged last key tile
            acc, l, m, shift, largest, q, k_base, v_base, b, h_kv, stride_kt, stride_kd, stride_vt, stride_vd,
            i, d, dv, full_end, n_key_tiles, Tk, offset, qk_scale, band_lo, band_hi, unit, softcap,
            BLOCK_K, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD,
            MASKED=False, CAUSAL=False, USE_TMA=USE_TMA, DOT_PRECISION=DOT_PRECISION,
            FUSED=True, INTERPRETED=INTERPRETED, BAND=True, SOFTCAP=SOFTCAP,
        )
        delta = delta_of_shift(m, shift, l, qk_scale, INTERPRETED)  # the shift's rounding, which (acc, l) carry
    else:
        # --8<-- [start:loops]
        if CAUSAL:
            n_full_tiles = full_key_tiles(q_start, Tk, BLOCK_K, offset)
            # tiles past it are never loaded
            n_key_tiles = last_key_tile(q_end, Tk, BLOCK_K, offset)
        else:
            n_full_tiles = Tk // BLOCK_K  # every tile but a ragged last one
            n_key_tiles = tl.cdiv(Tk, BLOCK_K)
        acc, l, m, shift, largest = _attend_key_tiles(
            acc, l, m, shift, largest, q, k_base, v_base, b, h_kv,
            stride_kt, stride_kd, stride_vt, stride_vd,
            i, d, dv, 0, n_full_tiles, Tk, offset, qk_scale, band_lo, band_hi, unit,
            softcap, BLOCK_K, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD,
            MASKED=False, CAUSAL=CAUSAL, USE_TMA=USE_TMA, DOT_PRECISION=DOT_PRECISION,
            FUSED=True, INTERPRETED=INTERPRETED, SOFTCAP=SOFTCAP,
        )
        # causal, or Tk not a multiple of BLOCK_K; otherwise not compiled (an empty loop
        # costs time)
        if MASKED_TILES:
            acc, l, m, shift, largest = _attend_key_tiles(
                acc, l, m, shift, largest, q, k_base, v_base, b, h_kv,
                stride_kt, stride_kd, stride_vt, stride_vd,
                i, d, dv, n_full_tiles, n_key_tiles, Tk, offset, qk_scale, band_lo,
                band_hi, unit, softcap,
                BLOCK_K, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD,
                MASKED=True, CAUSAL=CAUSAL, USE_TMA=USE_TMA, DOT_PRECISION=DOT_PRECISION,
                FUSED=True, INTERPRETED=INTERPRETED, SOFTCAP=SOFTCAP,
            )
        # the shift's rounding, which (acc, l) carry
        delta = delta_of_shift(m, shift, l, qk_scale, INTERPRETED)
        # --8<-- [end:loops]

    # --8<-- [start:exact_rerun]
    out = (O + program_offset(b, stride_ob) + program_offset(h, stride_oh)
           + i[:, None].to(tl.int64) * stride_ot + dv[None, :].to(tl.int64) * stride_od)
    o_mask = (i[:, None] < Tq) & (dv[None, :] < HEAD_DIM_V)
    rows = ROW_STATS + program_offset(b * H + h, Tq) + i  # ROW_STATS is (3, B, H, Tq), contiguous: lse, m, l
    if VARLEN:  # ROW_STATS is (3, H, total_q): n_rows = H * total_q, the document's rows from q_doc on
        rows = ROW_STATS + program_offset(h, n_rows // H) + q_doc + i
    _write_rows(acc, l, m, delta, qk_scale, out, rows, n_rows, o_mask, i < Tq, STATS)  # the fast result, at once
    if tl.max(largest, 0) >= SHIFT_LIMIT:  # a score past about 10^7, where 2^delta is no longer harmless
        # Rare, decided once per program, after the fast rows are on their way: the check then waits for
        # nothing (deciding first and writing in each branch was slower: sweeps/forward-ab-2.json). Start over
        # with the subtract-first update, exact at any magnitude, over every key tile (all through the
        # masked body: this path only has to be right), and write every row again. The barrier orders the
        # two writes of an element even where the two epilogues give it to different threads.
        tl.debug_barrier()
        m = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_Q], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q, HEAD_DIM_V_PAD], dtype=tl.float32)
        if SINK:  # the exact step keeps l relative to 2^(m * qk_scale): the sink counts 1 (0 if -inf;
            # read from m, not l: the fast start's l underflows to 0 for a sink past about 2^31)
            m, l, shift, largest = sink_start(sink, unit, qk_scale, BLOCK_Q, SOFTCAP, INTERPRETED)
            l = tl.where(m == float("-inf"), 0.0, 1.0)
        acc, l, m, shift, largest = _attend_key_tiles(
            acc, l, m, shift, largest, q, k_base, v_base, b, h_kv, stride_kt, stride_kd, stride_vt, stride_vd,
            i, d, dv, first_k_index, n_key_tiles, Tk, offset, qk_scale, band_lo, band_hi, unit, softcap,
            BLOCK_K, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD,
            MASKED=True, CAUSAL=CAUSAL, USE_TMA=USE_TMA,
            DOT_PRECISION=DOT_PRECISION, FUSED=False, INTERPRETED=INTERPRETED, BAND=BAND, SOFTCAP=SOFTCAP,
        )
        _write_rows(acc, l, m, tl.zeros([BLOCK_Q], dtype=tl.float32), qk_scale, out, rows, n_rows, o_mask, i < Tq,
                    STATS)
    # --8<-- [end:exact_rerun]


# --8<-- [start:epilogue]
@triton.jit
def _write_rows(acc, l, m, delta, qk_scale, out, rows, n_rows, o_mask, row_ok,
                STATS: tl.constexpr):
    """o = acc / l into ``out``; with STATS, lse, m and l into ROW_STATS at ``rows``
    (the 3 planes n_rows apart). A call that keeps no statistics (no gradient recorded,
    no lse returned) launches without them.

    (acc, l) carry a factor 2^delta, the fused path's rounding of its shift
    (``delta_of_shift``; 0 after the exact path): it cancels in o = acc / l, and
    l * 2^-delta is l in the units of lse and the stats.
    """
    # True only for a row that sees no key (a NaN l is not 0: that row stays NaN)
    empty = l == 0.0
    # such a row keeps acc = 0, so o = 0 rather than 0 / 0
    l_safe = tl.where(empty, 1.0, l)
    o = acc / l_safe[:, None]
    # a factor within 2^(+-1/2): the row sum the backward takes
    l = l * tl.math.exp2(-delta)
    l_safe = tl.where(empty, 1.0, l)
    # natural units: unit * m + ln l, never past them
    lse = m * (qk_scale * LN2) + tl.math.log2(l_safe) * LN2
    # a +inf score: lse = +inf, as torch.logsumexp says
    lse = tl.where(m == float("inf"), m, lse)
    lse = tl.where(empty, float("-inf"), lse)
    tl.store(out, o.to(out.dtype.element_ty), mask=o_mask)
    if STATS:
        tl.store(rows, lse, mask=row_ok)
        # for the backward: the final (m, l), m in raw-dot units
        tl.store(rows + n_rows, m, mask=row_ok)
        tl.store(rows + n_rows + n_rows, l, mask=row_ok)
# --8<-- [end:epilogue]


# --8<-- [start:config]
LAUNCH_SETTINGS = ("block_q", "block_k", "num_warps", "num_stages")  # what a caller may override


@functools.cache  # a pure function of its arguments, asked on every call: look it up once
def forward_config(head_dim: int, dtype: torch.dtype, interpreted: bool = False, causal: bool = False,
                   Tq: int = 4096, tma: bool = True, head_dim_v: int | None = None) -> dict:  # fmt: skip
    """Tile sizes, launch settings and the load path, measured on the H200 (sweeps/forward-tma.json,
    forward-wide-d64.json, forward-register-cap-probe.json).

    ``tma``: "auto" loads through TMA descriptors where the layout allows, False always through
    pointers. At D = 64 both paths run equally fast, and pointers cost the host less per call; at
    D = 128 TMA with 128 x 128 tiles wins from T = 2k, short sequences (Tq <= 1024) favour 64 x 64
    tiles with 4 warps, through TMA too (sweeps/forward-tma.json). fp32 takes twice the bytes per tile
    and stays on the pointer path, as does D = 256. At D = 64 without a mask, 128 x 128 tiles through
    TMA under the 128-register cap (two programs an SM, no spills) ran faster than 128 x 64 at T = 2k
    (sweeps/forward-wide-d64.json); through pointers the same tiles spill, and under causal they spill
    on either path, so those keep 128 x 64. ``tma=False`` asks for the best settings without
    descriptors, for a layout or a device that cannot have them. The interpreter (CPU tensors)
    runs programs one after another, where fewer, larger tiles are faster; it takes TMA where it can,
    so CPU tests cover that path.

    ``head_dim`` is d_qk, ``head_dim_v`` the value head dim d_v where the call has one (None: d_qk).
    The q and k tiles are d_qk wide, acc and v d_v wide. Where d_v pads to less than d_qk, the tiles
    hold less than the equal-dims call's and fit one more pipeline stage: at 192/128 (DeepSeek-V3's
    prefill, q.k 256 wide) 128 x 64 tiles in 3 stages ran x1.43 (8k) and x1.52 (2k) faster than the
    D = 256 settings, through TMA; at 128/64 128 x 64 tiles on 4 warps ran x1.05 to x1.08 faster than
    D = 128's, from 2k tokens (an H100, sweeps/unequal-configs.json). Any other pair takes the settings
    of the wider of the two (64/128 those of D = 128), whose equal-dims call holds at least its tiles.
    """
    # --8<-- [start:settings]
    pad_v = head_dim_pad(head_dim if head_dim_v is None else head_dim_v)
    pad = max(head_dim_pad(head_dim), pad_v)
    if interpreted:
        return dict(block_q=32, block_k=32, num_warps=4, num_stages=1, tma="auto")
    if dtype == torch.float32:
        if pad <= 64:
            return dict(block_q=128, block_k=64, num_warps=8, num_stages=3, tma=False)
        return dict(block_q=64, block_k=32, num_warps=4, num_stages=2, tma=False)
    # a narrower v: one more stage of k and v tiles fits (sweeps/unequal-configs.json)
    if pad_v < pad and pad == 256:
        return dict(block_q=128, block_k=64, num_warps=8, num_stages=3, tma="auto")
    if pad_v < pad and pad == 128 and Tq > 1024:
        return dict(block_q=128, block_k=64, num_warps=4, num_stages=3, tma="auto")
    # fewer, longer key steps; the cap keeps two programs an SM
    if pad == 64 and not causal and tma:
        return dict(block_q=128, block_k=128, num_warps=8, num_stages=3, tma="auto",
                    maxnreg=128)
    # two programs of 8 warps share an SM only at <= 128 registers a thread: capped there
    if pad <= 64:
        return dict(block_q=128, block_k=64, num_warps=8, num_stages=3, tma=False,
                    maxnreg=128)
    if pad == 128 and (Tq <= 512 or (Tq <= 1024 and causal)):
        return dict(block_q=64, block_k=64, num_warps=4, num_stages=3, tma="auto")
    if pad == 128:
        return dict(block_q=128, block_k=128, num_warps=8, num_stages=3, tma="auto")
    # D = 256: 128 x 64, 2 stages
    return dict(block_q=128, block_k=64, num_warps=8, num_stages=2, tma=False)
    # --8<-- [end:settings]
# --8<-- [end:config]


# --8<-- [start:launcher]
class ForwardPlan(NamedTuple):
    """Everything about a launch that follows from the inputs' layout and the flags,
    worked out once."""

    out_shape: tuple  # (B, H, Tq, d_v) of o
    out_strides: tuple  # o's (``_spec.output_strides``): q's layout where q is dense
    stats_shape: tuple  # (3, B, H, Tq) of the row statistics (lse, m, l)
    # q's, kept: reading q.device makes a new device object on every call
    device: torch.device
    # o has q's shape and strides (``_spec.output_strides``): torch.empty_like(q) gives
    # it
    o_like_q: bool
    # grid, the arguments after the tensors (strides, sizes, offset, qk_scale, rows),
    # settings
    launch: KernelLaunch
    # the same kernel storing o only (STATS=False), for calls that keep no lse
    launch_without_stats: KernelLaunch
    # (strides, tile rows, tile width) of each of q, k, v's descriptors, or None for
    # pointers
    tma: tuple | None
    return_stats: bool
    has_sinks: bool  # the spec's: the kernel starts every row from its head's sink

    def run(self, q, k, v, stats: bool = True,
            sinks=None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """``forward_with_plan(self, q, k, v, stats, sinks)``."""
        return forward_with_plan(self, q, k, v, stats, sinks)


def make_forward_plan(q, k, v, *, spec: AttentionSpec, return_stats: bool, block_q=None,
                      block_k=None, num_warps=None, num_stages=None,
                      tma=None) -> ForwardPlan:  # fmt: skip
    """Derive one call's launch from its checked options (``_spec.check_spec``); raises
    on a layout, a device or a launch setting the kernel cannot take."""
    shape = check_attention_inputs(q, k, v, dtypes=KERNEL_DTYPES,
                                   unequal_head_dims=True)  # fmt: skip
    d_v = v.shape[3]  # v, acc and o: d_v wide; q and k: D = d_qk
    mask = kernel_mask(spec.mask, shape.Tq, shape.Tk)
    softcap = spec.softcap
    causal = mask.causal  # a window that is plain causal (or no mask) runs as such
    tma = None if tma is None else check_flag("tma", tma)
    check_kernel_device("q", q)
    # so the cache stays small
    length_class = 512 if shape.Tq <= 512 else (1024 if shape.Tq <= 1024 else 4096)
    interpreted = q.device.type == "cpu"
    config = forward_config(shape.D, q.dtype, interpreted, causal, length_class,
                            head_dim_v=d_v)  # fmt: skip
    strides = use_tma(config["tma"] if tma is None else tma, q, k, v)
    # settings measured with descriptors, which this call lacks
    if strides is None and config["tma"] == "auto":
        config = forward_config(shape.D, q.dtype, interpreted, causal, length_class,
                                tma=False, head_dim_v=d_v)  # fmt: skip
    block_q, block_k, num_warps, num_stages, own_settings = launch_settings(
        config, block_q, block_k, num_warps, num_stages)
    B, H, H_kv, Tq, Tk, D = shape
    units = kernel_scale(spec.scale)
    offset = spec.mask.offset(Tq, Tk)
    # capped scores are in natural units (soft_cap)
    qk_scale = units.qk_scale if softcap is None else LOG2E
    n_tiles = -(-Tq // block_q)  # cdiv in plain Python: triton.cdiv is a jit function
    # a cap measured with these settings only
    maxnreg = config.get("maxnreg") if own_settings else None
    # q's layout where q is dense (a model's (B, T, H, D) view), else contiguous
    o_strides = output_strides(q, d_v)
    # the programs of one query head stream its kv head's K and V, which the group's
    # heads share
    plane_bytes = Tk * (D + d_v) * q.element_size() // shape.group
    resident = resident_programs(num_warps, maxnreg)
    chunk = heaviest_first_chunk(causal, plane_bytes, B * H, B * H * n_tiles, resident,
                                 q.device, shape.group)  # fmt: skip

    def launch(stats: bool) -> KernelLaunch:
        return KernelLaunch(
            _forward_kernel,
            grid=head_batch_grid(n_tiles, H, B),
            scalars=(*q.stride(), *k.stride(), *v.stride(), *o_strides, H, shape.group,
                     Tq, Tk, offset, qk_scale, B * H * Tq, max(chunk, 1), *mask.band,
                     units.unit, 1.0 if softcap is None else softcap),  # fmt: skip
            constexprs=dict(HEAD_DIM=D, HEAD_DIM_PAD=head_dim_pad(D), HEAD_DIM_V=d_v,
                            HEAD_DIM_V_PAD=head_dim_pad(d_v), BLOCK_Q=block_q,
                            BLOCK_K=block_k, CAUSAL=causal, SIGN=units.sign,
                            USE_TMA=strides is not None,
                            DOT_PRECISION=dot_precision(q.dtype),
                            INTERPRETED=interpreted,
                            HEAVIEST_FIRST=chunk > 0,
                            MASKED_TILES=causal or Tk % block_k != 0, BAND=mask.banded,
                            SOFTCAP=softcap is not None,
                            CU_Q=None, CU_K=None, ORDER=None, VARLEN=False, STATS=stats,
                            SINK=spec.has_sinks),  # fmt: skip
            num_warps=num_warps,
            num_stages=num_stages,
            maxnreg=maxnreg,
            # o, the row statistics and the sinks (o again for the statistics without
            # them; None for absent sinks), allocated on every call: the sinks as a
            # float32 copy
            fresh_outputs=3,
            # kept under q, k and v's layouts (flash_attention, and attention's kept
            # call)
            plan_keyed=True,
        )

    # the descriptors' tile widths: q, k, v
    pads = (head_dim_pad(D), head_dim_pad(D), head_dim_pad(d_v))
    tiles = (block_q, block_k, block_k)
    return ForwardPlan(
        out_shape=(B, H, Tq, d_v),
        out_strides=o_strides,
        stats_shape=(3, B, H, Tq),
        device=q.device,
        o_like_q=o_strides == tuple(q.stride()),
        launch=launch(True),
        launch_without_stats=launch(False),
        tma=None if strides is None else tuple(zip(strides, tiles, pads)),
        return_stats=return_stats,
        has_sinks=spec.has_sinks,
    )


# checked_forward_plan's, as flash_attention keys its plans
LAUNCHER_OPTIONS = ("causal", "scale", "alignment", "window", "softcap", "return_stats",
                    "block_q", "block_k", "num_warps", "num_stages", "tma")


def checked_forward_plan(q, k, v, *, causal, scale, alignment, window, softcap,
                         return_stats, block_q, block_k, num_warps, num_stages,
                         tma) -> ForwardPlan:  # fmt: skip
    """``flash_attention``'s plan: its arguments checked into one spec
    (``_spec.check_spec``), then ``make_forward_plan``; raises on anything the kernel
    cannot take."""
    shape = check_attention_inputs(q, k, v, dtypes=KERNEL_DTYPES,
                                   unequal_head_dims=True)  # fmt: skip
    spec = check_spec(shape, q.dtype, causal=causal, scale=scale, alignment=alignment,
                      window=window, softcap=softcap, causal_name="causal")
    return make_forward_plan(q, k, v, spec=spec,
                             return_stats=check_flag("return_stats", return_stats),
                             block_q=block_q, block_k=block_k, num_warps=num_warps,
                             num_stages=num_stages, tma=tma)  # fmt: skip


def flash_attention(
    q, k, v, *, causal=False, scale=None, alignment="upper_left", block_q=None,
    block_k=None, num_warps=None, num_stages=None, return_stats=False, tma=None,
    window=None, softcap=None,
):
    """Attention forward on the GPU, without materialising the Tq x Tk score matrix.

    Args:
        q: (B, H, Tq, D); k: (B, H_kv, Tk, D), v: (B, H_kv, Tk, d_v) with H a multiple
            of H_kv. fp16, bf16 or fp32 (fp32 dots in full fp32, never tf32), any
            strides, 1 <= D, d_v <= 256.
        causal, alignment: the causal mask of ``flashtile.reference.causal``. Every
            argument after v is a keyword.
        scale: τ, multiplies Q K^T; defaults to 1/sqrt(D). Zero and negative values are
            allowed.
        block_q, block_k: tile sizes (powers of two >= 16); defaults from
            ``forward_config``.
        num_warps, num_stages: launch settings, for benchmarks; defaults from
            ``forward_config``.
        return_stats: also return the final (m, l) of every row, the exact hand-off to
            ``flash_attention_backward(..., stats=...)``.
        tma: load tiles through TMA descriptors (True), through pointers (False), or let
            the launcher choose (None: ``forward_config``'s choice, where the strides
            and the device allow it).
        window: None or (left, right), the sliding window of
            ``flashtile.reference.masks``: query i sees keys
            i + offset - left .. i + offset + right, -1 unbounded, the right side capped
            at 0 when causal. Key tiles outside the band are never loaded, FULL ones run
            without a mask.
        softcap: None or s > 0: each scaled score x becomes s * tanh(x / s) before the
            mask and the softmax.

    Returns:
        o: (B, H, Tq, d_v) in q's dtype, laid out as q is where q is dense (for q a
        (B, H, T, D) view of a (B, T, H, D) tensor, o is one too, so o.transpose(1, 2)
        needs no copy), contiguous otherwise. lse: (B, H, Tq) fp32, natural log; a row
        that sees no key gets o = 0 and lse = -inf. With return_stats, also stats:
        (2, B, H, Tq) fp32, stats[0] = m (the row max of the raw dots sign(τ)·q·k; with
        a softcap, the capped score in natural units) and stats[1] = l.
    """
    # checked before it keys the plans: (True, 0) and (1, 0) hash alike
    if window is not None:
        window = check_window(window)
    plan = cached_plan(checked_forward_plan, (q, k, v), causal, scale, alignment,
                       window, softcap, return_stats, block_q, block_k, num_warps,
                       num_stages, tma, names=LAUNCHER_OPTIONS)  # fmt: skip
    o, row_stats = forward_with_plan(plan, q, k, v)
    if plan.return_stats:
        return o, row_stats[0], row_stats[1:]
    return o, row_stats[0]


def forward_with_spec(
    q, k, v, spec: AttentionSpec, sinks=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, lse, stats) of a call whose options are checked already
    (``flashtile.attention``'s): the plan kept per layout and spec; ``sinks`` the (H,)
    sinks where ``spec.has_sinks``."""
    plan = cached_plan(make_forward_plan, (q, k, v), spec, True,
                       names=("spec", "return_stats"))  # fmt: skip
    o, row_stats = forward_with_plan(plan, q, k, v, sinks=sinks)
    return o, row_stats[0], row_stats[1:]


def forward_with_plan(
    plan: ForwardPlan, q, k, v, stats: bool = True, sinks=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run one call's kernel from its plan: o, and row_stats (3, B, H, Tq) float32 =
    (lse, m, l), or None without ``stats`` (a call that records no gradient and returns
    no lse: one allocation, three stores fewer a row). ``sinks``: the (H,) sinks of a
    plan with ``has_sinks`` (checked by the caller), passed to the kernel as a fresh
    float32 copy, in the one dtype and alignment the plan's kernel was compiled for.

    One buffer for the three row statistics costs one allocation where three tensors
    would cost three; lse = row_stats[0] and stats = row_stats[1:] are views of it, made
    only where a caller needs them.
    """
    # what the kernel reads tiles through: the tensors, or TMA descriptors of them
    loads = (q, k, v)
    if plan.tma is not None:
        loads = tuple(tile_descriptor(x, strides, rows, pad)
                      for x, (strides, rows, pad) in zip(loads, plan.tma))
    # torch.empty_like is the cheapest allocation a call can make (no size or dtype to
    # parse), and where q is dense (and o as wide as q) it gives exactly q's strides,
    # which the plan passed to the kernel
    if plan.o_like_q:
        o = torch.empty_like(q)
    else:
        o = torch.empty_strided(plan.out_shape, plan.out_strides, dtype=q.dtype,
                                device=plan.device)  # fmt: skip
    # without sinks, None: the kernel is compiled with SINKS a constant it never reads,
    # and the launch passes one pointer fewer (each costs a driver call on the host)
    sinks = sinks.to(torch.float32, copy=True) if plan.has_sinks else None
    if not stats:  # and for ROW_STATS
        plan.launch_without_stats(*loads, o, o, sinks)
        return o, None
    row_stats = torch.empty(plan.stats_shape, dtype=torch.float32, device=plan.device)
    plan.launch(*loads, o, row_stats, sinks)
    return o, row_stats
# --8<-- [end:launcher]


def varlen_forward_config(head_dim: int, dtype: torch.dtype, interpreted: bool, causal: bool,
                          max_seqlen_q: int) -> dict:  # fmt: skip
    """The packed documents' launch settings: ``forward_config``'s for the pointer path at the longest document's
    length class. On the benchmark's packed case (8 documents in 16k, D = 128, bf16) its 128 x 128 tiles ran
    fastest of seven settings, 3.5 % ahead of 128 x 64 (bench/results/sweeps/varlen-configs.json)."""
    length_class = 512 if max_seqlen_q <= 512 else (1024 if max_seqlen_q <= 1024 else 4096)
    return forward_config(head_dim, dtype, interpreted, causal, length_class, tma=False)


def flash_attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, scale=None,
    alignment="upper_left", block_q=None, block_k=None, num_warps=None, num_stages=None, window=None,
    softcap=None, checked=False,
):  # fmt: skip
    """Attention within each packed document on the GPU: one program per (query tile, head, document).

    Args:
        q: (total_q, H, D); k: (total_k, H_kv, D), v: (total_k, H_kv, d_v), H a multiple of H_kv; fp16, bf16
            or fp32, any strides.
        cu_seqlens_q, cu_seqlens_k: int32 (n_documents + 1,) on q's device, 0 first, non-decreasing, ending at
            total_q and total_k (``flashtile.reference.varlen``).
        max_seqlen_q, max_seqlen_k: at least the longest document's query and key counts; the grid has
            cdiv(max_seqlen_q, block_q) query tiles per (head, document), and the programs past a document's
            tiles return at once.
        causal, scale, alignment, window, softcap: as ``flash_attention``, applied to each document with its
            own Tq and Tk. Key tiles outside a document's band are never loaded, FULL ones run unmasked.
        block_q, block_k, num_warps, num_stages: as ``flash_attention``; defaults from ``varlen_forward_config``,
            always on the pointer path (no TMA: a document's tiles start at any token).
        checked: True when the caller has already run ``check_varlen_inputs`` and the max_seqlen checks on these
            tensors (``flashtile.attention_varlen`` does): the launcher then reads nothing on the host.

    Returns:
        o (total_q, H, d_v) contiguous in q's dtype, lse (H, total_q) float32, and stats (2, H, total_q): the
        final (m, l) of every row, the hand-off to ``flash_attention_varlen_backward``.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, rank=3, dtypes=KERNEL_DTYPES)
    if not checked:
        _, _, _, documents = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
        check_max_seqlen("max_seqlen_q", max_seqlen_q, max((e - s for (s, e), _ in documents), default=0))
        check_max_seqlen("max_seqlen_k", max_seqlen_k, max((e - s for _, (s, e) in documents), default=0))
    max_q = check_int("max_seqlen_q", max_seqlen_q, minimum=1)
    shape = AttentionShape(1, q.shape[1], k.shape[1], q.shape[0], k.shape[0], q.shape[2])
    spec = check_spec(shape, q.dtype, causal=causal, scale=scale, alignment=alignment, window=window, softcap=softcap,
                      causal_name="causal")  # fmt: skip
    return varlen_forward_with_spec(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_q, spec=spec,
                                    block_q=block_q, block_k=block_k, num_warps=num_warps,
                                    num_stages=num_stages)  # fmt: skip


def varlen_forward_with_spec(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q: int, spec: AttentionSpec,
                             block_q=None, block_k=None, num_warps=None, num_stages=None, sinks=None):  # fmt: skip
    """``flash_attention_varlen`` on inputs and cu_seqlens checked already (``flashtile.attention_varlen``'s), with
    the call's checked options: (o, lse, stats). ``sinks``: the (H,) sinks where ``spec.has_sinks`` (checked by
    the caller): every row starts from its head's sink (``sink_start``)."""
    total_q, H, D = q.shape
    H_kv, d_v = k.shape[1], v.shape[2]
    check_kernel_device("q", q)
    mask = kernel_mask(spec.mask)  # the sides: each document's programs work out its own band
    softcap = spec.softcap
    left, right = mask.band
    config = varlen_forward_config(max(D, d_v), q.dtype, q.device.type == "cpu", mask.causal, max_seqlen_q)
    block_q, block_k, num_warps, num_stages, own_settings = launch_settings(config, block_q, block_k, num_warps,
                                                                            num_stages)  # fmt: skip
    maxnreg = config.get("maxnreg") if own_settings else None
    units = kernel_scale(spec.scale)
    qk_scale = units.qk_scale if softcap is None else LOG2E
    o = torch.empty((total_q, H, d_v), dtype=q.dtype, device=q.device)
    row_stats = torch.empty((3, H, total_q), dtype=torch.float32, device=q.device)  # lse, m, l
    n_docs = cu_seqlens_q.shape[0] - 1
    # the sinks as a contiguous float32 copy, the one form the kernel reads; None without them
    sinks = None if sinks is None else sinks.to(torch.float32, copy=True)

    def strides(x):  # (total, heads, D) seen as (1, heads, total, D): the batch stride is never stepped
        return 0, x.stride(1), x.stride(0), x.stride(2)

    _forward_kernel[head_batch_grid(-(-max_seqlen_q // block_q), H, n_docs)](
        q, k, v, o, row_stats, sinks, *strides(q), *strides(k), *strides(v), *strides(o),
        H, H // H_kv, total_q, k.shape[0], int(spec.mask.alignment == "lower_right"), qk_scale, H * total_q, 1, left,
        right, units.unit, 1.0 if softcap is None else softcap,
        HEAD_DIM=D, HEAD_DIM_PAD=head_dim_pad(D), HEAD_DIM_V=d_v, HEAD_DIM_V_PAD=head_dim_pad(d_v), BLOCK_Q=block_q,
        BLOCK_K=block_k, CAUSAL=mask.causal,
        SIGN=units.sign, USE_TMA=False, DOT_PRECISION=dot_precision(q.dtype), INTERPRETED=q.device.type == "cpu",
        HEAVIEST_FIRST=False, MASKED_TILES=True, BAND=mask.banded, SOFTCAP=softcap is not None,
        CU_Q=cu_seqlens_q, CU_K=cu_seqlens_k, ORDER=document_order(cu_seqlens_q, cu_seqlens_k), VARLEN=True,
        SINK=spec.has_sinks, num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip
    return o, row_stats[0], row_stats[1:]

"""Split-K decoding (FlashDecoding) as two Triton kernels, mirroring ``flashtile.reference.decode``.

``_decode_split_kernel``: one program per (key slice, KV head, sequence). It packs every query row of
its KV group, g heads times Tq new tokens, into one tile of BLOCK_M rows, walks the key tiles of its
slice once, and writes a normalised partial (o_s, lse_s) per row into an fp32 workspace.
``_decode_merge_kernel``: one program per (new token, head, sequence) combines the partials with the
rescale identity. With a single slice the split kernel writes o and lse directly and no merge runs.

Compared with the reference, the kernel adds only what the GPU forces on it: masks, 64-bit pointer
arithmetic, base-2 exponentials, raw-dot units (m is the max of the raw dots u = (sign · q)·k, and
p = exp2((u - m) · qk_scale), see ``flashtile.kernels._host.KernelScale``), and a per-key page
lookup instead of ``gather_pages``'s copy. A contiguous cache is the paged case with one page of
T_max keys per sequence, page = b, so the two share one kernel (the constexpr PAGED only skips the
block-table read).

Attention sinks (``SINKS``, one logit per query head) are counted once: the merge kernel starts from
the sink's partial (o = 0, lse = sink) where the keys are split, and the split kernel starts its rows
from the sink's state (``sink_start``) where one slice writes o itself. Values may have their own head
dim (d_v, ``HEAD_DIM_V``): q and k are d_qk wide, acc, the partials and o d_v wide.

Status: supports fp16, bf16 and fp32 (fp32 dots in full fp32), 1 <= d_qk, d_v <= 256, Tq 1 to 16,
any GQA ratio, sinks, ragged lengths, paged caches of any page size, any strides; any band of keys around each
sequence's lower-right diagonal (``reference.decode.decode_band``: decoding's causal rule, sliding
windows, and every mask of ``flashtile.attention``, whose calls of Tq <= 16 without a gradient run
here through ``make_attention_decode_plan``) and soft-capping. The key tiles no row of a sequence
sees are never read: the slices cover only the window's tiles. Tested on the CPU through Triton's
interpreter and on an H200 (``tests/decode/test_decode_gpu.py``); its times there against cuDNN's are
in ``bench/results/decode.json`` (the decode chapter's table). The launcher checks shapes, not values: a length
above the capacity or a block-table entry outside the pool reads out of bounds, so users call
``flashtile.decode_attention``, which checks them. As in the forward kernel and in the float64
truth, a NaN in the value of a key that the causal rule hides from an earlier new token (a later new
token's own value) still reaches that token's row, as 0 · NaN in the P·V dot.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._checks import (
    MAX_NEW_TOKENS,
    UNBOUNDED,
    DecodeShape,
    check_attention_inputs,
    check_decode_inputs,
    check_flag,
    check_num_splits,
    check_sinks_layout,
    check_softcap,
    check_window,
    resolve_scale,
)
from .._env import is_interpreting, sm_count
from .._layouts import contiguous_strides
from .._plans import cached_plan
from .._spec import AttentionSpec, MaskBand, output_strides
from ..reference.decode import decode_span, pick_num_splits
from ._host import (
    KERNEL_DTYPES,
    KernelLaunch,
    check_kernel_device,
    check_launch,
    check_tile_size,
    dot_precision,
    head_batch_grid,
    head_dim_pad,
    kernel_mask,
    kernel_scale,
)
from ._jit import apply_sign, online_softmax_step, program_offset, soft_cap

LN2 = tl.constexpr(math.log(2.0))
LOG2E = tl.constexpr(math.log2(math.e))


# --8<-- [start:page_slot]
@triton.jit
def _page_and_slot(
    BLOCK_TABLE, stride_tb, stride_tp, b, k_start, k_end,
    BLOCK_K: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr,
):  # fmt: skip
    """Where the keys k_start .. k_start + BLOCK_K - 1 of sequence b live: (page, slot)
    per key, int64, so K[page, h_kv, slot, :] is a key's row. Keys at or past k_end (the
    slice's end) read no table entry.

    Paged: page = block_table[b, j // page_size], slot = j % page_size. When a page
    holds whole tiles (page_size a multiple of BLOCK_K; k_start is always a multiple of
    BLOCK_K), the tile lies in one page: one table read serves it, and the slots are
    consecutive, which the compiler can see. Smaller pages take one read per key.
    Contiguous: the cache is one page per sequence, page = b and slot = j, and no table
    is read.
    """
    j = k_start + tl.arange(0, BLOCK_K)
    if PAGED:
        row = BLOCK_TABLE + program_offset(b, stride_tb)
        if PAGE_SIZE % BLOCK_K == 0:
            # int64, also from a Python int
            page_index = tl.zeros([], dtype=tl.int64) + k_start // PAGE_SIZE
            page = tl.load(
                row + page_index * stride_tp, mask=k_start < k_end, other=0
            ).to(tl.int64)
            slot = (k_start % PAGE_SIZE + tl.arange(0, BLOCK_K)).to(tl.int64)
            return tl.zeros_like(slot) + page, slot
        page = tl.load(
            row + (j // PAGE_SIZE).to(tl.int64) * stride_tp, mask=j < k_end, other=0
        )
        return page.to(tl.int64), (j % PAGE_SIZE).to(tl.int64)
    return tl.zeros_like(j).to(tl.int64) + b, j.to(tl.int64)
# --8<-- [end:page_slot]


# --8<-- [start:inner]
@triton.jit
def _decode_key_tiles(
    acc, l, m, q, t,
    K, V, BLOCK_TABLE, stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd,
    stride_tb, stride_tp,
    b, d, dv, first_k_index, end_k_index, k_end, lo, hi, qk_scale, unit, softcap,
    BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
    BAND: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold key tiles first_k_index .. end_k_index - 1 into (acc, l, m); t holds each
    row's new token.

    K and V point at the KV head; d runs over the query/key head dim, dv over the
    value head dim. Row r sees key j iff j < k_end and t + lo <= j <= t + hi: only
    MASKED tiles test it, the lower bound only with BAND. SOFTCAP caps the scores first
    (qk_scale = log2(e)).
    """
    # The table entries of each tile are read one iteration ahead: a load whose address
    # comes from a load in the same iteration leaves the pipeliner one buffer for K and
    # V instead of num_stages - 1.
    page, slot = _page_and_slot(
        BLOCK_TABLE, stride_tb, stride_tp, b, first_k_index * BLOCK_K, k_end, BLOCK_K,
        PAGE_SIZE, PAGED,
    )  # fmt: skip
    for k_index in range(first_k_index, end_k_index):
        # the key positions of this tile, in the sequence
        j = k_index * BLOCK_K + tl.arange(0, BLOCK_K)
        in_slice = j < k_end
        # keys before the first row's window (j < lo) are seen by no row: not read at
        # all
        if BAND:
            in_slice = in_slice & (j >= lo)
        k_mask = (d[:, None] < HEAD_DIM) & in_slice[None, :]
        k_ptrs = (
            K
            + page[None, :] * stride_kp
            + slot[None, :] * stride_kt
            + d[:, None].to(tl.int64) * stride_kd
        )
        if MASKED or HEAD_DIM != HEAD_DIM_PAD:
            # K^T tile: (HEAD_DIM_PAD, BLOCK_K)
            k = tl.load(k_ptrs, mask=k_mask, other=0.0)
        else:
            k = tl.load(k_ptrs)
        # (BLOCK_M, BLOCK_K) raw dots, every packed row
        u = tl.dot(q, k, input_precision=DOT_PRECISION)
        # the cap acts on the scaled score, before the mask, as in the forward kernel
        if SOFTCAP:
            u, _t = soft_cap(u, unit, softcap)
        if MASKED:
            hidden = (j[None, :] >= k_end) | (j[None, :] > t[:, None] + hi)
            if BAND:
                hidden = hidden | (j[None, :] < t[:, None] + lo)
            u = tl.where(hidden, float("-inf"), u)
        v_mask = in_slice[:, None] & (dv[None, :] < HEAD_DIM_V)
        v_ptrs = (
            V
            + page[:, None] * stride_vp
            + slot[:, None] * stride_vt
            + dv[None, :].to(tl.int64) * stride_vd
        )
        if MASKED or HEAD_DIM_V != HEAD_DIM_V_PAD:
            v = tl.load(v_ptrs, mask=v_mask, other=0.0)  # (BLOCK_K, HEAD_DIM_V_PAD)
        else:
            v = tl.load(v_ptrs)
        # as in the forward
        acc, l, m = online_softmax_step(acc, l, m, u, v, qk_scale, DOT_PRECISION)
        page, slot = _page_and_slot(
            BLOCK_TABLE, stride_tb, stride_tp, b, (k_index + 1) * BLOCK_K, k_end,
            BLOCK_K, PAGE_SIZE, PAGED,
        )  # fmt: skip
    return acc, l, m
# --8<-- [end:inner]


@triton.jit
def _decode_split_kernel(
    Q, K, V, SEQLENS, BLOCK_TABLE, SINKS, O_PART, LSE_PART,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kp, stride_kh, stride_kt, stride_kd,
    stride_vp, stride_vh, stride_vt, stride_vd,
    stride_sb, stride_tb, stride_tp, stride_sink,
    stride_ob, stride_oh, stride_ot, stride_os, stride_od,
    stride_lb, stride_lh, stride_lt, stride_ls,
    Tq, group, capacity, num_splits, qk_scale, band_lo, band_hi, unit, softcap, lse_offset,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, HAS_SEQLENS: tl.constexpr, SIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BAND: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    STORE_LSE: tl.constexpr = True, SINK: tl.constexpr = False,
):
    # --8<-- [start:packing]
    split = tl.program_id(0)
    n_rows = group * Tq  # every query row of one KV group: g heads x Tq new tokens
    n_row_blocks = tl.cdiv(n_rows, BLOCK_M)
    h_kv = tl.program_id(1) // n_row_blocks
    b = tl.program_id(2)
    # packed rows of this program
    r = (tl.program_id(1) % n_row_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = h_kv * group + r // Tq  # the query head of each row
    t = r % Tq  # the new token of each row
    row_ok = r < n_rows
    d = tl.arange(0, HEAD_DIM_PAD)
    q_ptrs = (Q + program_offset(b, stride_qb) + h[:, None].to(tl.int64) * stride_qh
              + t[:, None].to(tl.int64) * stride_qt + d[None, :].to(tl.int64) * stride_qd)
    q_mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    # (BLOCK_M, HEAD_DIM_PAD), loaded once
    q = apply_sign(tl.load(q_ptrs, mask=q_mask, other=0.0), SIGN)
    # --8<-- [end:packing]

    # --8<-- [start:slice]
    if HAS_SEQLENS:
        # ragged: this sequence's own number of keys
        length = tl.load(SEQLENS + program_offset(b, stride_sb))
    else:
        length = capacity
    # new token t sees keys t + lo .. t + hi (the band on this sequence's diagonal)
    lo = length - Tq + band_lo
    hi = length - Tq + band_hi
    # reference.decode.decode_keys: the keys some row sees, [key_first, key_end)
    key_first = tl.maximum(lo, 0)
    key_end = tl.maximum(tl.minimum(length + band_hi, length), key_first)
    first_tile = key_first // BLOCK_K  # the tiles before it are never read
    n_tiles = tl.cdiv(key_end, BLOCK_K) - first_tile
    # reference.decode.split_bounds, in the same units
    tiles_per_split = tl.cdiv(n_tiles, num_splits)
    start_tile = tl.minimum(first_tile + split * tiles_per_split, first_tile + n_tiles)
    end_tile = tl.minimum(start_tile + tiles_per_split, first_tile + n_tiles)
    k_end = tl.minimum(end_tile * BLOCK_K, key_end)
    # Tiles every row sees whole: from the first that starts at or past the last row's first
    # key (Tq - 1 + lo) to the last that ends by row 0's last key (hi) and by the slice's
    # end. Before them only a window's left edge cuts; after them the causal edge (or the
    # band's right edge) and the end of the keys.
    full_first = tl.minimum(
        tl.maximum(tl.cdiv(tl.maximum(Tq - 1 + lo, 0), BLOCK_K), start_tile), end_tile
    )
    full_end = tl.minimum(
        tl.maximum(tl.maximum(tl.minimum(hi + 1, k_end), 0) // BLOCK_K, full_first),
        end_tile,
    )
    # --8<-- [end:slice]

    dv = tl.arange(0, HEAD_DIM_V_PAD)  # the value head dim: acc and o are d_v wide
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    # --8<-- [start:sink_start]
    if SINK:  # one slice writes o itself: its rows start from their head's sink
        sink_ptrs = SINKS + h.to(tl.int64) * stride_sink  # each packed row's head
        sink = tl.load(sink_ptrs, mask=row_ok, other=float("-inf"))
        # one key already seen, score = the sink, value 0: m in the loop's units (raw
        # dots, or natural units for capped scores), l = 1 (0 for a sink of -inf)
        m = sink.to(tl.float32)
        if not SOFTCAP:
            m = m / unit
        l = tl.where(m == float("-inf"), 0.0, 1.0)
    # --8<-- [end:sink_start]
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], dtype=tl.float32)
    k_head = K + program_offset(h_kv, stride_kh)
    v_head = V + program_offset(h_kv, stride_vh)
    if BAND:  # a window's left edge: the tiles it crosses, masked (none without a window: full_first = start_tile)
        acc, l, m = _decode_key_tiles(
            acc, l, m, q, t, k_head, v_head, BLOCK_TABLE, stride_kp, stride_kt, stride_kd, stride_vp, stride_vt,
            stride_vd, stride_tb, stride_tp, b, d, dv, start_tile, full_first, k_end, lo, hi, qk_scale, unit,
            softcap, BLOCK_K, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, PAGE_SIZE, PAGED,
            MASKED=True, BAND=True, SOFTCAP=SOFTCAP,
            DOT_PRECISION=DOT_PRECISION,
        )
    acc, l, m = _decode_key_tiles(  # FULL: no mask
        acc, l, m, q, t, k_head, v_head, BLOCK_TABLE, stride_kp, stride_kt, stride_kd, stride_vp, stride_vt,
        stride_vd, stride_tb, stride_tp, b, d, dv, full_first, full_end, k_end, lo, hi, qk_scale, unit, softcap,
        BLOCK_K, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, PAGE_SIZE, PAGED,
        MASKED=False, BAND=False, SOFTCAP=SOFTCAP,
        DOT_PRECISION=DOT_PRECISION,
    )
    acc, l, m = _decode_key_tiles(  # the right edge and the end of the slice
        acc, l, m, q, t, k_head, v_head, BLOCK_TABLE, stride_kp, stride_kt, stride_kd, stride_vp, stride_vt,
        stride_vd, stride_tb, stride_tp, b, d, dv, full_end, end_tile, k_end, lo, hi, qk_scale, unit, softcap,
        BLOCK_K, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, PAGE_SIZE, PAGED,
        MASKED=True, BAND=BAND, SOFTCAP=SOFTCAP,
        DOT_PRECISION=DOT_PRECISION,
    )

    # --8<-- [start:partial]
    # this slice hides every key from the row (or the slice is empty), and no sink
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    o = acc / l_safe[:, None]  # normalised partial o_s, d_v wide; 0 for an empty row
    # natural units: unit * m + ln l, never past them
    lse = m * (qk_scale * LN2) + tl.math.log2(l_safe) * LN2
    lse = tl.where(m == float("inf"), m, lse)
    lse = tl.where(empty, float("-inf"), lse)
    o_ptrs = (O_PART + program_offset(b, stride_ob) + h[:, None].to(tl.int64) * stride_oh
              + t[:, None].to(tl.int64) * stride_ot + program_offset(split, stride_os)
              + dv[None, :].to(tl.int64) * stride_od)
    o_mask = row_ok[:, None] & (dv[None, :] < HEAD_DIM_V)
    tl.store(o_ptrs, o.to(O_PART.dtype.element_ty), mask=o_mask)
    if STORE_LSE:  # off only where one slice writes o itself and no caller wants lse
        lse_ptrs = (
            LSE_PART
            + lse_offset
            + program_offset(b, stride_lb)
            + h.to(tl.int64) * stride_lh
            + t.to(tl.int64) * stride_lt
            + program_offset(split, stride_ls)
        )
        tl.store(lse_ptrs, lse, mask=row_ok)
    # --8<-- [end:partial]


# --8<-- [start:merge]
@triton.jit
def _decode_merge_kernel(
    SINKS, O_PART, LSE_PART, O, LSE,
    stride_sink,
    stride_pb, stride_ph, stride_pt, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_lt, stride_ls,
    stride_ob, stride_oh, stride_ot, stride_od,
    H, Tq, num_splits, lse_offset,
    HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
    STORE_LSE: tl.constexpr = True, SINK: tl.constexpr = False,
):
    """o = sum_s exp(lse_s - lse) o_s, lse = log(e^sink + sum_s exp(lse_s)), for one row
    (t, h, b): the sink is one more partial, o = 0 and lse = sink, merged here once
    (no slice saw it). o is d_v wide."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_V_PAD)
    row = (
        lse_offset
        + program_offset(b, stride_lb)
        + program_offset(h, stride_lh)
        + program_offset(t, stride_lt)
    )
    lse_s = tl.load(
        LSE_PART + row + s.to(tl.int64) * stride_ls,
        mask=s < num_splits,
        other=float("-inf"),
    )
    m = tl.max(lse_s, 0)  # the largest partial lse; -inf when no slice saw a key
    if SINK:
        sink = tl.load(SINKS + program_offset(h, stride_sink)).to(tl.float32)
        m = tl.maximum(m, sink)
    m_safe = tl.where((m == float("-inf")) | (m == float("inf")), 0.0, m)
    # e^(lse_s - m): the rescale weights, <= 1; NaN stays NaN
    w = tl.math.exp2((lse_s - m_safe) * LOG2E)
    l = tl.sum(w, 0)
    if SINK:  # the sink's weight; its o is 0, so acc gains nothing
        l += tl.math.exp2((sink - m_safe) * LOG2E)
    part = (
        O_PART
        + program_offset(b, stride_pb)
        + program_offset(h, stride_ph)
        + program_offset(t, stride_pt)
        + s[:, None].to(tl.int64) * stride_ps
        + d[None, :].to(tl.int64) * stride_pd
    )
    o_s = tl.load(
        part, mask=(s[:, None] < num_splits) & (d[None, :] < HEAD_DIM_V), other=0.0
    )
    empty = l == 0.0
    o = tl.sum(w[:, None] * o_s, 0) / tl.where(empty, 1.0, l)  # (HEAD_DIM_V_PAD,)
    lse = m_safe + tl.log(tl.where(empty, 1.0, l))
    lse = tl.where(m == float("inf"), m, lse)
    lse = tl.where(empty, float("-inf"), lse)
    o_ptrs = (
        O
        + program_offset(b, stride_ob)
        + program_offset(h, stride_oh)
        + program_offset(t, stride_ot)
    )
    tl.store(
        o_ptrs + d.to(tl.int64) * stride_od,
        o.to(O.dtype.element_ty),
        mask=d < HEAD_DIM_V,
    )
    if STORE_LSE:
        tl.store(LSE + b * H * Tq + h * Tq + t, lse)  # lse is (B, H, Tq) contiguous
# --8<-- [end:merge]


# --8<-- [start:config]
def decode_config(d_qk: int, d_v: int, dtype: torch.dtype, rows: int) -> dict:
    """Tile sizes and launch settings for the H200: 64-key tiles, 4 warps, 3 stages.
    128-key tiles with 8 warps ran slower, contiguous and paged
    (bench/results/sweeps/decode-splits.json). Head dims d_qk != d_v take the setting of
    the wider one.

    BLOCK_M holds the packed rows of one KV group (g * Tq), at least 16 for tl.dot and
    at most 64, beyond which the rows take more programs. Decoding is bound by reading K
    and V, so BLOCK_K is chosen for long, coalesced loads. The interpreter runs programs
    one by one on the CPU: small tiles keep the tests' short caches several tiles long.
    """
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    if is_interpreting():
        return dict(block_m=block_m, block_k=16, num_warps=4, num_stages=1)
    wide = head_dim_pad(max(d_qk, d_v)) * (2 if dtype == torch.float32 else 1)
    if wide <= 128:
        return dict(block_m=block_m, block_k=64, num_warps=4, num_stages=3)
    return dict(block_m=block_m, block_k=32, num_warps=4, num_stages=2)
# --8<-- [end:config]


# --8<-- [start:launcher]
class DecodePlan(NamedTuple):
    """The launches of one decode call, worked out once per layout (see
    ``_plans.cached_plan``)."""

    shape: DecodeShape
    num_splits: int
    # o allocated by torch.empty_like(q) (its strides are the ones the plan passed);
    # else with o_strides
    o_like_q: bool
    o_strides: tuple
    # lse allocated, written and returned; otherwise None (a caller that does not want
    # it)
    store_lse: bool
    # every call passes the (H,) sinks, read through the strides this plan was made for
    has_sinks: bool
    # fp32 elements of the partials, o_s (d_v wide) then lse_s, with more than one
    # split; 0 with one
    workspace: int
    # each program: one slice of one sequence's keys, for one KV group's query rows
    split: KernelLaunch
    # each program: one (b, h, new token)'s partials, merged; None with one split
    merge: KernelLaunch | None

    def run(
        self, q, key_cache, value_cache, cache_seqlens=None, block_table=None,
        sinks=None,
    ):  # fmt: skip
        """``decode_with_plan(self, ...)``: (o, lse), lse None unless the plan stores
        it."""
        return decode_with_plan(
            self, q, key_cache, value_cache, cache_seqlens, block_table, sinks
        )


def make_decode_plan(
    q, key_cache, value_cache, cache_seqlens, block_table, sinks=None, *, scale,
    num_splits, window, softcap, store_lse=True, block_k=None, num_warps=None,
    num_stages=None,
) -> DecodePlan:  # fmt: skip
    """``flash_decode``'s plan: one call's shapes and options checked, then its launches
    (``plan_decode``); raises on anything the kernels cannot take. The sinks' layout is
    checked, not their values."""
    shape = check_decode_inputs(
        q,
        key_cache,
        value_cache,
        cache_seqlens,
        block_table,
        dtypes=KERNEL_DTYPES,
        check_values=False,
    )
    check_sinks_layout(sinks, shape, q.dtype, q.device)
    # right capped at 0: the new tokens are causal
    left, _ = check_window(window) or (UNBOUNDED, UNBOUNDED)
    return plan_decode(
        q, key_cache, value_cache, cache_seqlens, block_table, shape=shape,
        scale=resolve_scale(scale, shape.D, q.dtype),
        mask=MaskBand(left, 0, "lower_right"), softcap=check_softcap(softcap, q.dtype),
        num_splits=check_num_splits(num_splits),
        store_lse=check_flag("store_lse", store_lse), o_like_q=False, block_k=block_k,
        num_warps=num_warps, num_stages=num_stages, sinks=sinks,
    )  # fmt: skip


def make_attention_decode_plan(
    q, k, v, sinks=None, *, spec: AttentionSpec, store_lse: bool
) -> DecodePlan:
    """The plan of a ``flashtile.attention`` call that the decode kernels run (Tq <= 16,
    no gradient), from its checked options: k and v are a full cache of Tk keys, and o
    is laid out as ``attention`` lays it out (``_spec.output_strides``, d_v wide).
    ``sinks``: the call's (H,) sinks where ``spec.has_sinks`` (the plan keeps their
    strides: key it by their layout too)."""
    a = check_attention_inputs(
        q, k, v, dtypes=KERNEL_DTYPES, names=("query", "key", "value"),
        unequal_head_dims=True,
    )  # fmt: skip
    if a.Tq > MAX_NEW_TOKENS:
        raise ValueError(
            f"query has {a.Tq} rows; the decode kernels take 1 to {MAX_NEW_TOKENS}"
        )
    if spec.has_sinks != (sinks is not None):
        raise ValueError("sinks must be passed exactly where spec.has_sinks is set")
    shape = DecodeShape(
        a.B, a.H, a.H_kv, a.Tq, a.D, capacity=a.Tk, page_size=None, num_pages=0,
        D_v=v.shape[-1],
    )
    return plan_decode(
        q, k, v, None, None, shape=shape, scale=spec.scale, mask=spec.mask,
        softcap=spec.softcap, num_splits=None, store_lse=store_lse, o_like_q=True,
        sinks=sinks,
    )  # fmt: skip


def plan_decode(
    q, key_cache, value_cache, cache_seqlens, block_table, *, shape: DecodeShape,
    scale: float, mask: MaskBand, softcap: float | None, num_splits: int | None,
    store_lse: bool, o_like_q: bool, block_k=None, num_warps=None, num_stages=None,
    sinks=None,
) -> DecodePlan:  # fmt: skip
    """The launches for checked shapes and options: tiles, split count, strides, the
    band, the cap and the sinks (checked (H,) or None). The band is measured from each
    sequence's own lower-right diagonal j = t + length - Tq (``kernel_mask``'s diagonals
    on the full (Tq, capacity) matrix, shifted), so it keeps its place in a shorter
    sequence."""
    lo, hi = kernel_mask(mask, shape.Tq, shape.capacity).diagonals
    # reference.decode.decode_band
    band = (lo - (shape.capacity - shape.Tq), hi - (shape.capacity - shape.Tq))
    check_kernel_device("query", q)
    config = decode_config(shape.D, shape.D_v, q.dtype, shape.group * shape.Tq)
    block_m = config["block_m"]
    block_k = (
        config["block_k"] if block_k is None else check_tile_size("block_k", block_k)
    )
    num_warps, num_stages = check_launch(
        config["num_warps"] if num_warps is None else num_warps,
        config["num_stages"] if num_stages is None else num_stages,
    )
    n_row_blocks = -(-shape.group * shape.Tq // block_m)
    # without splits: often far fewer than the SMs
    programs = shape.B * shape.H_kv * n_row_blocks
    if num_splits is None:  # picked for the keys a window leaves, not the whole cache
        num_splits = pick_num_splits(
            programs, decode_span(shape.capacity, shape.Tq, band), sm_count(q.device)
        )
    units = kernel_scale(scale)
    # capped scores are in natural units (soft_cap)
    qk_scale = units.qk_scale if softcap is None else math.log2(math.e)
    B, H, Tq, D_v = shape.B, shape.H, shape.Tq, shape.D_v
    # o as attention lays it out (q's own layout where q is dense, d_v wide), or
    # contiguous (decode_attention's)
    o_strides = (
        output_strides(q, D_v) if o_like_q else contiguous_strides((B, H, Tq, D_v))
    )
    lse_strides = contiguous_strides((B, H, Tq))
    # the split kernel writes o and lse themselves: a split axis of size 1 (stride 0)
    if num_splits == 1:
        part_o_strides, part_lse_strides, workspace = (
            (*o_strides[:3], 0, o_strides[3]),
            (*lse_strides, 0),
            0,
        )
    # one fp32 workspace: the partials o_s (B, H, Tq, num_splits, d_v), then lse_s (B,
    # H, Tq, num_splits)
    else:
        part_o_strides = contiguous_strides((B, H, Tq, num_splits, D_v))
        part_lse_strides = contiguous_strides((B, H, Tq, num_splits))
        workspace = B * H * Tq * num_splits * (D_v + 1)
    # where lse_s starts in the workspace
    lse_offset = B * H * Tq * num_splits * D_v if num_splits > 1 else 0
    # cache_seqlens and block_table are read through their strides, like every other
    # argument: a view of either (every other entry, a column, an expanded row) gives
    # its own values, as the host check read them
    seqlens_stride = cache_seqlens.stride(0) if cache_seqlens is not None else 0
    table_strides = block_table.stride() if block_table is not None else (0, 0)
    # the sinks join once: in the split kernel's start state where it writes o itself,
    # else in the merge's
    sink_stride = sinks.stride(0) if sinks is not None else 0
    lo, hi = band
    split = KernelLaunch(
        _decode_split_kernel,
        grid=head_batch_grid(num_splits, shape.H_kv * n_row_blocks, B),
        scalars=(
            *q.stride(),
            *key_cache.stride(),
            *value_cache.stride(),
            seqlens_stride,
            *table_strides,
            sink_stride,
            *part_o_strides,
            *part_lse_strides,
            Tq,
            shape.group,
            shape.capacity,
            num_splits,
            qk_scale,
            lo,
            hi,
            units.unit,
            1.0 if softcap is None else softcap,
            lse_offset,
        ),  # fmt: skip
        constexprs=dict(
            HEAD_DIM=shape.D,
            HEAD_DIM_PAD=head_dim_pad(shape.D),
            HEAD_DIM_V=D_v,
            HEAD_DIM_V_PAD=head_dim_pad(D_v),
            BLOCK_M=block_m,
            BLOCK_K=block_k,
            PAGE_SIZE=shape.page_size or 1,
            PAGED=block_table is not None,
            HAS_SEQLENS=cache_seqlens is not None,
            SIGN=units.sign,
            DOT_PRECISION=dot_precision(q.dtype),
            BAND=lo > -shape.capacity,
            SOFTCAP=softcap is not None,
            STORE_LSE=store_lse or num_splits > 1,
            SINK=sinks is not None and num_splits == 1,
        ),  # fmt: skip
        num_warps=num_warps,
        num_stages=num_stages,
        # the partials (or o and lse), allocated on every call by decode_with_plan
        fresh_outputs=2,
        # every plan is kept under the layouts of the tensors it is given (flash_decode,
        # decode_attention and attention's decode route), and o stands in for absent
        # cache_seqlens and block_table: the kept kernel is found by the device alone
        plan_keyed=True,
    )
    merge = None
    if num_splits > 1:
        merge = KernelLaunch(
            _decode_merge_kernel,
            grid=head_batch_grid(Tq, H, B),
            scalars=(
                sink_stride,
                *part_o_strides,
                *part_lse_strides,
                *o_strides,
                H,
                Tq,
                num_splits,
                lse_offset,
            ),
            constexprs=dict(
                HEAD_DIM_V=D_v,
                HEAD_DIM_V_PAD=head_dim_pad(D_v),
                SPLITS_PAD=triton.next_power_of_2(num_splits),
                STORE_LSE=store_lse,
                SINK=sinks is not None,
            ),  # fmt: skip
            num_warps=4,
            num_stages=3,
            # the workspace (twice), o and lse: all allocated on every call
            fresh_outputs=4,
            plan_keyed=True,  # as the split kernel's launch
        )
    return DecodePlan(
        shape,
        num_splits,
        o_like_q and D_v == shape.D and tuple(o_strides) == tuple(q.stride()),
        tuple(o_strides),
        store_lse,
        sinks is not None,
        workspace,
        split,
        merge,
    )


def decode_with_plan(
    plan: DecodePlan, q, key_cache, value_cache, cache_seqlens=None, block_table=None,
    sinks=None,
):  # fmt: skip
    """Run one call's kernels from its plan: (o, lse), lse float32 (B, H, Tq) or None
    (``plan.store_lse``); o (B, H, Tq, d_v).

    The host work per call is what cannot be kept: at most three allocations (o; lse
    where it is returned; one workspace for every partial where the keys are split) and
    one or two launches. ``sinks``: the (H,) sinks, exactly where the plan has them.
    """
    if (sinks is not None) != plan.has_sinks:
        raise ValueError(
            "sinks must be passed exactly where the plan was made with them "
            f"(has_sinks={plan.has_sinks})"
        )
    B, H, Tq, D_v = plan.shape.B, plan.shape.H, plan.shape.Tq, plan.shape.D_v
    o = (
        torch.empty_like(q)
        if plan.o_like_q
        else torch.empty_strided(
            (B, H, Tq, D_v), plan.o_strides, dtype=q.dtype, device=q.device
        )
    )
    lse = (
        torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
        if plan.store_lse
        else None
    )
    # a dummy pointer, never read (sinks stay None without them: the kernels are
    # compiled with SINKS a constant they never read)
    seqlens = o if cache_seqlens is None else cache_seqlens
    table = o if block_table is None else block_table  # likewise
    if plan.merge is None:
        # o: a dummy for lse
        plan.split(
            q, key_cache, value_cache, seqlens, table, sinks, o,
            o if lse is None else lse,
        )  # fmt: skip
    else:
        work = torch.empty(plan.workspace, dtype=torch.float32, device=q.device)
        # lse_s at lse_offset in the same buffer
        plan.split(q, key_cache, value_cache, seqlens, table, sinks, work, work)
        plan.merge(sinks, work, work, o, o if lse is None else lse)
    return o, lse


def flash_decode(
    q, key_cache, value_cache, cache_seqlens=None, *, scale=None, num_splits=None,
    block_table=None,
    block_k=None, num_warps=None, num_stages=None, window=None, softcap=None,
    sinks=None,
):
    """Split-K decode on the GPU (or the interpreter). Arguments as
    ``flashtile.decode_attention``; block_k, num_warps, num_stages override
    ``decode_config`` (for benchmarks). Checks shapes only (the sinks' too).

    Returns (o, lse): o (B, H, Tq, d_v) contiguous in q's dtype, lse (B, H, Tq) float32,
    natural log.
    """
    # checked before it keys the plans: (True, 0) and (1, 0) hash alike
    if window is not None:
        window = check_window(window)
    plan = cached_plan(
        make_decode_plan,
        (q, key_cache, value_cache, cache_seqlens, block_table, sinks),
        scale,
        num_splits,
        window,
        softcap,
        block_k,
        num_warps,
        num_stages,
        names=(
            "scale",
            "num_splits",
            "window",
            "softcap",
            "block_k",
            "num_warps",
            "num_stages",
        ),
    )
    return decode_with_plan(
        plan, q, key_cache, value_cache, cache_seqlens, block_table, sinks
    )
# --8<-- [end:launcher]

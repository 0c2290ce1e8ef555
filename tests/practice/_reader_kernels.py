"""A reader's Triton softmax and forward kernel, one simple loop each, with switches for the gallery's
kernel bugs. Import only after TRITON_INTERPRET is set (the root conftest does it without CUDA).

* softmax ``pow2_block=False``: BLOCK = n_cols, so tl.arange gets a length that is not a power of two.
* softmax ``subtract_max=False``: exp(x) / sum exp(x) on the raw values; right until x passes 88.
* forward ``guard_neg_inf=False``: exp2(-inf - (-inf)) = NaN on rows that have seen no key.
* forward ``padded_keys_neg_inf=False``: keys j >= Tk loaded as 0 and never masked: they score 0.
* forward ``use_strides=False``: strides of a contiguous tensor of the same shape, whatever the layout.
* forward ``batch_axis=False``: a (query tiles, H) grid; b is always 0, so later batches are never written.
* forward ``flat_heads=True``: one grid axis for (b, h), offset (b * H + h) * stride_h: right for a
  contiguous (B, H, T, D) tensor only.
* forward ``scale_ignored=True``: τ = 1/sqrt(D) always.
* forward ``lse_log2=True``: lse = m + log2(l), left in log2 units.
* forward ``skip_tiles=False``: every key tile visited under causal, the hidden ones masked.
* forward ``alignment_ignored=True``: offset 0 whatever ``alignment`` says.
* forward ``stats_fp16=True``: m and l kept in float16 for float16 inputs (in the inputs' dtype).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_rows(X, Y, stride_xr, stride_xc, stride_yr, n_cols, BLOCK: tl.constexpr, SUBTRACT_MAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    m = tl.full([], float("-inf"), dtype=tl.float32)
    l = tl.zeros([], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_xr + cols * stride_xc, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        if SUBTRACT_MAX:
            l = tl.exp(m - m_sub) * l + tl.sum(tl.exp(x - m_sub), 0)
            m = m_new
        else:  # BUG: exp of the raw values, m stays 0
            l = l + tl.sum(tl.exp(x), 0)
            m = tl.zeros([], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_xr + cols * stride_xc, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        tl.store(Y + row * stride_yr + cols, (tl.exp(x - m) / l).to(Y.dtype.element_ty), mask=cols < n_cols)


def make_softmax(pow2_block=True, subtract_max=True) -> SimpleNamespace:
    def softmax(x, block=None):
        n_cols = x.shape[-1]
        if block is None:
            block = triton.next_power_of_2(n_cols) if pow2_block else n_cols  # BUG when not pow2_block
        x2 = x.reshape(-1, n_cols)
        y = torch.empty_like(x2)
        _softmax_rows[(x2.shape[0],)](x2, y, x2.stride(0), x2.stride(1), y.stride(0), n_cols, BLOCK=block,
                                      SUBTRACT_MAX=subtract_max)
        return y.view(x.shape)

    return SimpleNamespace(softmax=softmax)


@triton.jit
def _forward(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    H, Tq, Tk, offset, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr, GUARD_NEG_INF: tl.constexpr, PADDED_KEYS_NEG_INF: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FLAT_HEADS: tl.constexpr, SKIP_TILES: tl.constexpr, LSE_LOG2: tl.constexpr,
    STATS: tl.constexpr,
):
    q_index = tl.program_id(0)
    if FLAT_HEADS:  # BUG: (b * H + h) * stride_h is b * stride_b + h * stride_h only for contiguous (B, H, T, D)
        bh = tl.program_id(1).to(tl.int64)
        b, h = bh * 0, bh
    else:
        h, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    i = q_index * BLOCK_Q + tl.arange(0, BLOCK_Q)
    d = tl.arange(0, HEAD_DIM_PAD)
    q_mask = (i[:, None] < Tq) & (d[None, :] < HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + i[:, None] * stride_qt + d[None, :] * stride_qd, mask=q_mask,
                other=0.0)
    m = tl.full([BLOCK_Q], float("-inf"), dtype=STATS)  # in log2 units: scores times qk_scale
    l = tl.zeros([BLOCK_Q], dtype=STATS)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
    hi = Tk
    if CAUSAL and SKIP_TILES:  # key tiles past the last visible key of the tile's last row are never loaded
        seen = tl.maximum(tl.minimum(q_index * BLOCK_Q + BLOCK_Q, Tq) + offset, 0)
        hi = tl.minimum(Tk, tl.cdiv(seen, BLOCK_K) * BLOCK_K)
    for k_start in range(0, hi, BLOCK_K):
        j = k_start + tl.arange(0, BLOCK_K)
        kv_mask = (j[:, None] < Tk) & (d[None, :] < HEAD_DIM)
        k = tl.load(K + b * stride_kb + h * stride_kh + j[:, None] * stride_kt + d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        v = tl.load(V + b * stride_vb + h * stride_vh + j[:, None] * stride_vt + d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if PADDED_KEYS_NEG_INF:
            hidden = (j[None, :] >= Tk) | (i[:, None] < 0)
        else:
            hidden = (j[None, :] < 0) | (i[:, None] < 0)  # BUG: nothing hidden, padded keys score 0
        if CAUSAL:
            hidden = hidden | (j[None, :] > i[:, None] + offset)
        s = tl.where(hidden, float("-inf"), s)
        m_new = tl.maximum(m.to(tl.float32), tl.max(s, 1))
        if GUARD_NEG_INF:
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new  # BUG: exp2(-inf - (-inf)) = NaN
        alpha = tl.math.exp2(m.to(tl.float32) - m_sub)
        p = tl.math.exp2(s - m_sub[:, None])
        l = (alpha * l + tl.sum(p, 1)).to(STATS)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new.to(STATS)
    empty = l == 0.0
    o = acc / tl.where(empty, 1.0, l.to(tl.float32))[:, None]
    lse = m.to(tl.float32) + tl.math.log2(tl.where(empty, 1.0, l.to(tl.float32)))
    if not LSE_LOG2:
        lse = lse * 0.6931471805599453  # log2 units back to natural log
    lse = tl.where(empty, float("-inf"), lse)
    tl.store(O + b * stride_ob + h * stride_oh + i[:, None] * stride_ot + d[None, :] * stride_od,
             o.to(O.dtype.element_ty), mask=q_mask)
    tl.store(LSE + (b * H + h) * Tq + i, lse, mask=i < Tq)


def make_forward(guard_neg_inf=True, padded_keys_neg_inf=True, use_strides=True, batch_axis=True, flat_heads=False,
                 scale_ignored=False, lse_log2=False, skip_tiles=True, alignment_ignored=False,
                 stats_fp16=False) -> SimpleNamespace:
    def strides(t):
        if use_strides:
            return t.stride()
        B, H, T, D = t.shape
        return (H * T * D, T * D, D, 1)  # BUG: what a contiguous tensor of this shape would have

    def flash_attention(q, k, v, causal=False, scale=None, alignment="upper_left", block_q=None, block_k=None):
        B, H, Tq, D = q.shape
        Tk = k.shape[2]
        block_q, block_k = block_q or 16, block_k or 16
        tau = 1 / math.sqrt(D) if scale is None or scale_ignored else scale  # BUG when scale_ignored
        offset = 0 if alignment == "upper_left" or alignment_ignored else Tk - Tq  # BUG when alignment_ignored
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
        tiles = triton.cdiv(Tq, block_q)
        grid = (tiles, B * H) if flat_heads else (tiles, H, B) if batch_axis else (tiles, H)  # BUG: no batch axis
        _forward[grid](
            q, k, v, o, lse, *strides(q), *strides(k), *strides(v), *o.stride(),
            H, Tq, Tk, offset, tau * math.log2(math.e),
            HEAD_DIM=D, HEAD_DIM_PAD=max(16, triton.next_power_of_2(D)), BLOCK_Q=block_q, BLOCK_K=block_k,
            CAUSAL=causal, GUARD_NEG_INF=guard_neg_inf, PADDED_KEYS_NEG_INF=padded_keys_neg_inf,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FLAT_HEADS=flat_heads,
            SKIP_TILES=skip_tiles, LSE_LOG2=lse_log2,
            STATS=tl.float16 if stats_fp16 and q.dtype == torch.float16 else tl.float32,  # BUG when stats_fp16
        )
        return o, lse

    return SimpleNamespace(flash_attention=flash_attention)

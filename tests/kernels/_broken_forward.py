"""Deliberately broken variants of the forward kernel, for tests/kernels/test_common_bugs.py only.

Each bug is one a first Triton attention kernel really has. The shipped kernel in
``flashtile.kernels.forward`` must pass the checks that these variants fail; keeping the variants
here keeps them out of the shipped kernel's hot path.

``_forward_all_masked`` is the forward with one loop (every tile masked) and two switches:

* GUARD_NEG_INF=False subtracts a max that may still be -inf: exp(-inf - (-inf)) = NaN.
* PADDED_KEYS_NEG_INF=False loads padded keys as 0 and never masks them, so they score 0.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from flashtile.kernels._host import head_dim_pad, kernel_scale
from flashtile.kernels._jit import program_offset
from flashtile.kernels.forward import _forward_kernel
from flashtile.reference.causal import diagonal_offset


@triton.jit
def _forward_all_masked(
    Q, K, V, O, H, group, Tq, Tk, offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr,
    GUARD_NEG_INF: tl.constexpr, PADDED_KEYS_NEG_INF: tl.constexpr,
):
    # Contiguous (B, H, T, HEAD_DIM) tensors only: the bugs here are about values, not layout.
    q_tile, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    i = q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (bh * Tq + i[:, None]) * HEAD_DIM + d[None, :], mask=i[:, None] < Tq, other=0.0)
    kv_head = b * (H // group) + h // group
    m = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)
    for k_start in range(0, Tk, BLOCK_K):
        j = k_start + tl.arange(0, BLOCK_K)
        kv_offsets = (kv_head * Tk + j[:, None]) * HEAD_DIM + d[None, :]
        k = tl.load(K + kv_offsets, mask=j[:, None] < Tk, other=0.0)
        v = tl.load(V + kv_offsets, mask=j[:, None] < Tk, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        hidden = j[None, :] > i[:, None] + offset if CAUSAL else j[None, :] < 0
        if PADDED_KEYS_NEG_INF:
            hidden = hidden | (j[None, :] >= Tk)
        s = tl.where(hidden, float("-inf"), s)
        m_new = tl.maximum(m, tl.max(s, 1))
        if GUARD_NEG_INF:
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l = alpha * l + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    o = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    tl.store(O + (bh * Tq + i[:, None]) * HEAD_DIM + d[None, :], o, mask=i[:, None] < Tq)


def forward_all_masked(q, k, v, causal, alignment="upper_left", *, guard_neg_inf=True, padded_keys_neg_inf=True):
    """Run the one-loop variant on contiguous tensors; returns o only."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    o = q.new_empty(q.shape)
    _forward_all_masked[(triton.cdiv(Tq, 16), B * H)](
        q.contiguous(), k.contiguous(), v.contiguous(), o, H, H // k.shape[1], Tq, Tk,
        diagonal_offset(Tq, Tk, alignment), math.log2(math.e) / math.sqrt(D),
        HEAD_DIM=D, BLOCK_Q=16, BLOCK_K=16, CAUSAL=causal,
        GUARD_NEG_INF=guard_neg_inf, PADDED_KEYS_NEG_INF=padded_keys_neg_inf,
    )
    return o


def forward_assuming_contiguous_strides(q, k, v, causal=False, alignment="upper_left"):
    """The shipped kernel, launched with the strides a contiguous tensor of q's shape would have
    instead of the strides q really has: the layout bug of a launcher that never asks."""
    B, H, Tq, D = q.shape
    H_kv, Tk = k.shape[1], k.shape[2]

    def contiguous_strides(t):
        return (t.shape[1] * t.shape[2] * t.shape[3], t.shape[2] * t.shape[3], t.shape[3], 1)

    o = q.new_empty(q.shape)
    row_stats = q.new_empty((3, B, H, Tq)).float()  # lse, m, l
    units = kernel_scale(1.0 / math.sqrt(D))
    _forward_kernel[(triton.cdiv(Tq, 16), H, B)](
        q, k, v, o, row_stats, row_stats,  # no sinks: row_stats stands in for SINKS, never read
        *contiguous_strides(q), *contiguous_strides(k), *contiguous_strides(v), *o.stride(),
        H, H // H_kv, Tq, Tk, diagonal_offset(Tq, Tk, alignment), units.qk_scale, B * H * Tq, 1,
        0, 0, units.unit, 1.0,  # band_lo, band_hi, unit, softcap: no window, no cap (BAND, SOFTCAP off)
        HEAD_DIM=D, HEAD_DIM_PAD=head_dim_pad(D), HEAD_DIM_V=D, HEAD_DIM_V_PAD=head_dim_pad(D), BLOCK_Q=16,
        BLOCK_K=16, CAUSAL=causal, SIGN=units.sign,
        USE_TMA=False, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERPRETED=q.device.type == "cpu", HEAVIEST_FIRST=False, MASKED_TILES=True, BAND=False, SOFTCAP=False,
    )
    return o, row_stats[0]


@triton.jit
def _offset_probe(OUT, stride, WIDEN: tl.constexpr):
    """Store program_id * stride the way the shipped kernel computes it (WIDEN) or after a cast whose
    result was dropped on the floor."""
    index = tl.program_id(0)
    if WIDEN:
        offset = program_offset(index, stride)
    else:
        index.to(tl.int64)  # BUG: Triton values are immutable; this line changes nothing
        offset = index * stride
    tl.store(OUT + tl.program_id(0), offset.to(tl.int64))


def probe_offsets(out, stride, widen):
    _offset_probe[(out.numel(),)](out, stride, WIDEN=widen)
    return out

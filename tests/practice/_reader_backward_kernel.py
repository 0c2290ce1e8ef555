"""A reader's Triton backward, written from the skeleton of the ``backward_kernel`` step: the D preprocess,
the dK/dV kernel (one program per key tile, in the transposed domain) and the dQ kernel (one program per
query tile). No switches: ``test_planted_mistakes.py`` plants each mistake as one textual edit of this
file, so every line a plant replaces appears here once. Import only after TRITON_INTERPRET is set (the
root conftest does it without CUDA).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # exp(x) = exp2(x log2(e))


@triton.jit
def _delta_kernel(O, DO, DELTA, stride_b, stride_h, stride_t, H, Tq,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr):
    q_index, h, b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    i = q_index * BLOCK_Q + tl.arange(0, BLOCK_Q)
    d = tl.arange(0, HEAD_DIM_PAD)
    mask = (i[:, None] < Tq) & (d[None, :] < HEAD_DIM)
    offsets = b * stride_b + h * stride_h + i[:, None] * stride_t + d[None, :]
    o = tl.load(O + offsets, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + (b * H + h) * Tq + i, tl.sum(o * do, 1), mask=i < Tq)


@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                 stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                 H, Tq, Tk, offset, scale, qk_scale,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                 BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, DOT: tl.constexpr):
    k_index, h, b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    j = k_index * BLOCK_K + tl.arange(0, BLOCK_K)
    d = tl.arange(0, HEAD_DIM_PAD)
    kv_mask = (j[:, None] < Tk) & (d[None, :] < HEAD_DIM)
    kv_offsets = b * stride_kb + h * stride_kh + j[:, None] * stride_kt + d[None, :]
    k = tl.load(K + kv_offsets, mask=kv_mask, other=0.0)
    v = tl.load(V + kv_offsets, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_K, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_K, HEAD_DIM_PAD], dtype=tl.float32)
    lo = 0
    if CAUSAL:  # the first row that sees key k_index * BLOCK_K is that key minus offset
        lo = tl.maximum(k_index * BLOCK_K - offset, 0) // BLOCK_Q * BLOCK_Q
    for q_start in range(lo, Tq, BLOCK_Q):
        i = q_start + tl.arange(0, BLOCK_Q)
        q_mask = (i[:, None] < Tq) & (d[None, :] < HEAD_DIM)
        q_offsets = b * stride_qb + h * stride_qh + i[:, None] * stride_qt + d[None, :]
        q = tl.load(Q + q_offsets, mask=q_mask, other=0.0)
        do = tl.load(DO + q_offsets, mask=q_mask, other=0.0)
        lse = tl.load(LSE + (b * H + h) * Tq + i, mask=i < Tq, other=0.0)
        delta = tl.load(DELTA + (b * H + h) * Tq + i, mask=i < Tq, other=0.0)
        # a row that saw no key has lse = -inf: subtract +inf there, so that its P is 0, not NaN
        lse_col = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        st = tl.dot(k, tl.trans(q), input_precision=DOT) * qk_scale  # (BLOCK_K, BLOCK_Q): Sᵀ in log2 units
        hidden_t = (j[:, None] >= Tk) | (i[None, :] >= Tq)
        if CAUSAL:
            hidden_t = hidden_t | (j[:, None] > i[None, :] + offset)
        st = tl.where(hidden_t, float("-inf"), st)
        pt = tl.math.exp2(st - lse_col[None, :])  # Pᵀ
        dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT)  # dPᵀ = V dOᵀ
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(q.dtype), q, input_precision=DOT)
    dk = dk * scale
    tl.store(DK + kv_offsets, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_offsets, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
               stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
               H, Tq, Tk, offset, scale, qk_scale,
               HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
               BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, DOT: tl.constexpr):
    q_index, h, b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    i = q_index * BLOCK_Q + tl.arange(0, BLOCK_Q)
    d = tl.arange(0, HEAD_DIM_PAD)
    q_mask = (i[:, None] < Tq) & (d[None, :] < HEAD_DIM)
    q_offsets = b * stride_qb + h * stride_qh + i[:, None] * stride_qt + d[None, :]
    q = tl.load(Q + q_offsets, mask=q_mask, other=0.0)
    do = tl.load(DO + q_offsets, mask=q_mask, other=0.0)
    lse = tl.load(LSE + (b * H + h) * Tq + i, mask=i < Tq, other=0.0)
    delta = tl.load(DELTA + (b * H + h) * Tq + i, mask=i < Tq, other=0.0)
    lse_row = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    dq = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
    hi = Tk
    if CAUSAL:  # the tile's last row sees keys up to its index plus offset
        hi = tl.minimum(Tk, tl.maximum(tl.minimum(q_index * BLOCK_Q + BLOCK_Q, Tq) + offset, 0))
    for k_start in range(0, hi, BLOCK_K):
        j = k_start + tl.arange(0, BLOCK_K)
        kv_mask = (j[:, None] < Tk) & (d[None, :] < HEAD_DIM)
        kv_offsets = b * stride_kb + h * stride_kh + j[:, None] * stride_kt + d[None, :]
        k = tl.load(K + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(V + kv_offsets, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT) * qk_scale  # (BLOCK_Q, BLOCK_K), log2 units
        hidden = (i[:, None] >= Tq) | (j[None, :] >= Tk)
        if CAUSAL:
            hidden = hidden | (j[None, :] > i[:, None] + offset)
        s = tl.where(hidden, float("-inf"), s)
        p = tl.math.exp2(s - lse_row[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT)
    dq = dq * scale
    tl.store(DQ + q_offsets, dq.to(DQ.dtype.element_ty), mask=q_mask)


def flash_attention_backward(q, k, v, o, lse, do, causal=False, scale=None, block_q=None, block_k=None,
                             alignment="upper_left"):
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    block_q, block_k = block_q or 16, block_k or 16
    tau = 1 / math.sqrt(D) if scale is None else scale
    qk_scale = tau * LOG2E  # scores in log2 units, for exp2
    offset = 0 if alignment == "upper_left" else Tk - Tq
    # contiguous (B, H, T, D): q, o, do and dq share strides, and k, v, dk and dv theirs
    q, k, v, o, do = (t.contiguous() for t in (q, k, v, o, do))
    lse = lse.contiguous()
    delta = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    pad = max(16, triton.next_power_of_2(D))
    dot = "ieee" if q.dtype == torch.float32 else "tf32"
    _delta_kernel[(triton.cdiv(Tq, block_q), H, B)](o, do, delta, *q.stride()[:3], H, Tq, HEAD_DIM=D,
                                                     HEAD_DIM_PAD=pad, BLOCK_Q=block_q)
    strides = (*q.stride()[:3], *k.stride()[:3])
    sizes = dict(HEAD_DIM=D, HEAD_DIM_PAD=pad, BLOCK_Q=block_q, BLOCK_K=block_k, CAUSAL=causal, DOT=dot)
    _dkdv_kernel[(triton.cdiv(Tk, block_k), H, B)](q, k, v, do, lse, delta, dk, dv, *strides, H, Tq, Tk, offset,
                                                    tau, qk_scale, **sizes)
    _dq_kernel[(triton.cdiv(Tq, block_q), H, B)](q, k, v, do, lse, delta, dq, *strides, H, Tq, Tk, offset,
                                                  tau, qk_scale, **sizes)
    return dq, dk, dv


def make_backward() -> SimpleNamespace:
    return SimpleNamespace(flash_attention_backward=flash_attention_backward)

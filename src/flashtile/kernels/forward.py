"""The FlashAttention forward pass as one Triton kernel, mirroring ``flashtile.reference.forward``.

One program owns BLOCK_Q query rows of one (batch, head). It loads its Q tile once, walks the K/V
tiles it needs while keeping the running max ``m``, the running sum ``l`` and the unnormalised
output ``acc`` in fp32 registers, and writes O and lse once. Nothing of size Tq x Tk touches HBM.

Compared with the PyTorch tier, the kernel adds only what the GPU forces on it:

* masks, because tiles are powers of two and Tq, Tk and the head dim need not be;
* pointer arithmetic from strides, so any layout works without a copy, in 64 bits;
* dtype handling: tensor-core dots in the input dtype with fp32 accumulation;
* base-2 exponentials, because the hardware computes 2**x, so log2(e) is folded into the scale
  and ``m`` is kept in base-2 units until lse is written.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._checks import check_alignment, check_attention_inputs, check_block, check_causal, resolve_scale
from ..reference.causal import diagonal_offset
from ._common import (
    KERNEL_DTYPES,
    check_head_dim,
    check_kernel_device,
    check_tile_size,
    full_key_tiles,
    is_interpreting,
    last_key_tile,
    program_offset,
)

LOG2E = math.log2(math.e)
LN2 = tl.constexpr(math.log(2.0))  # a constexpr global, so the jit function may read it
MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension, which holds B * H


# --8<-- [start:inner]
@triton.jit
def _attend_key_tiles(
    acc, l, m, q,
    k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
    i, d, first_k_index, end_k_index, Tk, offset, qk_scale,
    BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Fold key tiles first_k_index .. end_k_index - 1 into (acc, l, m); i holds the query rows.

    MASKED is a compile-time switch: the FULL tiles run the branch-free body, and only the tiles
    that straddle the diagonal or the end of the keys pay for the mask.
    """
    for k_index in range(first_k_index, end_k_index):
        k_start = k_index * BLOCK_K
        j = k_start + tl.arange(0, BLOCK_K)  # the key columns of this tile
        k_mask = d[:, None] < HEAD_DIM  # padding of the head dim up to a power of two
        v_mask = d[None, :] < HEAD_DIM
        if MASKED:
            k_mask = k_mask & (j[None, :] < Tk)
            v_mask = v_mask & (j[:, None] < Tk)
        k_ptrs = k_base + d[:, None].to(tl.int64) * stride_kd + j[None, :].to(tl.int64) * stride_kt
        if MASKED or HEAD_DIM != HEAD_DIM_PAD:
            k = tl.load(k_ptrs, mask=k_mask, other=0.0)  # K^T tile: (HEAD_DIM_PAD, BLOCK_K)
        else:
            k = tl.load(k_ptrs)
        s = tl.dot(q, k) * qk_scale  # (BLOCK_Q, BLOCK_K) fp32 scores, in base-2 units
        if MASKED:
            hidden = j[None, :] >= Tk  # padded keys must score -inf, not 0
            if CAUSAL:
                hidden = hidden | (j[None, :] > i[:, None] + offset)
            s = tl.where(hidden, float("-inf"), s)
        m_new = tl.maximum(m, tl.max(s, 1))
        if MASKED:
            # A row that has seen no key yet has m_new = -inf; subtracting it would give
            # exp(-inf - (-inf)) = NaN. Subtracting 0 instead gives p = 0 and alpha = 0.
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new  # a FULL tile gives every row a finite score
        alpha = tl.math.exp2(m - m_new_safe)  # shrink what we had to the new max
        p = tl.math.exp2(s - m_new_safe[:, None])
        l = alpha * l + tl.sum(p, 1)
        v_ptrs = v_base + j[:, None].to(tl.int64) * stride_vt + d[None, :].to(tl.int64) * stride_vd
        if MASKED or HEAD_DIM != HEAD_DIM_PAD:
            v = tl.load(v_ptrs, mask=v_mask, other=0.0)  # (BLOCK_K, HEAD_DIM_PAD)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)  # P in the input dtype for the tensor cores
        m = m_new
    return acc, l, m
# --8<-- [end:inner]


@triton.jit
def _forward_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    H, group, Tq, Tk, offset, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr,
):
    # --8<-- [start:program]
    q_tile = tl.program_id(0)
    if CAUSAL:  # launch the longest query tiles (most key tiles) first, so the short ones fill the tail
        q_tile = tl.num_programs(0) - 1 - q_tile
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    h_kv = h // group  # GQA: query head h reads the key/value head of its group, no copy
    q_start = q_tile * BLOCK_Q
    q_end = tl.minimum(q_start + BLOCK_Q, Tq)
    i = q_start + tl.arange(0, BLOCK_Q)  # the query rows of this tile
    d = tl.arange(0, HEAD_DIM_PAD)
    # --8<-- [end:program]

    # --8<-- [start:pointers]
    q_base = Q + program_offset(b, stride_qb) + program_offset(h, stride_qh)
    k_base = K + program_offset(b, stride_kb) + program_offset(h_kv, stride_kh)
    v_base = V + program_offset(b, stride_vb) + program_offset(h_kv, stride_vh)
    q_ptrs = q_base + i[:, None].to(tl.int64) * stride_qt + d[None, :].to(tl.int64) * stride_qd
    q_mask = (i[:, None] < Tq) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)  # loaded once, reused for every key tile
    # --8<-- [end:pointers]

    # --8<-- [start:state]
    m = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
    # --8<-- [end:state]

    # --8<-- [start:loops]
    if CAUSAL:
        n_full_tiles = full_key_tiles(q_start, Tk, offset, BLOCK_K)
        n_key_tiles = last_key_tile(q_end, Tk, offset, BLOCK_K)  # tiles past it are never loaded
    else:
        n_full_tiles = Tk // BLOCK_K  # every tile but a ragged last one
        n_key_tiles = tl.cdiv(Tk, BLOCK_K)
    acc, l, m = _attend_key_tiles(
        acc, l, m, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
        i, d, 0, n_full_tiles, Tk, offset, qk_scale,
        BLOCK_K, HEAD_DIM, HEAD_DIM_PAD, MASKED=False, CAUSAL=CAUSAL,
    )
    acc, l, m = _attend_key_tiles(
        acc, l, m, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
        i, d, n_full_tiles, n_key_tiles, Tk, offset, qk_scale,
        BLOCK_K, HEAD_DIM, HEAD_DIM_PAD, MASKED=True, CAUSAL=CAUSAL,
    )
    # --8<-- [end:loops]

    # --8<-- [start:epilogue]
    seen = l > 0.0  # False only for a row that sees no key at all
    l_safe = tl.where(seen, l, 1.0)  # such a row keeps acc = 0, so o = 0 rather than 0 / 0
    o = acc / l_safe[:, None]
    lse = tl.where(seen, (m + tl.math.log2(l_safe)) * LN2, float("-inf"))  # base 2 back to base e
    o_ptrs = (O + program_offset(b, stride_ob) + program_offset(h, stride_oh)
              + i[:, None].to(tl.int64) * stride_ot + d[None, :].to(tl.int64) * stride_od)
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=q_mask)
    lse_ptrs = LSE + program_offset(bh, Tq) + i
    tl.store(lse_ptrs, lse, mask=i < Tq)
    # --8<-- [end:epilogue]


# --8<-- [start:config]
def forward_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Default tile sizes and launch settings for the H200 (performance tuning is a later step).

    Bigger head dims make each tile heavier in shared memory and registers, so the tiles shrink;
    fp32 inputs take twice the bytes of fp16/bf16 ones. The interpreter runs every program one
    after another on the CPU, where fewer, larger tiles are faster, and stages and warps mean nothing.
    """
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    wide = head_dim_pad * (2 if dtype == torch.float32 else 1)  # bytes-weighted head dim
    if is_interpreting():
        return dict(block_q=32, block_k=32, num_warps=4, num_stages=1)
    if wide <= 128:  # measured on the H200: 8 warps beat 4 by 9% at D=64 and 51% at D=128
        return dict(block_q=128, block_k=64, num_warps=8, num_stages=3)
    if dtype != torch.float32:  # D = 256 in 16 bits: 455 TFLOP/s, against 354 for 64 x 32 tiles and 4 warps
        return dict(block_q=128, block_k=64, num_warps=8, num_stages=2)
    return dict(block_q=64, block_k=32, num_warps=4, num_stages=2)  # fp32 with D >= 128: twice the bytes
# --8<-- [end:config]


# --8<-- [start:launcher]
def flash_attention(
    q, k, v, causal=False, scale=None, alignment="upper_left", block_q=None, block_k=None, *,
    num_warps=None, num_stages=None,
):
    """Attention forward on the GPU, without materialising the Tq x Tk score matrix.

    Args:
        q: (B, H, Tq, D); k, v: (B, H_kv, Tk, D) with H a multiple of H_kv. fp16, bf16 or fp32
            (fp32 dots may run in tf32 on the GPU), any strides, 16 <= D <= 256.
        causal, alignment: the causal mask of ``flashtile.reference.causal``.
        scale: multiplies Q K^T; defaults to 1/sqrt(D).
        block_q, block_k: tile sizes (powers of two >= 16); defaults from ``forward_config``.
        num_warps, num_stages: launch settings, for benchmarks; defaults from ``forward_config``.

    Returns:
        o: (B, H, Tq, D) contiguous, in q's dtype. lse: (B, H, Tq) fp32, natural log; a row that
        sees no key gets o = 0 and lse = -inf.
    """
    shape = check_attention_inputs(q, k, v, dtypes=KERNEL_DTYPES)
    check_causal(causal)
    check_alignment(alignment)
    scale = resolve_scale(scale, shape.D)
    check_head_dim(shape.D)
    check_kernel_device("q", q)
    config = forward_config(shape.D, q.dtype)
    block_q = config["block_q"] if block_q is None else check_tile_size("block_q", check_block("block_q", block_q))
    block_k = config["block_k"] if block_k is None else check_tile_size("block_k", check_block("block_k", block_k))
    B, H, H_kv, Tq, Tk, D = shape
    if B * H > MAX_GRID_Y:
        raise ValueError(f"B * H must be at most {MAX_GRID_Y} (one grid row per head), got {B * H}")

    o = torch.empty((B, H, Tq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(Tq, block_q), B * H)
    _forward_kernel[grid](
        q, k, v, o, lse,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        H, shape.group, Tq, Tk, diagonal_offset(Tq, Tk, alignment), scale * LOG2E,
        HEAD_DIM=D, HEAD_DIM_PAD=max(16, triton.next_power_of_2(D)),
        BLOCK_Q=block_q, BLOCK_K=block_k, CAUSAL=causal,
        num_warps=num_warps or config["num_warps"], num_stages=num_stages or config["num_stages"],
    )
    return o, lse
# --8<-- [end:launcher]

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
  saved (m, l) (see ``flashtile.kernels._common.KernelScale``).

NaN and inf follow the package's one rule (docs: "flashtile.attention"): a row that sees a NaN or an
infinite score comes out NaN (lse NaN, or +inf for a +inf score, as torch.logsumexp gives); a row
that sees no key gives o = 0 and lse = -inf.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._checks import check_alignment, check_attention_inputs, check_causal, check_flag, resolve_scale
from ..reference.causal import diagonal_offset
from ._common import (
    KERNEL_DTYPES,
    apply_sign,
    check_kernel_device,
    check_launch,
    check_tile_size,
    dot_precision,
    full_key_tiles,
    head_batch_grid,
    head_dim_pad,
    is_interpreting,
    kernel_scale,
    last_key_tile,
    program_offset,
)

LN2 = tl.constexpr(math.log(2.0))  # a constexpr global, so the jit function may read it


# --8<-- [start:inner]
@triton.jit
def _attend_key_tiles(
    acc, l, m, q,
    k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
    i, d, first_k_index, end_k_index, Tk, offset, qk_scale,
    BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
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
        u = tl.dot(q, k, input_precision=DOT_PRECISION)  # (BLOCK_Q, BLOCK_K) fp32 raw dots; S = unit * u
        if MASKED:
            visible = j[None, :] < Tk  # padded keys must score -inf, not 0
            if CAUSAL:
                visible = visible & (j[None, :] <= i[:, None] + offset)
            u = tl.where(visible, u, float("-inf"))
        m_new = tl.maximum(m, tl.max(u, 1))
        # A row that has seen only -inf scores so far (masked keys, or keys scoring -inf) has m_new = -inf;
        # subtracting it would give exp(-inf - (-inf)) = NaN. Subtracting 0 instead gives p = 0 and
        # alpha = 0. One select per row, in every tile: a FULL tile can hold -inf scores too.
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2((m - m_new_safe) * qk_scale)  # shrink what we had to the new max
        p = tl.math.exp2((u - m_new_safe[:, None]) * qk_scale)  # u - m first: exact for the max
        l = alpha * l + tl.sum(p, 1)
        v_ptrs = v_base + j[:, None].to(tl.int64) * stride_vt + d[None, :].to(tl.int64) * stride_vd
        if MASKED or HEAD_DIM != HEAD_DIM_PAD:
            v = tl.load(v_ptrs, mask=v_mask, other=0.0)  # (BLOCK_K, HEAD_DIM_PAD)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)  # P in the input dtype
        m = m_new
    return acc, l, m
# --8<-- [end:inner]


@triton.jit
def _forward_kernel(
    Q, K, V, O, LSE, M, L,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    H, group, Tq, Tk, offset, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, SIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # --8<-- [start:program]
    q_index = tl.program_id(0)
    if CAUSAL:  # launch the longest query tiles (most key tiles) first, so the short ones fill the tail
        q_index = tl.num_programs(0) - 1 - q_index
    h = tl.program_id(1)
    b = tl.program_id(2)
    h_kv = h // group  # GQA: query head h reads the key/value head of its group, no copy
    q_start = q_index * BLOCK_Q
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
    q = apply_sign(q, SIGN)  # sign(τ) · q, so that the raw dots u order the scores as S = τ q·k does
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
        BLOCK_K, HEAD_DIM, HEAD_DIM_PAD, MASKED=False, CAUSAL=CAUSAL, DOT_PRECISION=DOT_PRECISION,
    )
    acc, l, m = _attend_key_tiles(
        acc, l, m, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
        i, d, n_full_tiles, n_key_tiles, Tk, offset, qk_scale,
        BLOCK_K, HEAD_DIM, HEAD_DIM_PAD, MASKED=True, CAUSAL=CAUSAL, DOT_PRECISION=DOT_PRECISION,
    )
    # --8<-- [end:loops]

    # --8<-- [start:epilogue]
    empty = l == 0.0  # True only for a row that sees no key (a NaN l is not 0: that row stays NaN)
    l_safe = tl.where(empty, 1.0, l)  # such a row keeps acc = 0, so o = 0 rather than 0 / 0
    o = acc / l_safe[:, None]
    lse = (m * qk_scale + tl.math.log2(l_safe)) * LN2  # natural units: unit * m + ln l
    lse = tl.where(m == float("inf"), m, lse)  # a +inf score: lse = +inf, as torch.logsumexp says
    lse = tl.where(empty, float("-inf"), lse)
    o_ptrs = (O + program_offset(b, stride_ob) + program_offset(h, stride_oh)
              + i[:, None].to(tl.int64) * stride_ot + d[None, :].to(tl.int64) * stride_od)
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=q_mask)
    row = program_offset(b * H + h, Tq) + i  # lse and the (m, l) statistics are (B, H, Tq), contiguous
    tl.store(LSE + row, lse, mask=i < Tq)
    tl.store(M + row, m, mask=i < Tq)  # for the backward: the final (m, l), m in raw-dot units
    tl.store(L + row, l, mask=i < Tq)
    # --8<-- [end:epilogue]


# --8<-- [start:config]
def forward_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Default tile sizes and launch settings for the H200 (performance tuning is a later step).

    Bigger head dims make each tile heavier in shared memory and registers, so the tiles shrink;
    fp32 inputs take twice the bytes of fp16/bf16 ones. The interpreter runs every program one
    after another on the CPU, where fewer, larger tiles are faster, and stages and warps mean nothing.
    """
    wide = head_dim_pad(head_dim) * (2 if dtype == torch.float32 else 1)  # bytes-weighted head dim
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
    num_warps=None, num_stages=None, return_stats=False,
):
    """Attention forward on the GPU, without materialising the Tq x Tk score matrix.

    Args:
        q: (B, H, Tq, D); k, v: (B, H_kv, Tk, D) with H a multiple of H_kv. fp16, bf16 or fp32
            (fp32 dots in full fp32, never tf32), any strides, 1 <= D <= 256.
        causal, alignment: the causal mask of ``flashtile.reference.causal``.
        scale: τ, multiplies Q K^T; defaults to 1/sqrt(D). Zero and negative values are allowed.
        block_q, block_k: tile sizes (powers of two >= 16); defaults from ``forward_config``.
        num_warps, num_stages: launch settings, for benchmarks; defaults from ``forward_config``.
        return_stats: also return the final (m, l) of every row, the exact hand-off to
            ``flash_attention_backward(..., stats=...)``.

    Returns:
        o: (B, H, Tq, D) contiguous, in q's dtype. lse: (B, H, Tq) fp32, natural log; a row that
        sees no key gets o = 0 and lse = -inf. With return_stats, also stats: (2, B, H, Tq) fp32,
        stats[0] = m (the row max of the raw dots sign(τ)·q·k) and stats[1] = l.
    """
    shape = check_attention_inputs(q, k, v, dtypes=KERNEL_DTYPES)
    check_causal(causal)
    check_alignment(alignment)
    return_stats = check_flag("return_stats", return_stats)
    scale = resolve_scale(scale, shape.D, q.dtype)
    check_kernel_device("q", q)
    config = forward_config(shape.D, q.dtype)
    block_q = config["block_q"] if block_q is None else check_tile_size("block_q", block_q)
    block_k = config["block_k"] if block_k is None else check_tile_size("block_k", block_k)
    num_warps, num_stages = check_launch(
        config["num_warps"] if num_warps is None else num_warps,
        config["num_stages"] if num_stages is None else num_stages,
    )
    B, H, H_kv, Tq, Tk, D = shape
    grid = head_batch_grid(triton.cdiv(Tq, block_q), H, B)
    units = kernel_scale(scale)

    o = torch.empty((B, H, Tq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
    stats = torch.empty((2, B, H, Tq), dtype=torch.float32, device=q.device)
    _forward_kernel[grid](
        q, k, v, o, lse, stats[0], stats[1],
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        H, shape.group, Tq, Tk, diagonal_offset(Tq, Tk, alignment), units.qk_scale,
        HEAD_DIM=D, HEAD_DIM_PAD=head_dim_pad(D),
        BLOCK_Q=block_q, BLOCK_K=block_k, CAUSAL=causal, SIGN=units.sign,
        DOT_PRECISION=dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    return (o, lse, stats) if return_stats else (o, lse)
# --8<-- [end:launcher]

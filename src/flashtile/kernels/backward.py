"""FlashAttention backward in Triton: delta, then dK/dV with key tiles outer, then dQ with query tiles outer.

Mirrors ``flashtile.reference.backward``: same names in the same order (delta, p, dp, ds, dq, dk, dv, lse,
offset). What differs is what the GPU forces: pointers and masks instead of slices, float32
accumulators, the probabilities cast back to the input dtype before they enter a matmul, and two kernels
instead of one loop nest, because a GPU program may only write what it owns.

Why two kernels: dK and dV for key tile j are sums over query tiles, dQ for query tile i is a sum over key
tiles. A program that owns key tile j can hold dk and dv in registers and write them once; it cannot do the
same for dq, which every key tile touches. Writing dq from there would need floating-point atomics, whose
order (and so whose rounding) changes from run to run. So a second kernel owns query tiles and loops over
key tiles, recomputing S and P, and the backward stays bitwise deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._checks import (
    check_alignment,
    check_attention_inputs,
    check_block,
    check_causal,
    check_like,
    check_lse,
    resolve_scale,
)
from ..reference.causal import diagonal_offset
from ._common import KERNEL_DTYPES, check_head_dim, check_kernel_device, check_tile_size, is_interpreting
from .backward_preprocess import backward_preprocess, load_tile, store_tile

MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension, which holds B * H (or B * H_kv)


@triton.jit
def load_lse(LSE, stride_lt, rows, Tq):
    """lse for ``rows``, with -inf (a row that sees no key) and padding rows both turned into +inf.

    The backward recomputes p = exp(s - lse). With lse = -inf that is exp(+inf); with lse = +inf it is
    exp(-inf) = 0, which is exactly the zero contribution such a row must make. No NaN can appear.
    """
    lse = tl.load(LSE + rows.to(tl.int64) * stride_lt, mask=rows < Tq, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def visible(rows, keys, Tk, offset, CAUSAL: tl.constexpr):
    """Which (row, key) pairs contribute: keys inside [0, Tk) and, if causal, j <= i + offset."""
    ok = keys[None, :] < Tk
    if CAUSAL:
        ok = ok & (keys[None, :] <= rows[:, None] + offset)
    return ok


# --8<-- [start:dkdv]
@triton.jit
def backward_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_lb, stride_lh, stride_lt,
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_dvb, stride_dvh, stride_dvt, stride_dvd,
    H, H_kv, Tq, Tk, head_dim, scale, offset,
    CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (key tile, batch * kv head): dk, dv for that tile, summed over the group's heads."""
    k_start = tl.program_id(0) * BLOCK_K
    bg = tl.program_id(1).to(tl.int64)
    b = bg // H_kv
    g = bg % H_kv  # the kv head; query heads g * group .. g * group + group - 1 read it
    group = H // H_kv
    keys = k_start + tl.arange(0, BLOCK_K)
    cols = tl.arange(0, HEAD_DIM)
    k_tile = load_tile(K + b * stride_kb + g * stride_kh, stride_kt, stride_kd, keys, cols, Tk, head_dim)
    v_tile = load_tile(V + b * stride_vb + g * stride_vh, stride_vt, stride_vd, keys, cols, Tk, head_dim)
    dk = tl.zeros((BLOCK_K, HEAD_DIM), dtype=tl.float32)  # lives in registers for the whole program
    dv = tl.zeros((BLOCK_K, HEAD_DIM), dtype=tl.float32)
    q_lo = 0
    if CAUSAL:  # the first query that sees key k_start is i = k_start - offset; start at its tile
        q_lo = (tl.maximum(k_start - offset, 0) // BLOCK_Q) * BLOCK_Q
    for r in range(0, group):  # the group's query heads, in a fixed order: no atomics, no partials
        h = g * group + r
        q_ptr = Q + b * stride_qb + h * stride_qh
        do_ptr = DO + b * stride_dob + h * stride_doh
        for q_start in range(q_lo, Tq, BLOCK_Q):
            rows = q_start + tl.arange(0, BLOCK_Q)
            q_tile = load_tile(q_ptr, stride_qt, stride_qd, rows, cols, Tq, head_dim)
            do_tile = load_tile(do_ptr, stride_dot, stride_dod, rows, cols, Tq, head_dim)
            lse = load_lse(LSE + b * stride_lb + h * stride_lh, stride_lt, rows, Tq)
            delta = tl.load(DELTA + (b * H + h) * Tq + rows, mask=rows < Tq, other=0.0)
            s = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION) * scale
            s = tl.where(visible(rows, keys, Tk, offset, CAUSAL), s, float("-inf"))
            p = tl.exp(s - lse[:, None])  # P recomputed from lse: the forward's P, never stored
            dv += tl.dot(tl.trans(p.to(do_tile.dtype)), do_tile, input_precision=DOT_PRECISION)
            dp = tl.dot(do_tile, tl.trans(v_tile), input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q_tile.dtype)), q_tile, input_precision=DOT_PRECISION)
    dk = dk * scale  # S = scale * Q K^T, so dK = scale * dS^T Q
    store_tile(DK + b * stride_dkb + g * stride_dkh, stride_dkt, stride_dkd, keys, cols, Tk, head_dim, dk)
    store_tile(DV + b * stride_dvb + g * stride_dvh, stride_dvt, stride_dvd, keys, cols, Tk, head_dim, dv)
# --8<-- [end:dkdv]


# --8<-- [start:dq]
@triton.jit
def backward_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_lb, stride_lh, stride_lt,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    H, H_kv, Tq, Tk, head_dim, scale, offset,
    CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (query tile, batch * head): dq for that tile, a sum over its key tiles."""
    q_start = tl.program_id(0) * BLOCK_Q
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    g = h // (H // H_kv)  # the kv head this query head reads: K and V are indexed, never repeated
    rows = q_start + tl.arange(0, BLOCK_Q)
    cols = tl.arange(0, HEAD_DIM)
    q_tile = load_tile(Q + b * stride_qb + h * stride_qh, stride_qt, stride_qd, rows, cols, Tq, head_dim)
    do_tile = load_tile(DO + b * stride_dob + h * stride_doh, stride_dot, stride_dod, rows, cols, Tq, head_dim)
    lse = load_lse(LSE + b * stride_lb + h * stride_lh, stride_lt, rows, Tq)
    delta = tl.load(DELTA + bh * Tq + rows, mask=rows < Tq, other=0.0)
    dq = tl.zeros((BLOCK_Q, HEAD_DIM), dtype=tl.float32)
    k_hi = Tk
    if CAUSAL:  # the tile's last row, min(q_start + BLOCK_Q, Tq) - 1, sees keys up to that row + offset
        k_hi = tl.minimum(tl.maximum(tl.minimum(q_start + BLOCK_Q, Tq) + offset, 0), Tk)
    k_ptr = K + b * stride_kb + g * stride_kh
    v_ptr = V + b * stride_vb + g * stride_vh
    for k_start in range(0, k_hi, BLOCK_K):
        keys = k_start + tl.arange(0, BLOCK_K)
        k_tile = load_tile(k_ptr, stride_kt, stride_kd, keys, cols, Tk, head_dim)
        v_tile = load_tile(v_ptr, stride_vt, stride_vd, keys, cols, Tk, head_dim)
        s = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION) * scale
        s = tl.where(visible(rows, keys, Tk, offset, CAUSAL), s, float("-inf"))
        p = tl.exp(s - lse[:, None])
        dp = tl.dot(do_tile, tl.trans(v_tile), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k_tile.dtype), k_tile, input_precision=DOT_PRECISION)
    dq = dq * scale  # dQ = scale * dS K
    store_tile(DQ + b * stride_dqb + h * stride_dqh, stride_dqt, stride_dqd, rows, cols, Tq, head_dim, dq)
# --8<-- [end:dq]


# --8<-- [start:config]
def backward_config(head_dim: int, dtype: torch.dtype) -> dict:
    """(block_q, block_k, num_warps, num_stages) for each kernel, by head dim and dtype.

    The dK/dV kernel keeps k, v, dk and dv of BLOCK_K keys resident while query tiles stream past,
    the dQ kernel keeps q, do and dq of BLOCK_Q queries. On the H200 a 64 x 64 dK/dV tile with 4 warps
    beat 64 x 128 tiles by 1.5-1.7x (bench/results/backward-config-sweep.json): four fp32-sized resident
    tiles of 128 rows are more than the register file holds. fp32 inputs count as twice the head dim.
    The interpreter runs programs one after another: fewer, larger tiles are faster there.
    """
    wide = max(16, triton.next_power_of_2(head_dim)) * (2 if dtype == torch.float32 else 1)
    if is_interpreting():
        return dict(dkdv=(32, 32, 4, 1), dq=(32, 32, 4, 1))
    if wide <= 128:  # from bench/results/backward-config-sweep.json (H200, T = 8192, D = 64 and 128)
        return dict(dkdv=(64, 64, 4, 3), dq=(128, 64, 8, 3))
    return dict(dkdv=(32, 64, 4, 1), dq=(64, 32, 4, 1))
# --8<-- [end:config]


# --8<-- [start:launcher]
def flash_attention_backward(
    q, k, v, o, lse, do, causal=False, scale=None, block_q=None, block_k=None, alignment="upper_left", *, config=None
):
    """Gradients of attention from the forward's o and lse, with three Triton launches.

    Args:
        q: (B, H, Tq, D); k, v: (B, H_kv, Tk, D), H a multiple of H_kv; fp16, bf16 or fp32, any strides.
        o, do: like q (do may be non-contiguous). lse: (B, H, Tq) float32 from the forward.
        block_q, block_k: override both kernels' tile sizes (powers of two >= 16); None picks per kernel.
        config: replaces ``backward_config``'s choice, {"dkdv": (bq, bk, warps, stages), "dq": (...)};
            for tuning sweeps.

    Returns:
        dq like q; dk, dv like k (contiguous), each accumulated in float32 and cast to the input dtype.
    """
    shape = check_attention_inputs(q, k, v, dtypes=KERNEL_DTYPES)
    check_like("o", o, "q", q)
    check_like("do", do, "q", q)
    check_lse(lse, shape, q)
    check_causal(causal)
    offset = diagonal_offset(shape.Tq, shape.Tk, check_alignment(alignment))
    scale = resolve_scale(scale, shape.D)
    check_head_dim(shape.D)
    check_kernel_device("q", q)
    if block_q is not None:
        check_tile_size("block_q", check_block("block_q", block_q))
    if block_k is not None:
        check_tile_size("block_k", check_block("block_k", block_k))
    if shape.B * shape.H > MAX_GRID_Y:
        raise ValueError(f"B * H must be at most {MAX_GRID_Y} (one grid row per head), got {shape.B * shape.H}")
    head_dim_padded = max(16, triton.next_power_of_2(shape.D))  # 80 -> 128, masked past D
    config = config or backward_config(shape.D, q.dtype)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 stays fp32; 16-bit ignores it

    delta = backward_preprocess(o, do, block_q or config["dq"][0], head_dim_padded)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    common = (shape.H, shape.H_kv, shape.Tq, shape.Tk, shape.D, scale, offset)

    bq, bk, warps, stages = config["dkdv"]
    bq, bk = block_q or bq, block_k or bk
    backward_dkdv_kernel[(triton.cdiv(shape.Tk, bk), shape.B * shape.H_kv)](
        q, k, v, do, lse, delta, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *lse.stride(), *dk.stride(), *dv.stride(),
        *common, CAUSAL=causal, BLOCK_Q=bq, BLOCK_K=bk, HEAD_DIM=head_dim_padded,
        DOT_PRECISION=precision, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    bq, bk, warps, stages = config["dq"]
    bq, bk = block_q or bq, block_k or bk
    backward_dq_kernel[(triton.cdiv(shape.Tq, bq), shape.B * shape.H)](
        q, k, v, do, lse, delta, dq,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *lse.stride(), *dq.stride(),
        *common, CAUSAL=causal, BLOCK_Q=bq, BLOCK_K=bk, HEAD_DIM=head_dim_padded,
        DOT_PRECISION=precision, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dq, dk, dv
# --8<-- [end:launcher]

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

The hand-off from the forward: P is rebuilt as exp2((u - m) · qk_scale - log2 l) from the forward's own
final (m, l) and the same raw dots u = (sign · q)·k, in the same units (``_common.KernelScale``). The largest
score of a row then gives exactly 1 / l at any magnitude of the logits. Given only a natural-log lse (from
elsewhere: a merge across devices, say), the backward uses m = lse / |τ| and l = 1, which is as exact as
lse itself: its rounding, relative to |lse|, becomes an error in P of the same relative size times |lse|.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._checks import (
    check_alignment,
    check_attention_inputs,
    check_causal,
    check_flag,
    check_like,
    check_lse,
    check_tensor,
    resolve_scale,
)
from ..reference.causal import diagonal_offset
from ._common import (
    KERNEL_DTYPES,
    apply_sign,
    check_kernel_device,
    check_launch,
    check_tile_size,
    dot_precision,
    first_query_row,
    head_batch_grid,
    head_dim_pad,
    is_interpreting,
    kernel_scale,
    load_tile,
    store_tile,
)
from .backward_preprocess import backward_preprocess


# --8<-- [start:row_stats]
@triton.jit
def load_row_stats(M, L, rows, Tq):
    """The forward's final (m, l) for ``rows``, as (m, log2 l) ready for p = exp2((u - m) * qk_scale - log2 l).

    A row that sees no key (l = 0) and a padding row both get m = +inf and log2 l = 0: then
    u - m = -inf and p = exp2(-inf) = 0, exactly the zero contribution such a row must make. A NaN in
    m or l is kept, so a row that saw a NaN gets NaN gradients.
    """
    m = tl.load(M + rows, mask=rows < Tq, other=float("inf"))
    l = tl.load(L + rows, mask=rows < Tq, other=0.0)
    empty = l == 0.0
    return tl.where(empty, float("inf"), m), tl.math.log2(tl.where(empty, 1.0, l))


@triton.jit
def visible(rows, keys, Tq, Tk, offset, CAUSAL: tl.constexpr):
    """Which (row, key) pairs contribute: rows inside [0, Tq), keys inside [0, Tk) and, if causal,
    j <= i + offset. Padding rows load q = 0, and 0 * inf is NaN: they must give P = 0 explicitly."""
    ok = (rows[:, None] < Tq) & (keys[None, :] < Tk)
    if CAUSAL:
        ok = ok & (keys[None, :] <= rows[:, None] + offset)
    return ok


@triton.jit
def recompute_p(u, m, log2_l, qk_scale, keep):
    """P for one tile from the raw dots u and the forward's (m, log2 l); 0 where the forward masked.

    The mask is applied to P itself, not to u: a row whose statistics are NaN must still give 0, not
    NaN, for the keys it never saw.
    """
    p = tl.math.exp2((u - m[:, None]) * qk_scale - log2_l[:, None])
    return tl.where(keep, p, 0.0)
# --8<-- [end:row_stats]


# --8<-- [start:dkdv]
@triton.jit
def backward_dkdv_kernel(
    Q, K, V, DO, M, L, DELTA, DK, DV, DQ_ACC,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_dvb, stride_dvh, stride_dvt, stride_dvd,
    H, H_kv, Tq, Tk, head_dim, unit, scale, qk_scale, offset,
    CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    SIGN: tl.constexpr, DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):  # fmt: skip
    """One program per (key tile, kv head, batch): dk, dv for that tile, summed over the group's heads.

    With ATOMIC_DQ the same program also adds this key tile's share of dq, τ dS K, into DQ_ACC, a float32
    (B, H, Tq, HEAD_DIM_PAD) buffer, with atomic adds: one kernel and five matmuls per tile instead of
    seven over two kernels, at the price of a summation order that changes from run to run."""
    k_start = tl.program_id(0) * BLOCK_K
    h_kv = tl.program_id(1).to(tl.int64)  # the kv head; query heads h_kv * group + r, r < group, read it
    b = tl.program_id(2).to(tl.int64)
    group = H // H_kv
    keys = k_start + tl.arange(0, BLOCK_K)
    cols = tl.arange(0, HEAD_DIM_PAD)
    k_tile = load_tile(K + b * stride_kb + h_kv * stride_kh, stride_kt, stride_kd, keys, cols, Tk, head_dim)
    v_tile = load_tile(V + b * stride_vb + h_kv * stride_vh, stride_vt, stride_vd, keys, cols, Tk, head_dim)
    dk = tl.zeros((BLOCK_K, HEAD_DIM_PAD), dtype=tl.float32)  # lives in registers for the whole program
    dv = tl.zeros((BLOCK_K, HEAD_DIM_PAD), dtype=tl.float32)
    q_lo = 0
    if CAUSAL:  # start at the tile of the first query that sees key k_start
        q_lo = (first_query_row(k_start, offset) // BLOCK_Q) * BLOCK_Q
    for r in range(0, group):  # the group's query heads, in a fixed order: no atomics, no partials
        h = h_kv * group + r
        q_ptr = Q + b * stride_qb + h * stride_qh
        do_ptr = DO + b * stride_dob + h * stride_doh
        row_base = (b * H + h) * Tq  # m, l and delta are (B, H, Tq), contiguous
        for q_start in range(q_lo, Tq, BLOCK_Q):
            rows = q_start + tl.arange(0, BLOCK_Q)
            q_tile = apply_sign(load_tile(q_ptr, stride_qt, stride_qd, rows, cols, Tq, head_dim), SIGN)
            do_tile = load_tile(do_ptr, stride_dot, stride_dod, rows, cols, Tq, head_dim)
            m, log2_l = load_row_stats(M + row_base, L + row_base, rows, Tq)
            delta = tl.load(DELTA + row_base + rows, mask=rows < Tq, other=0.0)
            u = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION)  # the forward's raw dots
            keep = visible(rows, keys, Tq, Tk, offset, CAUSAL)
            p = recompute_p(u, m, log2_l, qk_scale, keep)  # never stored
            dv += tl.dot(tl.trans(p.to(do_tile.dtype)), do_tile, input_precision=DOT_PRECISION)
            dp = tl.dot(do_tile, tl.trans(v_tile), input_precision=DOT_PRECISION)
            ds = tl.where(keep, p * (dp - delta[:, None]), 0.0)  # a hidden pair: 0, even if its row is NaN
            dk += tl.dot(tl.trans(ds.to(q_tile.dtype)), q_tile, input_precision=DOT_PRECISION)
            if ATOMIC_DQ:  # this key tile's share of dQ = τ dS K; other key tiles add theirs concurrently
                dq_share = tl.dot(ds.to(k_tile.dtype), k_tile, input_precision=DOT_PRECISION) * scale
                dq_ptrs = DQ_ACC + (row_base + rows)[:, None] * HEAD_DIM_PAD + cols[None, :]
                tl.atomic_add(dq_ptrs, dq_share, mask=(rows[:, None] < Tq) & (cols[None, :] < head_dim))
    dk = dk * unit  # S = τ Q K^T = unit (sign Q) K^T, so dK = unit * dS^T (sign Q)
    store_tile(DK + b * stride_dkb + h_kv * stride_dkh, stride_dkt, stride_dkd, keys, cols, Tk, head_dim, dk)
    store_tile(DV + b * stride_dvb + h_kv * stride_dvh, stride_dvt, stride_dvd, keys, cols, Tk, head_dim, dv)
# --8<-- [end:dkdv]


# --8<-- [start:dq]
@triton.jit
def backward_dq_kernel(
    Q, K, V, DO, M, L, DELTA, DQ,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    H, H_kv, Tq, Tk, head_dim, scale, qk_scale, offset,
    CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    SIGN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (query tile, head, batch): dq for that tile, a sum over its key tiles."""
    q_start = tl.program_id(0) * BLOCK_Q
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    h_kv = h // (H // H_kv)  # the kv head this query head reads: K and V are indexed, never repeated
    rows = q_start + tl.arange(0, BLOCK_Q)
    cols = tl.arange(0, HEAD_DIM_PAD)
    row_base = (b * H + h) * Tq  # m, l and delta are (B, H, Tq), contiguous
    q_tile = load_tile(Q + b * stride_qb + h * stride_qh, stride_qt, stride_qd, rows, cols, Tq, head_dim)
    q_tile = apply_sign(q_tile, SIGN)  # sign(τ) · q, as in the forward
    do_tile = load_tile(DO + b * stride_dob + h * stride_doh, stride_dot, stride_dod, rows, cols, Tq, head_dim)
    m, log2_l = load_row_stats(M + row_base, L + row_base, rows, Tq)
    delta = tl.load(DELTA + row_base + rows, mask=rows < Tq, other=0.0)
    dq = tl.zeros((BLOCK_Q, HEAD_DIM_PAD), dtype=tl.float32)
    k_hi = Tk
    if CAUSAL:  # the tile's last row, min(q_start + BLOCK_Q, Tq) - 1, sees keys up to that row + offset
        k_hi = tl.minimum(tl.maximum(tl.minimum(q_start + BLOCK_Q, Tq) + offset, 0), Tk)
    k_ptr = K + b * stride_kb + h_kv * stride_kh
    v_ptr = V + b * stride_vb + h_kv * stride_vh
    for k_start in range(0, k_hi, BLOCK_K):
        keys = k_start + tl.arange(0, BLOCK_K)
        k_tile = load_tile(k_ptr, stride_kt, stride_kd, keys, cols, Tk, head_dim)
        v_tile = load_tile(v_ptr, stride_vt, stride_vd, keys, cols, Tk, head_dim)
        u = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION)
        keep = visible(rows, keys, Tq, Tk, offset, CAUSAL)
        p = recompute_p(u, m, log2_l, qk_scale, keep)
        dp = tl.dot(do_tile, tl.trans(v_tile), input_precision=DOT_PRECISION)
        ds = tl.where(keep, p * (dp - delta[:, None]), 0.0)
        dq += tl.dot(ds.to(k_tile.dtype), k_tile, input_precision=DOT_PRECISION)
    dq = dq * scale  # dQ = τ dS K, with the signed τ
    store_tile(DQ + b * stride_dqb + h * stride_dqh, stride_dqt, stride_dqd, rows, cols, Tq, head_dim, dq)
# --8<-- [end:dq]


# --8<-- [start:config]
def backward_config(head_dim: int, dtype: torch.dtype) -> dict:
    """(block_q, block_k, num_warps, num_stages) for each kernel, by head dim and dtype.

    The dK/dV kernel keeps k, v, dk and dv of BLOCK_K keys resident while query tiles stream past,
    the dQ kernel keeps q, do and dq of BLOCK_Q queries. On the H200 a 64 x 64 dK/dV tile with 4 warps
    beat 64 x 128 tiles by 1.5-1.7x (bench/results/sweeps/backward-configs.json): four fp32-sized resident
    tiles of 128 rows are more than the register file holds. fp32 inputs count as twice the head dim.
    The interpreter runs programs one after another: fewer, larger tiles are faster there.
    """
    wide = head_dim_pad(head_dim) * (2 if dtype == torch.float32 else 1)
    if is_interpreting():
        return dict(dkdv=(32, 32, 4, 1), dq=(32, 32, 4, 1))
    if wide <= 128:  # from bench/results/sweeps/backward-configs.json (H200, T = 8192, D = 64 and 128)
        return dict(dkdv=(64, 64, 4, 3), dq=(128, 64, 8, 3))
    return dict(dkdv=(32, 64, 4, 1), dq=(64, 32, 4, 1))
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


def stats_from_lse(lse: torch.Tensor, scale: float) -> torch.Tensor:
    """(m, l) for the kernels from a natural-log lse alone: m = lse / |τ| in raw-dot units, l = 1.

    exp2((u - m) * qk_scale) is then exp(S - lse). A row with lse = -inf becomes (m, l) = (-inf, 0).
    """
    m = lse.float() / kernel_scale(scale).unit
    l = torch.where(torch.isneginf(lse), 0.0, 1.0).to(torch.float32)
    return torch.stack([m, l])


# --8<-- [start:launcher]
def flash_attention_backward(
    q, k, v, o, lse, do, causal=False, scale=None, alignment="upper_left", block_q=None, block_k=None, *,
    stats=None, config=None, deterministic=True,
):
    """Gradients of attention from the forward's o and lse, with three Triton launches.

    Args:
        q: (B, H, Tq, D); k, v: (B, H_kv, Tk, D), H a multiple of H_kv; fp16, bf16 or fp32, any strides.
        o, do: like q (do may be non-contiguous). lse: (B, H, Tq) float32 from the forward.
        causal, scale, alignment: as in the forward (the positional order of ``flash_attention``).
        block_q, block_k: override both kernels' tile sizes (powers of two >= 16); None picks per kernel.
        stats: the forward's (2, B, H, Tq) final (m, l), from ``flash_attention(..., return_stats=True)``:
            the exact hand-off. Without it, (m, l) are derived from lse (``stats_from_lse``).
        config: replaces ``backward_config``'s choice, {"dkdv": (bq, bk, warps, stages), "dq": (...)};
            for tuning sweeps.
        deterministic: True (the default) computes dQ in its own kernel, bitwise the same on every run;
            False adds it up with float32 atomics inside the dK/dV kernel (two launches, five matmuls
            per tile instead of seven), whose summation order, and so whose last bits, vary between runs.

    Returns:
        dq like q; dk, dv like k (contiguous), each accumulated in float32 and cast to the input dtype.
    """
    shape = check_attention_inputs(q, k, v, dtypes=KERNEL_DTYPES)
    check_like("o", o, "q", q)
    check_like("do", do, "q", q)
    check_lse(lse, shape, q)
    check_causal(causal)
    offset = diagonal_offset(shape.Tq, shape.Tk, check_alignment(alignment))
    scale = resolve_scale(scale, shape.D, q.dtype)
    check_kernel_device("q", q)
    block_q = None if block_q is None else check_tile_size("block_q", block_q)
    block_k = None if block_k is None else check_tile_size("block_k", block_k)
    config = backward_config(shape.D, q.dtype) if config is None else check_config(config)
    if stats is None:
        stats = stats_from_lse(lse, scale)
    check_tensor("stats", stats, rank=4, dtypes=(torch.float32,))
    if tuple(stats.shape) != (2, *lse.shape) or stats.device != q.device:
        raise ValueError(f"stats must be (2, B, H, Tq) = {(2, *lse.shape)} on {q.device}, got {tuple(stats.shape)}")
    stats = stats.contiguous()
    units = kernel_scale(scale)
    deterministic = check_flag("deterministic", deterministic)

    delta = backward_preprocess(o, do, block_q or config["dq"][0])
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    pad = head_dim_pad(shape.D)
    common = dict(CAUSAL=causal, HEAD_DIM_PAD=pad, SIGN=units.sign, DOT_PRECISION=dot_precision(q.dtype))
    if deterministic:  # dQ gets its own kernel below, and the dK/dV kernel ignores this argument
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dq_acc = dq
    else:  # a float32 accumulator that every key tile adds into: zeroed first, cast once at the end
        dq_acc = torch.zeros((*q.shape[:3], pad), dtype=torch.float32, device=q.device)
    bq, bk, warps, stages = config["dkdv"]
    bq, bk = block_q or bq, block_k or bk
    backward_dkdv_kernel[head_batch_grid(triton.cdiv(shape.Tk, bk), shape.H_kv, shape.B)](
        q, k, v, do, stats[0], stats[1], delta, dk, dv, dq_acc,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        shape.H, shape.H_kv, shape.Tq, shape.Tk, shape.D, units.unit, scale, units.qk_scale, offset,
        BLOCK_Q=bq, BLOCK_K=bk, **common, ATOMIC_DQ=not deterministic, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if not deterministic:
        return dq_acc[..., : shape.D].to(q.dtype).contiguous(), dk, dv
    bq, bk, warps, stages = config["dq"]
    bq, bk = block_q or bq, block_k or bk
    backward_dq_kernel[head_batch_grid(triton.cdiv(shape.Tq, bq), shape.H, shape.B)](
        q, k, v, do, stats[0], stats[1], delta, dq,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        shape.H, shape.H_kv, shape.Tq, shape.Tk, shape.D, scale, units.qk_scale, offset,
        BLOCK_Q=bq, BLOCK_K=bk, **common, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dq, dk, dv
# --8<-- [end:launcher]

"""A measured probe, not part of the package: what stops the FP8 forward at 1.5x bf16, part by part.

The package's FP8 kernel (``flashtile.kernels.fp8_forward``) is timed as shipped beside the package's bf16
forward, and beside the probe's own copy of the FP8 kernel (``ablation_kernel``, the package's key step
with switches) with one part removed or changed at a time. The same copy with bf16 operands (q, k, v bf16,
every factor 1) is the bf16 *twin*: the same loop, tiles and launch order, so the two precisions differ in
nothing but their operands.

Variants (``variant`` in the rows; the letters are issue 34's ablation list):

* ``a_package``: the package's FP8 launch as shipped (its tiles; with these factors, one per head, its step
  without a factor on each score or a ratio on P); ``package_rows_64``: the package's general step (factors
  laid out one per row) at the copy's tiles, 128 x 64 (64 x 64 above D = 128), 8 warps; ``fp8_copy``: the
  probe's copy, every part on: the package's kernel before it took the levers (its output is compared with
  ``package_rows_64``, bit for bit or not, in ``copy_bit_equal``: the package now carries P's 448 in exp2's
  shift, so to float32 rounding, not bits); ``pv_outside_dot``: the
  copy with each tile's PV product summed from zero and added to acc in float32 outside the dot, instead of
  acc passed into the dot with ``max_num_imprecise_acc`` as the package does (the same sums; ptxas
  serialises every wgmma of the package's form, C7514, not of this one, yet this one measured 9-16 % slower
  in sweeps/fp8-forward-steps-pv-outside-dot.json), also compared with the package bit for bit;
* ``b_qk_fp8_pv_bf16``: QKᵀ in E4M3, P and V in bf16; ``c_qk_bf16_pv_fp8``: QKᵀ in bf16, PV in E4M3;
* ``d_cheap_exp``: both exp2 of the step (p and alpha) replaced by one multiply-add (numbers wrong,
  timing only), in E4M3 (``d_cheap_exp``) and in the twin (``bf16_cheap_exp``, issue 34's (f));
* ``e_matmuls_only``: no max, no exp2, no rescale, no l: t = QKᵀ·dk cast straight to the PV operand;
  ``bf16_matmuls_only`` the same in the twin; ``bf16_twin``: the twin with every part on;
* levers, each in E4M3 with everything else as shipped: ``lever_block_k128`` (128-key tiles; P would be
  rounded against a different running max than the emulation's, so timing only), ``lever_poly_half``
  (every odd column's exp2 by a cubic on the FMA pipe, FA3/FA4's split), ``lever_ex2_f16x2`` (exp2 of
  two values in one ``ex2.approx.f16x2`` by inline PTX, then straight to E4M3), ``lever_two_subtiles``
  (the query tile as two halves with their own (m, l, acc), both QKᵀ issued before either softmax, so that
  one half's softmax may run under the other's matmul), ``lever_warp_specialize`` (``tl.range(...,
  warp_specialize=True)`` on the key loops; recorded as an error where Triton refuses it on sm_90; compiled
  offline for sm_90 it gave the same register count as the copy, so it may be a no-op there);
  ``lever_pv_imprecise`` (the PV dot summed into acc in the E4M3 dot's own accumulator over every key tile,
  sm_90's default, instead of a float32 add of each tile's product: one add per acc entry a step fewer),
  ``lever_no_ratio`` (V per head or tensor, every ratio 1: 448 folded into exp2's shift, no multiply of P),
  ``lever_three`` (128-key tiles with both of those), ``lever_head_factors`` (no ratios, and k's factor one
  per head folded into dq: no multiply of the scores either; q, k, v quantised per head or tensor),
  ``lever_all`` (128-key tiles, all three), ``lever_maxnreg128`` (D = 64 only: a 128-register cap, so that two
  8-warp programs share an SM, as the
  bf16 forward does at D = 64; the copy needs 177 registers there, and compiles under the cap with no spill
  without a mask, 4 bytes with one), ``lever_maxnreg128_no_ratio_pv_imprecise`` and ``lever_maxnreg128_all``
  (D = 64 only); ``lever_64x128_4warps`` and ``lever_64x128_4warps_all`` (one warpgroup a program, 64 x 128
  tiles, 3 stages: two programs an SM at 255 registers and 74 KB of shared memory, D = 128).

The first run (``sweeps/fp8-forward-ablation.json``, at d89348c) measured the poly, f16x2, two-half-tile and
warp-specialised levers slower or unchanged; they are timed again only with ``FP8_ABLATION_LEVERS=all``.

From the rows ``summary`` rows (provider ``flashtile_fp8_model``, no time of their own) give per shape:
the matmul share of a key step, ``t_matmuls_only / t_full``, in each precision (the twin for bf16), the
softmax share (one minus it, the step assumed serial: nothing overlaps), and Amdahl's best FP8 speed-up over
the package's bf16 forward without overlap, ``t_bf16 / (t_fp8_matmuls_only + t_bf16_softmax)`` with the
softmax as the bf16 twin pays it, against what E4M3 reaches (``t_bf16 / t_a_package``) and a ceiling with
perfect overlap, ``t_bf16 / max(t_fp8_matmuls_only, t_bf16_softmax)``.

Run from the repository root on one H200 (about three minutes; most of it compiling the 96 launches' kernels, 78
distinct, in 8 processes):

    OUT=/some/folder PYTHONPATH=src python bench/probes/fp8/fp8_ablation.py

Kernels are compiled first in ``FP8_ABLATION_WORKERS`` processes (default 8; 1 compiles in the timing process
as it goes). ``FP8_ABLATION_SHAPES=all`` times every shape of the standard sweep's T = 4k and 16k (D 64, 128, causal
and not: eight) instead of the default five. ``FP8_ABLATION_INTERPRET=1`` with TRITON_INTERPRET=1 on a
CPU runs each variant Triton's interpreter can run (not the inline PTX, not warp specialisation) once at a
tiny shape and checks the copy with every part on against the float64 emulation: a check that the
probe runs, not a measurement. It writes ``$OUT/fp8-ablation.json`` (bench schema).
"""

from __future__ import annotations

import functools
import math
import os
import time
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flashtile.fp8 import quantize
from flashtile.kernels.fp8_forward import LOG2E, MIN_FP8_DOT, P_SCALE_JIT, fp8_config, launch_fp8_forward
from flashtile.kernels.parts import (
    full_key_tiles,
    heaviest_first_chunk,
    kernel_scale,
    last_key_tile,
    multiply_subtract,
    program_tile,
    resident_programs,
)

LN2 = tl.constexpr(math.log(2.0))
LOG2_P_SCALE = tl.constexpr(math.log2(448.0))
INTERPRET = os.environ.get("FP8_ABLATION_INTERPRET", "") == "1"
STANDARD = tuple((D, causal, T) for T in (4096, 16384) for D in (64, 128) for causal in (False, True))
DEFAULT_SHAPES = ((64, False, 16384), (64, True, 16384), (128, False, 16384), (128, True, 16384), (128, True, 4096))
METHOD = (
    "flashtile.bench.common.median_ms (triton.testing.do_bench median, warmup 25 ms, rep 100 ms) of one launch "
    "on ready inputs (factors and keys-contiguous V from flashtile.fp8.quantize, granularity 'head', N(0, 1) "
    "inputs); FLOPs 4·B·H·Tq·Tk·D (x0.5 causal). provider flashtile: the package's bf16 forward (the whole call); "
    "flashtile_fp8_launch: the package's FP8 kernel (variant a_package) or the probe's copy of its key step with "
    "one part removed or changed (variant names, module docstring); dtype bf16 for the bf16 twin's rows. "
    "Variants that change numbers are timing only. provider flashtile_fp8_model: Amdahl figures derived from "
    "the rows of the same shape, no time of their own"
)


@triton.jit
def exp2_poly(x):
    """2^x for x <= 0 on the FMA and integer pipes: 2^floor(x) from the exponent field, 2^f (f in [0, 1)) by a
    cubic (relative error about 1e-4, far below E4M3's 2^-4). Below -126 the answer is 0."""
    x = tl.maximum(x, -126.0)
    whole = tl.floor(x)
    f = x - whole
    poly = 1.0 + f * (0.69542437 + f * (0.22630767 + f * 0.07826796))  # 2^f on [0, 1]: both ends exact, 1.03e-4
    bits = poly.to(tl.int32, bitcast=True) + (whole.to(tl.int32) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def exp2_half_poly(x, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    """exp2 of every even column on the special-function unit, of every odd one by ``exp2_poly``."""
    even, odd = tl.split(x.reshape(BLOCK_Q, BLOCK_K // 2, 2))
    return tl.join(tl.math.exp2(even), exp2_poly(odd)).reshape(BLOCK_Q, BLOCK_K)


@triton.jit
def exp2_f16x2(x):
    """exp2 of x (float32) in float16, two values an instruction (ex2.approx.f16x2); returns float16."""
    return tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x.to(tl.float16)], dtype=tl.float16,
                                     is_pure=True, pack=2)  # fmt: skip


@triton.jit
def softmax_exp2(x, EXP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    """exp2 as a variant asks: 0 the special-function unit, 1 half by polynomial, 3 a multiply-add stand-in."""
    if EXP == 1:
        return exp2_half_poly(x, BLOCK_Q, BLOCK_K)
    if EXP == 3:
        return x * 0.015625 + 1.0  # timing only: one FFMA where the exponential was
    return tl.math.exp2(x)


@triton.jit
def ablation_step(acc, l, m, q, dq, k, v, dk, v_ratio, visible, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                  MASKED: tl.constexpr, QK8: tl.constexpr, PV8: tl.constexpr, SOFTMAX: tl.constexpr,
                  EXP: tl.constexpr, FLAGS: tl.constexpr):  # fmt: skip
    """The package's fold_fp8_key_tile after the loads, with switches. k (BLOCK_K, D); v (D, BLOCK_K) keys
    contiguous for PV8, else (BLOCK_K, D). SOFTMAX: 0 as shipped, 2 matmuls only. EXP: softmax_exp2's, and 2
    for ex2.approx.f16x2 (P made in float16, then E4M3). FLAGS: bit 1, the PV dot without max_num_imprecise_acc
    (summed into acc in the E4M3 dot's own accumulator, over every key tile); bit 8, the tile's PV product from
    zero, added to acc in float32 outside the dot (the same sums as the package's; ptxas does not serialise its
    wgmmas); bit 2, no V ratios on P (V per head or tensor: every ratio 1), 448 folded into exp2's shift, l
    summing 448 p; bit 4, k's factor one per head (granularity "head" or "tensor"), folded into dq, no multiply
    of the scores."""
    t = tl.dot(q, tl.trans(k))  # (BLOCK_Q, BLOCK_K)
    if (FLAGS & 4) == 0:  # k's factor per key (with bit 4 it is one per head, folded into dq by the caller)
        t = t * dk[None, :]
    if MASKED:
        t = tl.where(visible, t, float("-inf"))
    if SOFTMAX == 2:  # matmuls only: the scores go straight to the PV operand (numbers wrong)
        if PV8:
            acc = tl.dot(t.to(tl.float8e4nv), tl.trans(v), acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(t.to(v.dtype), v, acc)
        m_new = m
    else:
        acc, l, m_new = softmax_and_pv(acc, l, m, t, dq, v, v_ratio, BLOCK_Q, BLOCK_K, PV8, EXP, FLAGS)
    return acc, l, m_new


@triton.jit
def softmax_and_pv(acc, l, m, t, dq, v, v_ratio, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, PV8: tl.constexpr,
                   EXP: tl.constexpr, FLAGS: tl.constexpr):  # fmt: skip
    """The online softmax step and the PV product, as the package's, exp2 as EXP asks."""
    m_new = tl.maximum(m, tl.max(t, 1) * dq)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    if FLAGS & 2:  # 448 p = exp2(s - m + log2 448): the shift takes the scale, P needs no multiply
        x = multiply_subtract(t, dq[:, None], (m_safe - LOG2_P_SCALE)[:, None], False)
    else:
        x = multiply_subtract(t, dq[:, None], m_safe[:, None], False)  # s - m, in log2 units
    if EXP == 2:
        alpha = tl.math.exp2(m - m_safe)
        p16 = exp2_f16x2(x)
        l = alpha * l + tl.sum(p16.to(tl.float32), 1)
        if PV8:
            p_op = (p16 * (v_ratio[None, :] * P_SCALE_JIT).to(tl.float16)).to(tl.float8e4nv)
        else:
            p_op = p16.to(v.dtype)
    else:
        alpha = softmax_exp2(m - m_safe, 3 if EXP == 3 else 0, BLOCK_Q, BLOCK_K)
        p = softmax_exp2(x, EXP, BLOCK_Q, BLOCK_K)
        l = alpha * l + tl.sum(p, 1)
        if PV8 and FLAGS & 2:
            p_op = p.to(tl.float8e4nv)
        elif PV8:
            p_op = (p * (v_ratio[None, :] * P_SCALE_JIT)).to(tl.float8e4nv)
        else:
            p_op = p.to(v.dtype)
    if PV8 and FLAGS & 1:
        acc = tl.dot(p_op, tl.trans(v), acc * alpha[:, None])  # sm_90's default: every add in the E4M3 accumulator
    elif PV8 and FLAGS & 8:  # the tile's product from zero, added outside the dot: no C7514, measured slower
        acc = acc * alpha[:, None] + tl.dot(p_op, tl.trans(v))
    elif PV8:  # the package's: acc into the dot, added in float32 once a tile; ptxas serialises its wgmmas (C7514)
        acc = tl.dot(p_op, tl.trans(v), acc * alpha[:, None], max_num_imprecise_acc=BLOCK_K)
    else:
        acc = tl.dot(p_op, v, acc * alpha[:, None])
    return acc, l, m_new


@triton.jit
def load_key_tile(K, V, DK, VR, stride_kt, stride_kd, stride_vt, stride_vd, d, k_start, Tk,
                  HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, PV8: tl.constexpr):  # fmt: skip
    j = k_start + tl.arange(0, BLOCK_K).to(tl.int64)
    k = tl.load(K + j[:, None] * stride_kt + d[None, :] * stride_kd, mask=(j[:, None] < Tk) & (d[None, :] < HEAD_DIM),
                other=0.0)  # fmt: skip
    if PV8:  # (D_PAD, BLOCK_K), keys contiguous, as the package reads it
        v = tl.load(V + d[:, None] * stride_vd + j[None, :] * stride_vt,
                    mask=(d[:, None] < HEAD_DIM) & (j[None, :] < Tk), other=0.0)  # fmt: skip
    else:  # (BLOCK_K, D_PAD), row-major bf16, as the bf16 forward reads it
        v = tl.load(V + j[:, None] * stride_vt + d[None, :] * stride_vd,
                    mask=(j[:, None] < Tk) & (d[None, :] < HEAD_DIM), other=0.0)  # fmt: skip
    dk = tl.load(DK + j, mask=j < Tk, other=0.0)
    v_ratio = tl.load(VR + j, mask=j < Tk, other=0.0)
    return k, v, dk, v_ratio, j


@triton.jit
def key_loop(acc, l, m, q, dq, K, V, DK, VR, stride_kt, stride_kd, stride_vt, stride_vd, i, d, first, end, Tk,
             HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr,
             MASKED: tl.constexpr, QK8: tl.constexpr, PV8: tl.constexpr, SOFTMAX: tl.constexpr, EXP: tl.constexpr,
             WS: tl.constexpr, FLAGS: tl.constexpr):  # fmt: skip
    for k_index in tl.range(first, end, warp_specialize=WS):
        k, v, dk, v_ratio, j = load_key_tile(K, V, DK, VR, stride_kt, stride_kd, stride_vt, stride_vd, d,
                                             k_index * BLOCK_K, Tk, HEAD_DIM, BLOCK_K, PV8)  # fmt: skip
        visible = j[None, :] < Tk
        if CAUSAL:
            visible = visible & (j[None, :] <= i[:, None])
        acc, l, m = ablation_step(acc, l, m, q, dq, k, v, dk, v_ratio, visible, BLOCK_Q, BLOCK_K, MASKED, QK8, PV8,
                                  SOFTMAX, EXP, FLAGS)  # fmt: skip
    return acc, l, m


@triton.jit
def key_loop_two(acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, dq_a, dq_b, K, V, DK, VR, stride_kt, stride_kd,
                 stride_vt, stride_vd, i_a, i_b, d, first, end, Tk, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
                 BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """Two half tiles in one loop (E4M3, everything else as shipped): both QKᵀ first, then each softmax and PV."""
    for k_index in range(first, end):
        k, v, dk, v_ratio, j = load_key_tile(K, V, DK, VR, stride_kt, stride_kd, stride_vt, stride_vd, d,
                                             k_index * BLOCK_K, Tk, HEAD_DIM, BLOCK_K, True)  # fmt: skip
        t_a = tl.dot(q_a, tl.trans(k)) * dk[None, :]
        t_b = tl.dot(q_b, tl.trans(k)) * dk[None, :]
        if MASKED:
            visible_a = j[None, :] < Tk
            visible_b = j[None, :] < Tk
            if CAUSAL:
                visible_a = visible_a & (j[None, :] <= i_a[:, None])
                visible_b = visible_b & (j[None, :] <= i_b[:, None])
            t_a = tl.where(visible_a, t_a, float("-inf"))
            t_b = tl.where(visible_b, t_b, float("-inf"))
        m_new_a = tl.maximum(m_a, tl.max(t_a, 1) * dq_a)
        m_safe_a = tl.where(m_new_a == float("-inf"), 0.0, m_new_a)
        alpha_a = tl.math.exp2(m_a - m_safe_a)
        p_a = tl.math.exp2(multiply_subtract(t_a, dq_a[:, None], m_safe_a[:, None], False))
        l_a = alpha_a * l_a + tl.sum(p_a, 1)
        acc_a = tl.dot((p_a * (v_ratio[None, :] * P_SCALE_JIT)).to(tl.float8e4nv), tl.trans(v),
                       acc_a * alpha_a[:, None], max_num_imprecise_acc=BLOCK_K)  # fmt: skip
        m_a = m_new_a
        m_new_b = tl.maximum(m_b, tl.max(t_b, 1) * dq_b)
        m_safe_b = tl.where(m_new_b == float("-inf"), 0.0, m_new_b)
        alpha_b = tl.math.exp2(m_b - m_safe_b)
        p_b = tl.math.exp2(multiply_subtract(t_b, dq_b[:, None], m_safe_b[:, None], False))
        l_b = alpha_b * l_b + tl.sum(p_b, 1)
        acc_b = tl.dot((p_b * (v_ratio[None, :] * P_SCALE_JIT)).to(tl.float8e4nv), tl.trans(v),
                       acc_b * alpha_b[:, None], max_num_imprecise_acc=BLOCK_K)  # fmt: skip
        m_b = m_new_b
    return acc_a, l_a, m_a, acc_b, l_b, m_b


@triton.jit
def write_rows(acc, l, m, o_scale, log2_l_scale, O, LSE, i, d, Tq, stride_ot, stride_od, HEAD_DIM: tl.constexpr):
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    o = acc * (o_scale / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), (m + tl.math.log2(l_safe) - log2_l_scale) * LN2)
    tl.store(O + i[:, None] * stride_ot + d[None, :] * stride_od, o.to(O.dtype.element_ty),
             mask=(i[:, None] < Tq) & (d[None, :] < HEAD_DIM))  # fmt: skip
    tl.store(LSE + i, lse, mask=i < Tq)


@triton.jit
def ablation_kernel(
    Q, K, V, DQ, DK, VR, VS, O, LSE,
    stride_qb, stride_qh, stride_qt, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd, stride_ob, stride_oh, stride_ot, stride_od,
    H, Tq, Tk, qk_scale, chunk,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr, HEAVIEST_FIRST: tl.constexpr, QK8: tl.constexpr, PV8: tl.constexpr,
    SOFTMAX: tl.constexpr, EXP: tl.constexpr, TWO: tl.constexpr, WS: tl.constexpr, FLAGS: tl.constexpr,
):  # fmt: skip
    """The package's fp8_forward_kernel for τ > 0, H = H_kv, Tq = Tk (upper-left), with the probe's switches."""
    q_index, h, b = program_tile(chunk, HEAVY_TILE_LAST=CAUSAL, HEAVIEST_FIRST=HEAVIEST_FIRST)
    h, b = h.to(tl.int64), b.to(tl.int64)
    q_start = q_index * BLOCK_Q
    d = tl.arange(0, HEAD_DIM_PAD).to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    O += b * stride_ob + h * stride_oh
    DK += (b * H + h) * Tk
    VR += (b * H + h) * Tk
    DQ += (b * H + h) * Tq
    LSE += (b * H + h) * Tq
    o_scale = tl.load(VS + b * H + h) / P_SCALE_JIT  # 1 / 448 of 448 in the twin: its V factors are all 1
    log2_l_scale = 0.0
    if FLAGS & 2:  # l sums 448 p as acc does: only V's factor is left, and lse takes log2 448 out
        o_scale = o_scale * P_SCALE_JIT
        log2_l_scale = LOG2_P_SCALE
    if CAUSAL:
        q_end = tl.minimum(q_start + BLOCK_Q, Tq)
        n_full, n_visit = full_key_tiles(q_start, Tk, BLOCK_K, 0), last_key_tile(q_end, Tk, BLOCK_K, 0)
    else:
        n_full, n_visit = Tk // BLOCK_K, tl.cdiv(Tk, BLOCK_K)
    if TWO:  # two half tiles, each with its own state
        HALF: tl.constexpr = BLOCK_Q // 2
        i_a = q_start + tl.arange(0, HALF).to(tl.int64)
        i_b = i_a + HALF
        q_a = tl.load(Q + i_a[:, None] * stride_qt + d[None, :] * stride_qd,
                      mask=(i_a[:, None] < Tq) & (d[None, :] < HEAD_DIM), other=0.0)  # fmt: skip
        q_b = tl.load(Q + i_b[:, None] * stride_qt + d[None, :] * stride_qd,
                      mask=(i_b[:, None] < Tq) & (d[None, :] < HEAD_DIM), other=0.0)  # fmt: skip
        dq_a = tl.load(DQ + i_a, mask=i_a < Tq, other=1.0) * qk_scale
        dq_b = tl.load(DQ + i_b, mask=i_b < Tq, other=1.0) * qk_scale
        m_a = tl.full([HALF], float("-inf"), dtype=tl.float32)
        m_b = tl.full([HALF], float("-inf"), dtype=tl.float32)
        l_a = tl.zeros([HALF], dtype=tl.float32)
        l_b = tl.zeros([HALF], dtype=tl.float32)
        acc_a = tl.zeros([HALF, HEAD_DIM_PAD], dtype=tl.float32)
        acc_b = tl.zeros([HALF, HEAD_DIM_PAD], dtype=tl.float32)
        acc_a, l_a, m_a, acc_b, l_b, m_b = key_loop_two(
            acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, dq_a, dq_b, K, V, DK, VR, stride_kt, stride_kd, stride_vt,
            stride_vd, i_a, i_b, d, 0, n_full, Tk, HEAD_DIM, BLOCK_Q, BLOCK_K, CAUSAL, False)  # fmt: skip
        acc_a, l_a, m_a, acc_b, l_b, m_b = key_loop_two(
            acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, dq_a, dq_b, K, V, DK, VR, stride_kt, stride_kd, stride_vt,
            stride_vd, i_a, i_b, d, n_full, n_visit, Tk, HEAD_DIM, BLOCK_Q, BLOCK_K, CAUSAL, True)  # fmt: skip
        write_rows(acc_a, l_a, m_a, o_scale, log2_l_scale, O, LSE, i_a, d, Tq, stride_ot, stride_od, HEAD_DIM)
        write_rows(acc_b, l_b, m_b, o_scale, log2_l_scale, O, LSE, i_b, d, Tq, stride_ot, stride_od, HEAD_DIM)
    else:
        i = q_start + tl.arange(0, BLOCK_Q).to(tl.int64)
        q = tl.load(Q + i[:, None] * stride_qt + d[None, :] * stride_qd,
                    mask=(i[:, None] < Tq) & (d[None, :] < HEAD_DIM), other=0.0)  # fmt: skip
        dq = tl.load(DQ + i, mask=i < Tq, other=1.0) * qk_scale
        if FLAGS & 4:  # one k factor for the head: into dq, once
            dq = dq * tl.load(DK)
        m = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_Q], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
        acc, l, m = key_loop(acc, l, m, q, dq, K, V, DK, VR, stride_kt, stride_kd, stride_vt, stride_vd, i, d, 0,
                             n_full, Tk, HEAD_DIM, BLOCK_Q, BLOCK_K, CAUSAL, False, QK8, PV8, SOFTMAX, EXP, WS, FLAGS)
        acc, l, m = key_loop(acc, l, m, q, dq, K, V, DK, VR, stride_kt, stride_kd, stride_vt, stride_vd, i, d,
                             n_full, n_visit, Tk, HEAD_DIM, BLOCK_Q, BLOCK_K, CAUSAL, True, QK8, PV8, SOFTMAX, EXP,
                             WS, FLAGS)  # fmt: skip
        write_rows(acc, l, m, o_scale, log2_l_scale, O, LSE, i, d, Tq, stride_ot, stride_od, HEAD_DIM)


class Variant(NamedTuple):
    """One copy of the key step: E4M3 or bf16 operands per dot, the softmax's parts, the levers' switches."""

    qk8: bool = True  # QKᵀ on E4M3 codes (else bf16, factors 1)
    pv8: bool = True  # P and V in E4M3 (else bf16)
    softmax: int = 0  # 0 as shipped, 2 matmuls only
    exp: int = 0  # 0 ex2 (MUFU), 1 half by polynomial, 2 ex2.approx.f16x2, 3 a multiply-add stand-in
    two: bool = False  # two half tiles in one loop
    ws: bool = False  # tl.range(..., warp_specialize=True)
    block_k: int = 64
    maxnreg: int | None = None
    flags: int = 0  # 1: PV summed in the E4M3 accumulator over every tile; 2: no V ratios, 448 in the shift;
    # 4: k's factor one per head, folded into dq
    block_q: int | None = None  # the package's (fp8_config) where None
    num_warps: int | None = None
    num_stages: int | None = None


VARIANTS = {
    "fp8_copy": Variant(),
    "b_qk_fp8_pv_bf16": Variant(pv8=False),
    "c_qk_bf16_pv_fp8": Variant(qk8=False),
    "d_cheap_exp": Variant(exp=3),
    "e_matmuls_only": Variant(softmax=2),
    "bf16_twin": Variant(qk8=False, pv8=False),
    "bf16_cheap_exp": Variant(qk8=False, pv8=False, exp=3),
    "bf16_matmuls_only": Variant(qk8=False, pv8=False, softmax=2),
    "lever_block_k128": Variant(block_k=128),
    "lever_poly_half": Variant(exp=1),
    "lever_ex2_f16x2": Variant(exp=2),
    "lever_two_subtiles": Variant(two=True),
    "lever_warp_specialize": Variant(ws=True),
    "lever_pv_imprecise": Variant(flags=1),
    "pv_outside_dot": Variant(flags=8),  # the PV add outside the dot (adc541f's form, reverted): no C7514, slower
    "lever_no_ratio": Variant(flags=2),
    "lever_three": Variant(block_k=128, flags=3),  # the three that change no instruction mix's kind together
    "lever_head_factors": Variant(flags=6),  # q, k, v per head (or tensor): no multiply of the scores or of P
    "lever_all": Variant(block_k=128, flags=7),
    # D = 64 only: the copy needs 177 registers there (sm_90 compile), so one 8-warp program an SM, where the
    # bf16 forward caps at 128 and runs two, one's softmax under the other's matmuls
    "lever_maxnreg128": Variant(maxnreg=128),
    "lever_maxnreg128_no_ratio_pv_imprecise": Variant(maxnreg=128, flags=3),
    "lever_maxnreg128_all": Variant(maxnreg=128, flags=7),
    # one warpgroup a program, 64 x 128 tiles: two or three programs an SM at any D <= 128 (255 registers each
    # fit two of 128 threads), so one program's softmax and waits may run under another's matmuls
    "lever_64x128_4warps": Variant(block_q=64, block_k=128, num_warps=4, num_stages=3),
    "lever_64x128_4warps_all": Variant(block_q=64, block_k=128, num_warps=4, num_stages=3, flags=7),
}
# measured in the first run (sweeps/fp8-forward-ablation.json at d89348c), all slower or unchanged: timed again
# only with FP8_ABLATION_LEVERS=all
MEASURED = ("lever_poly_half", "lever_ex2_f16x2", "lever_two_subtiles", "lever_warp_specialize")
# at D = 128 the cap spills (sm_90 compile); 128-key tiles under it spill at D = 64
ONLY_D64 = ("lever_maxnreg128", "lever_maxnreg128_no_ratio_pv_imprecise", "lever_maxnreg128_all")
INTERPRETER_SKIPS = ("lever_ex2_f16x2", "lever_warp_specialize")  # inline PTX; a compiler pass


def prepared(B, H, T, D, device, seed):
    """Inputs of both precisions: bf16 q, k, v (float32 on the CPU) and their E4M3 codes, factors ('head', as
    quantize lays them out, one per head: ``quantized``; laid out one per row for the copy: ``factors``) and
    V's ratios."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # the interpreter's bf16 is wrong (issue 11584)
    q, k, v = (torch.randn(B, H, T, D, generator=gen, device=device, dtype=dtype) for _ in range(3))
    (q8, dq), (k8, dk) = quantize(q, "head"), quantize(k, "head")
    v8, dv = quantize(v, "head", keys_contiguous=True)
    v_scale = dv.amax(dim=-1).contiguous()
    v_ratio = (dv / v_scale[..., None]).contiguous()
    ones = torch.ones(dq.shape, dtype=torch.float32, device=device)  # bf16 operands: every factor 1, V's 448
    return dict(bf16=(q, k, v), fp8=(q8, k8, v8), factors=(dq.contiguous(), dk.contiguous(), v_ratio, v_scale),
                quantized=(dq, dk, dv), ones=(ones, ones, ones, torch.full_like(v_scale, 448.0)), dv=dv)  # fmt: skip


def launch(name, inputs, causal, out_dtype=torch.bfloat16):
    """One launch of the package kernel ("a_package") or the probe's copy with ``VARIANTS[name]``."""
    q8, k8, v8 = inputs["fp8"]
    B, H, T, D = q8.shape
    config = fp8_config(D)
    # the copy's tiles: the package's before it took the levers (128 x 64, 8 warps, 3 stages; 64 x 64, 2 above D 128)
    block_q, num_warps, num_stages = (128, 8, 3) if D <= 128 else (64, 8, 2)
    dq, dk, v_ratio, v_scale = inputs["factors"]
    if name == "a_package":  # the shipped launch: its tiles, its steps for factors one per head (as quantized)
        return launch_fp8_forward(q8, k8, v8, *inputs["quantized"], causal=causal, scale=D**-0.5,
                                  alignment="upper_left", out_dtype=out_dtype, **config)  # fmt: skip
    if name == "package_rows_64":  # the package's general step at the copy's tiles, factors laid out one per row
        return launch_fp8_forward(q8, k8, v8, dq, dk, inputs["dv"].contiguous(), causal=causal, scale=D**-0.5,
                                  alignment="upper_left", out_dtype=out_dtype, block_k=64, block_q=block_q,
                                  num_warps=num_warps, num_stages=num_stages)  # fmt: skip
    o = torch.empty((B, H, T, D), dtype=out_dtype, device=q8.device)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q8.device)
    n_tiles = triton.cdiv(T, block_q)
    chunk = heaviest_first_chunk(causal, 2 * T * D, B * H, B * H * n_tiles, resident_programs(num_warps, None),
                                 q8.device)  # fmt: skip
    qk_scale = kernel_scale(D**-0.5).unit * LOG2E
    d_pad = max(MIN_FP8_DOT, 1 << (D - 1).bit_length())
    qk8, pv8, softmax, exp, two, ws, block_k, maxnreg, flags, *tiles = VARIANTS[name]
    block_q, num_warps, num_stages = (own or shipped for own, shipped in zip(tiles, (block_q, num_warps, num_stages)))
    n_tiles = triton.cdiv(T, block_q)
    chunk = heaviest_first_chunk(causal, 2 * T * D, B * H, B * H * n_tiles, resident_programs(num_warps, maxnreg),
                                 q8.device)  # fmt: skip
    options = {} if maxnreg is None else dict(maxnreg=maxnreg)
    q16, k16, v16 = inputs["bf16"]
    q, k = (q8, k8) if qk8 else (q16, k16)
    v = v8 if pv8 else v16
    dq, dk = (dq, dk) if qk8 else inputs["ones"][:2]
    v_ratio, v_scale = (v_ratio, v_scale) if pv8 else inputs["ones"][2:]
    ablation_kernel[(n_tiles, H, B)](
        q, k, v, dq, dk, v_ratio, v_scale, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        H, T, T, qk_scale, max(chunk, 1), HEAD_DIM=D, HEAD_DIM_PAD=d_pad, BLOCK_Q=block_q, BLOCK_K=block_k,
        CAUSAL=causal, HEAVIEST_FIRST=chunk > 0, QK8=qk8, PV8=pv8, SOFTMAX=softmax, EXP=exp, TWO=two, WS=ws,
        FLAGS=flags, num_warps=num_warps, num_stages=num_stages, **options,
    )  # fmt: skip
    return o, lse


def interpret_check() -> None:
    """CPU, TRITON_INTERPRET=1: every variant the interpreter can run, once, at B1 H2 T160 D32. The copy with
    every part on must give the package kernel's answer, and the levers that keep the numbers (two half
    tiles, exp2 half by polynomial) nearly so; each is also printed against the float64 emulation, for
    information only: the interpreter's E4M3 cast loses the carry where rounding reaches a power of two,
    the package kernel as much as the copy. A check that the probe runs, not a measurement."""
    from flashtile.reference.fp8 import fp8_attention_forward
    from flashtile.reference.naive import naive_attention

    def relative_rmse(o, o_ref):
        return ((o.double() - o_ref.double()).pow(2).mean().sqrt() / o_ref.double().pow(2).mean().sqrt()).item()

    for causal in (False, True):
        inputs = prepared(1, 2, 160, 32, "cpu", 1)
        o_e, _ = fp8_attention_forward(*inputs["fp8"], inputs["factors"][0], inputs["factors"][1], inputs["dv"], causal)
        o_package = launch("package_rows_64", inputs, causal, out_dtype=torch.float32)[0]
        for name in VARIANTS:
            if name in INTERPRETER_SKIPS:
                continue
            start = time.time()
            o, lse = launch(name, inputs, causal, out_dtype=torch.float32)
            print(f"causal={causal} {name}: relative RMSE vs the package kernel {relative_rmse(o, o_package):.2e}, "
                  f"vs the emulation {relative_rmse(o, o_e):.2e} ({time.time() - start:.1f} s)")  # fmt: skip
            if name in ("fp8_copy", "pv_outside_dot"):  # to float32 rounding: the copy's s - m rounds the product
                assert relative_rmse(o, o_package) < 1e-6, "the probe's copy is not the package kernel"
            if name in ("lever_two_subtiles", "lever_poly_half", "lever_pv_imprecise", "lever_no_ratio",
                        "lever_maxnreg128", "lever_maxnreg128_no_ratio_pv_imprecise", "lever_head_factors",
                        "lever_maxnreg128_all"):  # fmt: skip
                assert relative_rmse(o, o_package) < 1e-2, name
            if name == "bf16_twin":  # float32 operands here: attention of the float inputs, to float32 rounding
                q, k, v = (x.double() for x in inputs["bf16"])
                o_exact, _ = naive_attention(q, k, v, causal)
                assert relative_rmse(o, o_exact) < 1e-5, relative_rmse(o, o_exact)


def names_for(D: int) -> list[str]:
    """The kernels timed at head dim D: the package's, then every variant that applies."""
    every = os.environ.get("FP8_ABLATION_LEVERS") == "all"
    return [name for name in ("a_package", "package_rows_64", *VARIANTS) if (D == 64 or name not in ONLY_D64)
            and (every or name not in MEASURED)]  # fmt: skip


def warm(task) -> int:
    """In a worker process: launch each named kernel once at the shape, so that Triton's on-disk cache holds it
    compiled and the timing process only loads it. Errors are left to the timing process to record."""
    device, B, H, T, D, causal, names = task
    inputs = prepared(B, H, T, D, device, T + D)
    done = 0
    for name in names:
        try:
            launch(name, inputs, causal, out_dtype=torch.bfloat16 if device == "cuda" else torch.float32)
            done += 1
        except Exception:  # noqa: BLE001 - recorded by the timing process, which launches it again
            pass
    if device == "cuda":
        torch.cuda.synchronize()
    return done


def precompile(shapes, device: str, workers: int) -> int:
    """Compile every kernel of the run in ``workers`` processes at once (Triton compiles one kernel at a time
    per process, about 3 s each for sm_90): tasks of two kernels of one shape, spread over a spawn pool."""
    import multiprocessing

    tasks = []
    for D, causal, T in shapes:
        names = names_for(D)
        B, H = (16384 // T, 2048 // D) if device == "cuda" else (1, 2)
        tasks += [(device, B, H, T, D, causal, names[at:at + 2]) for at in range(0, len(names), 2)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        return sum(pool.map(warm, tasks, chunksize=1))


def row(variant, shape, ms, dtype="fp8_e4m3", provider="flashtile_fp8_launch", **extra):
    from flashtile.bench.common import attention_tflops

    tflops = None if ms is None else round(attention_tflops(shape, ms), 1)
    return {"pass": "forward", "provider": provider, **shape, "dtype": dtype, "ms": None if ms is None else
            round(ms, 4), "tflops": tflops, "variant": variant, **extra}  # fmt: skip


def summary(shape, times) -> dict:
    """Amdahl from one shape's medians (ms): shares of a key step in each precision, and the best FP8 speed-ups.

    A step is taken as its matmuls then its softmax, nothing overlapped: softmax = full - matmuls only. The
    exponentials' share is (full - cheap exp) / full. amdahl_from_shares = 1 / ((1 - f) + f / r), f the bf16
    twin's matmul share and r its matmuls' time over the FP8 copy's (the chapter's step 8 with measured f and
    r), a speed-up over the twin; amdahl_best_no_overlap is over the package's bf16 forward, with the FP8
    matmuls as measured and the softmax as the twin pays it; ceiling_perfect_overlap the same with the two
    overlapped (the larger of them)."""
    t_bf16, t_fp8 = times["flashtile"], times["a_package"]
    mm8, mm16 = times["e_matmuls_only"], times["bf16_matmuls_only"]
    full8, full16 = times["fp8_copy"], times["bf16_twin"]
    softmax8, softmax16 = full8 - mm8, full16 - mm16
    f, r = mm16 / full16, mm16 / mm8
    return row("summary", shape, None, provider="flashtile_fp8_model", error="derived: no time of its own",
               matmul_share_fp8=round(mm8 / full8, 3), matmul_share_bf16=round(f, 3),
               softmax_ms_fp8=round(softmax8, 4), softmax_ms_bf16=round(softmax16, 4),
               exp_share_fp8=round((full8 - times["d_cheap_exp"]) / full8, 3),
               exp_share_bf16=round((full16 - times["bf16_cheap_exp"]) / full16, 3),
               matmuls_fp8_over_bf16=round(r, 3), twin_over_package_bf16=round(full16 / t_bf16, 3),
               speedup_measured=round(t_bf16 / t_fp8, 3), amdahl_from_shares=round(1 / ((1 - f) + f / r), 3),
               amdahl_best_no_overlap=round(t_bf16 / (mm8 + softmax16), 3),
               ceiling_perfect_overlap=round(t_bf16 / max(mm8, softmax16), 3))  # fmt: skip


def main(out: Path) -> None:
    from flashtile.bench.common import median_ms, save_result
    from flashtile.bench.providers import build

    shapes = STANDARD if os.environ.get("FP8_ABLATION_SHAPES") == "all" else DEFAULT_SHAPES
    start = time.time()
    workers = int(os.environ.get("FP8_ABLATION_WORKERS", "8"))
    if workers > 1:
        try:
            launched = precompile(shapes, "cuda", workers)
            print(f"compiled {launched} launches' kernels in {workers} processes: {time.time() - start:.0f} s",
                  flush=True)  # fmt: skip
        except Exception as error:  # noqa: BLE001 - the timing loop compiles what is missing, one at a time
            print(f"the compile pool failed ({type(error).__name__}: {error}); compiling as the run goes", flush=True)
    rows = []
    for D, causal, T in shapes:
        B, H = 16384 // T, 2048 // D
        shape = dict(B=B, H=H, H_kv=H, Tq=T, Tk=T, D=D, causal=causal, layout="bhtd")
        inputs = prepared(B, H, T, D, "cuda", T + D)
        q, k, v = inputs["bf16"]
        times = {"flashtile": median_ms(functools.partial(build("flashtile", shape), q, k, v), warmup=25, rep=100)}
        rows.append(row("package_bf16", shape, times["flashtile"], dtype="bf16", provider="flashtile"))
        o_package = launch("package_rows_64", inputs, causal)[0]
        for name in names_for(D):
            extra = {}
            try:
                o = launch(name, inputs, causal)[0]
                if name in ("fp8_copy", "pv_outside_dot"):
                    extra["copy_bit_equal"] = bool(torch.equal(o, o_package))
                    torch.testing.assert_close(o, o_package, rtol=1e-2, atol=1e-3)
                times[name] = median_ms(functools.partial(launch, name, inputs, causal), warmup=25, rep=100)
            except Exception as error:  # noqa: BLE001 - a lever Triton refuses is a result, recorded as such
                times[name] = None
                extra["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            dtype = "bf16" if name.startswith("bf16_") else "fp8_e4m3"
            rows.append(row(name, shape, times[name], dtype=dtype, ratio_vs_bf16=None if times[name] is None else
                            round(times["flashtile"] / times[name], 3), **extra))  # fmt: skip
        try:
            rows.append(summary(shape, times))
        except (KeyError, TypeError) as error:  # a part that did not run: no model for this shape
            rows.append(row("summary", shape, None, provider="flashtile_fp8_model", error=f"not derived: {error!r}"))
        print(f"[{time.time() - start:.0f} s] D={D} causal={causal} T={T}:",
              " ".join(f"{n}={t:.3f}" for n, t in times.items() if t is not None), "|",
              {k: v for k, v in rows[-1].items() if k.startswith(("matmul", "softmax_", "exp_", "amdahl", "ceiling",
                                                                    "speedup", "twin"))}, flush=True)  # fmt: skip
        save_result(out / "fp8-ablation.json", rows, METHOD)  # after every shape: a run cut short keeps its rows


if __name__ == "__main__":
    if INTERPRET:
        interpret_check()
        print("the worker pool:", precompile(((32, False, 96), (64, True, 64)), "cpu", 2), "launches")
    else:
        main(Path(os.environ.get("OUT", ".")))

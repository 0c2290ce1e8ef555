"""The FP8 (E4M3) attention forward: the textbook forward with E4M3 operands and their factors.

It computes what ``flashtile.reference.fp8.fp8_attention_forward`` emulates in float64, with the same
names in the same order; what changes from ``kernels/textbook.py`` is only what FP8 forces:

* q, k and v are float8_e4m3fn codes, and both ``tl.dot`` take E4M3 operands. On sm_90 an E4M3 dot sums
  in the tensor core's own accumulator, which keeps fewer bits than float32 (Triton's default there lets
  every add of a dot run imprecise): the raw dot of QKᵀ is summed that way (past D = 128 emptied into
  float32 every 128 products, so that D = 256 sums as two D = 128 halves), the PV product of each tile
  too, but the running acc is added to in float32, once a tile (``max_num_imprecise_acc``; ptxas
  serialises the wgmmas of that form, C7514, yet it measured faster than the add written outside the dot);
* V is read with its keys contiguous, the layout an E4M3 dot needs for its second operand (the reduced
  dimension contiguous): ``quantize(v, ..., keys_contiguous=True)`` returns it so; the launcher copies a
  V that is not laid out so, on every call;
* each row's factor leaves the QKᵀ dot exactly: the raw dot is multiplied by descale_k (per key column),
  the row max of that by descale_q (positive: τ's sign is folded into q's codes), and s - m is one
  multiply-add per score. k's factors one per head (stride 0 along T, as ``quantize`` lays out
  granularity "tensor" and "head") are folded into descale_q once instead (``K_ROWS=False``);
* P is rounded to E4M3 before the PV dot, as 448 · r_j · p with r_j = descale_v[j] / v_scale (at most 1:
  V's factors ride on P) and p = exp2(s - m) in [0, 1]; 448 rides in exp2's shift (448 p = exp2(s - m +
  log2 448)), so with V's factors one per head (every r_j exactly 1, ``V_RATIOS=False``) P takes no
  multiply at all; the factor v_scale is applied once in the epilogue. l sums the unrounded 448 p, in
  float32. The launcher picks both steps from the factors' layout (``one_per_head``), not from a switch.

What it supports: q (B, H, Tq, D), k and v (B, H_kv, Tk, D) with H a multiple of H_kv (GQA reads the
shared head, no copy), any strides, any Tq and Tk, 1 <= D <= 256, causal with both alignments, any
finite τ (a program whose row max passes 2^10 in log2 units reruns with the exact step, so
that the largest score gives P = 1 exactly at any size: ``FP8_SHIFT_LIMIT``); o in ``out_dtype`` (bf16 by default;
float32 too, which the interpreter tests use, since the interpreter computes bf16 wrongly), lse (B, H, Tq)
float32, natural log.

What it does not do (yet): it is forward only (inference and prefill), has no TMA descriptors, no
autotuning and no overlap of softmax and matmuls. ``flashtile.attention`` runs it for E4M3 inputs on CUDA
(``flashtile.fp8.attention``). Measured
speeds are in bench/PERF_LOG.md and sweeps/fp8-forward-speed-*.json. P is rounded tile by tile against
the running max, so ``block_k`` must equal the emulation's for the two to agree (``fp8_block_k``). Under the Triton
interpreter the float32 -> E4M3 cast loses the carry when rounding reaches a power of two, so the CPU
tests (tests/kernels/test_fp8_forward.py) feed it inputs on which nothing rounds.

Launch settings (``fp8_config``): 64 x 128 tiles, 4 warps (two programs an SM), 3 stages to D = 128; 64 x 64,
8 warps, 2 stages above (128-key tiles spill there); each head's heaviest query tile first under a causal
mask (``program_tile``, shared with the bf16 forward); the settings and the steps without factors on the
scores or ratios on P are the levers bench/probes/fp8/fp8_ablation.py measured (sweeps/fp8-forward-ablation-
levers.json);
E4M3 tensor-core dots need operand widths of at least 32 along the reduced dimension, so the head dim
is padded to at least 32. bench/probes/fp8/fp8_forward_steps.py times each step against the kernel without it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._checks import check_block, resolve_neg_bits
from .._plans import cached_plan
from .._spec import AttentionSpec, check_spec
from ..reference.fp8 import P_SCALE, check_descale_values, check_fp8_inputs, fp8_block_k
from ._host import (
    KernelLaunch,
    check_kernel_device,
    check_launch,
    check_tile_size,
    head_batch_grid,
    heaviest_first_chunk,
    kernel_mask,
    kernel_scale,
    resident_programs,
)
from ._jit import full_key_tiles, last_key_tile, multiply_subtract, program_tile

LOG2E = math.log2(math.e)
LN2 = tl.constexpr(math.log(2.0))
P_SCALE_JIT = tl.constexpr(P_SCALE)
LOG2_P_SCALE = tl.constexpr(math.log2(P_SCALE))  # 448 p = exp2(x + log2 448): P's scale in the shift
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_FP8_DOT = 32  # an E4M3 tensor-core dot reduces over at least 32 elements
# |m| in log2 units past which the exact rerun runs: the fast step's shift is rounded to within ulp(m) / 2, so
# o is off by up to ulp(m) ln 2 / 2 relative, 4e-5 at 2^10 (scores of about 700), and grows with the scores
FP8_SHIFT_LIMIT = tl.constexpr(2.0**10)


# --8<-- [start:fp8-key-step]
@triton.jit
def fold_fp8_key_tile(
    acc, l, m, q, dq, K, V, DK, VR, stride_kt, stride_kd, stride_vt, stride_vd,
    stride_dkt, i, d, k_start, Tk, offset, HEAD_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
    K_ROWS: tl.constexpr, V_RATIOS: tl.constexpr, INTERPRETED: tl.constexpr,
    EXACT: tl.constexpr = False,
):  # fmt: skip
    """One step of the online softmax over keys k_start .. k_start + BLOCK_K - 1, with
    E4M3 operands.

    EXACT keeps m in the raw dot's own units (t, before dq) and subtracts before it
    scales, as the bf16 kernel's exact step does: the row's largest score then gives 448
    p = exp2(0 + log2 448) at any size, where the fast step's rounded shift would give
    448 * 2^delta, which P's E4M3 rounding does not cancel (the kernel reruns with it
    past FP8_SHIFT_LIMIT)."""
    j = k_start + tl.arange(0, BLOCK_K).to(tl.int64)
    kv_mask = (j[:, None] < Tk) & (d[None, :] < HEAD_DIM)
    # (BLOCK_K, D_PAD) e4m3
    k = tl.load(
        K + j[:, None] * stride_kt + d[None, :] * stride_kd, mask=kv_mask, other=0.0
    )
    # V's transpose (D_PAD, BLOCK_K), keys contiguous: the layout an E4M3 dot's second
    # operand needs
    v_t_mask = (d[:, None] < HEAD_DIM) & (j[None, :] < Tk)
    v_t = tl.load(
        V + d[:, None] * stride_vd + j[None, :] * stride_vt, mask=v_t_mask, other=0.0
    )
    # (BLOCK_Q, BLOCK_K); s = t dq in log2 units (τ log2 e is in dq, > 0). Past 128 dims
    # the raw dot's short accumulator is emptied into float32 every 128 products, so a
    # score at D = 256 is summed as two at D = 128
    if HEAD_DIM > 128:
        t = tl.dot(q, tl.trans(k), max_num_imprecise_acc=128)
    else:
        t = tl.dot(q, tl.trans(k))
    if K_ROWS:  # k's factors per key; one per head is in dq already
        t = t * tl.load(DK + j * stride_dkt, mask=j < Tk, other=0.0)[None, :]
    if MASKED:  # a padded key, or one past the diagonal, scores -inf (p = 0)
        visible = j[None, :] < Tk
        if CAUSAL:
            visible = visible & (j[None, :] <= i[:, None] + offset)
        t = tl.where(visible, t, float("-inf"))
    if EXACT:  # m in t's units; (t - m) is exact for the row's max, then scaled
        m_new = tl.maximum(m, tl.max(t, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2((m - m_safe) * dq)
        # 448 p, in [0, 448]
        p = tl.math.exp2((t - m_safe[:, None]) * dq[:, None] + LOG2_P_SCALE)
    else:
        m_new = tl.maximum(m, tl.max(t, 1) * dq)
        # a row with no key yet: alpha = p = 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        # 448 p = exp2(s - shift): P's scale rides in the shift
        shift = m_safe - LOG2_P_SCALE
        # between shifts as rounded: that rounding cancels
        alpha = tl.math.exp2((m - LOG2_P_SCALE) - shift)
        # 448 p, in [0, 448]
        p = tl.math.exp2(multiply_subtract(t, dq[:, None], shift[:, None], INTERPRETED))
    l = alpha * l + tl.sum(p, 1)  # sums the unrounded 448 p
    # r_j = descale_v[j] / v_scale on P; with V's factors one per head every r_j is 1
    if V_RATIOS:
        p = p * tl.load(VR + j, mask=j < Tk, other=0.0)[None, :]
    # P rounded to E4M3; the tile's product summed in the E4M3 dot's short accumulator,
    # added to acc in float32
    acc = tl.dot(
        p.to(tl.float8e4nv),
        tl.trans(v_t),
        acc * alpha[:, None],
        max_num_imprecise_acc=BLOCK_K,
    )
    return acc, l, m_new
# --8<-- [end:fp8-key-step]


# --8<-- [start:fp8-forward]
@triton.jit
def fp8_program_planes(
    Q, K, V, O, q_index, h, b, H, H_kv, stride_qb, stride_qh, stride_kb, stride_kh,
    stride_vb, stride_vh, stride_ob, stride_oh, BLOCK_Q: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):  # fmt: skip
    """Where the program of query tile q_index, head h, batch b works: its query
    rows i and padded head dims d, h and b (all int64), the key/value head h_kv its
    query head reads (GQA: the shared head, no copy), and Q, O moved to (b, h)'s
    plane, K, V to (b, h_kv)'s."""
    h, b = h.to(tl.int64), b.to(tl.int64)
    h_kv = h // (H // H_kv)
    i = q_index * BLOCK_Q + tl.arange(0, BLOCK_Q).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_PAD).to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h_kv * stride_kh
    V += b * stride_vb + h_kv * stride_vh
    O += b * stride_ob + h * stride_oh
    return i, d, h, b, h_kv, Q, K, V, O


@triton.jit
def fp8_forward_kernel(
    Q, K, V, DQ, DK, VR, VS, O, LSE,
    stride_qb, stride_qh, stride_qt, stride_qd, stride_kb, stride_kh, stride_kt,
    stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd, stride_ob, stride_oh, stride_ot,
    stride_od,
    stride_dqb, stride_dqh, stride_dqt, stride_dkb, stride_dkh, stride_dkt, stride_vsb,
    stride_vsh,
    H, H_kv, Tq, Tk, offset, qk_scale, chunk,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr, SIGN: tl.constexpr, HEAVIEST_FIRST: tl.constexpr,
    K_ROWS: tl.constexpr,
    V_RATIOS: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """One program: query tile q_index of head h of batch b; grid (cdiv(Tq, BLOCK_Q), H,
    B), each head's heaviest tile first under a causal mask (``program_tile``). DQ (B,
    H, Tq) and DK (B, H_kv, Tk) are read through their strides (0 along T: one factor a
    head), VR (B, H_kv, Tk) is contiguous, VS (B, H_kv), all float32. K_ROWS: k's
    factors differ along the keys (else DK's first key holds the head's, folded into
    dq); V_RATIOS: V's too (else every ratio is 1 and VR is not read). τ's sign is SIGN
    (folded into q), qk_scale = |τ| log2 e."""
    q_index, h, b = program_tile(
        chunk, HEAVY_TILE_LAST=CAUSAL, HEAVIEST_FIRST=HEAVIEST_FIRST
    )
    i, d, h, b, h_kv, Q, K, V, O = fp8_program_planes(
        Q, K, V, O, q_index, h, b, H, H_kv, stride_qb, stride_qh, stride_kb, stride_kh,
        stride_vb, stride_vh, stride_ob, stride_oh, BLOCK_Q, HEAD_DIM_PAD,
    )  # fmt: skip
    q_start = q_index * BLOCK_Q
    DK += b * stride_dkb + h_kv * stride_dkh
    VR += (b * H_kv + h_kv) * Tk
    q_mask = (i[:, None] < Tq) & (d[None, :] < HEAD_DIM)
    # (BLOCK_Q, D_PAD) e4m3
    q = tl.load(
        Q + i[:, None] * stride_qt + d[None, :] * stride_qd, mask=q_mask, other=0.0
    )
    # τ < 0 (or 0) on q's codes, exactly, so that dq > 0 and a row's max of s is dq
    # times t's
    if SIGN != 1:
        q = (q.to(tl.float32) * SIGN).to(tl.float8e4nv)
    # (BLOCK_Q,) q's factors times |τ| log2 e; a padded row gets 1, not 0, so that its
    # -inf scores stay -inf
    dq = (
        tl.load(
            DQ + b * stride_dqb + h * stride_dqh + i * stride_dqt,
            mask=i < Tq,
            other=1.0,
        )
        * qk_scale
    )
    if not K_ROWS:  # one k factor for the head: into dq once, not into every score
        dq = dq * tl.load(DK)

    m = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_Q], dtype=tl.float32)
    # sum of E4M3(448 r p) v8, float32
    acc = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
    if CAUSAL:
        q_end = tl.minimum(q_start + BLOCK_Q, Tq)
        n_full, n_visit = (
            full_key_tiles(q_start, Tk, BLOCK_K, offset),
            last_key_tile(q_end, Tk, BLOCK_K, offset),
        )
    else:
        n_full, n_visit = Tk // BLOCK_K, tl.cdiv(Tk, BLOCK_K)
    for k_index in range(0, n_full):  # FULL tiles: no mask
        acc, l, m = fold_fp8_key_tile(
            acc, l, m, q, dq, K, V, DK, VR, stride_kt, stride_kd, stride_vt, stride_vd,
            stride_dkt, i, d, k_index * BLOCK_K, Tk, offset, HEAD_DIM, BLOCK_K, CAUSAL,
            False, K_ROWS, V_RATIOS, INTERPRETED,
        )  # fmt: skip
    for k_index in range(n_full, n_visit):  # DIAGONAL tiles and a ragged last tile
        acc, l, m = fold_fp8_key_tile(
            acc, l, m, q, dq, K, V, DK, VR, stride_kt, stride_kd, stride_vt, stride_vd,
            stride_dkt, i, d, k_index * BLOCK_K, Tk, offset, HEAD_DIM, BLOCK_K, CAUSAL,
            True, K_ROWS, V_RATIOS, INTERPRETED,
        )  # fmt: skip

    # V's largest factor; acc and l both carry 448
    v_scale = tl.load(VS + b * stride_vsb + h_kv * stride_vsh)
    out = O + i[:, None] * stride_ot + d[None, :] * stride_od
    rows = LSE + (b * H + h) * Tq + i
    _fp8_write_rows(acc, l, m, v_scale, dq, out, rows, q_mask, i < Tq, EXACT=False)
    # Past FP8_SHIFT_LIMIT the fast step's rounded shift (448 p = 448 * 2^delta for the
    # row's max) is no longer harmless: P's E4M3 rounding does not cancel it. Rare,
    # decided once per program after the fast rows are written: start over with the
    # exact step over every visited tile (the bf16 forward's exact rerun).
    if tl.max(tl.where(l > 0.0, tl.abs(m), 0.0), 0) >= FP8_SHIFT_LIMIT:
        tl.debug_barrier()
        m = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_Q], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
        for k_index in range(0, n_visit):
            acc, l, m = fold_fp8_key_tile(
                acc, l, m, q, dq, K, V, DK, VR, stride_kt, stride_kd, stride_vt,
                stride_vd, stride_dkt, i, d, k_index * BLOCK_K, Tk, offset, HEAD_DIM,
                BLOCK_K, CAUSAL, True, K_ROWS, V_RATIOS, INTERPRETED, EXACT=True,
            )  # fmt: skip
        _fp8_write_rows(acc, l, m, v_scale, dq, out, rows, q_mask, i < Tq, EXACT=True)


@triton.jit
def _fp8_write_rows(
    acc, l, m, v_scale, dq, out, rows, q_mask, row_ok, EXACT: tl.constexpr
):
    """o = acc * v_scale / l into ``out``, lse (natural log) into ``rows``; m in log2
    units after the fast step, in the raw dot's units (times dq for log2) after the
    exact one."""
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    o = acc * (v_scale / l_safe)[:, None]
    # (m dq + log2(l / 448)) ln 2, m dq never formed in log2 units (it may pass
    # float32's range there)
    if EXACT:
        lse = m * (dq * LN2) + (tl.math.log2(l_safe) - LOG2_P_SCALE) * LN2
    # the shift as the last step rounded it: its rounding cancels against l's, so lse is
    # m + log2(l / 448)
    else:
        lse = ((m - LOG2_P_SCALE) + tl.math.log2(l_safe)) * LN2
    lse = tl.where(empty, float("-inf"), lse)
    tl.store(out, o.to(out.dtype.element_ty), mask=q_mask)
    tl.store(rows, lse, mask=row_ok)
# --8<-- [end:fp8-forward]


def fp8_config(head_dim: int) -> dict:
    """Launch settings by head dim, from the measured tiles (sweeps/fp8-forward-ablation-levers.json): to D = 128,
    64 x 128 tiles with 4 warps and 3 stages (one warpgroup a program, two programs an SM); above, 64 x 64 with
    8 warps and 2 stages (wider tiles spill there). block_k is the emulation's (``fp8_block_k``): P is rounded
    tile by tile."""
    if head_dim <= 128:
        return dict(block_q=64, block_k=fp8_block_k(head_dim), num_warps=4, num_stages=3)
    return dict(block_q=64, block_k=fp8_block_k(head_dim), num_warps=8, num_stages=2)


def one_per_head(descale: torch.Tensor) -> bool:
    """descale (B, H, T) holds one factor per (batch, head) by its layout: stride 0 along T (as ``quantize``
    returns per-tensor and per-head factors, and ``flashtile.attention`` a 0-dim one), or a single row."""
    return descale.stride(-1) == 0 or descale.shape[-1] == 1


def fp8_forward(q8, k8, v8, descale_q, descale_k, descale_v, causal=False, scale=None, *, alignment="upper_left",
                out_dtype=torch.bfloat16, block_k=None):  # fmt: skip
    """(o, lse) of E4M3 q8, k8, v8 with their per-row float32 factors (as ``flashtile.fp8.quantize`` returns
    them): o (B, H, Tq, D) in ``out_dtype``, contiguous; lse (B, H, Tq) float32, natural log.

    ``block_k`` (a power of two, at least 32; None: ``fp8_block_k(D)``, the emulation's default) is the key
    tile. The checks of the layouts and options, and the launch they lead to, are worked out once per layout
    (``checked_fp8_forward_plan``, kept by ``_plans.cached_plan``). Factors that ``quantize`` made, or that an
    earlier call checked and that were not written to since, are not read again: the call then waits on
    nothing the GPU computes (``check_descale_values``). k's or V's factors laid out one per head (stride 0
    along T, ``one_per_head``) take the kernel's cheaper step: no factor on each score, no ratio on P. V with
    its keys contiguous (``quantize(v, ..., keys_contiguous=True)``) is read as it is; another layout is copied."""
    q8, k8, v8, descale_q, descale_k, descale_v = resolve_neg_bits(q8, k8, v8, descale_q, descale_k, descale_v)
    plan = cached_plan(checked_fp8_forward_plan, (q8, k8, v8, descale_q, descale_k, descale_v), causal, scale,
                       alignment, out_dtype, block_k, names=LAUNCHER_OPTIONS)  # fmt: skip
    for name, descale in (("descale_q", descale_q), ("descale_k", descale_k), ("descale_v", descale_v)):
        check_descale_values(name, descale)
    return plan.run(q8, k8, v8, descale_q, descale_k, descale_v)


LAUNCHER_OPTIONS = ("causal", "scale", "alignment", "out_dtype", "block_k")  # as fp8_forward keys its plans


def checked_fp8_forward_plan(q8, k8, v8, descale_q, descale_k, descale_v, *, causal, scale, alignment, out_dtype,
                             block_k=None, block_q=None, num_warps=None, num_stages=None) -> Fp8Plan:  # fmt: skip
    """``fp8_forward``'s plan (and ``launch_fp8_forward``'s): its options checked into one spec
    (``_spec.check_spec``, τ within float32's range: the statistics are float32), then ``make_fp8_forward_plan``."""
    shape = check_fp8_inputs(q8, k8, v8, descale_q, descale_k, descale_v, values=False)
    spec = check_spec(shape, q8.dtype, causal=causal, scale=scale, alignment=alignment, window=None, softcap=None,
                      causal_name="causal")  # fmt: skip
    return make_fp8_forward_plan(q8, k8, v8, descale_q, descale_k, descale_v, spec=spec, out_dtype=out_dtype,
                                 block_k=block_k, block_q=block_q, num_warps=num_warps,
                                 num_stages=num_stages)  # fmt: skip


class Fp8Plan(NamedTuple):
    """One FP8 launch, worked out from the inputs' layouts: which per-call work the factors' layout needs,
    and the kernel's grid, scalars and settings (``KernelLaunch``)."""

    out_shape: tuple  # (B, H, Tq, D) of o; lse drops the last dim
    out_dtype: torch.dtype
    copy_v: bool  # V's keys are not contiguous: copied on every call (``keys_contiguous``)
    v_ratios: bool  # V's factors differ along the keys: the ratios and the head's largest are made per call
    launch: KernelLaunch

    def run(self, q8, k8, v8, descale_q, descale_k, descale_v) -> tuple[torch.Tensor, torch.Tensor]:
        """o and lse of one call on inputs the plan was made for, their factors' values checked."""
        if self.copy_v:
            v8 = keys_contiguous(v8)
        if self.v_ratios:
            v_scale = descale_v.amax(dim=-1)  # (B, H_kv): each head's largest V factor
            v_ratio = (descale_v / v_scale[..., None]).contiguous()  # (B, H_kv, Tk), in (0, 1]
        else:  # every ratio is 1, so none is read; the head's factor is read through descale_v's own strides
            v_scale = v_ratio = descale_v
        o = torch.empty(self.out_shape, dtype=self.out_dtype, device=q8.device)
        lse = torch.empty(self.out_shape[:3], dtype=torch.float32, device=q8.device)
        self.launch(q8, k8, v8, descale_q, descale_k, v_ratio, v_scale, o, lse)
        return o, lse


def make_fp8_forward_plan(q8, k8, v8, descale_q, descale_k, descale_v, *, spec: AttentionSpec, out_dtype,
                          block_k=None, block_q=None, num_warps=None, num_stages=None) -> Fp8Plan:  # fmt: skip
    """One call's launch from its checked options (``_spec.check_spec``: scale, mask band, GQA group) and its
    inputs' layouts, at ``fp8_config``'s settings (``block_k``, ``block_q``, ``num_warps``, ``num_stages``:
    other settings, for probes that time them); raises on a layout, a device, a setting or an option the
    kernel cannot take (it has causal masks in both alignments, and no window, soft-cap or sinks).

    The factors' layout picks the step (``one_per_head``): with V's one per head every ratio is exactly 1, so
    none is made or read; with k's, the head's factor is folded into dq."""
    B, H, H_kv, Tq, Tk, D = check_fp8_inputs(q8, k8, v8, descale_q, descale_k, descale_v, values=False)
    mask = kernel_mask(spec.mask, Tq, Tk)  # a causal band runs as the causal mask, no band as none
    if mask.banded or spec.softcap is not None or spec.has_sinks:
        raise ValueError(f"the FP8 kernel takes a causal mask or none, with no soft-cap and no sinks; got the band "
                         f"{spec.mask}, softcap={spec.softcap}, has_sinks={spec.has_sinks}")  # fmt: skip
    config = fp8_config(D)
    block_k = check_block("block_k", config["block_k"] if block_k is None else block_k)
    if block_k < MIN_FP8_DOT or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two of at least {MIN_FP8_DOT} for E4M3 dots, got {block_k}")
    block_q = config["block_q"] if block_q is None else check_tile_size("block_q", block_q)
    num_warps, num_stages = check_launch(config["num_warps"] if num_warps is None else num_warps,
                                         config["num_stages"] if num_stages is None else num_stages)  # fmt: skip
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype!r}")
    for name, x in (("q8", q8), ("k8", k8), ("v8", v8)):
        check_kernel_device(name, x)
    if out_dtype == torch.bfloat16 and q8.device.type == "cpu":
        raise TypeError("out_dtype=torch.bfloat16 on the CPU: the Triton interpreter computes bfloat16 wrongly (Triton "
                        "issue 11584); pass out_dtype=torch.float32 there")  # fmt: skip
    v_ratios = not one_per_head(descale_v)
    copy_v = not (v8.stride(2) == 1 or Tk == 1)
    v_strides = (H_kv * Tk * D, Tk * D, 1, Tk) if copy_v else v8.stride()  # as keys_contiguous copies it
    v_scale_strides = (H_kv, 1) if v_ratios else descale_v.stride()[:2]  # amax's (B, H_kv), or descale_v's
    units = kernel_scale(spec.scale)
    n_tiles = -(-Tq // block_q)
    # the programs of one query head stream its kv head's K and V (one byte an entry), which the group shares
    chunk = heaviest_first_chunk(mask.causal, 2 * Tk * D // spec.group, B * H, B * H * n_tiles,
                                 resident_programs(num_warps, None), q8.device, spec.group)  # fmt: skip
    o_strides = (H * Tq * D, Tq * D, D, 1)  # o contiguous
    launch = KernelLaunch(
        fp8_forward_kernel,
        grid=head_batch_grid(n_tiles, H, B),
        scalars=(*q8.stride(), *k8.stride(), *v_strides, *o_strides, *descale_q.stride(), *descale_k.stride(),
                 *v_scale_strides, H, H_kv, Tq, Tk, spec.mask.offset(Tq, Tk), units.unit * LOG2E,
                 max(chunk, 1)),  # fmt: skip
        constexprs=dict(HEAD_DIM=D, HEAD_DIM_PAD=max(MIN_FP8_DOT, 1 << (D - 1).bit_length()), BLOCK_Q=block_q,
                        BLOCK_K=block_k, CAUSAL=mask.causal, SIGN=units.sign, HEAVIEST_FIRST=chunk > 0,
                        K_ROWS=not one_per_head(descale_k), V_RATIOS=v_ratios,
                        INTERPRETED=q8.device.type == "cpu"),  # fmt: skip
        num_warps=num_warps,
        num_stages=num_stages,
        fresh_outputs=2,
    )
    return Fp8Plan((B, H, Tq, D), out_dtype, copy_v, v_ratios, launch)


def launch_fp8_forward(q8, k8, v8, descale_q, descale_k, descale_v, **options):
    """One launch at other settings than ``fp8_config``'s, for probes that time them: ``options`` are
    ``checked_fp8_forward_plan``'s keywords (causal, scale, alignment, out_dtype, and block_k, block_q,
    num_warps, num_stages). The factors' values are not read."""
    plan = checked_fp8_forward_plan(q8, k8, v8, descale_q, descale_k, descale_v, **options)
    return plan.run(q8, k8, v8, descale_q, descale_k, descale_v)


def keys_contiguous(v8: torch.Tensor) -> torch.Tensor:
    """v8 (B, H_kv, Tk, D) with stride 1 along the keys, the layout the PV dot copies to shared memory ahead of
    use: v8 itself when it has it, else one copy. A row-major V (stride 1 along D) makes the compiled kernel
    load each V tile into registers and transpose it in every key step (tests/kernels/test_fp8_forward.py
    compiles both)."""
    if v8.stride(2) == 1 or v8.shape[2] == 1:
        return v8
    return v8.transpose(2, 3).contiguous().transpose(2, 3)  # strides (Tk D H_kv, Tk D, 1, Tk)

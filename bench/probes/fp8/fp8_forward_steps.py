"""A measured probe, not part of the package: each step of the FP8 forward against the kernel without it.

The package's FP8 kernel (``flashtile.kernels.fp8_forward``) took three steps from the package's bf16
forward after its second H200 run; this probe times each one switched off, all else as shipped:

* ``tiles``: 128 x 64 tiles, 8 warps, 3 stages up to D = 128 (``fp8_config``), against the first
  kernel's 64 x 64, 4 warps, 2 stages;
* ``fma``: the score scaled by k's factor only, the row max then times q's factor, and s - m one fused
  multiply-add, against s = raw (dq dk) and then s - m (one multiply a score more);
* ``order``: under a causal mask each head's heaviest query tile first (``program_tile``), against
  the plain order;
* ``pv_acc_in_dot``: acc passed into the PV dot (``tl.dot(p8, v, acc * alpha, max_num_imprecise_acc=
  BLOCK_K)``, the package's form), against the tile's product from zero added to acc outside the dot
  (``acc * alpha + tl.dot(p8, v)``: the same sums; ptxas serialises the wgmmas of the first form, C7514,
  not of the second, and the second measured 9-16 % slower). Its rows say whether its output equals the
  package's bit for bit (``pv_outside_bit_equal``).

Two more rows time the whole call: ``flashtile_fp8`` with V from ``quantize(..., keys_contiguous=True)``
and factors from ``quantize`` (no host read, no copy: what a caller should do), and
``flashtile_fp8_copy`` with row-major V (copied to keys-contiguous every call), and
``flashtile_fp8_copy_sync``, row-major V and factors made under ``torch.inference_mode`` (read on the host
every call, V copied every call: what the second run's call did). The bf16 forward
(``flashtile``) and the textbook bf16 kernel are timed beside them. Before timing, the probe's own copy of
the kernel with every step on is compared with the package kernel (rows say whether bit for bit), and
the package's output is checked against the float64 emulation.

Run from the repository root on one H200 (under three minutes):

    OUT=/some/folder PYTHONPATH=src python bench/probes/fp8/fp8_forward_steps.py

It writes ``$OUT/fp8-forward-steps.json``: rows in the bench schema; ``flashtile_fp8_launch`` rows carry
``step_off`` ("none" for the kernel as shipped, or the step switched off) and the launch settings.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from flashtile.bench.common import attention_tflops, median_ms, save_result
from flashtile.bench.providers import build
from flashtile.fp8 import quantize
from flashtile.kernels import parts
from flashtile.kernels.fp8_forward import (
    LOG2E,
    MIN_FP8_DOT,
    P_SCALE_JIT,
    fp8_forward,
    fp8_forward_kernel,
    fp8_program_planes,
)
from flashtile.kernels.parts import full_key_tiles, last_key_tile, multiply_subtract, program_tile
from flashtile.reference.fp8 import fp8_attention_forward

SHAPES = ((64, True, 16384), (128, False, 16384), (128, True, 4096), (128, True, 16384))  # (D, causal, T)
FIRST_TILES = dict(block_q=64, num_warps=4, num_stages=2)  # the first kernel's launch
# 128 x 64 tiles, 8 warps, 3 stages: the package's launch when this probe was run, before it took the ablation's
# levers (bench/probes/fp8/fp8_ablation.py; 64 x 128 tiles since); the package kernel is launched here with factors
# one per row and 64-key tiles, its general step of that time but for P's 448, now carried in exp2's shift
SHIPPED_THEN = dict(block_q=128, num_warps=8, num_stages=3)
LN2 = tl.constexpr(0.6931471805599453)
METHOD = (
    "flashtile.bench.common.median_ms (triton.testing.do_bench median, warmup 50 ms, rep 200 ms); FLOPs "
    "4·B·H·Tq·Tk·D (x0.5 causal); flashtile_fp8_launch: the kernel's launch alone (factors and V ready), "
    "step_off names the step switched off (tiles: 64x64/4 warps/2 stages; fma: s = raw (dq dk) then s - m; "
    "order: plain launch order; pv_acc_in_dot: acc * alpha + tl.dot(p8, v) outside the dot), none = as "
    "shipped; flashtile_fp8: the whole call, V keys-contiguous and factors from quantize; flashtile_fp8_copy: "
    "the same with row-major V (copied each call); "
    "flashtile_fp8_copy_sync: row-major V and factors made under inference_mode (read on the host each call); "
    "bf16 rows: N(0, 1) inputs"
)


@triton.jit
def fold_tile(acc, l, m, q, dq, K, V, DK, VR, stride_kt, stride_kd, stride_vt, stride_vd, i, d, k_start, Tk,
              offset, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
              FMA: tl.constexpr, PV_OUTSIDE: tl.constexpr):  # fmt: skip
    """The package's fold_fp8_key_tile, with FMA off: s = raw (dq dk), then exp2(s - m); with PV_OUTSIDE the
    tile's PV product is added to acc outside the dot instead of through max_num_imprecise_acc."""
    j = k_start + tl.arange(0, BLOCK_K).to(tl.int64)
    kv_mask = (j[:, None] < Tk) & (d[None, :] < HEAD_DIM)
    k = tl.load(K + j[:, None] * stride_kt + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v_t = tl.load(V + d[:, None] * stride_vd + j[None, :] * stride_vt, mask=(d[:, None] < HEAD_DIM) & (j[None, :] < Tk),
                  other=0.0)  # fmt: skip
    dk = tl.load(DK + j, mask=j < Tk, other=0.0)
    v_ratio = tl.load(VR + j, mask=j < Tk, other=0.0)
    if FMA:
        t = tl.dot(q, tl.trans(k)) * dk[None, :]
    else:
        t = tl.dot(q, tl.trans(k)) * (dq[:, None] * dk[None, :])
    if MASKED:
        visible = j[None, :] < Tk
        if CAUSAL:
            visible = visible & (j[None, :] <= i[:, None] + offset)
        t = tl.where(visible, t, float("-inf"))
    if FMA:
        m_new = tl.maximum(m, tl.max(t, 1) * dq)
    else:
        m_new = tl.maximum(m, tl.max(t, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m - m_safe)
    if FMA:
        p = tl.math.exp2(multiply_subtract(t, dq[:, None], m_safe[:, None], False))
    else:
        p = tl.math.exp2(t - m_safe[:, None])
    l = alpha * l + tl.sum(p, 1)
    p8 = (p * (v_ratio[None, :] * P_SCALE_JIT)).to(tl.float8e4nv)
    if PV_OUTSIDE:  # the same sums; no C7514 from ptxas, yet 9-16 % slower (fp8-forward-steps-pv-outside-dot.json)
        acc = acc * alpha[:, None] + tl.dot(p8, tl.trans(v_t))
    else:  # as the package: acc into the dot, summed in float32 once a tile
        acc = tl.dot(p8, tl.trans(v_t), acc * alpha[:, None], max_num_imprecise_acc=BLOCK_K)
    return acc, l, m_new


@triton.jit
def steps_kernel(
    Q, K, V, DQ, DK, VR, VS, O, LSE,
    stride_qb, stride_qh, stride_qt, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd, stride_ob, stride_oh, stride_ot, stride_od,
    H, H_kv, Tq, Tk, offset, qk_scale, chunk,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr, HEAVIEST_FIRST: tl.constexpr, FMA: tl.constexpr, ORDER: tl.constexpr,
    PV_OUTSIDE: tl.constexpr,
):  # fmt: skip
    """The package's fp8_forward_kernel for τ > 0, with the steps FMA and ORDER and the PV form as switches; the
    program's rows and planes are the package's own (``fp8_program_planes``)."""
    if ORDER:
        q_index, h, b = program_tile(chunk, HEAVY_TILE_LAST=CAUSAL, HEAVIEST_FIRST=HEAVIEST_FIRST)
    else:
        q_index, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i, d, h, b, h_kv, Q, K, V, O = fp8_program_planes(
        Q, K, V, O, q_index, h, b, H, H_kv, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
        stride_ob, stride_oh, BLOCK_Q, HEAD_DIM_PAD)  # fmt: skip
    q_start = q_index * BLOCK_Q
    DK += (b * H_kv + h_kv) * Tk
    VR += (b * H_kv + h_kv) * Tk
    q_mask = (i[:, None] < Tq) & (d[None, :] < HEAD_DIM)
    q = tl.load(Q + i[:, None] * stride_qt + d[None, :] * stride_qd, mask=q_mask, other=0.0)
    dq = tl.load(DQ + (b * H + h) * Tq + i, mask=i < Tq, other=1.0) * qk_scale
    m = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
    if CAUSAL:
        q_end = tl.minimum(q_start + BLOCK_Q, Tq)
        n_full, n_visit = full_key_tiles(q_start, Tk, BLOCK_K, offset), last_key_tile(q_end, Tk, BLOCK_K, offset)
    else:
        n_full, n_visit = Tk // BLOCK_K, tl.cdiv(Tk, BLOCK_K)
    for k_index in range(0, n_full):
        acc, l, m = fold_tile(acc, l, m, q, dq, K, V, DK, VR, stride_kt, stride_kd, stride_vt, stride_vd, i, d,
                              k_index * BLOCK_K, Tk, offset, HEAD_DIM, BLOCK_K, CAUSAL, False, FMA,
                              PV_OUTSIDE)  # fmt: skip
    for k_index in range(n_full, n_visit):
        acc, l, m = fold_tile(acc, l, m, q, dq, K, V, DK, VR, stride_kt, stride_kd, stride_vt, stride_vd, i, d,
                              k_index * BLOCK_K, Tk, offset, HEAD_DIM, BLOCK_K, CAUSAL, True, FMA,
                              PV_OUTSIDE)  # fmt: skip
    o_scale = tl.load(VS + b * H_kv + h_kv) / P_SCALE_JIT
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    o = acc * (o_scale / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), (m + tl.math.log2(l_safe)) * LN2)
    tl.store(O + i[:, None] * stride_ot + d[None, :] * stride_od, o.to(O.dtype.element_ty), mask=q_mask)
    tl.store(LSE + (b * H + h) * Tq + i, lse, mask=i < Tq)


def launch(kernel, q8, k8, v8, dq, dk, v_ratio, v_scale, causal, block_q, num_warps, num_stages, **switches):
    """One launch of ``kernel`` (the package's, or the probe's with ``switches``) on ready inputs, τ = 1/sqrt(D)."""
    B, H, T, D = q8.shape
    o = torch.empty((B, H, T, D), dtype=torch.bfloat16, device=q8.device)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q8.device)
    n_tiles = triton.cdiv(T, block_q)
    resident = parts.resident_programs(num_warps, None)
    chunk = parts.heaviest_first_chunk(causal, 2 * T * D, B * H, B * H * n_tiles, resident, q8.device)
    extra = dict(SIGN=1, INTERPRETED=False, K_ROWS=True, V_RATIOS=True) if kernel is fp8_forward_kernel else switches
    # the package kernel reads its factors through their strides (since it took the ablation's levers); the
    # probe's copy, contiguous: both get contiguous factors, the package's general step (a ratio, k per key)
    factor_strides = (*dq.stride(), *dk.stride(), *v_scale.stride()) if kernel is fp8_forward_kernel else ()
    kernel[(n_tiles, H, B)](
        q8, k8, v8, dq, dk, v_ratio, v_scale, o, lse, *q8.stride(), *k8.stride(), *v8.stride(), *o.stride(),
        *factor_strides, H, H, T, T, 0, parts.kernel_scale(D**-0.5).unit * LOG2E, max(chunk, 1), HEAD_DIM=D,
        HEAD_DIM_PAD=max(MIN_FP8_DOT, D), BLOCK_Q=block_q, BLOCK_K=64, CAUSAL=causal, HEAVIEST_FIRST=chunk > 0,
        num_warps=num_warps, num_stages=num_stages, **extra,
    )  # fmt: skip
    return o


def row(provider, shape, ms, **extra):
    return {"pass": "forward", "provider": provider, **shape, "dtype": "bf16" if provider.endswith("textbook")
            or provider == "flashtile" else "fp8_e4m3", "ms": round(ms, 4),
            "tflops": round(attention_tflops(shape, ms), 1), **extra}  # fmt: skip


def main(out: Path) -> None:
    rows = []
    for D, causal, T in SHAPES:
        B, H = 16384 // T, 2048 // D
        shape = dict(B=B, H=H, H_kv=H, Tq=T, Tk=T, D=D, causal=causal, layout="bhtd")
        gen = torch.Generator(device="cuda").manual_seed(T + D)
        q, k, v = (torch.randn(B, H, T, D, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for name in ("flashtile", "flashtile_textbook"):
            rows.append(row(name, shape, median_ms(functools.partial(build(name, shape), q, k, v))))
        (q8, dq), (k8, dk) = quantize(q, "head"), quantize(k, "head")
        v8, dv = quantize(v, "head", keys_contiguous=True)
        v_scale = dv.amax(dim=-1).contiguous()
        v_ratio = (dv / v_scale[..., None]).contiguous()
        ready = (q8, k8, v8, dq.contiguous(), dk.contiguous(), v_ratio, v_scale, causal)  # one per row: as before
        shipped = SHIPPED_THEN  # the package's tiles when these steps were timed (fp8_config has moved on since)
        o_package = launch(fp8_forward_kernel, *ready, **shipped)
        o_steps = launch(steps_kernel, *ready, **shipped, FMA=True, ORDER=True, PV_OUTSIDE=False)
        copy_is_exact = torch.equal(o_package, o_steps)  # the probe's copy with every step on: the same bits?
        torch.testing.assert_close(o_steps, o_package, rtol=1e-2, atol=1e-3)  # at the least the same answer
        o_outside = launch(steps_kernel, *ready, **shipped, FMA=True, ORDER=True, PV_OUTSIDE=True)
        outside_is_exact = torch.equal(o_package, o_outside)  # the other PV form: the same sums, the same bits?
        torch.testing.assert_close(o_outside, o_package, rtol=1e-2, atol=1e-3)
        # a sanity check against the float64 emulation on a slice (relative RMSE: the emulation is about 5e-2 off
        # float64 attention of the unquantised inputs, the kernel about a tenth of that off the emulation)
        small = (slice(0, 1), slice(0, 2), slice(0, 1024))
        o_e, _ = fp8_attention_forward(*(x[small].cpu() for x in (q8, k8, v8, dq, dk, dv)), causal)
        o_small, _ = fp8_forward(*(x[small].contiguous() for x in (q8, k8, v8, dq, dk, dv)), causal,
                                 out_dtype=torch.float32)  # fmt: skip
        agreement = ((o_small.cpu().double() - o_e).pow(2).mean().sqrt() / o_e.pow(2).mean().sqrt()).item()
        assert agreement < 2e-2, f"the kernel is {agreement:.2e} (relative RMSE) from the emulation at {shape}"
        variants = {"none": (fp8_forward_kernel, shipped, {}),
                    "tiles": (fp8_forward_kernel, FIRST_TILES, {}),
                    "fma": (steps_kernel, shipped, dict(FMA=False, ORDER=True, PV_OUTSIDE=False)),
                    "pv_acc_in_dot": (steps_kernel, shipped, dict(FMA=True, ORDER=True, PV_OUTSIDE=True))}  # fmt: skip
        if causal:
            variants["order"] = (steps_kernel, shipped, dict(FMA=True, ORDER=False, PV_OUTSIDE=False))
        for step_off, (kernel, settings, switches) in variants.items():
            ms = median_ms(functools.partial(launch, kernel, *ready, **settings, **switches))
            extra = dict(pv_outside_bit_equal=outside_is_exact) if step_off == "pv_acc_in_dot" else {}
            rows.append(row("flashtile_fp8_launch", shape, ms, step_off=step_off, block_q=settings["block_q"],
                            block_k=64, num_warps=settings["num_warps"], num_stages=settings["num_stages"],
                            probe_copy_bit_equal=copy_is_exact, **extra))  # fmt: skip
        rows.append(row("flashtile_fp8", shape, median_ms(functools.partial(fp8_forward, q8, k8, v8, dq, dk, dv,
                                                                             causal)), rel_rmse_vs_emulation=agreement))
        v8_rows = v8.contiguous()  # row-major: the call copies it to keys-contiguous, every call
        rows.append(row("flashtile_fp8_copy", shape, median_ms(functools.partial(fp8_forward, q8, k8, v8_rows, dq,
                                                                                  dk, dv, causal))))  # fmt: skip
        with torch.inference_mode():  # factors without a version count: read on the host by every call
            (q8_i, dq_i), (k8_i, dk_i), (v8_i, dv_i) = (quantize(x, "head") for x in (q, k, v))
            ms = median_ms(functools.partial(fp8_forward, q8_i, k8_i, v8_i, dq_i, dk_i, dv_i, causal))
        rows.append(row("flashtile_fp8_copy_sync", shape, ms))
        print(*(f"{r['provider']}:{r.get('step_off', '')} {r['ms']}" for r in rows[-(len(variants) + 5):]),
              sep=" | ", flush=True)  # fmt: skip
    save_result(out / "fp8-forward-steps.json", rows, METHOD)


if __name__ == "__main__":
    main(Path(os.environ.get("OUT", ".")))

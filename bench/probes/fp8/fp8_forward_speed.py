"""A measured probe, not part of the package: the FP8 forward kernel's speed beside the bf16 kernels.

On the standard sweep's long rows (B·T = 16,384, H·D = 2,048, T = 4k to 16k, D = 64 and 128, causal and
not, layout bhtd), one process times ``flashtile.kernels.fp8_forward.fp8_forward`` on E4M3 inputs
(quantised per head before timing; the rotation and the quantisation are not timed), flashtile's bf16
forward, the textbook bf16 forward (the FP8 kernel's own shape, without FP8) and SDPA's cuDNN backend
in bf16. Before timing, each FP8 output is checked against the float64 emulation of its own rounding
(RMSE below a tenth of the emulation's own error against float64 attention, at a reduced batch). The
kernel's launch alone is also timed at a few tile settings (``CONFIGS``, provider ``flashtile_fp8_launch``),
to choose the package's.

Run from the repository root on one H200 (about three minutes):

    OUT=/some/folder PYTHONPATH=src python bench/probes/fp8/fp8_forward_speed.py

It writes ``$OUT/fp8-forward-speed.json``: rows in the bench schema, provider ``flashtile_fp8`` with
dtype ``fp8_e4m3`` beside ``flashtile``, ``flashtile_textbook`` and ``sdpa_cudnn`` in bf16.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import triton

from flashtile.bench.common import attention_tflops, median_ms, save_result
from flashtile.bench.providers import build
from flashtile.fp8 import quantize
from flashtile.kernels.fp8_forward import LOG2E, MIN_FP8_DOT, fp8_forward, fp8_forward_kernel, keys_contiguous
from flashtile.reference.fp8 import fp8_attention_forward
from flashtile.reference.naive import naive_attention

LENGTHS = (4096, 8192, 16384)
HEAD_DIMS = (64, 128)
BF16_PROVIDERS = ("flashtile", "flashtile_textbook", "sdpa_cudnn")
METHOD = (
    "flashtile.bench.common.median_ms (triton.testing.do_bench median, warmup 50 ms, rep 200 ms); FLOPs "
    "4·B·H·Tq·Tk·D (x0.5 causal); flashtile_fp8: fp8_forward on E4M3 inputs quantised per head (not timed), "
    "bf16 output, V given row-major (ms: the whole call, with its checks, which read the factors on the host, and "
    "its copy of V to keys-contiguous); flashtile_fp8_launch: the kernel's launch alone at the row's block_q, "
    "block_k, num_warps, num_stages, V already keys-contiguous; "
    "the others bf16 inputs and outputs, N(0, 1)"
)


def check_against_emulation(D: int, causal: bool) -> float:
    """RMSE(kernel, emulation) / RMSE(emulation, float64 attention) at B = 1, H = 2, T = 1024."""
    gen = torch.Generator().manual_seed(D)
    q, k, v = (torch.randn(1, 2, 1024, D, generator=gen, dtype=torch.float64) for _ in range(3))
    (q8, dq), (k8, dk), (v8, dv) = (quantize(x, "head") for x in (q, k, v))
    o_e, _ = fp8_attention_forward(q8, k8, v8, dq, dk, dv, causal)
    o, _ = fp8_forward(*(x.cuda() for x in (q8, k8, v8, dq, dk, dv)), causal, out_dtype=torch.float32)
    o_truth, _ = naive_attention(q, k, v, causal)
    ratio = ((o.cpu().double() - o_e).pow(2).mean() / (o_e - o_truth).pow(2).mean()).sqrt().item()
    assert ratio < 0.1, f"D={D} causal={causal}: the kernel is {ratio:.2f} of the emulation's error away from it"
    return ratio


# (BLOCK_Q, BLOCK_K, num_warps, num_stages) tried for the kernel's launch alone; the first is the package's.
# Compiled for sm_90 at D = 128 all four fit without spills (245 registers); (128, 128, 8) spills at D = 128.
CONFIGS = {64: ((64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2)),
           128: ((64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3))}


def launch(q8, k8, v8_keys, dq, dk, dv, causal, block_q, block_k, num_warps, num_stages):
    """The kernel's launch at one setting, on checked inputs with V already keys-contiguous (the launcher's
    own host work, a few small tensors, included), in the plain launch order (each head's heaviest tile
    first under a causal mask since; bench/probes/fp8/fp8_forward_steps.py times that step)."""
    B, H, T, D = q8.shape
    v_scale = dv.amax(dim=-1).contiguous()
    v_ratio = (dv / v_scale[..., None]).contiguous()
    o = torch.empty((B, H, T, D), dtype=torch.bfloat16, device=q8.device)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q8.device)
    fp8_forward_kernel[(triton.cdiv(T, block_q), H, B)](
        q8, k8, v8_keys, dq, dk, v_ratio, v_scale, o, lse, *q8.stride(), *k8.stride(), *v8_keys.stride(), *o.stride(),
        *dq.stride(), *dk.stride(), *v_scale.stride(), H, k8.shape[1], T, T, 0, D**-0.5 * LOG2E, 1, HEAD_DIM=D,
        HEAD_DIM_PAD=max(MIN_FP8_DOT, D), BLOCK_Q=block_q, BLOCK_K=block_k, CAUSAL=causal, SIGN=1,
        HEAVIEST_FIRST=False, K_ROWS=True, V_RATIOS=True, INTERPRETED=False, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return o


def main(out: Path) -> None:
    rows = []
    for D in HEAD_DIMS:
        for causal in (False, True):
            agreement = check_against_emulation(D, causal)
            for T in LENGTHS:
                B, H = 16384 // T, 2048 // D
                shape = dict(B=B, H=H, H_kv=H, Tq=T, Tk=T, D=D, causal=causal, layout="bhtd")
                gen = torch.Generator(device="cuda").manual_seed(T + D)
                q, k, v = (torch.randn(B, H, T, D, generator=gen, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))  # fmt: skip
                for name in BF16_PROVIDERS:
                    try:
                        ms = median_ms(functools.partial(build(name, shape), q, k, v))
                        rows.append({"pass": "forward", "provider": name, **shape, "dtype": "bf16", "ms": round(ms, 4),
                                     "tflops": round(attention_tflops(shape, ms), 1)})  # fmt: skip
                    except Exception as error:  # a provider that cannot run here still gets its row
                        why = f"{type(error).__name__}: {str(error)[:80]}"
                        rows.append({"pass": "forward", "provider": name, **shape, "dtype": "bf16", "ms": None,
                                     "tflops": None, "error": why})  # fmt: skip
                (q8, dq), (k8, dk), (v8, dv) = (quantize(x, "head") for x in (q, k, v))
                ms = median_ms(functools.partial(fp8_forward, q8, k8, v8, dq, dk, dv, causal))
                rows.append({"pass": "forward", "provider": "flashtile_fp8", **shape, "dtype": "fp8_e4m3",
                             "ms": round(ms, 4), "tflops": round(attention_tflops(shape, ms), 1),
                             "rmse_vs_emulation_ratio": round(agreement, 4)})
                v8_keys = keys_contiguous(v8)
                for block_q, block_k, num_warps, num_stages in CONFIGS[D]:
                    ms = median_ms(functools.partial(launch, q8, k8, v8_keys, dq, dk, dv, causal, block_q, block_k,
                                                     num_warps, num_stages))  # fmt: skip
                    rows.append({"pass": "forward", "provider": "flashtile_fp8_launch", **shape, "dtype": "fp8_e4m3",
                                 "ms": round(ms, 4), "tflops": round(attention_tflops(shape, ms), 1),
                                 "block_q": block_q, "block_k": block_k, "num_warps": num_warps,
                                 "num_stages": num_stages})  # fmt: skip
                print(T, D, causal, *(f"{r['provider']} {r.get('block_q', '')} {r['ms']}" for r in rows[-8:]),
                      sep=" | ", flush=True)  # fmt: skip
    save_result(out / "fp8-forward-speed.json", rows, METHOD)


if __name__ == "__main__":
    main(Path(os.environ.get("OUT", ".")))

"""A measured probe, not part of the package: the backward's GPU time split by kernel, beside cuDNN's.

Issue 35's backward bars (0.85x cuDNN at D <= 128 from 2k tokens, 0.75x at D = 256) are missed; the deterministic
form runs seven matmuls per tile pair over two kernels (dQ: S, dP, dS K; dK/dV: S, P^T dO, dP, dS^T Q), cuDNN
five in one. This probe profiles (torch.profiler, CUDA activity) ten backward calls at each shape and sums each
kernel's device time per call: flashtile's launcher called directly (``kernels.backward.flash_attention_backward``
with the forward's stats), and SDPA's cuDNN backward through autograd. For each of flashtile's two kernels it
also gives the rate of its own matmuls (dQ: 3, dK/dV: 4 products of 2 * Tq * Tk * D FLOPs, halved under causal),
the number to hold against the Triton GEMM's 538 TFLOP/s on this GPU (bf16).

    OUT=/some/folder PYTHONPATH=src python bench/probes/backward/backward_kernel_split.py

Writes ``$OUT/backward-kernel-split.json``.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention
from torch.profiler import ProfilerActivity, profile

from flashtile.bench.common import attention_flops, save_result
from flashtile.bench.shapes import shape
from flashtile.kernels.backward import flash_attention_backward
from flashtile.kernels.forward import flash_attention

HEADS = {64: 32, 128: 16, 256: 8}
SHAPES = [shape(16384 // T, HEADS[D], T, D, causal) for D in (64, 128, 256) for T in (2048, 8192)
          for causal in (False, True)]  # fmt: skip
CALLS = 10
MATMULS = {"backward_dq_kernel": 3, "backward_dkdv_kernel": 4}


def device_us(events) -> dict:
    """Kernel name -> total device time in µs, over the profiled events."""
    out = defaultdict(float)
    for e in events:
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = e.self_cuda_time_total
        if us > 0:
            out[e.key] += us
    return out


def profiled(fn) -> dict:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    return {name: us / CALLS for name, us in device_us(prof.key_averages()).items()}


def measure(s: dict) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(s["B"], s["H"], s["Tq"], s["D"], device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(4))  # fmt: skip
    causal = s["causal"]
    o, lse, stats = flash_attention(q, k, v, causal=causal, return_stats=True)
    ours = profiled(lambda: flash_attention_backward(q, k, v, o, lse, do, causal=causal, stats=stats))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o_s = scaled_dot_product_attention(*leaves, is_causal=causal)

    def cudnn_backward():
        for x in leaves:
            x.grad = None
        o_s.backward(do, retain_graph=True)

    theirs = profiled(cudnn_backward)
    one_product = attention_flops(s, "fwd") / 2  # 2 * B * H * Tq * Tk * D, halved under causal
    kernels = {}
    for name, us in ours.items():
        short = next((m for m in MATMULS if m in name), name)
        kernels[short] = dict(us=round(us, 1))
        if short in MATMULS:
            kernels[short]["matmul_tflops"] = round(MATMULS[short] * one_product / (us * 1e-6) / 1e12, 1)
    total, cudnn_total = sum(ours.values()), sum(theirs.values())
    row = dict(**{key: s[key] for key in ("B", "H", "Tq", "Tk", "D", "causal")}, flashtile_us=round(total, 1),
               flashtile_kernels=kernels, cudnn_us=round(cudnn_total, 1),
               cudnn_kernels={n: round(t, 1) for n, t in theirs.items()}, ratio_to_cudnn=round(cudnn_total / total, 3))
    print(s["D"], s["Tq"], causal, row["ratio_to_cudnn"], kernels, round(cudnn_total, 1), flush=True)
    return row


def main(out: Path) -> None:
    rows = [measure(s) for s in SHAPES]
    save_result(out / "backward-kernel-split.json", rows,
                f"torch.profiler (CUDA activity), {CALLS} calls after one warm-up, device time per call summed by "
                "kernel; flashtile: kernels.backward.flash_attention_backward called directly with the forward's "
                "stats; cuDNN: SDPA (CUDNN_ATTENTION) o.backward(do, retain_graph=True), grads set to None first; "
                "matmul_tflops: the kernel's own products (dQ 3, dK/dV 4) of 2*B*H*Tq*Tk*D (x0.5 causal) / its time")


if __name__ == "__main__":
    main(Path(os.environ.get("OUT", ".")))

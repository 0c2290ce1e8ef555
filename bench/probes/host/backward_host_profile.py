"""A measured probe, not part of the package: where a backward through autograd spends its time at the
D = 64, B = 2 model shapes (H = 16, H_kv = 4 and 16, T = 2048, causal, bf16, both layouts).

For each shape: ``o.backward(do, retain_graph=True)`` timed back to back (triton do_bench median, as the
backward table times it), the wall time of the same call in a plain loop (host and GPU together), and
the GPU time of each kernel from torch.profiler (mean over 20 calls); cuDNN's backward beside it, timed
the same way. ``PYTHONPATH=src python bench/probes/host/backward_host_profile.py OUT.json`` on an H200.
Results: bench/results/sweeps/backward-models-d64-profile.json, bench/PERF_LOG.md.
"""
import collections
import sys
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention
from torch.profiler import ProfilerActivity, profile

from flashtile.api import attention
from flashtile.bench.common import attention_tflops, save_result
from flashtile.bench.providers import make_inputs

CALLS = 20


def profiled(o, do, leaves):
    """(do_bench median ms, loop wall µs per call, {kernel: GPU µs per call})."""
    ms = triton.testing.do_bench(lambda: o.backward(do, retain_graph=True), grad_to_none=leaves, warmup=50,
                                 rep=200, return_mode="median")  # fmt: skip
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            for x in leaves:
                x.grad = None
            o.backward(do, retain_graph=True)
        torch.cuda.synchronize()
    kernels = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:48]] += event.device_time / CALLS
    start = time.perf_counter()
    for _ in range(50):
        for x in leaves:
            x.grad = None
        o.backward(do, retain_graph=True)
    torch.cuda.synchronize()
    return ms, (time.perf_counter() - start) / 50 * 1e6, kernels


def main(out):
    rows = []
    for H_kv in (4, 16):
        for layout in ("bhtd", "bthd"):
            shape = dict(B=2, H=16, H_kv=H_kv, Tq=2048, Tk=2048, D=64, causal=True, layout=layout, dtype="bf16")
            q, k, v = make_inputs(shape)
            do = torch.randn_like(q)
            for provider in ("flashtile", "sdpa_cudnn"):
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                if provider == "flashtile":
                    o = attention(*leaves, is_causal=True, enable_gqa=H_kv != 16)
                    ms, wall, kernels = profiled(o, do, leaves)
                else:
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        o = scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=H_kv != 16)
                        ms, wall, kernels = profiled(o, do, leaves)
                gpu = sum(kernels.values())
                rows.append(dict({"pass": "backward", "provider": provider}, **shape, ms=round(ms, 4),
                                 tflops=round(attention_tflops(shape, ms, "bwd"), 1), loop_wall_us=round(wall, 1),
                                 gpu_us=round(gpu, 1), kernels_us={n: round(t, 1) for n, t in kernels.items()}))
                print(f"{provider:>10} H_kv={H_kv} {layout}: do_bench {ms * 1e3:.1f} us, loop {wall:.1f} us, "
                      f"GPU {gpu:.1f} us {dict(kernels.most_common(4))}", flush=True)
    method = ("backward only through autograd: do_bench median of o.backward(do, retain_graph=True) (warmup 50 ms, "
              "rep 200 ms); loop_wall_us: perf_counter over 50 back-to-back calls and one synchronize; gpu_us: "
              f"sum of the CUDA kernels' device time from torch.profiler, mean over {CALLS} calls")
    save_result(out, rows, method)


if __name__ == "__main__":
    main(sys.argv[1])

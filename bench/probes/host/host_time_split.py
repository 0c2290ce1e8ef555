"""A measured probe, not part of the package: where a tiny forward + backward spends its host time.

Issue 35's per-call target: ``flashtile.attention`` forward + backward at B1 H1 T128 D64 causal bf16 within
1.3x of SDPA's time (375.7 against 200.2 µs in ``overhead.json``). At that size the GPU work is a few µs, so
every µs is host work. This probe splits it, all entry points timed in turns (``overhead.interleaved_us_per_call``):

* ``sdpa_fwd`` / ``ft_fwd``: the forward alone under no_grad; ``ft_launcher``: ``kernels.forward.flash_attention``;
* ``sdpa_fwdbwd`` / ``ft_fwdbwd``: forward, then ``torch.autograd.grad(o, (q, k, v), do)``;
* ``sdpa_fwd_grad`` / ``ft_fwd_grad``: the forward with gradients recorded, its graph dropped at once;
* ``ft_fwd_then_impl``: the forward under no_grad, then ``api.backward_impl`` called on the main thread
  (the backward's Python and launches without the autograd engine);
* ``ft_bwd_launcher``: ``kernels.backward.flash_attention_backward`` alone, on the main thread;
* ``id_fn_cuda`` / ``id_fn_cpu``: a trivial ``torch.autograd.Function`` (forward ``x * 1``, backward
  returns the gradient) through ``torch.autograd.grad``: the engine's own cost per call, on CUDA tensors
  (backward on autograd's CUDA device thread) and on CPU tensors (on the calling thread);
* ``alloc16_bwd_cuda`` / ``alloc0_bwd_cuda``: the same with 16 (0) ``torch.empty_like`` calls inside the
  backward, on autograd's device thread, and ``alloc16_main_cuda`` the 16 calls on the main thread: what one
  PyTorch call costs on each thread;
* ``sdpa_grad_only`` and ``ft_grad_only``: ``torch.autograd.grad`` of a kept graph (retain_graph), the
  backward alone through the engine.

Also the GPU time of each kernel under torch.profiler (mean over 50 fwd+bwd calls), and cProfile of
``ft_fwd_then_impl`` (main thread only) as text. Run on an H200:

    OUT=/some/folder PYTHONPATH=src python bench/probes/host/host_time_split.py

Writes ``$OUT/host-time-split.json`` (rows: provider, us_per_call) and ``$OUT/host-time-split-cprofile.txt``.
"""

from __future__ import annotations

import collections
import cProfile
import io
import os
import pstats
from pathlib import Path

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa
from torch.profiler import ProfilerActivity, profile

from flashtile import api
from flashtile.api import attention
from flashtile.bench.common import save_result
from flashtile.bench.overhead import interleaved_us_per_call
from flashtile.kernels.backward import flash_attention_backward
from flashtile.kernels.forward import flash_attention

B, H, T, D = 1, 1, 128, 64


class Allocating(torch.autograd.Function):
    """Forward x * 1; the backward makes ``ctx.n`` empty tensors of x's size before returning the gradient."""

    @staticmethod
    def forward(ctx, x, n):
        ctx.n = n
        return x * 1

    @staticmethod
    def backward(ctx, g):
        for _ in range(ctx.n):
            torch.empty_like(g)
        return g, None


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g


def main(out: Path) -> None:
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    xc, xh = torch.randn(64, device="cuda", requires_grad=True), torch.randn(64, requires_grad=True)

    def ft_fwd():
        with torch.no_grad():
            return attention(q, k, v, is_causal=True)

    def ft_fwdbwd():
        o = attention(*leaves, is_causal=True)
        return torch.autograd.grad(o, leaves, do)

    def sdpa_fwd():
        with torch.no_grad():
            return sdpa(q, k, v, is_causal=True)

    def sdpa_fwdbwd():
        o = sdpa(*leaves, is_causal=True)
        return torch.autograd.grad(o, leaves, do)

    o_ft, lse_ft, stats_ft = flash_attention(q, k, v, causal=True, return_stats=True)
    scale = D**-0.5

    spec = api.check_attention_call(q, k, v, is_causal=True, scale=scale, enable_gqa=False, alignment="upper_left",
                                    return_lse=False, window=None, softcap=None).spec  # the checked options

    def ft_fwd_then_impl():
        o, lse, stats = api.forward_impl(q, k, v, spec, "triton")
        return api.backward_impl(do, q, k, v, o, lse, stats, spec=spec, backend="triton")

    def ft_bwd_launcher():
        return flash_attention_backward(q, k, v, o_ft, lse_ft, do, causal=True, scale=scale, stats=stats_ft)

    o_kept_ft = attention(*leaves, is_causal=True)
    o_kept_sdpa = sdpa(*leaves, is_causal=True)

    def ft_grad_only():
        return torch.autograd.grad(o_kept_ft, leaves, do, retain_graph=True)

    def sdpa_grad_only():
        return torch.autograd.grad(o_kept_sdpa, leaves, do, retain_graph=True)

    def id_fn(x):
        return lambda: torch.autograd.grad(Identity.apply(x), x, torch.ones_like(x))

    tasks = {
        "sdpa_fwd": (sdpa_fwd, 1000), "ft_fwd": (ft_fwd, 1000),
        "ft_launcher": (lambda: flash_attention(q, k, v, causal=True), 1000),
        "sdpa_fwdbwd": (sdpa_fwdbwd, 250), "ft_fwdbwd": (ft_fwdbwd, 250),
        "sdpa_fwd_grad": (lambda: sdpa(*leaves, is_causal=True), 500),
        "ft_fwd_grad": (lambda: attention(*leaves, is_causal=True), 500),
        "ft_fwd_then_impl": (ft_fwd_then_impl, 250), "ft_bwd_launcher": (ft_bwd_launcher, 250),
        "sdpa_grad_only": (sdpa_grad_only, 250), "ft_grad_only": (ft_grad_only, 250),
        "id_fn_cuda": (id_fn(xc), 500), "id_fn_cpu": (id_fn(xh), 500),
        "alloc16_bwd_cuda": (lambda: torch.autograd.grad(Allocating.apply(xc, 16), xc, torch.ones_like(xc)), 500),
        "alloc0_bwd_cuda": (lambda: torch.autograd.grad(Allocating.apply(xc, 0), xc, torch.ones_like(xc)), 500),
        "alloc16_main_cuda": (lambda: [torch.empty_like(xc) for _ in range(16)], 500),
    }  # fmt: skip
    us = interleaved_us_per_call(tasks)
    rows = [dict(provider=name, B=B, H=H, Tq=T, Tk=T, D=D, causal=True, dtype="bf16", us_per_call=round(t, 1),
                 calls=tasks[name][1]) for name, t in us.items()]  # fmt: skip
    for r in rows:
        print(f"{r['provider']:>18} {r['us_per_call']:8.1f} us")

    torch.cuda.synchronize()
    gpu_us = {}
    for name, fn in (("ft_fwdbwd", ft_fwdbwd), ("sdpa_fwdbwd", sdpa_fwdbwd)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
        kernels = collections.Counter()
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name[:80]] += event.device_time / 50
        gpu_us[name] = {key: round(val, 2) for key, val in kernels.items()}
        print(name, gpu_us[name])

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(2000):
        ft_fwd_then_impl()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    (out / "host-time-split-cprofile.txt").write_text(text.getvalue())
    method = ("host wall time per call, overhead.interleaved_us_per_call (median of 9 rounds of N calls and one "
              "synchronize, entry points in turns); gpu_us: torch.profiler CUDA kernel time per call, mean of 50")
    save_result(out / "host-time-split.json", rows, method, gpu_us=gpu_us)


if __name__ == "__main__":
    main(Path(os.environ.get("OUT", ".")))

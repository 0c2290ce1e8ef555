"""Host work of the tiny call (issue 35), on the CPU, with the kernel launches stubbed out.

Usage: ``TRITON_INTERPRET=1 PYTHONPATH=src python bench/probes/host/host_path_cpu.py [--calls N] [--repeats R]``
(run it from a checkout of any commit to compare: it needs ``flashtile.attention``,
``kernels.forward.flash_attention``, ``kernels.parts.KernelLaunch`` and ``bench.overhead``).

The shape is the overhead table's (B1 H1 T128 D64, causal), in float16 CPU tensors, which the interpreter
setting sends down the Triton tier's host path. ``KernelLaunch.__call__`` returns at once, so no kernel runs
and what is timed is the Python and PyTorch work around the launches: checks, plan lookups, allocations,
views, autograd's bookkeeping. ``forward_config`` is asked for the GPU's settings (not the interpreter's,
which would build TMA descriptors the H200 does not build at this shape), so the plans are the GPU's; and
every call runs under ``use_backend("triton")``, the tier CUDA tensors get (the interpreter's knob is left out).

Paths: ``attention`` without grad; ``attention`` with grad recorded (the forward alone, the graph dropped);
forward + ``torch.autograd.grad`` (on CPU tensors the engine runs the backward on the calling thread, so
the device thread's extra cost is not in these numbers: the PyTorch-call counts are the proxy for it);
the launcher ``flash_attention`` alone; the backward launcher alone; SDPA on the same tensors for scale.

Counts per call: Python calls (function frames and calls of built-ins, ``sys.setprofile``), Python-level
torch calls (a ``TorchFunctionMode``: functions, tensor methods and
attribute reads such as ``.shape``), and ATen ops that reach the dispatcher (a ``TorchDispatchMode``:
allocations, views, copies). Times are medians of interleaved loops (``bench.overhead``), so a machine
slowing down falls on every path alike, and they are this thread's CPU time unless ``--wall`` is given
(another process holding the core is then left out); on a shared machine compare counts first, times second.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.autograd import Variable  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import flashtile  # noqa: E402
from flashtile.api import use_backend  # noqa: E402
from flashtile.bench.overhead import interleaved_us_per_call  # noqa: E402
from flashtile.kernels import forward as kforward  # noqa: E402
from flashtile.kernels import parts  # noqa: E402
from flashtile.kernels.backward import flash_attention_backward  # noqa: E402
from flashtile.kernels.forward import flash_attention  # noqa: E402


class FunctionCount(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))] += 1
        return func(*args, **(kwargs or {}))


class DispatchCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def python_calls(fn) -> int:
    """Python function calls and calls of built-in functions during one call of fn (``sys.setprofile``): the
    same count on every run, where times on a shared machine are not."""
    count = [0]

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            count[0] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0] - 1  # the call of sys.setprofile(None) itself


def counted(fn):
    """(Python calls, torch function calls, their kinds, ATen ops, their kinds) of one call of fn
    (``counted_form`` where the timed form hides work from the function mode)."""
    fn = getattr(fn, "counted_form", fn)
    with FunctionCount() as f:
        fn()
    with DispatchCount() as d:
        fn()
    return python_calls(fn), sum(f.calls.values()), f.calls, sum(d.calls.values()), d.calls


def stub_launches() -> None:
    parts.KernelLaunch.__call__ = lambda self, *tensors: None  # no kernel runs: the host path alone
    real_config = kforward.forward_config

    def gpu_config(head_dim, dtype, interpreted, causal, length_class, tma=True, **options):
        return real_config(head_dim, dtype, False, causal, length_class, tma, **options)

    kforward.forward_config = gpu_config


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--detail", action="store_true", help="list the kinds of torch calls of each path")
    parser.add_argument("--wall", action="store_true", help="wall time (default: this thread's CPU time, which "
                        "leaves out the time other processes hold the core: steadier on a shared machine)")
    args = parser.parse_args(argv)
    stub_launches()
    # the tier CUDA tensors get, "triton", without the interpreter's knob, which only CPU tensors read (on the
    # GPU's path pick_backend returns at q.is_cuda; forced, one step earlier)
    with use_backend("triton"):
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 1, 128, 64, generator=gen, dtype=torch.float16) for _ in range(3))
        do = torch.randn_like(q)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o, lse, stats = flash_attention(q, k, v, causal=True, return_stats=True)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def fwd_grad():
            flashtile.attention(*leaves, is_causal=True)

        def fwd_bwd():
            torch.autograd.grad(flashtile.attention(*leaves, is_causal=True), leaves, do)

        def sdpa_bwd():
            torch.autograd.grad(sdpa(*leaves, is_causal=True), leaves, do)

        # A function mode is switched off while it handles a call, so the backward that autograd.grad runs
        # would go uncounted: the counted form calls the engine as autograd.grad does, without that dispatch.
        def engine_grad(out):
            Variable._execution_engine.run_backward((out,), (do,), False, False, tuple(leaves), False, False)

        fwd_bwd.counted_form = lambda: engine_grad(flashtile.attention(*leaves, is_causal=True))
        sdpa_bwd.counted_form = lambda: engine_grad(sdpa(*leaves, is_causal=True))

        cases = {
            "attention fwd, no grad": (lambda: flashtile.attention(q, k, v, is_causal=True), args.calls),
            "attention fwd, grad recorded": (fwd_grad, args.calls),
            "attention fwd + autograd.grad": (fwd_bwd, args.calls // 4),
            "launcher flash_attention": (lambda: flash_attention(q, k, v, causal=True), args.calls),
            "launcher flash_attention_backward": (
                lambda: flash_attention_backward(q, k, v, o, lse, do, causal=True, stats=stats), args.calls),
            "sdpa fwd (CPU math, for scale)": (lambda: sdpa(q, k, v, is_causal=True), max(args.calls // 8, 1)),
            "sdpa fwd + autograd.grad (CPU)": (sdpa_bwd, max(args.calls // 40, 1)),
        }
        clock = time.perf_counter if args.wall else time.thread_time
        us = interleaved_us_per_call(cases, repeats=args.repeats, warmup=50, sync=lambda: None, clock=clock)
        print(f"{'path':>36} {'us/call':>8} {'py calls':>8} {'torch fn':>8} {'aten ops':>8}")
        for name, (fn, _) in cases.items():
            n_py, n_fn, fns, n_aten, atens = counted(fn)
            print(f"{name:>36} {us[name]:8.2f} {n_py:8d} {n_fn:8d} {n_aten:8d}", flush=True)
            if args.detail and not name.startswith("sdpa"):
                print("      torch fn:", dict(fns.most_common()))
                print("      aten    :", dict(atens.most_common()))


if __name__ == "__main__":
    main()

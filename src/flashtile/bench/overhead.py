"""Host overhead: wall time per call of a tiny attention, where launches and Python are the whole cost.

``python -m flashtile.bench overhead`` writes ``bench/results/overhead.json``. The shape is B=1, H=1,
T=128, D=64, bf16, causal: about 2 MFLOP, nanoseconds of work for an H200, so what is measured is the
time the host needs to validate arguments, go through autograd and launch kernels.

Method: ``calls`` back-to-back calls timed with ``time.perf_counter`` and one ``torch.cuda.synchronize``
at the end; the per-call time of ``repeats`` such loops, after a warm-up, and their median. Unlike
``triton.testing.do_bench`` (CUDA events around the GPU work) this includes everything the host does.

Providers: ``flashtile`` (``flashtile.attention``, the public, differentiable entry point),
``flashtile_launcher`` (``kernels.forward.flash_attention`` alone; forward only) and ``sdpa``
(``scaled_dot_product_attention`` with PyTorch's own choice of backend). Modes: ``fwd`` (the forward
call) and ``fwd+bwd`` (the forward, then ``torch.autograd.grad(o, (q, k, v), do)``).

Rows: the bench schema's row fields, with ``pass`` "forward" for mode ``fwd`` and "backward" for mode
``fwd+bwd`` (the whole forward and backward, not the backward alone), ``ms`` the wall time per call and
``tflops`` the convention's FLOPs (×1 forward, ×3.5 forward and backward) over it; plus ``mode``,
``us_per_call``, ``calls`` and ``repeats``. Each provider's forward output is checked against the
float32 truth first, as in the forward tables.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from . import providers as prov
from .common import RESULTS, attention_tflops, save_result
from .shapes import SHAPE_KEYS, shape

SHAPE = shape(1, 1, 128, 64, True)
CALLS = {"fwd": 2000, "fwd+bwd": 500}
REPEATS, WARMUP = 5, 20
METHOD = (
    "host wall time: time.perf_counter around N back-to-back calls and one torch.cuda.synchronize, per call; "
    f"median of {REPEATS} loops after {WARMUP} warm-up calls; N = {CALLS['fwd']} (fwd), {CALLS['fwd+bwd']} "
    "(fwd+bwd: forward, then torch.autograd.grad(o, (q, k, v), do)); TFLOP/s = 4*B*H*T*T*D*0.5 (x3.5 fwd+bwd) / time"
)


def us_per_call(fn, calls: int, repeats: int = REPEATS, warmup: int = WARMUP, sync=None,
                clock=time.perf_counter) -> float:  # fmt: skip
    """Median over ``repeats`` loops of the wall time per call, in µs, of ``calls`` calls and one ``sync()``."""
    sync = sync or torch.cuda.synchronize
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = clock()
        for _ in range(calls):
            fn()
        sync()
        samples.append((clock() - start) / calls * 1e6)
    return statistics.median(samples)


def overhead_row(provider: str, mode: str, us: float, calls: int, repeats: int, s: dict = SHAPE) -> dict:
    ms = us / 1e3
    return {"pass": "forward" if mode == "fwd" else "backward", "provider": provider,
            **{key: s[key] for key in SHAPE_KEYS}, "ms": round(ms, 5),
            "tflops": float(f"{attention_tflops(s, ms, mode):.3g}"), "mode": mode, "us_per_call": round(us, 1),
            "calls": calls, "repeats": repeats}  # fmt: skip


def entry_points(s: dict = SHAPE) -> dict:
    """provider -> (the forward as a function of q, k, v; whether it is differentiable)."""
    from ..api import attention
    from ..kernels.forward import flash_attention

    causal = s["causal"]
    return {
        "flashtile": (lambda q, k, v: attention(q, k, v, is_causal=causal), True),
        "flashtile_launcher": (lambda q, k, v: flash_attention(q, k, v, causal=causal)[0], False),
        "sdpa": (lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal), True),
    }


def measure(s: dict = SHAPE, device="cuda", calls=None, repeats: int = REPEATS, warmup: int = WARMUP,
            sync=None, providers=None) -> list[dict]:  # fmt: skip
    """One row per (provider, mode); ``device``, ``calls``, ``sync`` and ``providers`` exist for the CPU test."""
    calls = calls or CALLS
    q, k, v = prov.make_inputs(s, device)
    do = torch.randn_like(q)
    truth = prov.reference_output(q, k, v, s["causal"])
    rows = []
    for name, (forward, differentiable) in entry_points(s).items():
        if providers and name not in providers:
            continue
        prov.check_output(name, forward(q, k, v), truth, s["dtype"])
        fwd_us = us_per_call(lambda f=forward: f(q, k, v), calls["fwd"], repeats, warmup, sync)
        rows.append(overhead_row(name, "fwd", fwd_us, calls["fwd"], repeats, s))
        if differentiable:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]

            def step(f=forward, leaves=leaves):
                torch.autograd.grad(f(*leaves), leaves, do)

            both_us = us_per_call(step, calls["fwd+bwd"], repeats, warmup, sync)
            rows.append(overhead_row(name, "fwd+bwd", both_us, calls["fwd+bwd"], repeats, s))
        print(f"{name:>18} " + ", ".join(f"{r['mode']} {r['us_per_call']} us" for r in rows if r["provider"] == name),
              flush=True)  # fmt: skip
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashtile.bench overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "overhead.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the benchmarks need a CUDA device")
    save_result(args.out, measure(), METHOD, shape={key: SHAPE[key] for key in SHAPE_KEYS})


if __name__ == "__main__":
    main()

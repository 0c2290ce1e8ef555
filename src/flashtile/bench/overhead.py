"""Host overhead: wall time per call of a tiny attention, where launches and Python are the whole cost.

``python -m flashtile.bench overhead`` writes ``bench/results/overhead.json``. The shape is B=1, H=1,
T=128, D=64, bf16, causal: about 2 MFLOP, nanoseconds of work for an H200, so what is measured is the
time the host needs to validate arguments, go through autograd and launch kernels.

Method: ``calls`` back-to-back calls timed with ``time.perf_counter`` and one ``torch.cuda.synchronize``
at the end; the per-call time of ``repeats`` such loops, after a warm-up, and their median. The entry
points take turns, one loop each per round, so that a host slowing down mid-run slows them all. Unlike
``triton.testing.do_bench`` (CUDA events around the GPU work) this includes everything the host does.

Providers: ``flashtile`` (``flashtile.attention``, the public, differentiable entry point),
``flashtile_launcher`` (``kernels.forward.flash_attention`` alone; forward only) and ``sdpa``
(``scaled_dot_product_attention`` with PyTorch's own choice of backend). Modes: ``fwd`` (the forward
call) and ``fwd+bwd`` (the forward, then ``torch.autograd.grad(o, (q, k, v), do)``).

``--decode`` times the decode step instead (``measure_decode``, ``bench/results/overhead-decode.json``): one
new token, B=1, H=32, H_kv=8, a 256-key cache, D=128, bf16, no ``cache_seqlens`` (nothing to read back):
``flashtile_decode`` (``flashtile.decode_attention``), ``flashtile_decode_launcher``
(``kernels.decode.flash_decode``), ``flashtile`` (``flashtile.attention`` with enable_gqa, which routes a
call without a gradient to the same kernels) and ``sdpa`` (with enable_gqa), rows of ``pass`` "decode".

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
CALLS = {"fwd": 1000, "fwd+bwd": 250}
REPEATS, WARMUP = 9, 20
METHOD = (
    "host wall time: time.perf_counter around N back-to-back calls and one torch.cuda.synchronize, per call; "
    f"median of {REPEATS} rounds after {WARMUP} warm-up calls, every entry point timing one loop per round in turn; "
    f"N = {CALLS['fwd']} (fwd), {CALLS['fwd+bwd']} (fwd+bwd: forward, then torch.autograd.grad(o, (q, k, v), do)); "
    "TFLOP/s = 4*B*H*T*T*D*0.5 (x3.5 fwd+bwd) / time"
)


def interleaved_us_per_call(tasks: dict, repeats: int = REPEATS, warmup: int = WARMUP, sync=None,
                            clock=time.perf_counter) -> dict:  # fmt: skip
    """{key: median µs per call} for ``tasks`` = {key: (fn, calls)}, the tasks taking turns.

    Round r times one loop of ``calls`` calls and one ``sync()`` for every task in turn, so a drift of
    the host's speed during the run (loops minutes apart on one machine differ by tens of percent)
    falls on every entry point alike instead of on whichever ran during it.
    """
    sync = sync or torch.cuda.synchronize
    for fn, _ in tasks.values():
        for _ in range(warmup):
            fn()
    sync()
    samples = {key: [] for key in tasks}
    for _ in range(repeats):
        for key, (fn, calls) in tasks.items():
            start = clock()
            for _ in range(calls):
                fn()
            sync()
            samples[key].append((clock() - start) / calls * 1e6)
    return {key: statistics.median(times) for key, times in samples.items()}


def us_per_call(fn, calls: int, repeats: int = REPEATS, warmup: int = WARMUP, sync=None,
                clock=time.perf_counter) -> float:  # fmt: skip
    """Median over ``repeats`` loops of the wall time per call, in µs, of ``calls`` calls and one ``sync()``."""
    return interleaved_us_per_call({fn: (fn, calls)}, repeats, warmup, sync, clock)[fn]


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
    tasks = {}  # (provider, mode) -> (one call, calls per loop)
    for name, (forward, differentiable) in entry_points(s).items():
        if providers and name not in providers:
            continue
        prov.check_output(name, forward(q, k, v), truth, s["dtype"])
        tasks[name, "fwd"] = (lambda f=forward: f(q, k, v), calls["fwd"])
        if differentiable:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]

            def step(f=forward, leaves=leaves):
                torch.autograd.grad(f(*leaves), leaves, do)

            tasks[name, "fwd+bwd"] = (step, calls["fwd+bwd"])
    us = interleaved_us_per_call(tasks, repeats, warmup, sync)
    rows = [overhead_row(name, mode, us[name, mode], n, repeats, s) for (name, mode), (_, n) in tasks.items()]
    for row in rows:
        print(f"{row['provider']:>18} {row['mode']:>8} {row['us_per_call']} us", flush=True)
    return rows


DECODE_SHAPE = dict(B=1, H=32, H_kv=8, Tq=1, Tk=256, D=128, causal=False, layout="bhtd", dtype="bf16")
DECODE_CALLS = 2000
DECODE_METHOD = (
    f"host wall time of one decode step (q (1, 32, 1, 128), a cache of 256 keys, 8 KV heads, bf16, no cache_seqlens): "
    f"time.perf_counter around {DECODE_CALLS} back-to-back calls and one torch.cuda.synchronize, per call; median of "
    f"{REPEATS} rounds after {WARMUP} warm-up calls, the entry points taking turns; under torch.no_grad"
)


def decode_entry_points() -> dict:
    """provider -> the decode step as a function of q, k, v (the cache, full)."""
    from ..api import attention
    from ..decode import decode_attention
    from ..kernels.decode import flash_decode

    return {
        "flashtile_decode": lambda q, k, v: decode_attention(q, k, v),
        "flashtile_decode_launcher": lambda q, k, v: flash_decode(q, k, v)[0],
        "flashtile": lambda q, k, v: attention(q, k, v, enable_gqa=True),  # routed to the decode kernels
        "sdpa": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }


def measure_decode(s: dict = DECODE_SHAPE, device="cuda", dtype=torch.bfloat16, calls: int = DECODE_CALLS,
                   repeats: int = REPEATS, warmup: int = WARMUP, sync=None, providers=None) -> list[dict]:  # fmt: skip
    """One row per provider of the decode step's host time; ``device``, ``dtype``, ``sync`` and ``providers``
    exist for the CPU test. Each output is checked against SDPA's in float32 first."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(s["B"], h, t, s["D"], generator=gen).to(device, dtype)
               for h, t in ((s["H"], s["Tq"]), (s["H_kv"], s["Tk"]), (s["H_kv"], s["Tk"])))  # fmt: skip
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    tasks = {}
    with torch.no_grad():
        for name, fn in decode_entry_points().items():
            if providers and name not in providers:
                continue
            err = (fn(q, k, v).float() - expected).abs().max().item()
            assert err < 5e-2, f"{name} disagrees with SDPA by {err}"
            tasks[name] = (lambda f=fn: f(q, k, v), calls)
        us = interleaved_us_per_call(tasks, repeats, warmup, sync)
    rows = []
    for name, per_call in us.items():
        rows.append({"pass": "decode", "provider": name, **{key: s[key] for key in SHAPE_KEYS},
                     "ms": round(per_call / 1e3, 5), "mode": "decode", "us_per_call": round(per_call, 1),
                     "calls": calls, "repeats": repeats})  # fmt: skip
        print(f"{name:>26} decode {rows[-1]['us_per_call']} us", flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashtile.bench overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="default: bench/results/overhead.json (overhead-decode.json)")
    parser.add_argument("--decode", action="store_true", help="time the decode step instead (measure_decode)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the benchmarks need a CUDA device")
    if args.decode:
        out = args.out or str(RESULTS / "overhead-decode.json")
        save_result(out, measure_decode(), DECODE_METHOD, shape=DECODE_SHAPE)
        return
    out = args.out or str(RESULTS / "overhead.json")
    save_result(out, measure(), METHOD, shape={key: SHAPE[key] for key in SHAPE_KEYS})


if __name__ == "__main__":
    main()

"""Where a sink's cost goes: GPU kernel times of flashtile.attention with and without sinks, by kernel.

Usage: ``OUT=/some/folder PYTHONPATH=src python bench/probes/sinks/sink_cost_profile.py``

The sinks table times a sink at +0-5 % over the same call without one. This probe splits that difference
by kernel with ``torch.profiler`` (CUDA activity): for each case of the sinks table (gpt-oss's attention,
H = 64 on H_kv = 8, D = 64, bf16, ``bthd``), ``REPEATS`` blocks of ``ITERATIONS`` forward calls under
``no_grad`` and of ``ITERATIONS`` backward calls (``o.backward(do, retain_graph=True)``, the gradients set
to None before each, as the sinks table does, so that no accumulation kernel runs), with and without sinks
taking turns block by block, the order swapped every block; per kernel name, the median over the blocks of
the GPU time per call. A sink's forward runs the same kernel with its start state
(``SINK``) and one float32 copy of the (H,) sinks; its backward runs the same kernels and then the dsinks
reduction over the rows (``kernels.sinks.sink_gradient``, one launch). Writes
``$OUT/sink-cost-profile.json``: per case and pass, {kernel name: µs per call} for both, and the sums.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch

import flashtile
from flashtile.bench.common import provenance
from flashtile.bench.providers import make_inputs
from flashtile.bench.shapes import shape

CASES = {"1k": (16, 1024, None), "4k": (4, 4096, None), "16k": (1, 16384, None), "4k-window": (4, 4096, (127, 0))}
ITERATIONS = 20
REPEATS = 5


def kernel_times(fn, iterations: int) -> dict:
    """{kernel name: GPU µs per call} of ``iterations`` calls of ``fn`` after three warm-up calls."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            fn()
        torch.cuda.synchronize()
    times: dict = {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and getattr(event, "device_time_total", 0) > 0:
            times[event.key[:90]] = round(event.device_time_total / iterations, 2)
    return times


def measure(name: str) -> dict:
    B, T, window = CASES[name]
    s = shape(B, 64, T, 64, True, H_kv=8, layout="bthd")
    q, k, v = make_inputs(s)
    sinks = (torch.randn(64, generator=torch.Generator().manual_seed(1)) + 1.0).to(q.device, q.dtype)
    do = torch.randn_like(q)
    calls = {}
    for label, extra in (("no_sink", {}), ("sinks", {"sinks": sinks})):

        def forward(extra=extra):
            with torch.no_grad():
                flashtile.attention(q, k, v, is_causal=True, window=window, enable_gqa=True, **extra)

        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        own = {key: t.detach().requires_grad_() for key, t in extra.items()}
        o = flashtile.attention(*leaves, is_causal=True, window=window, enable_gqa=True, **own)
        grads = (*leaves, *own.values())

        def backward(o=o, grads=grads):
            for x in grads:
                x.grad = None
            o.backward(do, retain_graph=True)

        calls[label] = {"forward": forward, "backward": backward}
    out = {}
    for which in ("forward", "backward"):
        blocks = {"no_sink": [], "sinks": []}
        for rep in range(REPEATS):
            for label in (("no_sink", "sinks") if rep % 2 == 0 else ("sinks", "no_sink")):
                blocks[label].append(kernel_times(calls[label][which], ITERATIONS))
        for label, seen in blocks.items():
            times = {kernel: statistics.median(b.get(kernel, 0.0) for b in seen) for kernel in set().union(*seen)}
            out.setdefault(which, {})[label] = {"kernels_us": {kernel: round(t, 2) for kernel, t in times.items()},
                                                "total_us": round(sum(times.values()), 2)}  # fmt: skip
    for which in ("forward", "backward"):
        plain, with_sinks = (out[which][k]["total_us"] for k in ("no_sink", "sinks"))
        out[which]["extra_us"] = round(with_sinks - plain, 2)
        out[which]["extra_percent"] = round(100 * (with_sinks / plain - 1), 2)
    print(name, {w: (out[w]["extra_us"], out[w]["extra_percent"]) for w in out}, file=sys.stderr, flush=True)
    return out


def main() -> None:
    result = {"provenance": provenance(f"torch.profiler CUDA kernel times per call, median of {REPEATS} blocks of "
                                       f"{ITERATIONS} calls (3 warm-up each), with and without sinks in turn"),
              "cases": {name: measure(name) for name in CASES}}  # fmt: skip
    folder = Path(os.environ.get("OUT", "."))
    (folder / "sink-cost-profile.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

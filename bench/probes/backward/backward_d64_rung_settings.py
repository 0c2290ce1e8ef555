"""A measured probe, not part of the package: why the package's backward is slower than the ladder's rung 4 at D = 64.

The ladder run (``ladder-backward.json``, an H100) timed the package's backward below rung 4 at every D = 64
shape (x0.93, x0.93, x0.97, and x0.79 at 512 tokens causal) and above it at D = 128. The two differ in the
dK/dV kernel's tiles (package 32 x 128, rung 4 64 x 64; both 4 warps, 3 stages, the same dQ setting) and in
everything the package's kernels carry beyond the dense path (windows, soft-caps, documents, GQA splits,
atomics: compiled out here). This probe times, at D = 64 (H = 16, B.T = 16,384, bf16; 512 to 8k tokens):

- ``rung_4``: the ladder's last backward rung;
- ``package``: ``kernels.backward.flash_attention_backward`` with its own settings;
- ``package_rung4_settings``: the same with ``config=`` rung 4's tiles (the public tuning argument);
- ``package_rung4_settings_tma_as_rung4``: and TMA exactly where rung 4 takes it (from 1k tokens),

each a CUDA-graph replay in interleaved rounds (the ladder's timing, ``flashtile.bench.ladder``), every
gradient compared with rung 4's first. Then, with ``torch.profiler``, ten calls of each: the device time of
every kernel, so a gap can be put on the dK/dV kernel or the dQ kernel.

    OUT=/some/folder PYTHONPATH=src python bench/probes/backward_d64_rung_settings.py [--rounds 5]

Writes ``$OUT/backward-d64-rung-settings.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

from flashtile.bench import providers as prov
from flashtile.bench.common import attention_tflops, save_result
from flashtile.bench.ladder import TIMING, interleaved_ms
from flashtile.bench.shapes import describe, shape
from flashtile.kernels.backward import flash_attention_backward
from flashtile.kernels.forward import flash_attention
from flashtile.kernels.ladder import entry_point, rungs

SHAPES = [shape(16384 // T, 16, T, 64, causal) for T, causal in (
    (512, True), (1024, True), (2048, True), (4096, True), (8192, True), (512, False), (2048, False))]
RUNG4_SETTINGS = {"dkdv": (64, 64, 4, 3), "dq": (64, 64, 4, 3)}


def calls(s: dict) -> dict:
    """name -> (q, k, v, o, lse, do, stats) -> (dq, dk, dv)."""
    causal = s["causal"]
    last = rungs("backward")[-1]
    rung = entry_point(last, "backward")
    tma_as_rung = s["Tq"] >= 1024
    return {
        f"rung_{last.index}": lambda q, k, v, o, lse, do, st: rung(q, k, v, o, lse, do, causal),
        "package": lambda q, k, v, o, lse, do, st: flash_attention_backward(q, k, v, o, lse, do, causal=causal,
                                                                            stats=st),  # fmt: skip
        "package_rung4_settings": lambda q, k, v, o, lse, do, st: flash_attention_backward(
            q, k, v, o, lse, do, causal=causal, stats=st, config=RUNG4_SETTINGS),
        "package_rung4_settings_tma_as_rung4": lambda q, k, v, o, lse, do, st: flash_attention_backward(
            q, k, v, o, lse, do, causal=causal, stats=st, config=RUNG4_SETTINGS, tma=tma_as_rung),
    }


def kernel_times(fn, repeats: int = 10) -> dict[str, float]:
    """Device microseconds per call of each kernel ``fn`` launches, from torch.profiler over ``repeats`` calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    for event in p.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.key] += event.device_time_total / repeats
    return {name: round(us, 2) for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])}


def measure(s: dict, rounds: int) -> list[dict]:
    q, k, v = prov.make_inputs(s)
    do = torch.randn_like(q)
    o, lse, stats = flash_attention(q, k, v, causal=s["causal"], return_stats=True)
    found = calls(s)
    first = None
    fns, diffs = {}, {}
    for name, fn in found.items():
        grads = fn(q, k, v, o, lse, do, stats)
        if first is None:
            first = grads
        diffs[name] = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, first))
        if diffs[name] > 0.05:
            raise AssertionError(f"{name} disagrees with rung 4 by {diffs[name]} at {describe(s)}")
        fns[name] = lambda fn=fn: fn(q, k, v, o, lse, do, stats)
    times, how = interleaved_ms(fns, rounds, **TIMING)
    rows = []
    for name in found:
        ms = statistics.median(times[name])
        rows.append(dict(provider=name, **s, ms=round(ms, 4), tflops=round(attention_tflops(s, ms, "bwd"), 1),
                         ms_rounds=[round(t, 4) for t in times[name]], timing=how[name],
                         max_abs_grad_diff_vs_rung_4=float(f"{diffs[name]:.3g}"),
                         kernel_us=kernel_times(fns[name])))  # fmt: skip
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    rows = []
    for s in SHAPES:
        print(describe(s), file=sys.stderr, flush=True)
        new = measure(s, args.rounds)
        for r in new:
            print(f"  {r['provider']:>38} {r['ms']} ms {r['tflops']} TFLOP/s {r['kernel_us']}", file=sys.stderr,
                  flush=True)  # fmt: skip
        rows += new
        torch.cuda.empty_cache()
    method = ("backward only, on the package forward's o, lse and stats; each call captured in a CUDA graph and its "
              "replay timed (triton.testing.do_bench median, warmup 25 ms, rep 100 ms) in interleaved rounds "
              "(flashtile.bench.ladder.interleaved_ms), ms = median of the rounds; kernel_us: torch.profiler device "
              "time per call by kernel over 10 plain calls; TFLOP/s = 2.5*4*B*H*Tq*Tk*D (x0.5 causal) / time")
    out = Path(os.environ.get("OUT", ".")) / "backward-d64-rung-settings.json"
    save_result(out, rows, method, rounds=args.rounds, rung4_settings=RUNG4_SETTINGS)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""A measured probe, not part of the package: where the host time of one tiny forward call goes.

The overhead table's shape (B = H = 1, T = 128, D = 64, bf16, causal). Each row times one piece of the
eager no-grad path on its own, all pieces taking turns (``bench.overhead.interleaved_us_per_call``), so
that the parts can be set against the whole and against SDPA's call in the same run.

``PYTHONPATH=src python bench/probes/host/forward_host_breakdown.py OUT.json`` on an H200.
"""
import sys

import torch

from flashtile.api import attention
from flashtile.bench.common import save_result
from flashtile.bench.overhead import SHAPE, interleaved_us_per_call, overhead_row
from flashtile.bench.providers import make_inputs
from flashtile.kernels.forward import LAUNCHER_OPTIONS, checked_forward_plan, flash_attention, forward_with_plan
from flashtile.kernels.parts import cached_plan, specialization
from flashtile.kernels.parts import current_stream as _current_stream

CALLS = 2000


def pieces(q, k, v):
    causal = SHAPE["causal"]
    flags = (causal, None, "upper_left", None, None, False, None, None, None, None, None)  # flash_attention's
    plan = cached_plan(checked_forward_plan, (q, k, v), *flags, names=LAUNCHER_OPTIONS)
    o = torch.empty(plan.out_shape, dtype=q.dtype, device=q.device)
    stats = torch.empty((3, *plan.out_shape[:3]), dtype=torch.float32, device=q.device)
    launch = plan.launch
    launch(q, k, v, o, stats)
    device = torch.cuda.current_device()
    run, function, metadata, tail = launch._compiled[(device, *map(specialization, (q, k, v, o, stats)))]
    stream = _current_stream(device)
    scalars = launch.scalars
    shape3 = (3, *plan.out_shape[:3])
    return {
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "attention": lambda: attention(q, k, v, is_causal=causal),
        "launcher": lambda: flash_attention(q, k, v, causal=causal),
        "plan_lookup": lambda: cached_plan(checked_forward_plan, (q, k, v), *flags, names=LAUNCHER_OPTIONS),
        "forward_with_plan": lambda: forward_with_plan(plan, q, k, v),
        "two_empty": lambda: (torch.empty(plan.out_shape, dtype=q.dtype, device=q.device),
                              torch.empty(shape3, dtype=torch.float32, device=q.device)),  # fmt: skip
        "launch_call": lambda: launch(q, k, v, o, stats),
        "compiled_run": lambda: run(*launch.grid, stream, function, metadata, None, None, None, q, k, v, o, stats,
                                    *scalars, *tail),  # fmt: skip
        "current_device": torch.cuda.current_device,
        "current_stream": lambda: _current_stream(device),
        "specialization_x5": lambda: tuple(map(specialization, (q, k, v, o, stats))),
        "empty_like_q": lambda: torch.empty_like(q),
    }


def main(out):
    q, k, v = make_inputs(SHAPE)
    tasks = {name: (fn, CALLS) for name, fn in pieces(q, k, v).items()}
    us = interleaved_us_per_call(tasks, repeats=9, warmup=50)
    for name, value in us.items():
        print(f"{name:>20} {value:7.2f} us", flush=True)
    rows = [{**overhead_row("sdpa" if name == "sdpa" else "flashtile", "fwd", value, CALLS, 9), "piece": name}
            for name, value in us.items()]  # fmt: skip
    save_result(out, rows, f"host wall time per call, {CALLS} calls per loop and one synchronize, median of 9 "
                "rounds, the pieces taking turns (bench.overhead.interleaved_us_per_call)", shape=SHAPE)


if __name__ == "__main__":
    main(sys.argv[1])

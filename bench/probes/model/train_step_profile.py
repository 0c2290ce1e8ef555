"""A measured probe, not part of the package: where the small model's train step spends its time.

The train-step table's padded case (``bench.train_step.PADDED_SHAPE``: the 8-layer model, B = 8 sequences of
512-2048 tokens right-padded to 2048, bf16), or with ``main`` as a second argument its main case
(``MAIN_SHAPE``: the same model at B = 2, T = 2048, no padding), for flashtile and SDPA: the step's wall time
in a plain loop (host and GPU together), the GPU's busy time in the same steps, and each kernel's GPU time per step from
torch.profiler (the 15 largest, names cut to 60 characters), summed into attention and everything else.
A step whose wall time is well above its GPU time waits on the host (launches, reads of device values).
``do_bench_ms`` is the same step timed as the train-step table times it (``train_step.step_median_ms``: triton's
do_bench, which clears the L2 cache before each call and times it with CUDA events), in the same process.

``PYTHONPATH=src python bench/probes/model/train_step_profile.py OUT.json [main]`` on an H200 (about a minute).
"""

import collections
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from flashtile.bench.common import save_result
from flashtile.bench.train_step import (
    MAIN_SHAPE,
    PADDED_SHAPE,
    build,
    forward_backward,
    padding_mask,
    step_median_ms,
    token_ids,
)
from flashtile.integrations.transformers import register

STEPS = 20
ATTENTION_WORDS = ("attention", "attn", "fmha", "flash", "_forward_kernel", "backward_dq", "backward_dkdv", "cutlass")


def profile_steps(model, ids, mask) -> dict:
    for _ in range(3):
        forward_backward(model, ids, mask)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(STEPS):
        forward_backward(model, ids, mask)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / STEPS * 1e3
    bench_ms = step_median_ms(lambda: forward_backward(model, ids, mask))  # the train-step table's own timer
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            forward_backward(model, ids, mask)
        torch.cuda.synchronize()
    kernels = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:60]] += event.device_time / STEPS / 1e3  # ms per step
    attention = sum(ms for name, ms in kernels.items() if any(w in name.lower() for w in ATTENTION_WORDS))
    return dict(wall_ms=round(wall_ms, 3), do_bench_ms=round(bench_ms, 3), gpu_ms=round(sum(kernels.values()), 3),
                attention_gpu_ms=round(attention, 3),
                top_kernels_ms={name: round(ms, 3) for name, ms in kernels.most_common(15)})  # fmt: skip


def main(out: str, which: str = "padded") -> None:
    shape = MAIN_SHAPE if which == "main" else PADDED_SHAPE
    ids = token_ids(shape, "cuda")
    mask, lengths = padding_mask(shape, "cuda") if which != "main" else (None, None)
    rows = []
    for provider, implementation in (("flashtile", register()), ("sdpa", "sdpa")):
        model = build(shape, implementation, "cuda", torch.bfloat16)
        rows.append(dict(provider=provider, lengths=lengths, **profile_steps(model, ids, mask)))
        print(rows[-1], file=sys.stderr, flush=True)
        del model
        torch.cuda.empty_cache()
    save_result(out, rows, f"{which} train step: wall time of {STEPS} steps in a loop, the table's do_bench median, "
                f"GPU time per kernel from torch.profiler over another {STEPS} (ms per step)", shape=shape)  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:3])

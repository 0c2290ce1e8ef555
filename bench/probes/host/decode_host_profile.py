"""Host work of one decode step, on the CPU, with the kernel launches stubbed out (issue 35, item 3).

Usage: ``TRITON_INTERPRET=1 python bench/probes/host/decode_host_profile.py`` (run it from a checkout of any
commit to compare: it only needs ``flashtile.decode_attention``, ``kernels.decode.flash_decode``,
``flashtile.attention`` and ``kernels.parts.KernelLaunch``).

What it measures: the Python and PyTorch work a call does before and around its launches, at the issue's
shape (B=1, H=32, H_kv=8, Tq=1, a 256-key cache, D=128; float32 CPU tensors, which the interpreter
setting sends down the Triton tier's host path). ``KernelLaunch.__call__`` is replaced by a function that
returns at once, so no kernel runs and the time per call is the host path alone: the checks, the plan
lookups, the allocations and the launch bookkeeping above the launcher. CPU allocations are cheaper than
CUDA ones (the caching allocator costs about 1-2 µs a tensor there), so the script also counts the
tensors each call allocates (``torch.empty`` and ``torch.empty_like``, wrapped). The GPU's own numbers
come from ``python -m flashtile.bench overhead --decode``.
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import flashtile  # noqa: E402
from flashtile.kernels import parts  # noqa: E402
from flashtile.kernels.decode import flash_decode  # noqa: E402

CALLS, REPEATS = 2000, 7


def per_call_us(fn) -> float:
    for _ in range(200):
        fn()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        times.append((time.perf_counter() - start) / CALLS * 1e6)
    return statistics.median(times)


def allocations(fn) -> int:
    """Tensors one call allocates through torch.empty / torch.empty_like (the functions the launchers use)."""
    count = [0]
    real_empty, real_like = torch.empty, torch.empty_like

    def empty(*a, **kw):
        count[0] += 1
        return real_empty(*a, **kw)

    def empty_like(*a, **kw):
        count[0] += 1
        return real_like(*a, **kw)

    torch.empty, torch.empty_like = empty, empty_like
    try:
        fn()
    finally:
        torch.empty, torch.empty_like = real_empty, real_like
    return count[0]


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 1, 128, generator=gen)
    k = torch.randn(1, 8, 256, 128, generator=gen)
    v = torch.randn(1, 8, 256, 128, generator=gen)
    seqlens = torch.full((1,), 256, dtype=torch.int32)
    parts.KernelLaunch.__call__ = lambda self, *tensors: None  # no kernel runs: the host path alone
    cases = {
        "decode_attention(q, k, v)": lambda: flashtile.decode_attention(q, k, v),
        "decode_attention(q, k, v, seqlens)": lambda: flashtile.decode_attention(q, k, v, seqlens),
        "flash_decode(q, k, v)": lambda: flash_decode(q, k, v),
        "attention(q, k, v, enable_gqa=True)": lambda: flashtile.attention(q, k, v, enable_gqa=True),
        "torch.empty_like(q) (one allocation)": lambda: torch.empty_like(q),
    }
    with torch.no_grad():
        for name, fn in cases.items():
            print(f"{name:>40}: {per_call_us(fn):6.2f} us per call, {allocations(fn)} tensors allocated", flush=True)


if __name__ == "__main__":
    main()

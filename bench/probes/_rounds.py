"""What the side-by-side probes share: calls timed in interleaved rounds, one row per call.

Each round times every call once (``median_ms``), in the same order, so that a drift of the GPU's clocks during
the run touches every version alike; a call's time is the median of its rounds. Used by ``forward_ablation.py``
and ``backward_fused_bias.py``.
"""

from __future__ import annotations

import contextlib
import statistics

from flashtile.bench.common import attention_tflops, median_ms

FIELDS = ("B", "H", "Tq", "Tk", "D", "causal")


def interleaved_rows(shape: dict, calls: dict, mode: str, rounds: int = 3, contexts: dict | None = None) -> list[dict]:
    """One row per entry of ``calls`` (name -> zero-argument callable), with ``calls["sdpa_cudnn"]`` the baseline:
    provider (``flashtile_<name>`` for flashtile's versions), the shape's fields, ms, TFLOP/s by ``mode``'s
    convention, the ratio to cuDNN's time and every round's time. ``contexts`` maps a name to a context-manager
    factory entered around that call's timing (an SDPA backend, say)."""
    contexts = contexts or {}
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            with contexts.get(name, contextlib.nullcontext)():
                times[name].append(median_ms(call, warmup=25, rep=100))
    base = statistics.median(times["sdpa_cudnn"])
    rows = []
    for name, ms_list in times.items():
        ms = statistics.median(ms_list)
        rows.append(dict(provider=name if name == "sdpa_cudnn" else f"flashtile_{name}",
                         **{key: shape[key] for key in FIELDS}, ms=round(ms, 4),
                         tflops=round(attention_tflops(shape, ms, mode), 1), ratio_to_cudnn=round(base / ms, 3),
                         ms_rounds=[round(t, 4) for t in ms_list]))  # fmt: skip
    return rows

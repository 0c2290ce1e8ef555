"""What every benchmark shares: inputs, SDPA providers, the FLOP convention, timing and provenance."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path

import torch

# Where every result lives, by role: bench/results/<table>.json for the tables the site renders,
# bench/results/sweeps/ for launch-config sweeps, bench/results/history/ for superseded comparisons.
# The CLI writes here and the site reads from here, whatever the working directory.
ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "bench" / "results"

# The convention of the team's anchor file (shared/anchors): causal work is counted as half of dense,
# and a backward as 2.5 forwards (five matmuls instead of two), so a forward and backward is 3.5.
MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def attention_flops(shape: dict, mode: str = "fwd") -> float:
    """FLOPs of one attention call by the convention: 4·B·H·Tq·Tk·D, ×0.5 if causal, ×2.5 for a backward.

    ``shape`` has B, H, D, causal and either Tq and Tk (the bench schema) or T (older rows, Tq = Tk = T).
    Halving is the convention for a square causal call only; a causal call with Tq != Tk has no agreed
    count here and is refused rather than mislabelled.
    """
    Tq, Tk = (shape[key] if key in shape else shape["T"] for key in ("Tq", "Tk"))
    if shape["causal"] and Tq != Tk:
        raise ValueError(f"the causal FLOP convention (x0.5) is for Tq == Tk; got Tq={Tq}, Tk={Tk}")
    flops = 4 * shape["B"] * shape["H"] * Tq * Tk * shape["D"] * (0.5 if shape["causal"] else 1.0)
    return MODE_FACTOR[mode] * flops


def attention_tflops(shape: dict, ms: float, mode: str = "fwd") -> float:
    """TFLOP/s of one attention call of ``shape`` (see ``attention_flops``) that took ``ms`` milliseconds."""
    return attention_flops(shape, mode) / (ms * 1e-3) / 1e12


def median_ms(fn, warmup: int = 50, rep: int = 200, **kwargs) -> float:
    """Median time of ``fn()`` in ms, from CUDA events (triton.testing.do_bench); warm-up and rep in ms."""
    import triton

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median", **kwargs)


L2_FLUSH_BYTES = 256 * 1024 * 1024  # far more than the H200's 50 MB L2, as triton.testing.do_bench uses
_flush_buffers: dict = {}


def clean_l2_ms(fn, warmup: int = 50, rep: int = 200) -> float:
    """Median time of ``fn()`` in ms, from CUDA events, with ``fn``'s data read out of the L2 before each
    call by *reading* a 256 MB buffer; warm-up and rep in ms, as for ``median_ms``.

    ``triton.testing.do_bench`` empties the L2 by writing (zeroing) such a buffer, which leaves the L2
    full of dirty lines: the timed call then pays for writing them back to HBM (what that costs a decode
    call on the H200, flushing by a write, by a read and not at all: bench/PERF_LOG.md, "Decode clocks").
    Next to a bandwidth-bound call that is someone else's traffic counted as the call's own. Reading
    leaves clean lines, which cost nothing to drop.
    """
    device = torch.cuda.current_device()
    if device not in _flush_buffers:
        _flush_buffers[device] = torch.ones(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    flush_buffer = _flush_buffers[device]

    def flush():
        flush_buffer.max()  # reads every byte, writes one number

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = start.elapsed_time(end) / 5
    for _ in range(max(1, int(warmup / estimate_ms))):
        fn()
    n = max(1, int(rep / estimate_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        flush()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(starts, ends))


def graph_ms(fn, warmup: int = 50, rep: int = 200, timer=None) -> float:
    """Median time of one replay of ``fn`` captured in a CUDA graph: the GPU's time without the host's.

    Serving engines capture their decode steps in graphs, so the host launches one graph per step,
    whatever the Python around the kernels costs. ``timer`` times the replay (``median_ms`` unless
    given), which empties the L2 before each one.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, allocate) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return (timer or median_ms)(graph.replay, warmup=warmup, rep=rep)


def _git_commit() -> str:
    if os.environ.get("FLASHTILE_COMMIT"):  # a copy of the tree without its .git history says it here
        return os.environ["FLASHTILE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("FLASHTILE_COMMIT", "unknown")


def provenance(method: str) -> dict:
    """Where and how a table was measured; committed with the numbers."""
    import triton

    return dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
        date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        commit=os.environ.get("FLASHTILE_COMMIT") or _git_commit(),
        method=method,
    )


def save_result(out: str | Path, rows: list[dict], method: str, **extra) -> dict:
    """Write ``{"provenance": ..., **extra, "rows": rows}`` to ``out`` as JSON and return it."""
    result = dict(provenance=provenance(method), **extra, rows=rows)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return result


def load_result(json_name: str, folder: Path | None = None) -> dict:
    """``bench/results/<json_name>`` (or ``folder/<json_name>``) as ``save_result`` wrote it: the pages'
    claims and the site's tables and plots read their numbers through this."""
    return json.loads(((folder or RESULTS) / json_name).read_text())


def select_rows(json_name: str, **where) -> list[dict]:
    """The rows of ``bench/results/<json_name>`` whose fields equal every ``where`` item (``pass`` goes in as
    ``**{"pass": ...}``, a keyword Python reserves)."""
    return [row for row in load_result(json_name)["rows"] if all(row.get(k, object()) == v for k, v in where.items())]


def speedup(json_name: str, old: dict, new: dict, key: str = "ms", **where) -> float:
    """How many times faster the one row matching ``old`` and ``where`` is made by the one matching ``new``
    and ``where``, both from one run: old time / new time for ``key="ms"``, new rate / old rate otherwise."""
    (before,), (after,) = ([row[key] for row in select_rows(json_name, **{**where, **fields})] for fields in (old, new))
    return before / after if key == "ms" else after / before

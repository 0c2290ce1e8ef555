"""A measured probe, not part of the package: versions of the forward kernel's module timed side by side.

Each version is a copy of ``src/flashtile/kernels/forward.py`` (an earlier commit's, or the package's with
one change) loaded as its own module, so that Triton compiles each one separately; all are timed in one
process, in interleaved rounds with cuDNN, at the same inputs, after a check against cuDNN's output.

    python bench/probes/forward_ab.py make DIR [REV]   # DIR/base.py from REV (git show), DIR/nocheck.py

A version from before the kernels' shared helpers were split into ``_host.py`` and ``_jit.py`` imports
them from ``kernels/_common.py``: ``make`` then also writes REV's ``_common.py`` beside ``base.py``
(as ``base_common.py``) and points ``base.py`` at it, so any earlier commit loads against its own helpers.
    python bench/probes/forward_ab.py OUT.json name=path.py ... [--cells main|causal|all|2k|d128] [--rounds N]

``nocheck`` is an ablation, never a candidate: the package's kernel with its check for huge scores
(``tl.max(largest, 0) >= SHIFT_LIMIT`` and the exact rerun it guards) replaced by a compile-time False,
so only the fast path's stores remain (``forward-ab-1.json`` ran the same ablation on the earlier
order, the check before the stores). For ordinary inputs its outputs equal the package's bitwise; it shows what
the check costs.
"""
import importlib.util
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from flashtile.bench.common import attention_tflops, median_ms, save_result
from flashtile.bench.providers import make_inputs
from flashtile.bench.shapes import standard_sweep
from flashtile.kernels import forward as package_forward

CHECK = "if tl.max(largest, 0) >= SHIFT_LIMIT:"  # the package's check (since a260343: after the fast rows' stores)


def absolute_imports(source: str) -> str:
    """The module's relative imports, made absolute, so that a copy outside the package imports the package."""
    source = source.replace("from .._", "from flashtile._").replace("from ..reference", "from flashtile.reference")
    return re.sub(r"^from \.(?=\w)", "from flashtile.kernels.", source, flags=re.M)  # siblings in kernels/


def make_versions(folder: str, rev: str | None = None) -> None:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    source = Path(package_forward.__file__).read_text()
    assert source.count(CHECK) == 1, "the check's line moved: update CHECK"
    (out / "nocheck.py").write_text(absolute_imports(source.replace(CHECK, "if SHIFT_LIMIT < 0:  # ablation: never")))
    if rev:
        old = subprocess.run(["git", "show", f"{rev}:src/flashtile/kernels/forward.py"], check=True,
                             capture_output=True, text=True).stdout  # fmt: skip
        if "from ._common import" in old:  # before the split: the helpers as they were at REV
            common = subprocess.run(["git", "show", f"{rev}:src/flashtile/kernels/_common.py"], check=True,
                                    capture_output=True, text=True).stdout  # fmt: skip
            (out / "base_common.py").write_text(f"# src/flashtile/kernels/_common.py at {rev}\n"
                                                + absolute_imports(common))  # fmt: skip
            old = old.replace("from ._common import", "from base_common import")
        (out / "base.py").write_text(f"# src/flashtile/kernels/forward.py at {rev}\n" + absolute_imports(old))


def load(name: str, path: str):
    folder = str(Path(path).resolve().parent)  # where a version's own helpers (base_common.py) lie
    if folder not in sys.path:
        sys.path.append(folder)
    spec = importlib.util.spec_from_file_location(f"probe_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CELLS = {  # the standard sweep's cells under issue 10's targets, and their neighbours
    "main": [s for s in standard_sweep("bf16") if s["Tq"] in (2048, 4096) or (s["Tq"] == 512 and s["D"] == 128)],
    "causal": [s for s in standard_sweep("bf16") if s["causal"]],
    "all": standard_sweep("bf16"),
    "2k": [s for s in standard_sweep("bf16") if s["Tq"] == 2048 or (s["Tq"] == 4096 and s["D"] == 128)],
    "d128": [s for s in standard_sweep("bf16") if s["D"] == 128 or s["Tq"] in (2048, 4096)],
}


def measure(shape: dict, versions: dict, rounds: int = 3) -> list[dict]:
    q, k, v = make_inputs(shape)
    causal = shape["causal"]
    calls = {"sdpa_cudnn": lambda: scaled_dot_product_attention(q, k, v, is_causal=causal)}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        truth = calls["sdpa_cudnn"]().float()
    errors = {}
    for name, module in versions.items():
        calls[name] = lambda module=module: module.flash_attention(q, k, v, causal=causal)
        errors[name] = (calls[name]()[0].float() - truth).abs().max().item()
        assert errors[name] < 0.05, (name, errors[name])
    times = {name: [] for name in calls}
    for _ in range(rounds):  # interleaved, so that a drift of the clocks touches every version alike
        for name, call in calls.items():
            if name == "sdpa_cudnn":
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    times[name].append(median_ms(call, warmup=25, rep=100))
            else:
                times[name].append(median_ms(call, warmup=25, rep=100))
    cudnn = statistics.median(times["sdpa_cudnn"])
    rows = []
    for name, ms_list in times.items():
        ms = statistics.median(ms_list)
        rows.append({"pass": "forward", "provider": name if name == "sdpa_cudnn" else f"flashtile_{name}", **shape,
                     "ms": round(ms, 4), "tflops": round(attention_tflops(shape, ms), 1),
                     "ms_rounds": [round(t, 4) for t in ms_list], "ratio_to_cudnn": round(cudnn / ms, 3),
                     **({} if name == "sdpa_cudnn" else {"max_abs_diff_vs_cudnn": errors[name]})})  # fmt: skip
    line = "  ".join(f"{r['provider']} {r['ms'] * 1e3:.1f} ({r['ratio_to_cudnn']:.3f})" for r in rows)
    print(f"D{shape['D']} T{shape['Tq']} {'causal' if causal else 'nomask'}: {line}", flush=True)
    return rows


def main(out: str, specs: list[str], cells: str = "main", rounds: int = 3) -> None:
    torch.cuda.set_device(0)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    versions = {"package": package_forward}
    for spec in specs:
        name, path = spec.split("=", 1)
        versions[name] = load(name, path)
    rows = [row for shape in CELLS[cells] for row in measure(shape, versions, rounds)]
    save_result(out, rows, f"do_bench median (warmup 25 ms, rep 100 ms) per round, {rounds} interleaved rounds, "
                "the median of the rounds; each version checked against cuDNN's output first",
                versions={name: os.path.relpath(module.__file__) for name, module in versions.items()})  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make_versions(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
    else:
        args = sys.argv[2:]
        options = {"--cells": "main", "--rounds": "3"}
        for flag in options:
            if flag in args:
                at = args.index(flag)
                options[flag] = args[at + 1]
                args = args[:at] + args[at + 2:]
        main(sys.argv[1], args, options["--cells"], int(options["--rounds"]))

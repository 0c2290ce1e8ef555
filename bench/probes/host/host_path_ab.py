"""The tiny call's host path before and after a change, on one CPU: ``host_path_cpu.py`` run from two
checkouts in alternating processes.

Usage: ``OUT=/some/folder python bench/probes/host/host_path_ab.py BEFORE AFTER [--rounds N] [--calls N]
[--repeats R]``, BEFORE and AFTER two checkouts (``git archive <commit> | tar -x -C <folder>``), each timed
with its own copy of ``host_path_cpu.py`` (``bench/probes/host/`` or, in older trees, ``bench/probes/``)
and its own ``src`` on ``PYTHONPATH``.

Each round starts one process per checkout, in the order ABBA, BAAB, ... so that a machine that slows
down during a round falls on both alike. Every process prints per-path times (this thread's CPU time,
launches stubbed) and Python/torch/ATen call counts, and one more process per checkout counts the bytecode
instructions one call of each path executes; the file keeps them all, the medians over rounds,
after / before per path, and the same ratio with each process's own SDPA rows dividing its flashtile
rows (CPU SDPA is the same code in both processes, so it tells a slower process from a slower path).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROBE_PATHS = ("bench/probes/host/host_path_cpu.py", "bench/probes/host_path_cpu.py")
ROW = re.compile(r"^\s*(?P<path>.+?)\s+(?P<us>[0-9.]+)\s+(?P<py>\d+)\s+(?P<fn>\d+)\s+(?P<aten>\d+)\s*$")
# each flashtile path and the SDPA row that scales it (same autograd work: forward alone, or forward + grad)
SCALED_BY = {
    "attention fwd, no grad": "sdpa fwd (CPU math, for scale)",
    "attention fwd, grad recorded": "sdpa fwd (CPU math, for scale)",
    "attention fwd + autograd.grad": "sdpa fwd + autograd.grad (CPU)",
    "launcher flash_attention": "sdpa fwd (CPU math, for scale)",
    "launcher flash_attention_backward": "sdpa fwd (CPU math, for scale)",
}


def probe_of(tree: Path) -> Path:
    for relative in PROBE_PATHS:
        if (tree / relative).is_file():
            return tree / relative
    raise SystemExit(f"{tree} holds no host_path_cpu.py ({' or '.join(PROBE_PATHS)})")


def run_once(tree: Path, calls: int, repeats: int) -> dict:
    """One process of ``host_path_cpu.py`` from ``tree``: {path: {"us", "python_calls", "torch_calls",
    "aten_ops"}}."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), TRITON_INTERPRET="1")
    env.pop("PYTHONPYCACHEPREFIX", None)  # each tree its own bytecode
    out = subprocess.run([sys.executable, str(probe_of(tree)), "--calls", str(calls), "--repeats", str(repeats)],
                         cwd=tree, env=env, capture_output=True, text=True, check=True).stdout  # fmt: skip
    rows = {}
    for line in out.splitlines():
        match = ROW.match(line)
        if match:
            rows[match["path"]] = dict(us=float(match["us"]), python_calls=int(match["py"]),
                                       torch_calls=int(match["fn"]), aten_ops=int(match["aten"]))  # fmt: skip
    if not rows:
        raise SystemExit(f"no rows in the output of {tree}:\n{out}")
    return rows


# Run in a child process from each checkout (its probe's path as argv[1]): the probe's launch stubs, then the
# bytecode instructions one call of each path executes (sys.settrace's opcode events), in all and in
# flashtile's own files. A count, like the call counts: the same on every run, where times are not.
OPCODE_COUNTER = r"""
import collections, json, os, runpy, sys
os.environ["TRITON_INTERPRET"] = "1"
probe = runpy.run_path(sys.argv[1], run_name="host_path_cpu")
probe["stub_launches"]()
import torch
import flashtile
from flashtile.api import use_backend
from flashtile.kernels.forward import flash_attention

with use_backend("triton"):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 128, 64, generator=gen, dtype=torch.float16) for _ in range(3))
    do = torch.randn_like(q)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    paths = {
        "attention fwd, no grad": lambda: flashtile.attention(q, k, v, is_causal=True),
        "attention fwd, grad recorded": lambda: flashtile.attention(*leaves, is_causal=True),
        "attention fwd + autograd.grad": lambda: torch.autograd.grad(
            flashtile.attention(*leaves, is_causal=True), leaves, do),
        "launcher flash_attention": lambda: flash_attention(q, k, v, causal=True),
    }
    out = {}
    for name, fn in paths.items():
        for _ in range(5):
            fn()
        counts = collections.Counter()

        def tracer(frame, event, arg):
            frame.f_trace_opcodes = True
            if event == "opcode":
                counts["flashtile" if os.sep + "flashtile" + os.sep in frame.f_code.co_filename else "other"] += 1
            return tracer

        sys.settrace(tracer)
        fn()
        sys.settrace(None)
        out[name] = dict(bytecodes=sum(counts.values()), bytecodes_in_flashtile=counts["flashtile"])
print(json.dumps(out))
"""


def opcode_counts(tree: Path) -> dict:
    """{path: {"bytecodes", "bytecodes_in_flashtile"}} of one call of each path, from ``tree``."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), TRITON_INTERPRET="1")
    env.pop("PYTHONPYCACHEPREFIX", None)
    out = subprocess.run([sys.executable, "-c", OPCODE_COUNTER, str(probe_of(tree))], cwd=tree, env=env,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return json.loads(out.splitlines()[-1])


def summarize(runs: list[dict]) -> dict:
    """Per path: the median time over the processes, the counts (the same in every process, or a list of
    what each saw), and the median of each process's time / its SDPA row's time."""
    out = {}
    for path in runs[0]:
        times = [r[path]["us"] for r in runs]
        row = dict(us_median=statistics.median(times), us_all=times)
        for count in ("python_calls", "torch_calls", "aten_ops"):
            seen = sorted({r[path][count] for r in runs})
            row[count] = seen[0] if len(seen) == 1 else seen
        if path in SCALED_BY:
            row["per_sdpa_median"] = statistics.median(r[path]["us"] / r[SCALED_BY[path]]["us"] for r in runs)
        out[path] = row
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--before-label", default="before")
    parser.add_argument("--after-label", default="after")
    args = parser.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs = {"before": [], "after": []}
    for r in range(args.rounds):
        order = ["before", "after", "after", "before"] if r % 2 == 0 else ["after", "before", "before", "after"]
        for side in order:
            runs[side].append(run_once(trees[side], args.calls, args.repeats))
            print(f"round {r + 1}/{args.rounds}: {side} done", file=sys.stderr, flush=True)
    before, after = summarize(runs["before"]), summarize(runs["after"])
    for side, summary in (("before", before), ("after", after)):
        for path, counts in opcode_counts(trees[side]).items():
            summary[path].update(counts)
    ratios = {
        path: dict(after_over_before=after[path]["us_median"] / before[path]["us_median"],
                   after_over_before_per_sdpa=(after[path]["per_sdpa_median"] / before[path]["per_sdpa_median"]
                                               if path in SCALED_BY else None))  # fmt: skip
        for path in before if path in after
    }
    import torch

    result = dict(
        provenance=dict(
            machine=f"{platform.machine()}, {os.cpu_count()} cores (no GPU)",
            python=platform.python_version(),
            torch=torch.__version__,
            date_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            before=args.before_label,
            after=args.after_label,
            method=("bench/probes/host/host_path_cpu.py from each checkout, launches stubbed, TRITON_INTERPRET=1, "
                    f"thread CPU time; {args.rounds} rounds of 4 processes (ABBA, then BAAB), {args.calls} calls "
                    f"per loop, median of {args.repeats} interleaved loops per process; medians over processes"),
        ),
        before=before,
        after=after,
        ratios=ratios,
    )
    folder = Path(os.environ.get("OUT", "."))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "host-path-cpu-ab.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'path':>36} {'before':>8} {'after':>8} {'ratio':>6} {'/sdpa':>6} {'bytecodes':>11}")
    for path, ratio in ratios.items():
        scaled = ratio["after_over_before_per_sdpa"]
        codes = "" if "bytecodes" not in before[path] else f"{before[path]['bytecodes']}->{after[path]['bytecodes']}"
        scaled = "" if scaled is None else f"{scaled:6.3f}"
        print(f"{path:>36} {before[path]['us_median']:8.2f} {after[path]['us_median']:8.2f} "
              f"{ratio['after_over_before']:6.3f} {scaled:>6} {codes:>11}")  # fmt: skip


if __name__ == "__main__":
    main()

"""The overhead table's host time before and after a change, on one GPU: ``python -m flashtile.bench
overhead``'s own measurement run from two checkouts in alternating processes.

Usage: ``OUT=/some/folder python bench/probes/host/overhead_ab.py BEFORE AFTER [--rounds N] [--budget-s S]
[--before-label L] [--after-label L]``, BEFORE and AFTER two checkouts (``git archive <commit> src | tar -x
-C <folder>`` is enough), each imported from its own ``src`` on ``PYTHONPATH`` with its own bytecode; or
``OUT=... python bench/probes/host/overhead_ab.py --pool FILE FILE ... [--variants V ...]``, which takes
the processes of several runs together (``overhead-ab-pooled.json``), for the variants whose code is the
same in every run.

Why processes in turn: one checkout's table, run after run, moved by 20 % between processes, and SDPA,
the same code in both, moved with it. So each round starts one process per checkout (AB, then BA, ...),
after one discarded process per checkout that fills Triton's cache. Every process calls
``flashtile.bench.overhead.measure()`` (the table's method: entry points taking turns, median of 9 loops)
three times:

- ``tool``: as the command runs it;
- ``gc-timed``: with a ``gc.callbacks`` hook adding up the time Python's garbage collector ran and how
  many collections of each generation it made while the loops ran;
- ``gc-frozen``: after ``gc.collect(); gc.freeze()``, so that a collection no longer walks the objects
  the process made before the loops (imported modules, compiled kernels, caches);

and then the decode table's ``measure_decode()`` once (``decode``, the collector still frozen).

The file keeps every process's µs per call, and per variant and row: the median over processes of each
checkout, after / before with a bootstrap 95 % interval (processes resampled), and the same ratio with
each process's own SDPA row of the same mode dividing its flashtile rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("tool", "gc-timed", "gc-frozen", "decode")
# each flashtile row and the SDPA row of the same mode (same autograd work) that scales it
SCALED_BY = {"flashtile fwd": "sdpa fwd", "flashtile fwd+bwd": "sdpa fwd+bwd", "flashtile_launcher fwd": "sdpa fwd",
             "flashtile_decode decode": "sdpa decode", "flashtile_decode_launcher decode": "sdpa decode",
             "flashtile decode": "sdpa decode"}

# Run in each child process, from one checkout: argv[1] is that checkout's src folder.
CHILD = r"""
import gc, json, sys, time
import flashtile
from flashtile.bench import overhead
assert flashtile.__file__.startswith(sys.argv[1]), (flashtile.__file__, sys.argv[1])
gc_run = dict(seconds=0.0, collections=[0, 0, 0])
started = [0.0]

def timed(phase, info):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        gc_run["seconds"] += time.perf_counter() - started[0]
        gc_run["collections"][info["generation"]] += 1

result = {}
for variant in ("tool", "gc-timed", "gc-frozen", "decode"):
    if variant == "gc-frozen":
        gc.collect()
        gc.freeze()
    gc_run.update(seconds=0.0, collections=[0, 0, 0])
    tracked = len(gc.get_objects())
    if variant == "gc-timed":
        gc.callbacks.append(timed)
    rows = overhead.measure_decode() if variant == "decode" else overhead.measure()
    if variant == "gc-timed":
        gc.callbacks.remove(timed)
    result[variant] = dict(us={f"{r['provider']} {r['mode']}": r["ms"] * 1e3 for r in rows},
                           tracked_objects=tracked)
    if variant == "gc-timed":
        result[variant].update(gc_seconds=gc_run["seconds"], gc_collections=list(gc_run["collections"]))
print("RESULT " + json.dumps(result))
"""


def run_once(tree: Path) -> dict:
    """One process from ``tree``: {variant: {"us": {row: µs per call}, "tracked_objects", ...}}."""
    src = tree / "src"
    env = dict(os.environ, PYTHONPATH=str(src))
    env.pop("PYTHONPYCACHEPREFIX", None)  # each tree its own bytecode
    done = subprocess.run([sys.executable, "-c", CHILD, str(src)], cwd=tree, env=env, capture_output=True,
                          text=True)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"the process from {tree} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return json.loads(lines[-1][len("RESULT "):])


def bootstrap_ratio(before: list[float], after: list[float], draws: int = 4000, seed: int = 0) -> list[float]:
    """A 95 % interval of median(after) / median(before), each side's processes drawn with replacement."""
    rng = random.Random(seed)
    ratios = sorted(statistics.median(rng.choices(after, k=len(after)))
                    / statistics.median(rng.choices(before, k=len(before))) for _ in range(draws))  # fmt: skip
    return [ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]]


def summarize(runs: dict, variant: str) -> dict:
    """Per row of ``variant``: both sides' per-process µs, medians, after / before with its interval, and
    the same for the rows scaled by their process's SDPA row."""
    out = {}
    for row in runs["before"][0][variant]["us"]:
        sides = {side: [r[variant]["us"][row] for r in runs[side]] for side in runs}
        entry = {f"{side}_us": values for side, values in sides.items()}
        entry.update({f"{side}_median": statistics.median(values) for side, values in sides.items()})
        entry["after_over_before"] = entry["after_median"] / entry["before_median"]
        entry["interval_95"] = bootstrap_ratio(sides["before"], sides["after"])
        if row in SCALED_BY:
            scaled = {side: [r[variant]["us"][row] / r[variant]["us"][SCALED_BY[row]] for r in runs[side]]
                      for side in runs}  # fmt: skip
            entry["per_sdpa_after_over_before"] = statistics.median(scaled["after"]) / statistics.median(
                scaled["before"])
            entry["per_sdpa_interval_95"] = bootstrap_ratio(scaled["before"], scaled["after"])
        out[row] = entry
    for side in runs:  # where the processes' own files are at hand (not for pooled files)
        if "gc_seconds" in runs[side][0][variant]:
            out[f"gc ms per process ({side})"] = [round(r[variant]["gc_seconds"] * 1e3, 2) for r in runs[side]]
            out[f"gc collections per process ({side})"] = [r[variant]["gc_collections"] for r in runs[side]]
        if "tracked_objects" in runs[side][0][variant]:
            out[f"tracked objects ({side})"] = statistics.median(r[variant]["tracked_objects"] for r in runs[side])
    return out


def runs_of(result: dict) -> dict:
    """The per-process µs that a result file of this probe keeps, back in ``summarize``'s form."""
    runs = {}
    for side in ("before", "after"):
        variants = {variant: {row: entry[f"{side}_us"] for row, entry in rows.items() if isinstance(entry, dict)}
                    for variant, rows in result["variants"].items()}  # fmt: skip
        n = len(variants["tool"]["flashtile fwd"])
        runs[side] = [{variant: {"us": {row: values[i] for row, values in rows.items()}}
                       for variant, rows in variants.items()} for i in range(n)]  # fmt: skip
    return runs


def pool(files: list[Path], variants=VARIANTS) -> dict:
    """Several runs as one, for the ``variants`` whose code is the same in every run (the same two checkouts,
    or heads that differ elsewhere): their processes together, summarized as one run's."""
    results = [json.loads(f.read_text()) for f in files]
    runs = {"before": [], "after": []}
    for result in results:
        for side, processes in runs_of(result).items():
            runs[side] += processes
    common = [v for v in variants if all(v in r["variants"] for r in results)]
    runs = {side: [{v: p[v] for v in common} for p in processes] for side, processes in runs.items()}
    return dict(provenance=dict(pooled=[dict(file=f.name, **r["provenance"]) for f, r in zip(files, results)],
                                method="the processes of the files above taken together; medians over them, "
                                       "bootstrap 95 % intervals of after / before (4000 draws)"),
                variants={variant: summarize(runs, variant) for variant in common})  # fmt: skip


def print_summary(result: dict) -> None:
    for variant, rows in result["variants"].items():
        print(f"{variant}: {'row':>24} {'before':>8} {'after':>8} {'ratio':>6} {'95 %':>13} {'/sdpa':>6}")
        for row, entry in rows.items():
            if not isinstance(entry, dict):
                continue
            lo, hi = entry["interval_95"]
            scaled = f"{entry['per_sdpa_after_over_before']:6.3f}" if row in SCALED_BY else ""
            print(f"{'':>{len(variant) + 1}} {row:>24} {entry['before_median']:8.2f} {entry['after_median']:8.2f} "
                  f"{entry['after_over_before']:6.3f} [{lo:.3f},{hi:.3f}] {scaled:>6}")  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, nargs="?")
    parser.add_argument("after", type=Path, nargs="?")
    parser.add_argument("--pool", type=Path, nargs="+", help="instead of running: pool these result files' "
                        "processes into overhead-ab-pooled.json")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS,
                        help="with --pool: the variants to pool (those whose code is the same in every file)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=480.0, help="start no round after this many seconds")
    parser.add_argument("--before-label", default="before")
    parser.add_argument("--after-label", default="after")
    args = parser.parse_args(argv)
    folder = Path(os.environ.get("OUT", "."))
    folder.mkdir(parents=True, exist_ok=True)
    if args.pool:
        result = pool(args.pool, args.variants)
        (folder / "overhead-ab-pooled.json").write_text(json.dumps(result, indent=1) + "\n")
        print_summary(result)
        return
    if args.before is None or args.after is None:
        parser.error("BEFORE and AFTER are needed, unless --pool is given")
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    start = time.perf_counter()
    for side in trees:  # fills Triton's cache with this tree's kernels; discarded
        run_once(trees[side])
    runs = {"before": [], "after": []}
    for r in range(args.rounds):
        if time.perf_counter() - start > args.budget_s:
            break
        for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
            runs[side].append(run_once(trees[side]))
        print(f"round {r + 1}/{args.rounds} done, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    import torch

    result = dict(
        provenance=dict(
            gpu=torch.cuda.get_device_name(),
            torch=torch.__version__,
            triton=__import__("triton").__version__,
            cuda=torch.version.cuda,
            python=platform.python_version(),
            date_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            before=args.before_label,
            after=args.after_label,
            rounds=len(runs["after"]),
            method=("flashtile.bench.overhead.measure() from each checkout (B=1, H=1, T=128, D=64, bf16, causal; "
                    "median of 9 loops, the entry points taking turns), three times per process: as the command "
                    "runs it, with gc.callbacks timing the collector, after gc.freeze(); then measure_decode(); "
                    "one process per checkout per round, AB then BA, after one discarded process per checkout; "
                    "medians over processes, "
                    "bootstrap 95 % intervals of after / before (4000 draws)"),
        ),
        variants={variant: summarize(runs, variant) for variant in VARIANTS},
    )
    (folder / "overhead-ab.json").write_text(json.dumps(result, indent=1) + "\n")
    print_summary(result)


if __name__ == "__main__":
    main()

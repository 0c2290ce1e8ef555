"""Forward tables: flashtile's kernel against SDPA's four backends, flex attention and naive PyTorch, same run.

flashtile appears twice: the package's kernel (``flashtile``) and the chapters' textbook kernel
(``flashtile_textbook``, ``kernels.textbook``), so the tables show what the optimisations buy.

``python -m flashtile.bench forward`` measures every shape set of ``bench.shapes`` and writes one file
per set under ``bench/results/`` (``--set main,fp16,models,scaleup`` picks sets; all by default):

- ``forward.json`` (``main``): the seed shape (B=8, H=16, T=2048, D=64, causal), then the standard
  sweep (B·T = 16,384, H·D = 2,048, T = 512 .. 16k, D = 64 and 128, causal and not), bf16, ``bhtd``;
- ``forward-fp16.json`` (``fp16``): the standard sweep at D = 128 in fp16;
- ``forward-models.json`` (``models``): GQA, the ``bthd`` layout, small B·H and D = 256;
- ``forward-scaleup.json`` (``scaleup``): the lab's B=8, H=16, D=64, causal, T = 256 .. 32k.

Rows follow BENCH_SCHEMA.md (``pass: "forward"``, ``Tq``, ``Tk``, ``H_kv``, ``layout``, ``dtype``, ``ms``,
``tflops``) plus ``max_abs_err_vs_fp32``. Every provider of a shape is measured in this process on the
same inputs, after its output was checked against a float32 softmax(QKᵀ/√D)V of those inputs
(``providers.check_output``): a provider that disagrees stops the run (``WrongAnswer``), it is never
timed. A provider that cannot run a shape gets ``ms: null`` and a short ``error``: ``"OOM"``, the SDPA
backend's refusal, a flex compile failure, or the math backend's skip above its memory budget.
flashtile itself must run every shape: anything but an OOM from it is raised.

Options: ``--providers`` (a comma list), ``--config block_q,block_k,warps,stages`` (flashtile's launch
config; writes to ``bench/results/sweeps/``), ``--sweep`` / ``--sweep-d256`` (time a list of launch
configs of our kernel, as the defaults in ``kernels.forward.forward_config`` were chosen), ``--dry-run``
(print the plan and a rough duration; needs no GPU). A progress line per measurement goes to stderr.
On a machine without the repository's .git, set ``FLASHTILE_COMMIT`` to the commit measured: it goes
into each file's provenance. After a run, ``python hooks/render_tables.py`` renders the site's tables.
"""

from __future__ import annotations

import argparse
import gc
import sys
import warnings

import torch

from . import providers as prov
from .common import RESULTS, attention_tflops, median_ms, save_result
from .progress import Progress
from .shapes import SEED, SETS, SHAPE_KEYS, describe, shape

METHOD = (
    "triton.testing.do_bench median (warmup 50 ms, rep 200 ms; L2 cleared before each repetition); every "
    "provider first checked against a float32 softmax(QK^T/sqrt(D))V of the same inputs; TFLOP/s = "
    "4*B*H*Tq*Tk*D (x0.5 causal) / time"
)
SWEEP = [  # (block_q, block_k, num_warps, num_stages)
    (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 3), (128, 32, 4, 3),
    (128, 128, 8, 2), (64, 128, 4, 3),
]  # fmt: skip
SWEEP_SHAPES = [SEED, shape(8, 16, 2048, 128, True)]
SWEEP_D256 = [(64, 32, 4, 2), (64, 64, 4, 2), (64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2)]
D256_SHAPE = shape(4, 16, 4096, 256, True)
LAUNCH_KEYS = ("block_q", "block_k", "num_warps", "num_stages")
# Rough costs on an H200 for --dry-run: one do_bench timing with its warm-up, one flex compile, and
# per shape the inputs and the float32 truth.
SECONDS_PER_TIMING, SECONDS_PER_FLEX_COMPILE, SECONDS_PER_SHAPE = 0.5, 10.0, 1.0


def schema_row(shape: dict, provider: str, ms: float | None = None, error: str | None = None, **extra) -> dict:
    """One row of BENCH_SCHEMA.md for a forward measurement; ``ms=None`` needs an ``error``."""
    row = {"pass": "forward", "provider": provider, **{key: shape[key] for key in SHAPE_KEYS}}
    if ms is None:
        if not error:
            raise ValueError(f"a row without a time must say why: {provider} {describe(shape)}")
        row.update(ms=None, tflops=None, error=error)
    else:
        row.update(ms=round(ms, max(4, 3 - _exponent(ms))), tflops=round(attention_tflops(shape, ms), 1))
    return {**row, **extra}


def _exponent(x: float) -> int:
    """The decimal exponent of x > 0 (0.0123 -> -2), so times keep 4 significant digits."""
    return int(f"{x:e}".split("e")[1])


def error_reason(exc: BaseException, caught: list | None = None) -> str:
    """A short reason for a row: "OOM", or the first line of the error (an SDPA refusal with its first warning)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "OOM"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith(("No available kernel", "No viable backend")):  # SDPA gives its reasons as warnings
        text = text.split(". ")[0].rstrip(".")
        if caught:
            text += ": " + str(caught[0].message).strip().splitlines()[0]
    return text[:160]


def free_memory(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# --8<-- [start:measure]
def measure_provider(
    name: str, shape: dict, q, k, v, truth, *, timer, device="cuda", launch=None,
    build=prov.build,
) -> dict:  # fmt: skip
    """Check one provider's output against the truth, then time it; a row either way."""
    caught: list = []
    reason = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # raises Skip where the provider is not run
            fn = build(name, shape, device, launch)
            o = fn(q, k, v)  # the first call also compiles (flashtile, flex)
    except prov.Skip as exc:
        return schema_row(shape, name, error=str(exc))
    # an OOM, an SDPA backend that refuses the shape, a flex compile failure
    except Exception as exc:
        if name.startswith("flashtile") and not isinstance(exc, torch.OutOfMemoryError):
            # our kernel must run every shape of the sets: anything else is a bug to
            # see, not a row
            raise
        reason = error_reason(exc, caught)
    # out of the except block, so the traceback no longer holds the tensors
    if reason is not None:
        free_memory(device)
        return schema_row(shape, name, error=reason)
    dtype = prov.provider_dtype(name, shape)
    # raises WrongAnswer: a wrong answer is never timed
    err = prov.check_output(name, o, truth, dtype)
    del o
    try:
        ms = timer(lambda: fn(q, k, v))
    # the naive provider can fit once and not across repetitions
    except torch.OutOfMemoryError:
        ms = None
    if ms is None:
        free_memory(device)
        return schema_row(shape, name, error="OOM")
    extra = dict(launch) if launch and name == "flashtile" else {}
    if dtype != shape["dtype"]:  # FP8: the row says what was computed, and from what
        extra.update(dtype=dtype, input_dtype=shape["dtype"], granularity="head")
    return schema_row(shape, name, ms, max_abs_err_vs_fp32=float(f"{err:.3g}"), **extra)
# --8<-- [end:measure]


def measure(shape: dict, names, *, timer=None, device="cuda", launch=None, progress=None, build=prov.build,
            seed: int = 0) -> list[dict]:  # fmt: skip
    """Rows for every provider in ``names`` at ``shape``, on one set of inputs and one float32 truth."""
    timer = timer or median_ms
    q, k, v = prov.make_inputs(shape, device, seed)
    truth = prov.reference_output(q, k, v, shape["causal"])
    rows = []
    for name in names:
        if progress:
            progress.step(f"{name} {describe(shape)}")
        rows.append(measure_provider(name, shape, q, k, v, truth, timer=timer, device=device, launch=launch,
                                     build=build))  # fmt: skip
    del q, k, v, truth
    free_memory(device)
    return rows


def run(shapes: list[dict], names, out, *, launch=None, timer=None, device="cuda", stream=None, **extra) -> dict:
    """Measure ``shapes`` x ``names`` with a progress bar on stderr; save rows and provenance to ``out``."""
    progress = Progress(len(shapes) * len(names), stream=stream)
    rows = []
    for s in shapes:
        rows += measure(s, names, timer=timer, device=device, launch=launch, progress=progress)
    progress.close()
    return save_result(out, rows, METHOD, providers=list(names), **extra)


def estimate_seconds(n_shapes: int, names) -> float:
    """A rough duration on an H200, for planning runs against a time limit."""
    flex = SECONDS_PER_FLEX_COMPILE if "flex" in names else 0.0
    return n_shapes * (len(names) * SECONDS_PER_TIMING + flex + SECONDS_PER_SHAPE)


def plan(args) -> list[tuple[str, list[dict], list[str], str, dict]]:
    """(label, shapes, providers, output file, extra result keys) for each run the arguments ask for."""
    names = args.providers
    if args.sweep or args.sweep_d256:
        configs, shapes = (SWEEP_D256, [D256_SHAPE]) if args.sweep_d256 else (SWEEP, SWEEP_SHAPES)
        out = args.out or RESULTS / "sweeps" / "forward-configs.json"
        return [(f"sweep {c}", shapes, ["flashtile"], out, dict(zip(LAUNCH_KEYS, c))) for c in configs]
    if args.out and len(args.sets) != 1:
        raise SystemExit("--out needs exactly one --set")
    runs = []
    for set_name in args.sets:
        file, make = SETS[set_name]
        if args.config:
            tag = "-".join(str(n) for n in args.config.values())
            file = f"sweeps/forward-config-{tag}-{set_name}.json"
        runs.append((set_name, make(), names, args.out or RESULTS / file, {}))
    return runs


def parse_config(text: str) -> dict:
    values = [int(x) for x in text.split(",")]
    if len(values) != 4:
        raise argparse.ArgumentTypeError("--config takes block_q,block_k,num_warps,num_stages, e.g. 128,64,8,3")
    return dict(zip(LAUNCH_KEYS, values))


def parse_list(known):
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        unknown = [x for x in items if x not in known]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(known)}")
        return items

    return parse


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashtile.bench forward", description=__doc__.splitlines()[0])
    parser.add_argument("--set", dest="sets", type=parse_list(tuple(SETS)), default=list(SETS),
                        help=f"comma list of shape sets (default: all): {', '.join(SETS)}")  # fmt: skip
    parser.add_argument("--providers", type=parse_list(prov.PROVIDERS), default=list(prov.DEFAULT_PROVIDERS),
                        help=f"comma list (default: all but flashtile_fp8): {', '.join(prov.PROVIDERS)}")  # fmt: skip
    parser.add_argument("--config", type=parse_config, help="flashtile launch config block_q,block_k,warps,stages")
    parser.add_argument("--sweep", action="store_true", help="time launch configs of our kernel instead")
    parser.add_argument("--sweep-d256", action="store_true", help="the sweep, for head dim 256")
    parser.add_argument("--out", help="output file (one set only); default: bench/results/<the set's file>")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and a rough duration, run nothing")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("the benchmarks need a CUDA device")
    runs = plan(args)
    if args.dry_run:
        total = 0.0
        for label, shapes, names, out, _ in runs:
            seconds = estimate_seconds(len(shapes), names)
            total += seconds
            print(f"{label}: {len(shapes)} shapes x {len(names)} providers = {len(shapes) * len(names)} "
                  f"measurements, ~{seconds / 60:.1f} min -> {out}")  # fmt: skip
        print(f"total ~{total / 60:.1f} min on an H200 (rough: {SECONDS_PER_TIMING} s a timing, "
              f"{SECONDS_PER_FLEX_COMPILE:.0f} s a flex compile)")  # fmt: skip
        return
    if args.sweep or args.sweep_d256:
        rows = []
        for label, shapes, names, _, launch in runs:
            print(label, file=sys.stderr, flush=True)
            for s in shapes:
                try:
                    rows += measure(s, names, launch=launch)
                except Exception as exc:  # out of shared memory, say: record it and go on
                    rows.append(schema_row(s, "flashtile", error=error_reason(exc), **launch))
        save_result(runs[0][3], rows, METHOD)
        return
    for label, shapes, names, out, _ in runs:
        print(f"{label}: {len(shapes)} shapes x {len(names)} providers -> {out}", file=sys.stderr, flush=True)
        main_shape = {key: SEED[key] for key in SHAPE_KEYS} if label == "main" else None
        extra = dict(set=label)
        if main_shape:
            extra["main_shape"] = main_shape
        if args.config:
            extra["launch"] = args.config
        run(shapes, names, out, launch=args.config, **extra)


if __name__ == "__main__":
    main(sys.argv[1:])

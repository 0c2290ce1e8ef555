"""A measured probe, not part of the package: what ``@triton.autotune`` picks for the forward kernel,
against the package's own table (``kernels.forward.forward_config``), and what the tuning costs.

The lab's stretch goal asks whether autotuning (tile sizes, warps and ``num_stages``) would have found
the settings the table holds. This wraps the package's own ``_forward_kernel`` in ``triton.autotune``
over a grid of configs (plus the table's own choices, so that the autotuner can pick them), keyed on
the arguments a table would key on, and for every shape records:

- every config's time as the autotuner measured it (its own ``do_bench``: median of about 100 ms),
  ``inf`` where the config did not compile (shared memory, registers);
- the config it picked, and how long the first call took (``first_call_s``: compiling every config
  not compiled yet, then benchmarking all of them; later shapes of one key set pay the benchmarking only);
- the picked config and the table's choice timed again through ``flash_attention`` itself, in the same
  process, with triton.testing.do_bench (median; warm-up 25 ms, rep 100 ms), each output checked first
  against SDPA-cuDNN's.

The autotuned launch uses the pointer path (no TMA descriptors: a descriptor's box is the tile, fixed
before the autotuner chooses one) and the plain launch order (the heaviest-first chunk depends on
block_q). So the table's choice is timed twice: as the package runs it (``flashtile``, TMA where the
table says so, heaviest-first under causal) and on the pointer path (``flashtile_pointers``), the
like-for-like comparison for the autotuned pick (``flashtile_autotuned``, also through
``flash_attention(..., tma=False)``, so with the same launch order as the table's choice).

Run from the repository root on one H200 (about 3 minutes, most of it compiling the configs; the six
causal shapes, ``--unmasked`` adds two without the mask):

    OUT=/some/folder PYTHONPATH=src python bench/probes/forward/autotune_study.py

It writes ``$OUT/autotune.json`` (BENCH_SCHEMA.md rows, plus an ``autotune`` section with the configs,
the key and every shape's timings). ``--smoke`` runs a tiny shape with two configs in the Triton
interpreter on the CPU, wall-clock timed: a check that the probe itself runs, not a measurement.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from flashtile.kernels.forward import (  # noqa: E402
    LAUNCH_SETTINGS,
    checked_forward_plan,
    flash_attention,
    forward_config,
)
from flashtile.kernels.parts import forward_kernel as _forward_kernel  # noqa: E402

KEY = ["Tq", "Tk", "HEAD_DIM", "CAUSAL"]  # what the table keys on (D, causal, a length class), plus Tk
# (block_q, block_k, num_warps, num_stages, maxnreg): the grid, then the table's choices that it lacks
GRID = [(bq, bk, w, s, None) for bq, bk, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))]
TOKENS, WIDTH = 16384, 2048  # the standard sweep's B*T and H*D
SHAPES = [  # (B, H, T, D, causal): the lab's setting (causal) at three lengths, both head dims
    (TOKENS // T, WIDTH // D, T, D, True) for D in (64, 128) for T in (1024, 4096, 16384)
]
UNMASKED = [(8, 32, 2048, 64, False), (8, 16, 2048, 128, False)]  # --unmasked: two more compiles of every config
METHOD = ("triton.autotune over the configs listed (its default do_bench: median over ~100 ms), then the picked "
          "and the table's config through flash_attention, triton.testing.do_bench median (warmup 25 ms, rep "
          "100 ms); TFLOP/s = 4*B*H*Tq*Tk*D (x0.5 causal) / time")  # fmt: skip


def table_choice(D: int, T: int, causal: bool, dtype, tma: bool) -> tuple:
    """The package's (block_q, block_k, num_warps, num_stages, maxnreg) for this shape, as the launcher asks."""
    length_class = 512 if T <= 512 else (1024 if T <= 1024 else 4096)
    config = forward_config(D, dtype, False, causal, length_class, tma=tma)
    return (*(config[name] for name in LAUNCH_SETTINGS), config.get("maxnreg"))


def as_config(c: tuple) -> triton.Config:
    block_q, block_k, num_warps, num_stages, maxnreg = c
    return triton.Config({"BLOCK_Q": block_q, "BLOCK_K": block_k}, num_warps=num_warps, num_stages=num_stages,
                         maxnreg=maxnreg)  # fmt: skip


def config_tuple(config: triton.Config) -> tuple:
    return (config.kwargs["BLOCK_Q"], config.kwargs["BLOCK_K"], config.num_warps, config.num_stages, config.maxnreg)


def autotuned_kernel(configs: list[tuple], do_bench=None):
    """The package's forward kernel under ``triton.autotune``: the same JIT function, so compiled variants
    are shared with ``flash_attention``."""
    return triton.autotune([as_config(c) for c in configs], key=KEY, do_bench=do_bench)(_forward_kernel)


def launch_autotuned(tuned, q, k, v, causal: bool):
    """One call of the autotuned kernel on q, k, v (pointer loads, plain launch order); returns o."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    if Tk % 128 or Tq % 128:
        raise ValueError(f"the study's shapes have T a multiple of 128 (no ragged tile), got Tq={Tq}, Tk={Tk}")
    plan = checked_forward_plan(q, k, v, causal=causal, scale=None, alignment="upper_left", window=None, softcap=None,
                                return_stats=False, block_q=None, block_k=None, num_warps=None, num_stages=None,
                                tma=False)  # fmt: skip
    constexprs = {name: value for name, value in plan.launch.constexprs.items() if name not in ("BLOCK_Q", "BLOCK_K")}
    constexprs.update(USE_TMA=False, HEAVIEST_FIRST=False, MASKED_TILES=causal)  # no ragged tile at these T
    scalars = (*plan.launch.scalars[:-1], 1)  # the chunk is unused in the plain order
    o = torch.empty(plan.out_shape, dtype=q.dtype, device=q.device)
    stats = torch.empty((3, B, H, Tq), dtype=torch.float32, device=q.device)
    grid = lambda meta: (triton.cdiv(Tq, meta["BLOCK_Q"]), H, B)  # noqa: E731
    tuned[grid](q, k, v, o, stats, stats, *scalars, **constexprs)  # SINKS: unused without SINK, any buffer
    return o


def fastest_first(item) -> float:
    return item[1][0] if item[1][0] is not None else float("inf")


def study_shape(tuned, shape: tuple, device: str, dtype, timer, truth_fn, check_tol: float) -> tuple[dict, list]:
    B, H, T, D, causal = shape
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=gen, device=device, dtype=dtype) for _ in range(3))
    truth = truth_fn(q, k, v, causal)
    start = time.perf_counter()
    o = launch_autotuned(tuned, q, k, v, causal)
    if device == "cuda":
        torch.cuda.synchronize()
    first_call_s = time.perf_counter() - start
    err = (o.float() - truth.float()).abs().max().item()
    if not err < check_tol:
        raise AssertionError(f"autotuned output off by {err} at {shape}")
    picked = config_tuple(tuned.best_config)
    # [median, 20th, 80th percentile] in ms; a config that did not compile has inf, written as null
    timings = {
        config_tuple(c): [None if x == float("inf") else x for x in t]
        for c, t in getattr(tuned, "configs_timings", {}).items()
    }
    fields = dict(B=B, H=H, H_kv=H, Tq=T, Tk=T, D=D, causal=causal, layout="bhtd",
                  dtype={torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype])  # fmt: skip
    table_tma, table_ptr = table_choice(D, T, causal, dtype, True), table_choice(D, T, causal, dtype, False)
    rows = []
    for provider, settings, tma in (
        ("flashtile", {}, None),
        ("flashtile_pointers", {}, False),
        ("flashtile_autotuned", dict(zip(LAUNCH_SETTINGS, picked[:4])), False),
    ):

        def call(settings=settings, tma=tma):
            return flash_attention(q, k, v, causal=causal, **settings, tma=tma)[0]

        err = (call().float() - truth.float()).abs().max().item()
        if not err < check_tol:
            raise AssertionError(f"{provider} off by {err} at {shape}")
        ms = timer(call)
        flops = 4 * B * H * T * T * D * (0.5 if causal else 1.0)
        config = {"flashtile": table_tma, "flashtile_pointers": table_ptr, "flashtile_autotuned": picked}[provider]
        # flash_attention keeps the table's register cap only with the table's own settings
        applied_cap = (
            config[4] if provider != "flashtile_autotuned" else (table_ptr[4] if picked[:4] == table_ptr[:4] else None)
        )
        rows.append({"pass": "forward", "provider": provider, **fields, "ms": round(ms, 4),
                     "tflops": round(flops / (ms * 1e-3) / 1e12, 1), "block_q": config[0], "block_k": config[1],
                     "num_warps": config[2], "num_stages": config[3], "maxnreg": applied_cap,
                     "autotune_ms": None if provider == "flashtile" else timings.get(config, [None])[0]})  # fmt: skip
    record = dict(shape=fields, key=dict(Tq=T, Tk=T, HEAD_DIM=D, CAUSAL=causal), first_call_s=round(first_call_s, 2),
                  picked=picked, table_pointers=table_ptr, table_package=table_tma,
                  timings_ms=[[list(c), t] for c, t in sorted(timings.items(), key=fastest_first)])  # fmt: skip
    return record, rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny CPU run in the interpreter (not a measurement)")
    parser.add_argument("--unmasked", action="store_true", help="also two shapes without the mask (about 2 min more)")
    parser.add_argument("--out", default=None, help="output file (default: $OUT/autotune.json)")
    args = parser.parse_args(argv)
    if args.smoke:

        def wall_ms(fn, quantiles=None):
            start = time.perf_counter()
            fn()
            ms = (time.perf_counter() - start) * 1e3
            return [ms, ms, ms] if quantiles else ms

        configs = [(32, 32, 4, 1, None), (16, 32, 4, 1, None)]
        shapes, device, dtype, timer, tol = (
            [(1, 2, 128, 16, True), (1, 2, 128, 16, False)],
            "cpu",
            torch.float32,
            wall_ms,
            1e-4,
        )

        def truth_fn(q, k, v, causal):
            return torch.nn.functional.scaled_dot_product_attention(
                q.double(), k.double(), v.double(), is_causal=causal
            )
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        device, dtype, tol, shapes = "cuda", torch.bfloat16, 5e-2, SHAPES + (UNMASKED if args.unmasked else [])
        table = {table_choice(D, T, c, dtype, False) for _, _, T, D, c in shapes}
        configs = GRID + sorted(table - set(GRID), key=str)

        def timer(fn):
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

        def truth_fn(q, k, v, causal):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    tuned = autotuned_kernel(configs, do_bench=wall_ms if args.smoke else None)
    records, rows = [], []
    for shape in shapes:
        record, shape_rows = study_shape(tuned, shape, device, dtype, timer, truth_fn, tol)
        records.append(record)
        rows += shape_rows
        by = {r["provider"]: r["ms"] for r in shape_rows}
        print(
            f"{shape}: first call {record['first_call_s']:.1f} s, picked {record['picked']}, table "
            f"{record['table_pointers']}; ms table {by['flashtile']} pointers {by['flashtile_pointers']} "
            f"autotuned {by['flashtile_autotuned']}",
            flush=True,
        )
    extra = dict(autotune=dict(key=KEY, configs=[list(c) for c in configs], shapes=records))
    if args.smoke:
        print(json.dumps(extra)[:2000])
        return 0
    from flashtile.bench.common import save_result

    out = args.out or str(Path(os.environ["OUT"]) / "autotune.json")
    save_result(out, rows, METHOD, **extra)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

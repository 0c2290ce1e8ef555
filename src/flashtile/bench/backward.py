"""Backward tables: the flashtile backward against SDPA's cuDNN and flash backends, same run.

``python -m flashtile.bench backward`` measures the shape sets of ``bench.shapes`` and writes one file per
set under ``bench/results/`` (``--set main,models`` picks sets; both by default):

- ``backward.json`` (``main``): the standard sweep (B·T = 16,384, H·D = 2,048, T = 512 .. 16k, D = 64 and
  128, causal and not), bf16, ``bhtd``;
- ``backward-models.json`` (``models``): the forward's model shapes (GQA, the ``bthd`` layout, few heads,
  D = 256);
- ``backward-d256.json`` (``d256``, asked for by name): D = 256 at B·T = 16,384, H = 8, T 2k-8k, both masks.

Providers: ``flashtile`` (``flashtile.attention``: the deterministic default, dQ in its own kernel, TMA
loads where ``backward_config`` picks them), ``flashtile_atomic_dq`` (the same kernels with
``deterministic=False``: dQ added up with float32 atomics inside the dK/dV kernel),
``flashtile_pointers`` (the default with ``tma=False``: what the TMA loads buy), ``flashtile_textbook``
(``kernels.textbook``: the chapters' first forward and backward kernels, fixed tiles, pointer loads; its
row says "skipped" at GQA shapes and head dims above 128), ``sdpa_cudnn`` and ``sdpa_flash``;
``--providers`` also takes ``flashtile_tma`` (``tma=True``). Each provider is timed on its backward
alone: the forward runs once, then ``o.backward(do, retain_graph=True)`` is timed, the same way for
every provider. Before timing, each provider's dq, dk, dv are checked against SDPA's flash backend
(cuDNN's where flash refuses the shape).
A provider that cannot run a shape gets ``ms: null`` and a short ``error``; flashtile must run every shape.
Rows follow BENCH_SCHEMA.md (``pass: "backward"``, ``Tq``, ``Tk``, ``H_kv``, ``layout``, ``dtype``).
``--sweep`` times launch configs of the backward launcher instead (how ``kernels.backward.backward_config``
was chosen).
"""

from __future__ import annotations

import argparse
import sys

import torch

from .common import RESULTS, attention_tflops, median_ms, save_result
from .forward import error_reason, free_memory
from .providers import _sdpa, make_inputs, textbook_skip
from .shapes import describe, head_dim_256_shapes, model_shapes, shape, standard_sweep

SETS = {  # set name -> (result file under bench/results, shapes)
    "main": ("backward.json", lambda: standard_sweep("bf16")),
    "models": ("backward-models.json", model_shapes),
    "d256": ("backward-d256.json", head_dim_256_shapes),
}
DEFAULT_PROVIDERS = ("flashtile", "flashtile_atomic_dq", "flashtile_pointers", "flashtile_textbook", "sdpa_cudnn",
                     "sdpa_flash")
OPTIONAL_PROVIDERS = ("flashtile_tma",)
SWEEP_SHAPES = [shape(16384 // 8192, 2048 // D, 8192, D, causal) for D in (64, 128) for causal in (False, True)]
SWEEP_DKDV = [  # (block_q, block_k, warps, stages): query rows per step x keys resident
    (32, 128, 8, 3), (32, 64, 8, 3), (32, 128, 8, 2), (32, 64, 8, 2), (16, 128, 8, 2), (16, 128, 8, 3),
    (64, 64, 8, 2), (64, 64, 8, 3), (32, 64, 4, 3), (32, 128, 8, 4), (32, 64, 8, 4), (64, 128, 8, 2),
    (16, 64, 8, 3), (32, 64, 4, 2), (32, 128, 8, 5), (64, 128, 8, 3), (64, 64, 4, 2), (32, 128, 4, 3),
]  # fmt: skip
SWEEP_DQ = [  # (block_q, block_k, warps, stages): query rows resident x keys per step
    (128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (128, 32, 8, 2), (128, 64, 8, 4), (128, 32, 8, 4),
    (64, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (64, 64, 8, 2), (128, 32, 8, 5), (64, 32, 8, 3),
    (128, 64, 4, 3), (64, 64, 4, 2),
]  # fmt: skip
METHOD = (
    "backward only: o.backward(do, retain_graph=True), triton.testing.do_bench median (warmup 50 ms, rep 200 ms); "
    "each provider's gradients first checked against SDPA flash's; TFLOP/s = 2.5*4*B*H*Tq*Tk*D (x0.5 causal) / time"
)
SWEEP_METHOD = ("launcher only: flash_attention_backward, do_bench median (warmup 25 ms, rep 100 ms), each config "
                "on the pointer path and through TMA descriptors (tma)")


class LauncherBackward(torch.autograd.Function):
    """flashtile's forward, and its backward launcher with options (``deterministic=False``: the opt-in
    atomic-dQ path; ``tma=True``: descriptor loads)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, options):
        from ..kernels.forward import flash_attention

        o, lse, stats = flash_attention(q, k, v, causal=causal, return_stats=True)
        ctx.save_for_backward(q, k, v, o, lse, stats)
        ctx.causal, ctx.options = causal, options
        return o

    @staticmethod
    def backward(ctx, do):
        from ..kernels.backward import flash_attention_backward

        q, k, v, o, lse, stats = ctx.saved_tensors
        grads = flash_attention_backward(q, k, v, o, lse, do, causal=ctx.causal, stats=stats, **ctx.options)
        return (*grads, None, None)


class TextbookAttention(torch.autograd.Function):
    """The textbook forward, and the textbook backward (delta, dK/dV and dQ kernels) as its gradient."""

    @staticmethod
    def forward(ctx, q, k, v, causal):
        from ..kernels.textbook import textbook_forward

        o, lse = textbook_forward(q, k, v, causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):
        from ..kernels.textbook import textbook_backward

        q, k, v, o, lse = ctx.saved_tensors
        return (*textbook_backward(q, k, v, o, lse, do, ctx.causal), None)


def providers(shape: dict, names) -> dict:
    """name -> (q, k, v) -> o with autograd, for the providers in ``names`` (in that order)."""
    from ..api import attention

    causal, gqa = shape["causal"], shape["H_kv"] != shape["H"]
    launcher = lambda **options: lambda q, k, v: LauncherBackward.apply(q, k, v, causal, options)
    known = {
        "flashtile": lambda q, k, v: attention(q, k, v, is_causal=causal, enable_gqa=gqa),
        "flashtile_atomic_dq": launcher(deterministic=False),
        "flashtile_pointers": launcher(tma=False),
        "flashtile_tma": launcher(tma=True),
        "flashtile_textbook": lambda q, k, v: TextbookAttention.apply(q, k, v, causal),
        "sdpa_cudnn": _sdpa("CUDNN_ATTENTION", causal, gqa),
        "sdpa_flash": _sdpa("FLASH_ATTENTION", causal, gqa),
    }
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown providers {unknown}; known: {', '.join(known)}")
    return {n: known[n] for n in names}


def gradients(fn, q, k, v, do):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = fn(*leaves)
    o.backward(do, retain_graph=True)
    return leaves, o


def schema_row(shape: dict, provider: str, ms=None, error=None, **extra) -> dict:
    row = dict({"pass": "backward"}, **shape, mode="bwd", provider=provider)
    if ms is None:
        return dict(row, ms=None, tflops=None, error=error)
    return dict(row, ms=round(ms, 4), tflops=round(attention_tflops(shape, ms, "bwd"), 1), **extra)


def measure(shape: dict, names) -> list[dict]:
    """One row per provider: its backward timed, after its gradients were checked against SDPA's."""
    q, k, v = make_inputs(shape)
    do = torch.randn_like(q)  # q's layout: a bthd shape gets a bthd do, as a model's backward would
    fns = providers(shape, names)
    expected, rows, failed = None, [], {}
    for name in ("sdpa_flash", "sdpa_cudnn"):  # the reference gradients: the first backend that takes the shape
        try:
            expected, _ = gradients(providers(shape, [name])[name], q, k, v, do)
            break
        except RuntimeError as exc:
            failed[name] = error_reason(exc)
    for name, fn in fns.items():
        if name == "flashtile_textbook" and textbook_skip(shape):  # a shape it does not take: a row says so
            rows.append(schema_row(shape, name, error=textbook_skip(shape)))
            continue
        try:
            leaves, o = gradients(fn, q, k, v, do)
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            if name.startswith("flashtile") and not isinstance(exc, torch.OutOfMemoryError):
                raise
            rows.append(schema_row(shape, name, error=failed.get(name) or error_reason(exc)))
            print(f"{name:>20} {describe(shape)} {rows[-1]['error'][:60]}", file=sys.stderr, flush=True)
            free_memory(q.device)
            continue
        err = None
        if expected is not None:
            err = max((a.grad.float() - b.grad.float()).abs().max().item() for a, b in zip(leaves, expected))
            assert err < 0.25, f"{name} gradients disagree with SDPA's by {err}"
        ms = median_ms(lambda o=o: o.backward(do, retain_graph=True), grad_to_none=leaves)
        rows.append(schema_row(shape, name, ms, max_abs_grad_diff_vs_sdpa=err))
        print(f"{name:>20} {describe(shape)} {ms:.4f} ms {rows[-1]['tflops']:.1f} TFLOP/s", file=sys.stderr,
              flush=True)  # fmt: skip
        del leaves, o
    return rows


def sweep(shape: dict) -> list[dict]:
    """Time the backward launcher alone for each dK/dV config (dQ at its default) and each dQ config, on
    the pointer path and, where the device has TMA, through descriptors (``tma=True``)."""
    from ..kernels._host import has_tma
    from ..kernels.backward import backward_config, flash_attention_backward
    from ..kernels.forward import flash_attention

    q, k, v = make_inputs(shape)
    do = torch.randn_like(q)
    o, lse, stats = flash_attention(q, k, v, causal=shape["causal"], return_stats=True)
    chosen = backward_config(shape["D"], q.dtype, shape["Tq"])
    default = dict(dkdv=chosen["dkdv"], dq=chosen["dq"])
    trials = [dict(default, dkdv=c) for c in SWEEP_DKDV] + [dict(default, dq=c) for c in SWEEP_DQ]
    loads = (False, True) if has_tma(q.device) else (False,)
    rows = []
    for config, tma in ((config, tma) for config in trials for tma in loads):
        options = dict(causal=shape["causal"], stats=stats, config=config, tma=tma)
        launch = lambda options=options: flash_attention_backward(q, k, v, o, lse, do, **options)
        try:
            launch()
            ms = median_ms(launch, warmup=25, rep=100)
        except Exception as exc:  # out of shared memory or registers, say: record it and go on
            print("failed", describe(shape), config, tma, repr(exc)[:200], file=sys.stderr, flush=True)
            continue
        tflops = attention_tflops(shape, ms, "bwd")
        rows.append(dict(shape, dkdv=list(config["dkdv"]), dq=list(config["dq"]), tma=tma, ms=round(ms, 4),
                         tflops=round(tflops, 1)))  # fmt: skip
        print(f"{describe(shape)} dkdv={config['dkdv']} dq={config['dq']} tma={tma} {ms:.4f} ms {tflops:.1f} TFLOP/s",
              file=sys.stderr, flush=True)  # fmt: skip
    return rows


def parse_names(text: str, known, what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{what} must be a comma list of {', '.join(known)}; got {text!r}")
    return names


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashtile.bench backward", description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="main,models", type=lambda t: parse_names(t, SETS, "--set"),
                        help="comma list of shape sets: main, models, d256 (default: main,models)")
    parser.add_argument("--providers", default=",".join(DEFAULT_PROVIDERS),
                        type=lambda t: parse_names(t, (*DEFAULT_PROVIDERS, *OPTIONAL_PROVIDERS), "--providers"),
                        help=f"comma list (default: {','.join(DEFAULT_PROVIDERS)}; "
                             f"also {','.join(OPTIONAL_PROVIDERS)})")
    parser.add_argument("--out", help="the output file, for one set (default: bench/results/<the set's file>)")
    parser.add_argument("--sweep", action="store_true", help="time launch configs of our backward instead")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the benchmarks need a CUDA device")
    if args.out and len(args.set) != 1 and not args.sweep:
        parser.error("--out names one file: pick one --set with it")
    if args.sweep:
        rows = [row for s in SWEEP_SHAPES for row in sweep(s)]
        save_result(args.out or RESULTS / "sweeps/backward-configs.json", rows, SWEEP_METHOD)
        return
    for name in args.set:
        file, shapes = SETS[name]
        rows = [row for s in shapes() for row in measure(s, args.providers)]
        save_result(args.out or RESULTS / file, rows, METHOD, set=name, providers=list(args.providers))

"""Backward table: the flashtile backward against SDPA's cuDNN and flash backends, same run.

Providers: ``flashtile`` (``flashtile.attention``: the deterministic default, dQ in its own kernel),
``flashtile_atomic_dq`` (the same kernels with ``deterministic=False``: dQ added up with float32 atomics
inside the dK/dV kernel), ``flashtile_tma`` (the deterministic kernels with ``tma=True``: the streamed
tiles loaded through TMA descriptors, on sm_90 and newer), ``flashtile_rotated`` (``rotate=True``: each
program walks its unmasked tiles from its own tile index on), ``sdpa_cudnn`` and ``sdpa_flash``. Each
provider is timed on its backward alone: the forward runs once, then ``o.backward(do, retain_graph=True)``
is timed, the same way for every provider. Before timing, each provider's dq, dk, dv are checked
against SDPA's flash backend.
``--sweep`` times launch configs of the backward launcher instead (how ``kernels.backward.backward_config``
was chosen).
"""

from __future__ import annotations

import argparse

import torch

from .common import RESULTS, attention_tflops, median_ms, random_inputs, save_result, sdpa_providers

TOKENS, WIDTH = 16384, 2048  # B * T and H * D, as in the team's anchor measurements
SHAPES = [
    dict(B=TOKENS // T, H=WIDTH // D, T=T, D=D, causal=causal)
    for D in (64, 128)
    for T in (2048, 8192)
    for causal in (False, True)
]
SWEEP_DKDV = [  # (block_q, block_k, warps, stages): query rows per step x keys resident
    (32, 128, 8, 3), (32, 64, 8, 3), (32, 128, 8, 2), (32, 64, 8, 2), (16, 128, 8, 2), (16, 128, 8, 3),
    (64, 64, 8, 2), (64, 64, 8, 3), (32, 64, 4, 3), (32, 128, 8, 4), (32, 64, 8, 4), (64, 128, 8, 2),
    (16, 64, 8, 3), (32, 64, 4, 2), (32, 128, 8, 5), (64, 128, 8, 3),
]
SWEEP_DQ = [  # (block_q, block_k, warps, stages): query rows resident x keys per step
    (128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (128, 32, 8, 2), (128, 64, 8, 4), (128, 32, 8, 4),
    (64, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (64, 64, 8, 2), (128, 32, 8, 5), (64, 32, 8, 3),
    (128, 64, 4, 3), (64, 64, 4, 2),
]
METHOD = (
    "backward only: o.backward(do, retain_graph=True), triton.testing.do_bench median (warmup 50 ms, rep 200 ms); "
    "bf16; B*T = 16384, H*D = 2048; TFLOP/s = 2.5*4*B*H*T*T*D (x0.5 causal) / time"
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
        grads = flash_attention_backward(q, k, v, o, lse, do, ctx.causal, stats=stats, **ctx.options)
        return (*grads, None, None)


def providers(causal: bool) -> dict:
    from ..api import attention
    from ..kernels._common import has_tma

    fns = {
        "flashtile": lambda q, k, v: attention(q, k, v, is_causal=causal),
        "flashtile_atomic_dq": lambda q, k, v: LauncherBackward.apply(q, k, v, causal, dict(deterministic=False)),
    }
    fns["flashtile_rotated"] = lambda q, k, v: LauncherBackward.apply(q, k, v, causal, dict(rotate=True))
    if torch.cuda.is_available() and has_tma(torch.device("cuda")):
        fns["flashtile_tma"] = lambda q, k, v: LauncherBackward.apply(q, k, v, causal, dict(tma=True))
    return {**fns, **sdpa_providers(causal)}


def gradients(fn, q, k, v, do):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = fn(*leaves)
    o.backward(do, retain_graph=True)
    return leaves, o


def measure(shape: dict) -> list[dict]:
    q, k, v, do = random_inputs(shape, 4)
    fns = providers(shape["causal"])
    expected, _ = gradients(fns["sdpa_flash"], q, k, v, do)
    rows = []
    for name, fn in fns.items():
        leaves, o = gradients(fn, q, k, v, do)
        err = max((a.grad.float() - b.grad.float()).abs().max().item() for a, b in zip(leaves, expected))
        assert err < 0.25, f"{name} gradients disagree with sdpa_flash by {err}"
        ms = median_ms(lambda o=o: o.backward(do, retain_graph=True), grad_to_none=leaves)
        tflops = attention_tflops(shape, ms, "bwd")
        schema = dict(H_kv=shape["H"], Tq=shape["T"], Tk=shape["T"], layout="bhtd")  # BENCH_SCHEMA.md's names
        rows.append(dict({"pass": "backward"}, **shape, **schema, dtype="bf16", mode="bwd", provider=name,
                         ms=round(ms, 4), tflops=round(tflops, 1), max_abs_grad_diff_vs_sdpa_flash=err))  # fmt: skip
        print(f"{name:>10} {shape} {ms:.4f} ms {tflops:.1f} TFLOP/s (grad diff {err:.3g})", flush=True)
    return rows


def sweep(shape: dict) -> list[dict]:
    """Time the backward launcher alone for each dK/dV config (dQ at its default) and each dQ config, on
    the pointer path and, where the device has TMA, through descriptors (``tma=True``)."""
    from ..kernels._common import has_tma
    from ..kernels.backward import backward_config, flash_attention_backward
    from ..kernels.forward import flash_attention

    q, k, v, do = random_inputs(shape, 4)
    o, lse, stats = flash_attention(q, k, v, causal=shape["causal"], return_stats=True)
    default = backward_config(shape["D"], q.dtype)
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
            print("failed", shape, config, tma, repr(exc)[:200], flush=True)
            continue
        tflops = attention_tflops(shape, ms, "bwd")
        rows.append(dict(shape, dkdv=list(config["dkdv"]), dq=list(config["dq"]), tma=tma, ms=round(ms, 4),
                         tflops=round(tflops, 1)))  # fmt: skip
        print(f"{shape} dkdv={config['dkdv']} dq={config['dq']} tma={tma} {ms:.4f} ms {tflops:.1f} TFLOP/s",
              flush=True)  # fmt: skip
    return rows


def run(out: str, do_sweep: bool = False) -> dict:
    if do_sweep:
        rows = [row for shape in SHAPES if shape["T"] == 8192 for row in sweep(shape)]
    else:
        rows = [row for shape in SHAPES for row in measure(shape)]
    return save_result(out, rows, SWEEP_METHOD if do_sweep else METHOD)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashtile.bench backward", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="default: bench/results/backward.json, or sweeps/backward-configs.json")
    parser.add_argument("--sweep", action="store_true", help="time launch configs of our backward instead")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the benchmarks need a CUDA device")
    run(args.out or RESULTS / ("sweeps/backward-configs.json" if args.sweep else "backward.json"), args.sweep)

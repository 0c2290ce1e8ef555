"""First backward table: the flashtile backward against SDPA's cuDNN and flash backends, same run.

Usage (on a CUDA machine, from the repository root):
    PYTHONPATH=src python3 bench/backward_first_table.py --out bench/results/backward-first-table.json
    PYTHONPATH=src python3 bench/backward_first_table.py --sweep --out sweep.json   # try launch configs

Each provider is timed on its backward alone: the forward runs once, then ``o.backward(do,
retain_graph=True)`` is timed (median of triton.testing.do_bench), the same way for all three.
TFLOP/s = 2.5 * 4 * B * H * T * T * D (x0.5 when causal) / time. Before timing, each provider's dq, dk, dv
are checked against SDPA's flash backend.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile.kernels.backward import backward_config, flash_attention_backward
from flashtile.kernels.forward import flash_attention

TOKENS, WIDTH = 16384, 2048  # B * T and H * D, as in the team's anchor measurements
SHAPES = [
    dict(B=TOKENS // T, H=WIDTH // D, T=T, D=D, causal=causal)
    for D in (64, 128)
    for T in (2048, 8192)
    for causal in (False, True)
]
SWEEP_DKDV = [(32, 128, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3), (128, 128, 8, 2)]
SWEEP_DQ = [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 8, 2), (128, 128, 8, 2)]


def backward_flops(shape: dict) -> float:
    return 2.5 * 4 * shape["B"] * shape["H"] * shape["T"] ** 2 * shape["D"] * (0.5 if shape["causal"] else 1.0)


def make_inputs(shape: dict):
    gen = torch.Generator(device="cuda").manual_seed(0)
    size = (shape["B"], shape["H"], shape["T"], shape["D"])
    return [torch.randn(size, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4)]


def forward_fns(shape: dict) -> dict:
    causal = shape["causal"]

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return run

    return {
        "flashtile": lambda q, k, v: flashtile.attention(q, k, v, is_causal=causal),
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
    }


def gradients(fn, q, k, v, do):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = fn(*leaves)
    o.backward(do, retain_graph=True)
    return leaves, o


def measure(shape: dict) -> list[dict]:
    q, k, v, do = make_inputs(shape)
    fns = forward_fns(shape)
    expected, _ = gradients(fns["sdpa_flash"], q, k, v, do)
    rows = []
    for name, fn in fns.items():
        leaves, o = gradients(fn, q, k, v, do)
        err = max((a.grad.float() - b.grad.float()).abs().max().item() for a, b in zip(leaves, expected))
        assert err < 0.25, f"{name} gradients disagree with sdpa_flash by {err}"
        ms = triton.testing.do_bench(
            lambda o=o: o.backward(do, retain_graph=True), grad_to_none=leaves, warmup=50, rep=200, return_mode="median"
        )
        tflops = backward_flops(shape) / (ms * 1e-3) / 1e12
        rows.append(dict(shape, dtype="bf16", mode="bwd", provider=name, ms=round(ms, 4), tflops=round(tflops, 1),
                         max_abs_grad_diff_vs_sdpa_flash=err))  # fmt: skip
        print(f"{name:>10} {shape} {ms:.4f} ms {tflops:.1f} TFLOP/s (grad diff {err:.3g})", flush=True)
    return rows


def sweep(shape: dict) -> list[dict]:
    """Time the backward launcher alone for each dK/dV config (dQ at its default) and each dQ config."""
    q, k, v, do = make_inputs(shape)
    o, lse = flash_attention(q, k, v, causal=shape["causal"])
    default = backward_config(shape["D"], q.dtype)
    trials = [dict(default, dkdv=c) for c in SWEEP_DKDV] + [dict(default, dq=c) for c in SWEEP_DQ]
    rows = []
    for config in trials:
        run = lambda config=config: flash_attention_backward(q, k, v, o, lse, do, causal=shape["causal"], config=config)
        try:
            run()
            ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
        except Exception as exc:  # out of shared memory or registers, say: record it and go on
            print("failed", shape, config, repr(exc)[:200], flush=True)
            continue
        tflops = backward_flops(shape) / (ms * 1e-3) / 1e12
        launch = dict(dkdv=list(config["dkdv"]), dq=list(config["dq"]))
        rows.append(dict(shape, **launch, ms=round(ms, 4), tflops=round(tflops, 1)))
        print(f"{shape} dkdv={config['dkdv']} dq={config['dq']} {ms:.4f} ms {tflops:.1f} TFLOP/s", flush=True)
    return rows


def provenance() -> dict:
    return dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
        date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        commit=os.environ.get("FLASHTILE_COMMIT", "unknown"),
        method="backward only: o.backward(do, retain_graph=True), triton.testing.do_bench median (warmup 50 ms, "
        "rep 200 ms); bf16; B*T = 16384, H*D = 2048; TFLOP/s = 2.5*4*B*H*T*T*D (x0.5 causal) / time",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sweep", action="store_true", help="time launch configs of our backward instead")
    args = parser.parse_args()
    rows = []
    if args.sweep:
        for shape in (s for s in SHAPES if s["T"] == 8192):
            rows += sweep(shape)
    else:
        for shape in SHAPES:
            rows += measure(shape)
    with open(args.out, "w") as f:
        meta = provenance()
        if args.sweep:
            meta["method"] = "launcher only: flash_attention_backward, do_bench median (warmup 25 ms, rep 100 ms)"
        json.dump(dict(provenance=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

"""First GPU table: the flashtile forward kernel against SDPA (cuDNN and flash backends), same run.

Usage (on a CUDA machine, from the repository root):
    PYTHONPATH=src python3 bench/forward_first_table.py --out bench/results/forward-first-table.json
    PYTHONPATH=src python3 bench/forward_first_table.py --sweep --out sweep.json   # try launch configs

TFLOP/s = 4 * B * H * T * T * D (x0.5 when causal) / time, time the median of triton.testing.do_bench.
Each provider's output is checked against SDPA's flash backend before it is timed.
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

from flashtile.kernels.forward import flash_attention

MAIN_SHAPE = dict(B=8, H=16, T=2048, D=64, causal=True)
EXTRA_SHAPES = [
    dict(B=8, H=16, T=2048, D=64, causal=False),
    dict(B=8, H=16, T=2048, D=128, causal=True),
    dict(B=8, H=16, T=2048, D=128, causal=False),
    dict(B=2, H=16, T=8192, D=128, causal=True),
    dict(B=4, H=16, T=4096, D=256, causal=True),
]
SWEEP = [  # (block_q, block_k, num_warps, num_stages)
    (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 3), (128, 32, 4, 3),
    (128, 128, 8, 2), (64, 128, 4, 3),
]


SWEEP_D256 = [(64, 32, 4, 2), (64, 64, 4, 2), (64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2)]
D256_SHAPE = dict(B=4, H=16, T=4096, D=256, causal=True)


def tflops(shape: dict, ms: float) -> float:
    flops = 4 * shape["B"] * shape["H"] * shape["T"] ** 2 * shape["D"] * (0.5 if shape["causal"] else 1.0)
    return flops / (ms * 1e-3) / 1e12


def make_inputs(shape: dict):
    gen = torch.Generator(device="cuda").manual_seed(0)
    size = (shape["B"], shape["H"], shape["T"], shape["D"])
    return [torch.randn(size, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3)]


def providers(shape: dict, **launch):
    causal = shape["causal"]

    def ours(q, k, v):
        return flash_attention(q, k, v, causal=causal, **launch)[0]

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return run

    return {
        "flashtile": ours,
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
    }


def measure(shape: dict, only=None, **launch) -> list[dict]:
    q, k, v = make_inputs(shape)
    rows = []
    expected = providers(shape)["sdpa_flash"](q, k, v)
    for name, fn in providers(shape, **launch).items():
        if only and name not in only:
            continue
        out = fn(q, k, v)
        err = (out.float() - expected.float()).abs().max().item()
        assert err < 5e-2, f"{name} disagrees with sdpa_flash by {err}"
        ms = triton.testing.do_bench(lambda fn=fn: fn(q, k, v), warmup=50, rep=200, return_mode="median")
        rows.append(dict(shape, dtype="bf16", provider=name, ms=round(ms, 4), tflops=round(tflops(shape, ms), 1),
                         max_abs_diff_vs_sdpa_flash=err, **launch))
        print(f"{name:>10} {shape} {launch} {ms:.4f} ms {rows[-1]['tflops']:.1f} TFLOP/s", flush=True)
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
        method="triton.testing.do_bench median (warmup 50 ms, rep 200 ms); bf16; TFLOP/s = 4*B*H*T*T*D "
        "(x0.5 causal) / time",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sweep", action="store_true", help="time launch configs of our kernel instead")
    parser.add_argument("--sweep-d256", action="store_true", help="the sweep, for head dim 256")
    args = parser.parse_args()
    if args.sweep or args.sweep_d256:
        rows = []
        plan = [(D256_SHAPE, SWEEP_D256)] if args.sweep_d256 else [(MAIN_SHAPE, SWEEP), (EXTRA_SHAPES[1], SWEEP)]
        for shape, configs in plan:
            for block_q, block_k, num_warps, num_stages in configs:
                try:
                    rows += measure(shape, only={"flashtile"}, block_q=block_q, block_k=block_k,
                                    num_warps=num_warps, num_stages=num_stages)
                except Exception as exc:  # out of shared memory, say: record it and go on
                    print("failed", shape, block_q, block_k, num_warps, num_stages, repr(exc)[:200])
        result = dict(provenance=provenance(), rows=rows)
    else:
        result = dict(provenance=provenance(), main_shape=MAIN_SHAPE, rows=measure(MAIN_SHAPE))
        for shape in EXTRA_SHAPES:
            result["rows"] += measure(shape)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""Forward table: the flashtile forward kernel against SDPA (cuDNN and flash backends), same run.

Each provider's output is checked against SDPA's flash backend before it is timed. ``--sweep`` times
launch configs of our kernel instead (how the defaults in ``kernels.forward.forward_config`` were
chosen); the sweeps are recorded in bench/PERF_LOG.md.
"""

from __future__ import annotations

import argparse

import torch

from .common import RESULTS, attention_tflops, median_ms, random_inputs, save_result, sdpa_providers

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
]  # fmt: skip
SWEEP_D256 = [(64, 32, 4, 2), (64, 64, 4, 2), (64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2)]
D256_SHAPE = dict(B=4, H=16, T=4096, D=256, causal=True)
METHOD = "triton.testing.do_bench median (warmup 50 ms, rep 200 ms); bf16; TFLOP/s = 4*B*H*T*T*D (x0.5 causal) / time"


def providers(shape: dict, **launch) -> dict:
    from ..kernels.forward import flash_attention

    causal = shape["causal"]
    ours = {"flashtile": lambda q, k, v: flash_attention(q, k, v, causal=causal, **launch)[0]}
    return {**ours, **sdpa_providers(causal)}


def measure(shape: dict, only=None, **launch) -> list[dict]:
    q, k, v = random_inputs(shape, 3)
    fns = providers(shape, **launch)
    expected = fns["sdpa_flash"](q, k, v)
    rows = []
    for name, fn in fns.items():
        if only and name not in only:
            continue
        err = (fn(q, k, v).float() - expected.float()).abs().max().item()
        assert err < 5e-2, f"{name} disagrees with sdpa_flash by {err}"
        ms = median_ms(lambda fn=fn: fn(q, k, v))
        tflops = round(attention_tflops(shape, ms), 1)
        rows.append(dict(shape, dtype="bf16", provider=name, ms=round(ms, 4), tflops=tflops,
                         max_abs_diff_vs_sdpa_flash=err, **launch))  # fmt: skip
        print(f"{name:>10} {shape} {launch} {ms:.4f} ms {rows[-1]['tflops']:.1f} TFLOP/s", flush=True)
    return rows


def run(out: str, sweep: bool = False, sweep_d256: bool = False) -> dict:
    if sweep or sweep_d256:
        rows = []
        plan = [(D256_SHAPE, SWEEP_D256)] if sweep_d256 else [(MAIN_SHAPE, SWEEP), (EXTRA_SHAPES[1], SWEEP)]
        for shape, configs in plan:
            for block_q, block_k, num_warps, num_stages in configs:
                try:
                    rows += measure(shape, only={"flashtile"}, block_q=block_q, block_k=block_k,
                                    num_warps=num_warps, num_stages=num_stages)  # fmt: skip
                except Exception as exc:  # out of shared memory, say: record it and go on
                    print("failed", shape, block_q, block_k, num_warps, num_stages, repr(exc)[:200])
        return save_result(out, rows, METHOD)
    rows = [row for shape in [MAIN_SHAPE, *EXTRA_SHAPES] for row in measure(shape)]
    return save_result(out, rows, METHOD, main_shape=MAIN_SHAPE)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashtile.bench forward", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="default: bench/results/forward.json, or sweeps/forward-configs.json")
    parser.add_argument("--sweep", action="store_true", help="time launch configs of our kernel instead")
    parser.add_argument("--sweep-d256", action="store_true", help="the sweep, for head dim 256")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the benchmarks need a CUDA device")
    sweeping = args.sweep or args.sweep_d256
    out = args.out or RESULTS / ("sweeps/forward-configs.json" if sweeping else "forward.json")
    run(out, args.sweep, args.sweep_d256)

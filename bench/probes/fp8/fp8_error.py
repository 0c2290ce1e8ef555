"""A measured probe, not part of the package: the error of FP8 attention by quantisation granularity and
rotation, on N(0, 1) inputs and on FlashAttention-3's outlier inputs.

For each input kind, head dim and mask, q, k and v are drawn in float64 and quantised with
``flashtile.fp8.quantize`` at each granularity ("tensor", "head", "block" of 64 rows; beside "block",
also q and k by block with v per head), with and without the Hadamard rotation of q and k (v is never
rotated: the output would have to be rotated back). The output of
``flashtile.reference.fp8.fp8_attention_forward`` (the float64 emulation of the FP8 kernel, block_k =
64) is compared with float64 attention of the original inputs, ``naive_attention``, as an RMSE over
every entry of o. Two more columns split that error: ``rmse_inputs`` is float64 attention of the
dequantised q, k, v (P not rounded), and the rows with provider ``rounded_inputs`` give float64
attention of inputs rounded to bf16 or fp16, for scale. The outlier inputs are N(0, 1) with 0.1 % of
the entries (of q, k and v alike) redrawn from N(0, 10²). Every cell is drawn with two seeds.

This is arithmetic, not timing: the CPU numbers are the numbers. Run from the repository root (about seven
minutes on two cores):

    PYTHONPATH=src python bench/probes/fp8/fp8_error.py bench/results/sweeps/fp8-error-granularity-rotation.json
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

from flashtile.fp8 import GRANULARITIES, quantize
from flashtile.reference.fp8 import fp8_attention_forward
from flashtile.reference.naive import naive_attention

B, H, T = 2, 4, 1024
HEAD_DIMS = (64, 128)
BLOCK = 64  # rows per factor with granularity "block", and the emulation's key tile
SEEDS = (34, 35)  # two draws of every cell: the spread between them is the noise of one draw
# (granularity of q and k, granularity of v): v's factors ride on P (reference.fp8), so "block" v is also
# measured against v per head, FlashAttention-3's choice
GRANULARITY_PAIRS = tuple((g, g) for g in GRANULARITIES) + (("block", "head"),)
METHOD = (
    "RMSE of FP8 attention (its float64 emulation) by quantisation granularity and rotation; CPU, float64 "
    "arithmetic: rmse = sqrt(mean((o - o_exact)^2)) over every entry of o, o_exact = float64 "
    "attention (naive_attention) of the original float64 inputs; o = flashtile.reference.fp8.fp8_attention_forward "
    f"(block_k = {BLOCK}) of flashtile.fp8.quantize(x, granularity, rotate) of q, k and v (rotate applies to q and k "
    f"only; block = {BLOCK} rows); rmse_inputs = float64 attention of the dequantised q, k, v (P not rounded); "
    "provider rounded_inputs: float64 attention of q, k, v rounded to that dtype. Inputs: N(0, 1), or N(0, 1) with "
    f"0.1 % of entries redrawn from N(0, 10^2) ('outliers'); B = {B}, H = H_kv = {H}, T = {T}, seeds {SEEDS}; "
    "q and k quantised at 'granularity', v at 'v_granularity'"
)


def draw(kind: str, D: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)
    if kind == "outliers":
        pick = torch.rand(B, H, T, D, generator=gen, dtype=torch.float64) < 1e-3
        x = torch.where(pick, 10 * torch.randn(B, H, T, D, generator=gen, dtype=torch.float64), x)
    return x


def rmse(o: torch.Tensor, o_exact: torch.Tensor) -> float:
    return (o - o_exact).pow(2).mean().sqrt().item()


def rows_for(kind: str, D: int, causal: bool, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed * 1000 + D + 2 * causal + (kind == "outliers"))
    q, k, v = (draw(kind, D, gen) for _ in range(3))
    o_exact, _ = naive_attention(q, k, v, causal)
    shape = dict(B=B, H=H, H_kv=H, Tq=T, Tk=T, D=D, causal=causal, layout="bhtd", inputs=kind, seed=seed)
    untimed = dict(ms=None, tflops=None, error="not timed: an accuracy study of the float64 emulation")
    rows = []
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        o, _ = naive_attention(*(x.to(dtype).double() for x in (q, k, v)), causal)
        rows.append({"pass": "forward", "provider": "rounded_inputs", **shape, "dtype": name, **untimed,
                     "rmse": rmse(o, o_exact)})  # fmt: skip
    for granularity, v_granularity in GRANULARITY_PAIRS:
        block = BLOCK if granularity == "block" else None
        for rotate in (False, True):
            (q8, dq), (k8, dk) = (quantize(x, granularity, rotate=rotate, block=block) for x in (q, k))
            v8, dv = quantize(v, v_granularity, block=BLOCK if v_granularity == "block" else None)
            o, _ = fp8_attention_forward(q8, k8, v8, dq, dk, dv, causal, None, BLOCK)
            o_inputs, _ = naive_attention(*(x8.double() * d.double()[..., None] for x8, d in
                                            ((q8, dq), (k8, dk), (v8, dv))), causal)  # fmt: skip
            rows.append({"pass": "forward", "provider": "flashtile_fp8_emulation", **shape, "dtype": "fp8_e4m3",
                         **untimed, "granularity": granularity, "v_granularity": v_granularity, "rotate": rotate,
                         "rmse": rmse(o, o_exact), "rmse_inputs": rmse(o_inputs, o_exact)})  # fmt: skip
            print(kind, D, causal, seed, granularity, v_granularity, rotate, f"{rows[-1]['rmse']:.3e}", flush=True)
    return rows


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def save_cpu_result(out: str, rows: list[dict], method: str) -> None:
    """The rows as bench-schema JSON with a CPU provenance (no GPU: these probes run the float64 emulation)."""
    provenance = dict(gpu=None, device="cpu", torch=torch.__version__, python=platform.python_version(),
                      date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                      commit=commit(), method=method)  # fmt: skip
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(dict(provenance=provenance, rows=rows), indent=1) + "\n")


def main(out: str) -> None:
    torch.set_num_threads(2)
    rows = [row for kind in ("normal", "outliers") for D in HEAD_DIMS for causal in (False, True) for seed in SEEDS
            for row in rows_for(kind, D, causal, seed)]  # fmt: skip
    save_cpu_result(out, rows, METHOD)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fp8-error-granularity-rotation.json")

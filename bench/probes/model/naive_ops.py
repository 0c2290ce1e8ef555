"""A measured probe, not part of the package: where the naive provider's time goes, operation by operation.

The scale-up table (``forward-scaleup.json``, B = 4, H = 16, D = 64, no mask, bf16) has the naive
provider at 64.1, 49.6, 44.6 and then 65.8 TFLOP/s from T = 1k to 16k: faster per score at 16k than
at 8k, though nothing in ``bench.providers.naive_attention`` changes with T (it never chunks; the same
three lines run at every length). This times each PyTorch operation of that function alone, on the same
inputs, at each length: the scores' matmul, the scale, the softmax and the matmul with V, plus the whole
function, so the table says which of them changes speed between 8k and 16k. Each operation's
effective bandwidth counts the (B, H, T, T) tensors it reads and writes (bf16), the traffic that makes
naive attention memory-bound.

Run from the repository root on one H200 (under a minute):

    OUT=/some/folder PYTHONPATH=src python bench/probes/model/naive_ops.py

It writes ``$OUT/naive-ops.json``: one row per (T, operation) with ``ms`` and ``tbps``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import triton

from flashtile.bench.common import save_result
from flashtile.bench.providers import naive_attention

B, H, D = 4, 16, 64
LENGTHS = (2048, 4096, 8192, 16384)
METHOD = (
    "triton.testing.do_bench median (warmup 25 ms, rep 100 ms) of each operation alone on tensors made before "
    "timing; tbps = bytes of the (B, H, T, T) bf16 tensors the operation reads and writes / time"
)


def bench(call) -> float:
    return triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")


def measure(T: int) -> list[dict]:
    """One row per operation at length T; the whole function first, alone (at 16k it holds 64 GiB)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    times = [("naive_attention", bench(lambda: naive_attention(q, k, v, False)), 6)]
    torch.cuda.empty_cache()
    s = q @ k.transpose(-2, -1)
    p = torch.softmax(s, dim=-1)
    times += [  # (name, ms, (B, H, T, T) tensors read + written)
        ("q @ k^T", bench(lambda: q @ k.transpose(-2, -1)), 1),
        ("s * scale", bench(lambda: s * D**-0.5), 2),
        ("softmax", bench(lambda: torch.softmax(s, dim=-1)), 2),
        ("p @ v", bench(lambda: p @ v), 1),
    ]
    scores = B * H * T * T * 2  # bytes of one (B, H, T, T) bf16 tensor
    rows = []
    for name, ms, tensors in times:
        tbps = round(tensors * scores / (ms * 1e-3) / 1e12, 2)
        rows.append({"pass": "forward", "op": name, "B": B, "H": H, "Tq": T, "Tk": T, "D": D, "causal": False,
                     "dtype": "bf16", "ms": round(ms, 4), "tbps": tbps})  # fmt: skip
        print(f"T={T:6d} {name:16s} {ms:9.3f} ms  {rows[-1]['tbps']:5.2f} TB/s", flush=True)
    return rows


def main() -> int:
    rows = []
    for T in LENGTHS:
        rows += measure(T)
        torch.cuda.empty_cache()
    out = Path(os.environ["OUT"]) / "naive-ops.json"
    save_result(out, rows, METHOD)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

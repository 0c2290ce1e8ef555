"""Fused row softmax against torch.softmax and an unfused five-kernel softmax, in GB/s.

The byte model (docs/part-b/fused-softmax.md): with N = rows * cols elements of s bytes each, a row
that fits in one block costs 2 N s (read once, write once); a streamed row costs 3 N s (read twice);
the unfused max / subtract / exp / sum / divide sequence costs 8 N s. "GB/s" below is always the
useful traffic 2 N s divided by the time, so the three are directly comparable.
"""

from __future__ import annotations

import argparse

import torch

from .common import RESULTS, median_ms, save_result

SHAPES = [(16384, 1024), (8192, 4096), (4096, 8192), (2048, 32768), (256, 100_000)]
METHOD = "triton.testing.do_bench median (warmup 25 ms, rep 100 ms); bf16; useful GB/s = 2 * N * s / time"


def unfused(x):
    m = x.amax(dim=-1, keepdim=True)
    z = x - m
    e = torch.exp(z)
    l = e.sum(dim=-1, keepdim=True)
    return e / l


def run(out: str) -> dict:
    from ..kernels.softmax import MAX_BLOCK, softmax

    rows = []
    for n_rows, n_cols in SHAPES:
        x = torch.randn(n_rows, n_cols, device="cuda", dtype=torch.bfloat16)
        expected = torch.softmax(x.float(), dim=-1)
        useful_bytes = 2 * x.numel() * x.element_size()
        for name, fn in [("flashtile", softmax), ("torch_softmax", lambda t: torch.softmax(t, -1)),
                         ("unfused_5_kernels", unfused)]:  # fmt: skip
            err = (fn(x).float() - expected).abs().max().item()
            assert err < 1e-2, (name, err)
            ms = median_ms(lambda fn=fn, x=x: fn(x), warmup=25, rep=100)
            rows.append(dict(rows=n_rows, cols=n_cols, dtype="bf16", provider=name, ms=round(ms, 4),
                             useful_GBps=round(useful_bytes / (ms * 1e-3) / 1e9, 1),
                             streamed=(name == "flashtile" and n_cols > MAX_BLOCK)))  # fmt: skip
            print(rows[-1], flush=True)
    return save_result(out, rows, METHOD)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashtile.bench softmax", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "softmax.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the benchmarks need a CUDA device")
    run(args.out)

"""Fused row softmax against torch.softmax and an unfused five-kernel softmax, in GB/s.

Usage (CUDA machine, repository root):
    PYTHONPATH=src python3 bench/softmax_table.py --out bench/results/softmax-first-table.json

The byte model (docs/part-b/fused-softmax.md): with N = rows * cols elements of s bytes each, a row
that fits in one block costs 2 N s (read once, write once); a streamed row costs 3 N s (read twice);
the unfused max / subtract / exp / sum / divide sequence costs 8 N s. "GB/s" below is always the
useful traffic 2 N s divided by the time, so the three are directly comparable.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from flashtile.kernels.softmax import MAX_BLOCK, softmax

SHAPES = [(16384, 1024), (8192, 4096), (4096, 8192), (2048, 32768), (256, 100_000)]


def unfused(x):
    m = x.amax(dim=-1, keepdim=True)
    z = x - m
    e = torch.exp(z)
    l = e.sum(dim=-1, keepdim=True)
    return e / l


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from forward_first_table import provenance  # same folder; run from the repository root

    rows = []
    for n_rows, n_cols in SHAPES:
        x = torch.randn(n_rows, n_cols, device="cuda", dtype=torch.bfloat16)
        expected = torch.softmax(x.float(), dim=-1)
        useful_bytes = 2 * x.numel() * x.element_size()
        for name, fn in [("flashtile", softmax), ("torch_softmax", lambda t: torch.softmax(t, -1)),
                         ("unfused_5_kernels", unfused)]:
            err = (fn(x).float() - expected).abs().max().item()
            assert err < 1e-2, (name, err)
            ms = triton.testing.do_bench(lambda fn=fn, x=x: fn(x), warmup=25, rep=100, return_mode="median")
            rows.append(dict(rows=n_rows, cols=n_cols, dtype="bf16", provider=name, ms=round(ms, 4),
                             useful_GBps=round(useful_bytes / (ms * 1e-3) / 1e9, 1),
                             streamed=(name == "flashtile" and n_cols > MAX_BLOCK)))
            print(rows[-1], flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(provenance=provenance(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

"""A measured probe, not part of the package: the FP8 forward at short sequences, where it ran slower than bf16.

In ``forward-fp8.json`` the FP8 forward ran 0.65x flashtile's bf16 forward at D = 128, causal, T = 1k (0.306
against 0.199 ms, slower than its own T = 2k row), and 0.84-0.97x at D = 64 causal from 512 to 2k. This probe
asks whether that is the launch settings (64 x 128 tiles, 4 warps, 3 stages), the launch order, or noise:
on the standard sweep's short rows (B·T = 16,384, H·D = 2,048, T = 512 / 1k / 2k, D = 64 and 128, causal and
not), two rounds in turn of

* ``bf16``: flashtile's bf16 forward (``kernels.forward.flash_attention``);
* ``fp8``: ``flashtile.attention`` on per-head E4M3 copies with V keys-contiguous, as the forward table's
  ``flashtile_fp8`` provider times it;
* ``launch BQ x BK wW sS [plain]``: ``kernels.fp8_forward.launch_fp8_forward`` at those settings (block_k
  stays the emulation's 128, which fixes P's rounding), in the package's launch order or, with ``plain``,
  with the heaviest-first order switched off.

    OUT=/some/folder PYTHONPATH=src python bench/probes/fp8/fp8_short_t.py

Writes ``$OUT/fp8-short-t.json``: rows in the bench schema with ``variant`` and ``round``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

import flashtile
from flashtile.bench.common import attention_tflops, median_ms, save_result
from flashtile.bench.providers import make_inputs
from flashtile.bench.shapes import shape as make_shape
from flashtile.fp8 import quantize
from flashtile.kernels import fp8_forward as fp8k
from flashtile.kernels.forward import flash_attention

LENGTHS = (512, 1024, 2048)
# (block_q, num_warps, num_stages, plain order); the first is the package's
SETTINGS = ((64, 4, 3, False), (64, 4, 3, True), (64, 4, 2, False), (64, 4, 4, False), (128, 8, 2, False),
            (128, 8, 3, False), (64, 8, 2, False))


def no_chunk(*args, **kwargs):
    return 0


def main(out: Path) -> None:
    rows = []
    for rnd in (0, 1):
        for D in (128, 64):
            for causal in (True, False):
                for T in LENGTHS:
                    shape = make_shape(16384 // T, 2048 // D, T, D, causal)
                    q, k, v = make_inputs(shape, seed=T + D)
                    (q8, dq), (k8, dk) = quantize(q, "head"), quantize(k, "head")
                    v8, dv = quantize(v, "head", keys_contiguous=True)
                    timed = {"bf16": functools.partial(flash_attention, q, k, v, causal=causal),
                             "fp8": functools.partial(flashtile.attention, q8, k8, v8, is_causal=causal,
                                                      descale_q=dq, descale_k=dk, descale_v=dv)}  # fmt: skip
                    for block_q, warps, stages, plain in SETTINGS:
                        name = f"launch {block_q}x128 w{warps} s{stages}" + (" plain" if plain else "")
                        timed[name] = (block_q, warps, stages, plain)
                    line = []
                    for name, fn in timed.items():
                        if isinstance(fn, tuple):
                            block_q, warps, stages, plain = fn
                            fn = functools.partial(fp8k.launch_fp8_forward, q8, k8, v8, dq, dk, dv, causal=causal,
                                                   scale=D**-0.5, alignment="upper_left", out_dtype=torch.bfloat16,
                                                   block_k=128, block_q=block_q, num_warps=warps,
                                                   num_stages=stages)  # fmt: skip
                            if plain:
                                keep, fp8k.heaviest_first_chunk = fp8k.heaviest_first_chunk, no_chunk
                        try:
                            ms = median_ms(fn)
                            error = None
                        except Exception as e:  # a setting that does not compile still gets its row
                            ms, error = None, f"{type(e).__name__}: {str(e)[:80]}"
                        finally:
                            if isinstance(timed[name], tuple) and timed[name][3]:
                                fp8k.heaviest_first_chunk = keep
                        row = {"pass": "forward", "provider": "flashtile" if name == "bf16" else "flashtile_fp8",
                               **shape, "dtype": "bf16" if name == "bf16" else "fp8_e4m3",
                               "ms": None if ms is None else round(ms, 4),
                               "tflops": None if ms is None else round(attention_tflops(shape, ms), 1),
                               "variant": name, "round": rnd}  # fmt: skip
                        if error:
                            row["error"] = error
                        rows.append(row)
                        line.append(f"{name} {row['ms']}")
                    print(rnd, D, causal, T, *line, sep=" | ", flush=True)
    save_result(out / "fp8-short-t.json", rows,
                "flashtile.bench.common.median_ms (do_bench median, warmup 50 ms, rep 200 ms); two rounds; "
                "per-head E4M3 factors, V keys-contiguous, quantisation not timed; launch rows: "
                "kernels.fp8_forward.launch_fp8_forward at block_k 128")


if __name__ == "__main__":
    main(Path(os.environ.get("OUT", ".")))

"""A measured probe, not part of the package: the atomic-dQ backward with each dQ share added as one TMA bulk add.

The deterministic backward runs seven matmuls per (query tile, key tile) over two kernels; the atomic mode
(``deterministic=False``) runs five in one, but added its dQ shares with one float32 atomic per element and
measured 0.53-0.65x cuDNN, below the deterministic mode's 0.76-0.92x (``bench/results/backward.json``). With
TMA (``tma=True`` or the package's choice from 1k tokens on) the dK/dV kernel now adds each 64 x D share with
one ``cp.reduce.async.bulk.tensor`` (``DQ_REDUCE``). This probe times, at the standard sweep's D = 64 and 128
shapes and the issue's D = 256 shapes (T 2k and 8k, causal and not), the deterministic default, the atomic mode
through pointers (the previous form), the atomic mode with bulk adds at several dK/dV settings, and cuDNN and
FlashAttention-2 (SDPA backends) in the same run; every flashtile gradient is compared with the deterministic
one.

    OUT=/some/folder PYTHONPATH=src python bench/probes/backward/atomic_dq_reduce.py

Writes ``$OUT/atomic-dq-reduce.json``. A setting that does not compile (shared memory) records the error.
"""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

import torch

from flashtile.bench.common import attention_tflops, median_ms, save_result
from flashtile.bench.providers import build
from flashtile.bench.shapes import shape
from flashtile.kernels.backward import backward_config, flash_attention_backward
from flashtile.kernels.forward import flash_attention

SETTINGS = {  # dK/dV (block_q, block_k, warps, stages) for the atomic mode with bulk adds, by head dim
    64: [(32, 128, 4, 3), (64, 64, 4, 2), (64, 128, 8, 2), (32, 64, 4, 3)],
    128: [(32, 64, 4, 3), (64, 64, 8, 2), (64, 64, 4, 2), (64, 128, 8, 2)],
    256: [(32, 64, 8, 2), (16, 64, 8, 2), (32, 32, 8, 2), (16, 32, 4, 2)],
}
HEADS = {64: 32, 128: 16, 256: 8}  # H * D = 2048 at D <= 128 (the standard sweep), H = 8 at D = 256 (issue 35)
SHAPES = [shape(16384 // T, HEADS[D], T, D, causal) for D in (64, 128, 256) for T in (2048, 8192)
          for causal in (False, True)]  # fmt: skip
BUDGET_S = float(os.environ.get("PROBE_BUDGET_S", "420"))
METHOD = ("triton.testing.do_bench median (warmup 50 ms, rep 200 ms); flashtile: kernels.backward."
          "flash_attention_backward called directly (stats from the forward); SDPA: o.backward(do, retain_graph=True); "
          "TFLOP/s = 2.5*4*B*H*T*T*D (x0.5 causal) / time; max_err against the deterministic default's gradients")


def main(out: Path) -> None:
    start = time.time()
    rows = []
    for s in SHAPES:
        if time.time() - start > BUDGET_S:
            print("budget spent: stopping before", s, flush=True)
            break
        D, causal = s["D"], s["causal"]
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(s["B"], s["H"], s["Tq"], D, device="cuda", dtype=torch.bfloat16, generator=g)
                       for _ in range(4))  # fmt: skip
        fields = {key: s[key] for key in ("B", "H", "Tq", "D", "causal")}
        for name in ("sdpa_cudnn", "sdpa_flash"):
            run = build(name, s)
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            o_s = run(*leaves)
            ms = median_ms(partial(o_s.backward, do, retain_graph=True), grad_to_none=leaves)
            rows.append(dict(provider=name, ms=ms, tflops=attention_tflops(s, ms, "bwd"), **fields))
            print(s["Tq"], D, causal, name, round(rows[-1]["tflops"], 1), flush=True)
        o, lse, stats = flash_attention(q, k, v, causal=causal, return_stats=True)
        truth = flash_attention_backward(q, k, v, o, lse, do, causal=causal, stats=stats)
        default = backward_config(D, torch.bfloat16, s["Tq"])
        runs = [("deterministic", None, None, True), ("atomic_pointers", None, False, False)]
        runs += [("atomic_bulk", dict(dkdv=setting, dq=default["dq"]), True, False) for setting in SETTINGS[D]]
        for provider, config, tma, deterministic in runs:
            row = dict(provider=provider, dkdv=None if config is None else config["dkdv"], tma=tma, **fields)
            try:
                fn = partial(flash_attention_backward, q, k, v, o, lse, do, causal, stats=stats, config=config,
                             tma=tma, deterministic=deterministic)  # fmt: skip
                grads = fn()
                row["max_err"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, truth))
                row["ms"] = median_ms(fn)
                row["tflops"] = attention_tflops(s, row["ms"], "bwd")
            except Exception as error:  # noqa: BLE001  (a setting that cannot compile is a result)
                row["error"] = f"{type(error).__name__}: {str(error)[:160]}"
            rows.append(row)
            print(s["Tq"], D, causal, provider, row["dkdv"], row.get("tflops"), row.get("max_err"),
                  row.get("error", ""), flush=True)  # fmt: skip
    save_result(out / "atomic-dq-reduce.json", rows, METHOD, settings={str(d): v for d, v in SETTINGS.items()})


if __name__ == "__main__":
    main(Path(os.environ.get("OUT", ".")))

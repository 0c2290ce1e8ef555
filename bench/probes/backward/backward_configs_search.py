"""A measured probe, not part of the package: the deterministic backward's settings searched again at D = 64, 128.

The kernel split (``sweeps/backward-kernel-split.json``) puts 62-65 % of the backward's time at D = 64 in the dK/dV
kernel, whose own four matmuls run at 351-434 TFLOP/s there against 472-599 at D = 128. Its settings (32 x 128
tiles, 4 warps, 3 stages: 32-row query tiles, so every matmul has a side of 32) were chosen among three in
``sweeps/backward-tma-configs-2.json``, before the kernels' later changes. This probe times, at the standard
sweep's shapes (B·T = 16384, H·D = 2048, T 2k and 8k, causal and not, bf16, TMA as the package takes it from 1k
tokens), candidate (block_q, block_k, warps, stages) settings of the dK/dV kernel with the dQ kernel at the
package's choice, then dQ settings with the best dK/dV one, each backward's gradients compared with the
package's. Settings that do not compile (shared memory) record the error.

    OUT=/some/folder PYTHONPATH=src python bench/probes/backward/backward_configs_search.py

Writes ``$OUT/backward-configs-search.json``.
"""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

import torch

from flashtile.bench.common import attention_tflops, median_ms, save_result
from flashtile.bench.shapes import shape
from flashtile.kernels.backward import backward_config, flash_attention_backward
from flashtile.kernels.forward import flash_attention

DKDV = {
    64: [(32, 128, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (128, 64, 8, 2),
         (128, 128, 8, 2), (64, 128, 4, 2), (32, 128, 4, 2), (32, 64, 4, 3)],
    128: [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 8, 2), (128, 64, 8, 2), (32, 128, 4, 2), (128, 128, 8, 1)],
}
DQ = {
    64: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3), (128, 64, 4, 3), (128, 32, 8, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3), (64, 128, 4, 2)],
}
HEADS = {64: 32, 128: 16}
BUDGET_S = float(os.environ.get("PROBE_BUDGET_S", "420"))
METHOD = ("triton.testing.do_bench median (warmup 50 ms, rep 200 ms) of kernels.backward.flash_attention_backward "
          "called directly with the forward's stats, config=..., tma=True; TFLOP/s = 2.5*4*B*H*T*T*D (x0.5 causal) "
          "/ time; max_err against the package's default settings' gradients")


def shapes(D: int) -> list[dict]:
    return [shape(16384 // T, HEADS[D], T, D, causal) for T in (2048, 8192) for causal in (False, True)]


def main(out: Path) -> None:
    start = time.time()
    rows = []
    for D in (64, 128):
        cases = []
        for s in shapes(D):
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(s["B"], s["H"], s["Tq"], D, device="cuda", dtype=torch.bfloat16, generator=g)
                           for _ in range(4))  # fmt: skip
            o, lse, stats = flash_attention(q, k, v, causal=s["causal"], return_stats=True)
            truth = flash_attention_backward(q, k, v, o, lse, do, causal=s["causal"], stats=stats)
            cases.append((s, partial(flash_attention_backward, q, k, v, o, lse, do, s["causal"], stats=stats,
                                     tma=True), truth))  # fmt: skip
        default = backward_config(D, torch.bfloat16, 8192)

        def run(config, stage, D=D, cases=cases):
            total = 0.0
            for s, call, truth in cases:
                row = dict(stage=stage, dkdv=config["dkdv"], dq=config["dq"],
                           **{key: s[key] for key in ("B", "H", "Tq", "D", "causal")})  # fmt: skip
                try:
                    grads = call(config=config)
                    row["max_err"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, truth))
                    row["ms"] = median_ms(partial(call, config=config))
                    row["tflops"] = attention_tflops(s, row["ms"], "bwd")
                    total += row["ms"]
                except Exception as error:  # noqa: BLE001  (a setting that cannot compile is a result)
                    row["error"] = f"{type(error).__name__}: {str(error)[:160]}"
                    total = float("inf")
                rows.append(row)
                print(D, stage, config, s["Tq"], s["causal"], row.get("tflops"), row.get("max_err"),
                      row.get("error", ""), flush=True)  # fmt: skip
            return total

        times = {}
        for setting in DKDV[D]:
            if time.time() - start > BUDGET_S * (0.3 if D == 64 else 0.8):
                break
            times[setting] = run(dict(dkdv=setting, dq=default["dq"]), "dkdv")
        best_dkdv = min(times, key=times.get)
        dq_times = {}
        for setting in DQ[D]:
            if time.time() - start > BUDGET_S * (0.5 if D == 64 else 1.0):
                break
            dq_times[setting] = (times[best_dkdv] if setting == default["dq"]
                                 else run(dict(dkdv=best_dkdv, dq=setting), "dq"))  # fmt: skip
        print(D, "best", best_dkdv, min(dq_times, key=dq_times.get), flush=True)
    save_result(out / "backward-configs-search.json", rows, METHOD,
                dkdv={str(d): v for d, v in DKDV.items()}, dq={str(d): v for d, v in DQ.items()})


if __name__ == "__main__":
    main(Path(os.environ.get("OUT", ".")))

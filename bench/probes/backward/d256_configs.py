"""A measured probe, not part of the package: launch settings for head dim 256, forward and backward.

Issue 35: at D = 256 (B·T = 16384, H = 8, bf16) the backward runs 88-97 TFLOP/s against cuDNN's 306-376 and
FlashAttention-2's 188-254, the forward 0.74-0.79x cuDNN. The package's D = 256 settings were never searched
since the kernels changed. This probe times, at T = 4k without a mask, candidate (block_q, block_k, warps,
stages) settings of each backward kernel in turn (dK/dV with dQ at the package's choice, then dQ with the
best dK/dV), and forward settings with and without TMA, each output checked against the package's default
settings; then the best three of each at every issue shape (T 2k, 4k, 8k; causal and not) beside the
package's settings, cuDNN and FlashAttention-2 (SDPA backends) in the same run.

Backward times: ``kernels.backward.flash_attention_backward`` called directly (config=..., tma=...) for
flashtile; ``o.backward(do, retain_graph=True)`` for SDPA. Forward: ``flash_attention`` / SDPA under no_grad.

    OUT=/some/folder PYTHONPATH=src python bench/probes/backward/d256_configs.py

``D256_ROUND=2`` searches around round 1's best (TMA on). Writes ``$OUT/d256-configs-round<N>.json``. A
settings row that fails to compile (shared memory) records the error.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from flashtile.bench.common import attention_tflops, median_ms, save_result
from flashtile.bench.providers import build
from flashtile.bench.shapes import shape
from flashtile.kernels.backward import backward_config, flash_attention_backward
from flashtile.kernels.forward import flash_attention

D = 256
SEARCH = shape(4, 8, 4096, D, False)
ROUNDS = {  # round 1: around the settings kept before (pointers); round 2: around round 1's best (TMA)
    1: dict(
        dkdv=[(16, 32, 4, 2), (16, 32, 8, 2), (32, 32, 4, 2), (32, 32, 8, 2), (16, 64, 4, 2), (16, 64, 8, 2),
              (32, 64, 8, 2), (32, 64, 8, 1), (64, 64, 8, 2), (64, 32, 8, 2)],
        dq=[(64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2), (32, 64, 4, 2), (128, 64, 8, 1),
            (64, 32, 8, 3), (32, 32, 4, 2)],
        fwd=[(128, 64, 8, 2, False), (128, 64, 8, 2, True), (128, 64, 8, 3, False), (128, 32, 8, 2, False),
             (128, 32, 8, 3, True), (64, 64, 4, 2, False), (64, 64, 4, 3, True), (128, 128, 8, 1, True),
             (64, 128, 8, 2, True), (64, 64, 8, 2, True)],
        tma=False,
    ),
    2: dict(
        dkdv=[(64, 64, 8, 2), (64, 64, 8, 1), (64, 64, 8, 3), (128, 64, 8, 2), (64, 128, 8, 2), (128, 32, 8, 2),
              (32, 128, 8, 2), (64, 64, 4, 2), (128, 64, 8, 1)],
        dq=[(128, 64, 8, 1), (128, 64, 8, 2), (128, 128, 8, 1), (256, 64, 8, 1), (128, 32, 8, 1), (256, 32, 8, 1),
            (64, 128, 8, 1), (128, 64, 4, 1)],
        fwd=[(128, 64, 8, 2, False), (128, 32, 8, 3, True), (128, 32, 8, 4, True), (64, 64, 4, 4, True),
             (64, 32, 4, 4, True), (128, 64, 8, 1, True), (64, 128, 4, 2, True), (128, 64, 4, 2, True),
             (64, 64, 8, 3, True)],
        tma=True,
    ),
}
ROUND = int(os.environ.get("D256_ROUND", "1"))
DKDV, DQ, FWD, SEARCH_TMA = (ROUNDS[ROUND][key] for key in ("dkdv", "dq", "fwd", "tma"))
SHAPES = [shape(B, 8, T, D, causal) for B, T in ((8, 2048), (4, 4096), (2, 8192)) for causal in (False, True)]
BUDGET_S = float(os.environ.get("D256_BUDGET_S", "330"))
METHOD = ("triton.testing.do_bench median (warmup 50 ms, rep 200 ms); backward: flashtile's launcher called "
          "directly with config/tma, SDPA through o.backward(do, retain_graph=True); TFLOP/s = 4*B*H*T*T*D "
          "(x0.5 causal, x2.5 backward) / time; every setting's output compared with the package's default")


def inputs(s, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(s["B"], s["H"], s["Tq"], D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]


def main(out: Path) -> None:
    start = time.time()
    rows = []
    default = backward_config(D, torch.bfloat16, 4096)

    def bwd_row(s, config, tma, stage, truth=None):
        q, k, v, do = inputs(s)
        o, lse, stats = flash_attention(q, k, v, causal=s["causal"], return_stats=True)
        row = dict(pass_="backward", provider="flashtile", stage=stage, dkdv=config["dkdv"], dq=config["dq"], tma=tma,
                   **{key: s[key] for key in ("B", "H", "Tq", "D", "causal")})  # fmt: skip
        try:
            fn = lambda: flash_attention_backward(q, k, v, o, lse, do, causal=s["causal"], stats=stats, config=config,
                                                  tma=tma)  # fmt: skip
            grads = fn()
            if truth is not None:
                row["max_err"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, truth))
            row["ms"] = median_ms(fn)
            row["tflops"] = attention_tflops(s, row["ms"], "bwd")
        except Exception as error:  # noqa: BLE001  (a setting that cannot compile is a result)
            row["error"] = f"{type(error).__name__}: {str(error)[:160]}"
        print(stage, config, tma, row.get("tflops"), row.get("max_err"), row.get("error", ""), flush=True)
        rows.append({("pass" if key == "pass_" else key): val for key, val in row.items()})
        return row

    def fwd_row(s, launch, stage, truth=None):
        q, k, v, _ = inputs(s)
        bq, bk, warps, stages, tma = launch
        row = dict(pass_="forward", provider="flashtile", stage=stage, launch=launch,
                   **{key: s[key] for key in ("B", "H", "Tq", "D", "causal")})  # fmt: skip
        try:
            fn = lambda: flash_attention(q, k, v, causal=s["causal"], block_q=bq, block_k=bk, num_warps=warps,
                                         num_stages=stages, tma=tma)[0]  # fmt: skip
            with torch.no_grad():
                o = fn()
                if truth is not None:
                    row["max_err"] = (o.float() - truth.float()).abs().max().item()
                row["ms"] = median_ms(fn)
            row["tflops"] = attention_tflops(s, row["ms"], "fwd")
        except Exception as error:  # noqa: BLE001
            row["error"] = f"{type(error).__name__}: {str(error)[:160]}"
        print(stage, launch, row.get("tflops"), row.get("max_err"), row.get("error", ""), flush=True)
        rows.append({("pass" if key == "pass_" else key): val for key, val in row.items()})
        return row

    # the package's own answers at the search shape, the truth every setting is compared with
    q, k, v, do = inputs(SEARCH)
    o, lse, stats = flash_attention(q, k, v, causal=False, return_stats=True)
    truth_bwd = flash_attention_backward(q, k, v, o, lse, do, causal=False, stats=stats)
    with torch.no_grad():
        truth_fwd = flash_attention(q, k, v)[0]

    fwd = [fwd_row(SEARCH, launch, "search", truth_fwd) for launch in FWD]
    dkdv = []
    for setting in DKDV:
        if time.time() - start > BUDGET_S * 0.45:
            break
        dkdv.append(bwd_row(SEARCH, dict(dkdv=setting, dq=default["dq"]), SEARCH_TMA, "search-dkdv", truth_bwd))
    best_dkdv = max((r for r in dkdv if "ms" in r), key=lambda r: r["tflops"])["dkdv"]
    dq = []
    for setting in DQ:
        if time.time() - start > BUDGET_S * 0.7:
            break
        dq.append(bwd_row(SEARCH, dict(dkdv=best_dkdv, dq=setting), SEARCH_TMA, "search-dq", truth_bwd))
    best_dq = max((r for r in dq if "ms" in r), key=lambda r: r["tflops"])["dq"]
    best = dict(dkdv=best_dkdv, dq=best_dq)
    bwd_row(SEARCH, best, True, "search-tma", truth_bwd)
    top_fwd = [r["launch"] for r in sorted((r for r in fwd if "ms" in r), key=lambda r: -r["tflops"])[:2]]

    for s in SHAPES:
        if time.time() - start > BUDGET_S:
            print("budget spent: stopping before", s)
            break
        q, k, v, do = inputs(s)
        for name in ("sdpa_cudnn", "sdpa_flash"):
            run = build(name, s)
            with torch.no_grad():
                ms_f = median_ms(lambda run=run, q=q, k=k, v=v: run(q, k, v))
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            o_s = run(*leaves)
            ms_b = median_ms(lambda o_s=o_s, do=do: o_s.backward(do, retain_graph=True), grad_to_none=leaves)
            for pass_, ms, mode in (("forward", ms_f, "fwd"), ("backward", ms_b, "bwd")):
                fields = {key: s[key] for key in ("B", "H", "Tq", "D", "causal")}
                rows.append({"pass": pass_, "provider": name, "stage": "shapes", "ms": ms,
                             "tflops": attention_tflops(s, ms, mode), **fields})  # fmt: skip
            print(s["Tq"], s["causal"], name, rows[-2]["tflops"], rows[-1]["tflops"], flush=True)
        bwd_row(s, default_at(s), None, "shapes-package")
        bwd_row(s, best, False, "shapes-best")
        bwd_row(s, best, True, "shapes-best-tma")
        fwd_row(s, (128, 64, 8, 2, False), "shapes-package")
        for launch in top_fwd:
            fwd_row(s, launch, "shapes-best")
    save_result(out / f"d256-configs-round{ROUND}.json", rows, METHOD, search_shape=SEARCH, round=ROUND,
                best_backward=best, top_forward=top_fwd)


def default_at(s):
    config = backward_config(D, torch.bfloat16, s["Tq"])
    return dict(dkdv=config["dkdv"], dq=config["dq"])


if __name__ == "__main__":
    main(Path(os.environ.get("OUT", ".")))

"""A measured probe, not part of the package: launch settings at unequal head dims, and what sets the
192/128 call apart from cuDNN's.

The head-dims table times 192/128 (DeepSeek-V3's prefill) at about half of cuDNN's speed, and its forward
at 8k slower than the same call with v padded to 192, although that call does more work. Unequal widths
take the launch settings of the wider dim (``forward_config`` and ``backward_config`` at max(d_qk, d_v)),
measured only at equal dims. This probe, at the table's shapes (H = 16, bf16, ``bthd``, causal):

1. ``controls``: at 8k, flashtile's forward and backward at 192/128, 192/192, 256/128, 256/256 and
   128/128 with its own settings, and cuDNN (SDPA) at the same widths where it takes them. flashtile's
   192/128 against its 256/128 says what q and k of 192 cost beside 256 (a Triton tile's head dim is a
   power of two, so 192 runs in 256-wide tiles); cuDNN's the same for it; flashtile against cuDNN at
   128/128 and 256/256 is the gap at equal widths.
2. ``forward``: candidate (block_q, block_k, warps, stages, TMA) settings at 192/128, 2k and 8k, each
   output compared with the default settings' before it is timed.
3. ``backward``: candidate dK/dV settings (dQ at the default), then dQ settings (dK/dV at the best), TMA
   on (where the layout allows) and off, at 8k, each gradient compared with the default settings'; the best three
   again at 2k beside the default.
4. ``forward-128-64``: the same as 2 at 128/64.

Forward: ``kernels.forward.flash_attention`` under no_grad with block_q, block_k, num_warps, num_stages,
tma; backward: ``kernels.backward.flash_attention_backward`` with config= and tma=. SDPA through
``o.backward(do, retain_graph=True)``. A setting that fails to compile is a row with its error. Stops
adding rows past ``UNEQUAL_BUDGET_S`` seconds (default 300), saying which parts did not run.

    OUT=/some/folder PYTHONPATH=src python bench/probes/head_dims/unequal_configs.py

Writes ``$OUT/unequal-configs.json``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

import flashtile
from flashtile.bench.common import median_ms, save_result
from flashtile.kernels.backward import backward_config, flash_attention_backward
from flashtile.kernels.forward import flash_attention, forward_config

H = 16
SHAPES = {"2k": (8, 2048), "8k": (2, 8192)}
# (block_q, block_k, num_warps, num_stages, tma)
FORWARD = [(128, 64, 8, 2, False), (128, 64, 8, 2, True), (128, 64, 8, 3, False), (128, 64, 8, 3, True),
           (128, 32, 8, 2, False), (128, 32, 8, 3, True), (128, 128, 8, 2, True), (64, 64, 4, 2, False),
           (64, 64, 4, 3, True), (64, 128, 4, 2, True), (128, 64, 4, 2, False), (64, 64, 8, 2, True)]
FORWARD_128_64 = [(128, 128, 8, 3, True), (128, 64, 8, 3, True), (64, 64, 4, 3, True), (128, 128, 8, 2, True),
                  (128, 64, 4, 3, True), (64, 128, 4, 3, True), (128, 128, 8, 4, True), (128, 64, 8, 4, True)]
DKDV = [(64, 64, 8, 2), (64, 64, 8, 1), (64, 64, 8, 3), (32, 64, 4, 2), (64, 64, 4, 2), (64, 128, 8, 2),
        (128, 64, 8, 2), (32, 128, 8, 2), (64, 32, 8, 2)]
DQ = [(128, 64, 8, 1), (128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (128, 128, 8, 1), (64, 64, 8, 2),
      (64, 128, 8, 1)]
BUDGET_S = float(os.environ.get("UNEQUAL_BUDGET_S", "300"))
METHOD = ("triton.testing.do_bench median (warmup 50 ms, rep 200 ms, 25/100 for the searches); forward under "
          "no_grad through kernels.forward.flash_attention with the launch settings; backward through "
          "kernels.backward.flash_attention_backward with config= and tma=; SDPA (cuDNN) and the controls' "
          "flashtile backward through o.backward(do, retain_graph=True); H = 16, bf16, bthd, causal; every "
          "setting's output compared with the default settings'")


def inputs(B, T, d_qk, d_v, seed=0):
    """q, k (B, H, T, d_qk) and v, do (B, H, T, d_v): views of (B, T, H, d) tensors, as a model gives."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda d: torch.randn(B, T, H, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    return make(d_qk), make(d_qk), make(d_v), make(d_v)


def main(out: Path) -> None:
    start = time.time()
    rows, skipped = [], []

    def over_budget(part):
        if time.time() - start > BUDGET_S:
            skipped.append(part)
            print("budget spent, not run:", part, flush=True)
            return True
        return False

    def record(row, fn):
        try:
            row.update(fn())
        except Exception as error:  # noqa: BLE001  (a setting that cannot compile is a result)
            row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
        rows.append(row)
        print({k: v for k, v in row.items() if k not in ("part",)}, flush=True)
        return row

    # 1. controls: flashtile and cuDNN at five width pairs, 8k
    B, T = SHAPES["8k"]
    for d_qk, d_v in ((192, 128), (192, 192), (256, 128), (256, 256), (128, 128)):
        if over_budget(f"controls {d_qk}/{d_v}"):
            continue
        q, k, v, do = inputs(B, T, d_qk, d_v)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        for provider in ("flashtile", "sdpa_cudnn"):
            def timed(provider=provider, q=q, k=k, v=v, do=do, leaves=leaves):
                if provider == "flashtile":
                    call = lambda *a: flashtile.attention(*a, is_causal=True)
                else:
                    def call(*a):
                        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                            return scaled_dot_product_attention(*a, is_causal=True)
                with torch.no_grad():
                    fwd = median_ms(lambda: call(q, k, v))
                o = call(*leaves)
                bwd = median_ms(lambda: o.backward(do, retain_graph=True), grad_to_none=leaves)
                return dict(forward_ms=round(fwd, 4), backward_ms=round(bwd, 4))
            record(dict(part="controls", provider=provider, B=B, T=T, d_qk=d_qk, d_v=d_v), timed)
        del q, k, v, do, leaves

    # 2. forward settings at 192/128 (and 4. at 128/64)
    def forward_search(part, d_qk, d_v, configs):
        for name, (B, T) in SHAPES.items():
            q, k, v, _ = inputs(B, T, d_qk, d_v)
            with torch.no_grad():
                truth = flash_attention(q, k, v, causal=True)[0].float()
            default = forward_config(max(d_qk, d_v), torch.bfloat16, False, True, 4096)
            for config in configs:
                if over_budget(f"{part} {name} {config}"):
                    continue

                def timed(config=config, q=q, k=k, v=v, truth=truth):
                    bq, bk, warps, stages, tma = config
                    fn = lambda: flash_attention(q, k, v, causal=True, block_q=bq, block_k=bk, num_warps=warps,
                                                 num_stages=stages, tma=tma)[0]  # fmt: skip
                    with torch.no_grad():
                        err = (fn().float() - truth).abs().max().item()
                        if err > 0.02:
                            raise AssertionError(f"max |o - default's o| = {err}")
                        return dict(ms=round(median_ms(fn, warmup=25, rep=100), 4), max_diff=err)
                record(dict(part=part, case=name, B=B, T=T, d_qk=d_qk, d_v=d_v, launch=list(config),
                            default=[default[key] for key in ("block_q", "block_k", "num_warps", "num_stages")]
                            + [default["tma"]]), timed)  # fmt: skip

    forward_search("forward", 192, 128, FORWARD)

    # 3. backward settings at 192/128: dK/dV, then dQ, at 8k; then the best three at 2k
    def backward_rows(name, candidates, stage):
        B, T = SHAPES[name]
        q, k, v, do = inputs(B, T, 192, 128)
        o, lse, stats = flash_attention(q, k, v, causal=True, return_stats=True)
        truth = flash_attention_backward(q, k, v, o, lse, do, causal=True, stats=stats)
        done = []
        for config, tma in candidates:
            if over_budget(f"backward {stage} {name} {config} {tma}"):
                continue

            def timed(config=config, tma=tma):
                fn = lambda: flash_attention_backward(q, k, v, o, lse, do, causal=True, stats=stats,
                                                      config=config, tma=tma)  # fmt: skip
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(fn(), truth))
                if err > 0.05:
                    raise AssertionError(f"max |grad - default's grad| = {err}")
                return dict(ms=round(median_ms(fn, warmup=25, rep=100), 4), max_diff=err)
            done.append(record(dict(part="backward", stage=stage, case=name, B=B, T=T, d_qk=192, d_v=128,
                                    dkdv=list(config["dkdv"]), dq=list(config["dq"]), tma=tma), timed))
        return [r for r in done if "ms" in r]

    default = backward_config(192, torch.bfloat16, 8192)
    base = dict(dkdv=default["dkdv"], dq=default["dq"])
    tmas = (True, False)
    found = backward_rows("8k", [(dict(base, dkdv=c), t) for c in DKDV for t in tmas], "dkdv")
    best = min(found, key=lambda r: r["ms"]) if found else dict(dkdv=base["dkdv"], tma=None)
    found += backward_rows("8k", [(dict(dkdv=tuple(best["dkdv"]), dq=c), best["tma"]) for c in DQ], "dq")
    top = sorted(found, key=lambda r: r["ms"])[:3]
    picks = [(dict(dkdv=tuple(r["dkdv"]), dq=tuple(r["dq"])), r["tma"]) for r in top]
    backward_rows("2k", [(base, None), *picks], "confirm")  # None: the default's own TMA choice

    forward_search("forward-128-64", 128, 64, FORWARD_128_64)
    save_result(out / "unequal-configs.json", rows, METHOD, not_run=skipped,
                default_backward={k: list(v) if isinstance(v, tuple) else v for k, v in default.items()})


if __name__ == "__main__":
    main(Path(os.environ.get("OUT", ".")))

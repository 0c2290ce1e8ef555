"""A measured probe, not part of the package: what a program's fixed cost is at D = 128, T = 512.

Two views, both beside cuDNN in the same process:

* ``ablation``: the forward at Tq = 512 (B = 32, H = 16, no mask) against Tk = 64 ... 1024 keys (with
  ``--tq 2048``: B = 8, H = 16, Tk = 128 ... 4096, the 2k cell's 128 x 128 tiles). Time
  grows by a per-key-tile cost; what is left at zero keys (the intercept of a least-squares line) is
  what every program pays once: its launch, the Q load, the pipeline's fill, the epilogue and the
  write of O. The same fit for cuDNN says how much of that a hand-written kernel avoids.
* ``profile``: one call each of flashtile and cuDNN at the standard-sweep shapes where flashtile
  misses (D = 128 at T = 512, both masks, and at 2k without a mask), for Nsight Compute
  (``ncu --profile-from-start off``): warm-up calls run outside the profiled range.

``PYTHONPATH=src python bench/probes/forward/forward_short_t.py ablation OUT.json [--tq 2048]`` /
``ncu --profile-from-start off ... python bench/probes/forward/forward_short_t.py profile`` on an H200.
"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from flashtile.bench.common import attention_tflops, median_ms, save_result
from flashtile.bench.providers import make_inputs
from flashtile.kernels.forward import flash_attention

KEYS = {512: (64, 128, 256, 512, 768, 1024), 2048: (128, 256, 512, 1024, 2048, 3072, 4096)}
BATCH = {512: 32, 2048: 8}  # the standard sweep's batch at that length (H = 16, D = 128)


def shape_of(Tq, Tk, causal, B=32, H=16, D=128):
    return dict(B=B, H=H, H_kv=H, Tq=Tq, Tk=Tk, D=D, causal=causal, layout="bhtd", dtype="bf16")


def calls(shape):
    q, k, v = make_inputs(shape)
    causal = shape["causal"]

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return scaled_dot_product_attention(q, k, v, is_causal=causal)

    return {"flashtile": lambda: flash_attention(q, k, v, causal=causal)[0], "sdpa_cudnn": cudnn}


def fit(points):
    """(intercept, slope) of the least-squares line through (x, y) points."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope


def ablation(out, Tq=512):
    if Tq not in KEYS:
        raise ValueError(f"--tq must be one of {sorted(KEYS)}, got {Tq}")
    rows, fits = [], {}
    step = 64 if Tq == 512 else 128  # the key tile of the setting that runs at this length
    for Tk in KEYS[Tq]:
        shape = shape_of(Tq, Tk, False, B=BATCH[Tq])
        fns = calls(shape)
        truth = fns["sdpa_cudnn"]()
        assert (fns["flashtile"]().float() - truth.float()).abs().max().item() < 0.05
        for provider, fn in fns.items():
            ms = median_ms(fn, warmup=25, rep=100)
            rows.append({"pass": "forward", "provider": provider, **shape, "ms": round(ms, 4),
                         "tflops": round(attention_tflops(shape, ms), 1)})  # fmt: skip
    for provider in ("flashtile", "sdpa_cudnn"):
        points = [(r["Tk"] // step, r["ms"] * 1e3) for r in rows if r["provider"] == provider]
        fits[provider] = dict(zip(("fixed_us", f"us_per_{step}_keys"), (round(x, 2) for x in fit(points))))
        print(provider, fits[provider], [round(y, 1) for _, y in points], flush=True)
    save_result(out, rows, "do_bench median (warmup 25 ms, rep 100 ms, L2 cleared before each repetition); "
                f"Tq = {Tq}, B = {BATCH[Tq]}, H = 16, D = 128, no mask, Tk from {KEYS[Tq][0]} to {KEYS[Tq][-1]}; "
                f"fits: least squares of time against Tk / {step}", fits=fits)  # fmt: skip


def profile():
    for T, causal, B in ((512, False, 32), (512, True, 32), (2048, False, 8)):
        fns = calls(shape_of(T, T, causal, B=B))
        for fn in fns.values():
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    if sys.argv[1] == "ablation":
        ablation(sys.argv[2], int(sys.argv[4]) if sys.argv[3:4] == ["--tq"] else 512)
    else:
        profile()

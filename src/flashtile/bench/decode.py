"""Decode table: split-K decoding against the forward kernel at Tq = 1 and SDPA, in K/V bandwidth.

``python -m flashtile.bench.decode`` writes rows of ``pass: "decode"`` (schema: BENCH_SCHEMA.md) with
``tbps`` = bytes of K and V the call must read (2 · H_kv · sum of lengths · D · 2 bytes, each element
once, whatever the provider actually reads) / median time. The default sweep is the issue's headline:
B = 1, H = 32, H_kv in {32, 8}, D = 128, caches of 8k / 32k / 128k tokens, bf16, contiguous; ``--full``
adds B = 8, 4k caches, paged caches (pages of 16 and 256 keys, in shuffled order) and a ragged batch.

Providers, measured in one process: ``flashtile_split_k`` (``kernels.decode.flash_decode``, called
directly so that the public function's host-side value checks are not timed), ``flashtile`` (the
forward kernel at Tq = 1, to show one program per (b, h) starving the GPU), ``flashtile_attention``
(``flashtile.attention`` with enable_gqa, which routes a call without a gradient to the split-K
kernels), ``sdpa_cudnn`` and ``sdpa_flash`` (with ``enable_gqa``; a backend that refuses a shape gets
``ms: null`` and its reason). Each output is checked against SDPA's default choice before it is timed.

``--windows`` times sliding windows instead (``WINDOWED``, into ``bench/results/sweeps/decode-window.json``):
``flashtile_split_k`` with ``window=(W - 1, 0)``, ``flashtile_attention`` with the same window, and SDPA's
backends on the last W keys of the cache (what an engine that keeps only the window would read); tbps
counts the window's bytes.
"""

from __future__ import annotations

import argparse

import torch

from ..reference.decode import kv_cache_bytes
from .common import RESULTS, clean_l2_ms, graph_ms, save_result

METHOD = (
    "median of CUDA-event times (warmup 50 ms, rep 200 ms), the L2 emptied before every repetition by reading "
    "a 256 MB buffer (bench.common.clean_l2_ms: reading, not do_bench's zeroing, whose dirty lines the timed call "
    "would write back), so the cache is read from HBM each time: ms times the eager call (host work included "
    "where it exceeds the GPU's; every eager time is taken before the first graph is captured), ms_graph one "
    "replay of the call captured in a CUDA graph (the GPU's time alone, as serving engines run decode steps); "
    "bf16; Tq = 1; tbps = 2 * H_kv * sum(lengths) * D * 2 bytes / time (K and V read once)"
)
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
HEADLINE = [dict(B=1, H=32, H_kv=H_kv, Tk=Tk, D=128) for H_kv in (32, 8) for Tk in (8192, 32768, 131072)]
FULL = [
    *HEADLINE,
    *(dict(B=1, H=32, H_kv=H_kv, Tk=4096, D=128) for H_kv in (32, 8)),
    *(dict(B=8, H=32, H_kv=H_kv, Tk=Tk, D=128) for H_kv in (32, 8) for Tk in (4096, 32768)),
    *(dict(B=1, H=32, H_kv=8, Tk=Tk, D=128, page_size=p) for Tk in (32768, 131072) for p in (16, 256)),
    dict(B=8, H=32, H_kv=8, Tk=32768, D=128, ragged=True),
]
WINDOWED = [dict(B=1, H=32, H_kv=8, Tk=Tk, D=128, window=W) for Tk in (32768, 131072) for W in (1024, 4096)]


def make_inputs(shape: dict, seed: int = 0, device="cuda", dtype=torch.bfloat16):
    """q (B, H, 1, D); contiguous caches (B, H_kv, Tk, D); lengths (B,) int32 (random in [Tk/2, Tk] if ragged)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    B, H, H_kv, Tk, D = (shape[n] for n in ("B", "H", "H_kv", "Tk", "D"))
    q = torch.randn(B, H, 1, D, generator=gen, device=device).to(dtype)
    k = torch.randn(B, H_kv, Tk, D, generator=gen, device=device).to(dtype)
    v = torch.randn(B, H_kv, Tk, D, generator=gen, device=device).to(dtype)
    if shape.get("ragged"):
        lengths = torch.randint(Tk // 2, Tk + 1, (B,), generator=gen, device=device, dtype=torch.int32)
    else:
        lengths = torch.full((B,), Tk, device=device, dtype=torch.int32)
    return q, k, v, lengths


def paged(k: torch.Tensor, v: torch.Tensor, page_size: int, seed: int = 0):
    """The caches as a pool of pages in shuffled order, and the block table (B, Tk / page_size) int32."""
    B, H_kv, Tk, D = k.shape
    n = Tk // page_size
    gen = torch.Generator(device=k.device).manual_seed(seed)
    table = torch.randperm(B * n, generator=gen, device=k.device).to(torch.int32).view(B, n)

    def pool(x):
        pages = torch.empty(B * n, H_kv, page_size, D, dtype=x.dtype, device=x.device)
        pages[table.flatten().long()] = x.view(B, H_kv, n, page_size, D).transpose(1, 2).reshape(B * n, H_kv,
                                                                                                  page_size, D)
        return pages

    return pool(k), pool(v), table


def providers(shape: dict, q, k, v, lengths) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..api import attention
    from ..kernels.decode import flash_decode
    from ..kernels.forward import flash_attention

    page_size = shape.get("page_size")
    W = shape.get("window")
    if W:  # a sliding window of W keys: the new token sees the last W
        win = (W - 1, 0)
        fns = {"flashtile_split_k": lambda: flash_decode(q, k, v, lengths, window=win)[0],
               "flashtile_attention": lambda: attention(q, k, v, enable_gqa=True, is_causal=True,
                                                        alignment="lower_right", window=win)}  # fmt: skip
        k_w, v_w = k[:, :, -W:], v[:, :, -W:]
        for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            def run(backend=backend):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k_w, v_w, enable_gqa=True)

            fns[name] = run
        return fns
    if page_size:
        k_pages, v_pages, table = paged(k, v, page_size)
        # SDPA and the forward kernel have no paged cache
        return {"flashtile_split_k": lambda: flash_decode(q, k_pages, v_pages, lengths, block_table=table)[0]}
    fns = {"flashtile_split_k": lambda: flash_decode(q, k, v, lengths)[0]}
    if shape.get("ragged"):
        return fns  # ragged lengths: the other providers would attend to the padding
    fns["flashtile"] = lambda: flash_attention(q, k, v)[0]
    fns["flashtile_attention"] = lambda: attention(q, k, v, enable_gqa=True)  # routed to the split-K kernels

    def pinned(backend):
        def run():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        return run

    fns["sdpa_cudnn"] = pinned(SDPBackend.CUDNN_ATTENTION)
    fns["sdpa_flash"] = pinned(SDPBackend.FLASH_ATTENTION)
    return fns


def expected_output(shape, q, k, v, lengths):
    """SDPA's default backend on each sequence's valid keys (the last ``window`` of them with a window):
    what every provider is checked against."""
    W = shape.get("window")
    if W:
        lengths = lengths.tolist()
        return torch.cat([
            torch.nn.functional.scaled_dot_product_attention(q[b : b + 1], k[b : b + 1, :, max(n - W, 0) : n],
                                                             v[b : b + 1, :, max(n - W, 0) : n], enable_gqa=True)
            for b, n in enumerate(lengths)
        ])  # fmt: skip
    return torch.cat([
        torch.nn.functional.scaled_dot_product_attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n],
                                                         enable_gqa=True)
        for b, n in enumerate(lengths.tolist())
    ])  # fmt: skip


def measure(shape: dict, device="cuda", dtype=torch.bfloat16, clock: str = "both") -> list[dict]:
    """One row per provider for ``shape``; ``device`` and ``dtype`` exist for the CPU test of this module.

    ``clock``: "eager" (ms, tbps), "graph" (ms_graph, tbps_graph) or "both". ``run`` takes every eager
    time before any graph is captured, because eager calls measured after earlier captures in the same
    process ran slower (bench/PERF_LOG.md, decode).
    """
    q, k, v, lengths = make_inputs(shape, device=device, dtype=dtype)
    expected = expected_output(shape, q, k, v, lengths)
    seen = [min(n, shape.get("window") or n) for n in lengths.tolist()]  # a window reads only its keys
    total = kv_cache_bytes(seen, shape["H_kv"], shape["D"], itemsize=q.element_size())
    base = {"pass": "decode", "B": shape["B"], "H": shape["H"], "H_kv": shape["H_kv"], "Tq": 1, "Tk": shape["Tk"],
            "D": shape["D"], "causal": False, "layout": "bhtd", "dtype": DTYPE_NAMES[dtype]}  # Tq = 1 sees every key
    extra = {key: shape[key] for key in ("page_size", "ragged", "window") if key in shape}
    rows = []
    for name, fn in providers(shape, q, k, v, lengths).items():
        row = dict(base, provider=name, **extra)
        try:
            err = (fn().float() - expected.float()).abs().max().item()
            assert err < 5e-2, f"{name} disagrees with SDPA by {err}"
            row.update(max_abs_diff_vs_sdpa=err)
            if clock in ("eager", "both"):
                ms = clean_l2_ms(fn)
                row.update(ms=round(ms, 4), tbps=round(total / (ms * 1e-3) / 1e12, 3))
            if clock in ("graph", "both"):
                try:
                    ms_graph = graph_ms(fn, timer=clean_l2_ms)
                    row.update(ms_graph=round(ms_graph, 4), tbps_graph=round(total / (ms_graph * 1e-3) / 1e12, 3))
                except RuntimeError as exc:  # a provider that cannot be captured keeps its eager time
                    row.update(ms_graph=None, tbps_graph=None, graph_error=str(exc).splitlines()[0][:120])
        except (RuntimeError, AssertionError) as exc:  # a backend that refuses the shape, or runs out of memory
            row.update(ms=None, tbps=None, error=str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__)
        rows.append(row)
        print(f"{name:>18} {shape} {row.get('ms')} ms {row.get('tbps')} TB/s, graphed {row.get('ms_graph')} ms "
              f"{row.get('tbps_graph')} TB/s", flush=True)
    return rows


# --8<-- [start:streaming_fit]
def streaming_fit(
    rows: list[dict], provider: str, H_kv: int, B: int = 1, caches=(32768, 131072)
) -> tuple:
    """(R in TB/s, t0 in µs) of the model t = t0 + bytes / R, through the graphed times
    of two contiguous cache lengths: R is the rate at which a call streams K and V, t0
    what it costs whatever the length."""
    (x1, t1), (x2, t2) = sorted(
        # MB of K and V (bf16), µs
        (kv_cache_bytes([r["Tk"]] * B, H_kv, r["D"], 2) / 1e6, 1000 * r["ms_graph"])
        for r in rows
        if r["provider"] == provider and r["B"] == B and r["H_kv"] == H_kv
        and r["Tk"] in caches and not r.get("page_size") and not r.get("ragged")
    )  # fmt: skip
    us_per_mb = (t2 - t1) / (x2 - x1)  # 1 MB per µs is 1 TB/s
    return 1 / us_per_mb, t1 - us_per_mb * x1
# --8<-- [end:streaming_fit]


def copy_rate(n_bytes: int = 1 << 30) -> dict:
    """The device-to-device copy ceiling: read + write bytes of one copy / time, in TB/s."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = clean_l2_ms(lambda: dst.copy_(src))
    return dict(copy_bytes=2 * n_bytes, copy_ms=round(ms, 4), copy_tbps=round(2 * n_bytes / (ms * 1e-3) / 1e12, 3))


def run(out: str, full: bool = False, windows: bool = False) -> dict:
    shapes = WINDOWED if windows else FULL if full else HEADLINE
    rows = [row for shape in shapes for row in measure(shape, clock="eager")]  # no graph captured yet
    graphed = [row for shape in shapes for row in measure(shape, clock="graph")]
    for row, later in zip(rows, graphed, strict=True):  # the same shapes and providers, in the same order
        row.update({key: value for key, value in later.items() if key.startswith(("ms_graph", "tbps_graph", "graph_"))})
    return save_result(out, rows, METHOD, copy=copy_rate())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashtile.bench.decode", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="default: bench/results/decode.json (sweeps/decode-window.json)")
    parser.add_argument("--full", action="store_true", help="B = 8, 4k caches, paged and ragged rows too")
    parser.add_argument("--windows", action="store_true", help="sliding windows of 1k and 4k keys (WINDOWED)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the benchmarks need a CUDA device")
    default = RESULTS / ("sweeps/decode-window.json" if args.windows else "decode.json")
    run(args.out or str(default), args.full, args.windows)


if __name__ == "__main__":
    main()

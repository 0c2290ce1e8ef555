"""Time ring attention on the GPUs of one host, against single-GPU flashtile.attention.

    python -m flashtile.bench ring --commit abc1234 [--out ring.json] [--T 16384 32768] [--budget-s 200]

Writes ``bench/results/ring.json`` unless ``--out`` says otherwise; ``python hooks/render_tables.py``
then renders the chapter's table from it.

Rows follow the shared benchmark schema with ``pass: "ring"``. Providers: ``flashtile`` is
``flashtile.attention`` on one GPU with the whole sequence (the baseline); ``flashtile_ring`` is
``ring_attention`` with ``world_size`` ranks, one GPU each (world size 1 measures the ring's own
overhead). ``measures`` says what was timed: ``forward`` (under no_grad) or ``forward_backward``.

Method: every timed call starts after a barrier and a device sync and ends at a device sync; the
time of one call is the slowest rank's; the median over the repeats is reported. TFLOP/s counts the
whole attention (4·B·H·T²·D, ×0.5 causal; ×3.5 for forward+backward) over that time, summed over the
GPUs. ``speedup_vs_1gpu`` is the baseline's time over the row's. The output and gradients of the
widest ring are compared with the baseline's (relative Frobenius norm of the difference).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed.local import run_local_ring
from ..distributed.ring import exchange, ring_attention, ring_of, wait
from ..distributed.sharding import shard_sequence, unshard_sequence
from .common import RESULTS, attention_flops


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, reps: int, device: torch.device, everyone: bool = True) -> float:
    """Median over ``reps`` calls (after one warm-up) of the slowest rank's time, in ms.

    everyone=False: only this rank runs ``fn`` (no barrier, no reduction)."""
    times = []
    for i in range(reps + 1):
        if everyone:
            dist.barrier()
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        elapsed = torch.tensor([time.perf_counter() - start], device=device)
        if everyone:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i > 0:
            times.append(1000 * elapsed.item())
    return statistics.median(times)


# What a row measures -> the FLOP convention's mode (``common.attention_flops``: x3.5 for forward + backward).
MODES = {"forward": "fwd", "forward_backward": "fwd+bwd"}


def forward_and_backward(fn, q, k, v, do):
    """A closure running fn forward and backward, clearing the gradients first."""

    def run():
        for x in (q, k, v):
            x.grad = None
        fn(q, k, v).backward(do)

    return run


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bench_shape(rank, world_size, device, solo, shape, dtype, torch_cp: bool = False) -> list[dict]:
    """Every provider at one shape; rows on rank 0, [] elsewhere."""
    from ..api import attention

    B, H, H_kv, T, D, causal, reps = shape
    gen = torch.Generator(device=device).manual_seed(T + causal)  # the same tensors on every rank
    q = torch.randn(B, H, T, D, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(B, H_kv, T, D, device=device, dtype=dtype, generator=gen) for _ in range(2))
    do = torch.randn(B, H, T, D, device=device, dtype=dtype, generator=gen)
    single = lambda q, k, v: attention(q, k, v, is_causal=causal, enable_gqa=H_kv != H)
    solo_ring = lambda q, k, v: ring_attention(q, k, v, is_causal=causal, group=solo)
    ring = lambda q, k, v: ring_attention(q, k, v, is_causal=causal)
    times = {}
    if rank == 0:  # one GPU: the baseline, and the ring machinery with world size 1
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with torch.no_grad():
            times["flashtile", 1, "forward"] = timed(lambda: single(q, k, v), reps, device, False)
            times["flashtile_ring", 1, "forward"] = timed(lambda: solo_ring(q, k, v), reps, device, False)
        for name, fn in (("flashtile", single), ("flashtile_ring", solo_ring)):
            times[name, 1, "forward_backward"] = timed(forward_and_backward(fn, *leaves, do), reps, device, False)
        for x in leaves:
            x.grad = None
        o = single(*leaves)
        o.backward(do)
        reference = [o.detach(), *(x.grad for x in leaves)]
    dist.barrier()
    full = (q, k, v, do)
    q, k, v, do = (shard_sequence(x, world_size, rank, causal) for x in full)
    with torch.no_grad():
        times["flashtile_ring", world_size, "forward"] = timed(lambda: ring(q, k, v), reps, device)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    fwd_bwd = forward_and_backward(ring, *leaves, do)
    times["flashtile_ring", world_size, "forward_backward"] = timed(fwd_bwd, reps, device)
    for x in leaves:
        x.grad = None
    o = ring(*leaves)
    o.backward(do)
    gathered = []
    for x in (o.detach(), *(x.grad for x in leaves)):
        parts = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(parts, x.contiguous())
        gathered.append(unshard_sequence(parts, causal))
    failures = {}  # provider -> the first line of its error
    if torch_cp and device.type == "cuda":
        failures = torch_context_parallel_times(rank, world_size, device, full, causal, reps, times)
    if rank != 0:
        return []
    errors = {name: float(f"{rel(g, r):.3g}") for name, g, r in zip(("o", "dq", "dk", "dv"), gathered, reference)}
    shape_of = dict(B=B, H=H, Tq=T, Tk=T, D=D, causal=causal)
    rows = []
    for (provider, world, measures), ms in times.items():
        baseline = "sdpa" if provider in TORCH_CP_PROVIDERS else "flashtile"
        rows.append({
            "pass": "ring", "provider": provider, "measures": measures, "world_size": world,
            "B": B, "H": H, "H_kv": H_kv, "Tq": T, "Tk": T, "D": D, "causal": causal, "layout": "bhtd",
            "dtype": {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype],
            "ms": None if ms is None else round(ms, 3),
            "tflops": None if ms is None else round(attention_flops(shape_of, MODES[measures]) / ms / 1e9, 1),
            "speedup_vs_1gpu": None if ms is None else round(times[baseline, 1, measures] / ms, 3),
        })  # fmt: skip
        if ms is None:
            rows[-1]["error"] = failures[provider]
        if provider in TORCH_CP_PROVIDERS:
            rows[-1]["baseline"] = "sdpa flash backend on one GPU (provider sdpa)"
        if provider == "flashtile_ring" and world == world_size:
            rows[-1]["rel_err_vs_1gpu"] = errors
    print(f"H={H} T={T} causal={causal}: "
          + ", ".join(f"{p}/{w}/{m} {ms:.2f} ms" if ms is not None else f"{p}/{w}/{m} failed"
                      for (p, w, m), ms in times.items()),
          f"errors {errors}", flush=True)  # fmt: skip
    return rows


TORCH_CP_PROVIDERS = ("torch_cp_allgather", "torch_cp_alltoall")


def torch_context_parallel_times(rank, world_size, device, full, causal: bool, reps: int, times: dict) -> dict:
    """PyTorch's own context parallelism (torch.distributed.tensor.experimental.context_parallel) on the
    same tensors, with SDPA's flash backend, for both of its K/V rotation methods; and that backend on one
    GPU with the whole sequence (provider ``sdpa``, its baseline). Adds to ``times``; returns
    {provider: error} for the methods that failed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    failures = {}
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        if rank == 0:
            leaves = [x.clone().requires_grad_() for x in full[:3]]
            with torch.no_grad():
                times["sdpa", 1, "forward"] = timed(lambda: sdpa(*full[:3]), reps, device, False)
            times["sdpa", 1, "forward_backward"] = timed(forward_and_backward(sdpa, *leaves, full[3]), reps, device,
                                                         False)  # fmt: skip
        dist.barrier()
        mesh = init_device_mesh(device.type, (world_size,))
        for provider, method in zip(TORCH_CP_PROVIDERS, ("allgather", "alltoall"), strict=True):
            buffers = [x.clone() for x in full]  # context_parallel shards these in place
            balanced = _cp_options.enable_load_balance
            try:
                set_rotate_method(method)
                _cp_options.enable_load_balance = causal  # its head-tail balancing refuses non-causal attention
                with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 4, no_restore_buffers=set(buffers)):
                    shards, do = buffers[:3], buffers[3]  # this rank's shards now
                    with torch.no_grad():
                        times[provider, world_size, "forward"] = timed(lambda s=shards: sdpa(*s), reps, device)
                    leaves = [x.detach().requires_grad_() for x in shards]
                    times[provider, world_size, "forward_backward"] = timed(forward_and_backward(sdpa, *leaves, do),
                                                                           reps, device)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - recorded, and the other providers' rows still count
                failures[provider] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
                print(f"{provider} failed: {failures[provider]}", flush=True)
                for measures in ("forward", "forward_backward"):  # a row each, with the error
                    times[provider, world_size, measures] = None
            finally:
                _cp_options.enable_load_balance = balanced
            dist.barrier()
    return failures


def ring_bandwidth(device, n_bytes: int, reps: int = 5) -> float:
    """GB/s one rank sends to the next while receiving from the previous: the ring's transfer rate."""
    ring = ring_of(None)
    send = torch.ones(n_bytes // 2, dtype=torch.bfloat16, device=device)
    recv = torch.empty_like(send)
    ms = timed(lambda: wait(exchange(ring, [send], [recv])), reps, device)
    return n_bytes / (ms * 1e-3) / 1e9


def bench_worker(rank, world_size, shapes, budget_s, dtype=torch.bfloat16, partial_path=None, torch_cp=False):
    """Runs on every rank. Rank 0 returns {"rows", "ring_GBps"}, and after every shape writes the rows so
    far to ``partial_path`` (if given), so that a run cut short keeps what it measured; the others return None."""
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    solo = dist.new_group([0])  # rank 0 alone: the single-GPU runs
    bandwidth = ring_bandwidth(device, 2**28 if device.type == "cuda" else 2**20)
    start, rows = time.monotonic(), []
    for shape in shapes:
        go = torch.tensor([time.monotonic() - start < budget_s], device=device)
        dist.broadcast(go, 0)  # rank 0 decides, so every rank stops at the same shape
        if not go.item():
            break
        rows += bench_shape(rank, world_size, device, solo, shape, dtype, torch_cp)
        if rank == 0 and partial_path:
            Path(partial_path).write_text(json.dumps({"ring_GBps": round(bandwidth, 1), "rows": rows}, indent=1))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows, "ring_GBps": round(bandwidth, 1)} if rank == 0 else None


def provenance(commit: str) -> dict:
    import triton

    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl := torch.cuda.nccl.version(), tuple) else str(nccl),
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit,
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE",)},
        "method": (
            "python -m flashtile.bench ring; each timed call between a barrier+device sync and a device "
            "sync, slowest rank, median of the repeats after one warm-up; bf16; TFLOP/s = 4*B*H*T*T*D "
            "(x0.5 causal, x3.5 forward+backward) / time, summed over GPUs; speedup_vs_1gpu = time of "
            "flashtile.attention on one GPU with the whole sequence / time of the row"
        ),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "ring.json"), help="where to write the JSON")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--T", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--H", type=int, nargs="+", default=[16])
    parser.add_argument("--D", type=int, default=128)
    parser.add_argument("--extra", type=int, nargs=2, action="append", default=[], metavar=("H", "T"),
                        help="one more (H, T) after the sweep; repeatable")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=200.0, help="start no new shape after this long")
    parser.add_argument("--torch-cp", action="store_true",
                        help="also time PyTorch's context_parallel with SDPA's flash backend (CUDA only; what "
                             "its runs gave: bench/PERF_LOG.md, the two-GPU ring sweep, and sweeps/ring-torch-cp.json)")
    parser.add_argument("--cpu-smoke", action="store_true", help="gloo on CPU, fp32, to check the script runs")
    args = parser.parse_args(argv)
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off on shared hosts
    reps = lambda T: 10 if T <= 32768 else 5 if T <= 65536 else 3
    shapes = [(1, H, H, T, args.D, causal, reps(T)) for H in args.H for T in args.T for causal in (False, True)]
    shapes += [(1, H, H, T, args.D, causal, reps(T)) for H, T in args.extra for causal in (False, True)]
    backend, dtype = ("gloo", torch.float32) if args.cpu_smoke else ("nccl", torch.bfloat16)
    partial = str(Path(args.out).with_suffix(".partial.json"))
    measured = run_local_ring(bench_worker, args.world_size, shapes, args.budget_s, dtype, partial, args.torch_cp,
                              backend=backend, timeout_s=args.budget_s + 150)[0]  # fmt: skip
    meta = provenance(args.commit) if not args.cpu_smoke else {"cpu_smoke": True}
    meta["ring_GBps"] = measured["ring_GBps"]  # measured at start: 256 MiB sent to the next rank while receiving
    rows = measured["rows"]
    result = {"provenance": meta, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()

"""Take one two-rank ring forward apart: what each of its parts costs on its own.

    python -m flashtile.bench ring_parts --commit abc1234 [--out parts.json] [--H 16 32] [--T 32768]
    python -m flashtile.bench ring_parts --out parts.json --cpu-smoke      # gloo on CPU: the script runs

Writes ``bench/results/sweeps/ring-parts.json`` unless ``--out`` says otherwise.

Two ranks (one GPU each, NCCL; or gloo on CPU with ``--cpu-smoke``). For each shape, causal and not,
every part below is timed as ``ring.timed`` times the ring (after a barrier and a device sync, to a
device sync; the slowest rank; the median), with no autograd:

- ``1gpu_full``: the local attention on the whole sequence (each rank, its own device): the baseline;
- ``ring`` and ``ring_nocheck``: ``ring_attention`` with ``check_shards`` True and False;
- ``step0_kernel``: the rank's own shard (step 0's plan), alone;
- ``step1_kernel``: the visiting shard's plan (``step1_query_rows``, ``step1_key_rows``), alone;
- ``merge``: step 1's partial merged into step 0's result;
- ``exchange_kv``: K and V sent to the next rank and received from the previous one, alone;
- ``step0_with_exchange``: step 0's kernel while K and V travel (what the ring does);
- ``check_shards``: the shape check alone.

Rows follow the shared benchmark schema (``pass: "ring"``, ``measures: "forward:<part>"``); TFLOP/s is
the part's own attention arithmetic over its time, null for the parts that do none.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from ..distributed.local import run_local_ring
from ..distributed.ring import (
    check_shards_agree,
    exchange,
    local_forward,
    merge_into,
    ring_attention,
    ring_of,
    step_plan,
    wait,
)
from ..distributed.sharding import shard_sequence
from .common import RESULTS
from .ring import provenance, sync, timed

WORLD = 2  # the parts are those of a two-rank ring: one step with the rank's own keys, one with the visitor's


def block_flops(H: int, rows: int, keys: int, D: int, causal: bool) -> float:
    """4 * H * rows * keys * D, halved for a causal square block (B = 1)."""
    return 4 * H * rows * keys * D * (0.5 if causal else 1.0)


def span(rows: slice, length: int) -> int:
    return len(range(*rows.indices(length)))


def part_times(q, k, v, full, causal: bool, scale: float, reps: int, device) -> dict:
    """Every part's median time in ms on this rank, and step 1's plan; all ranks call it together."""
    ring = ring_of(None)
    T_local = q.shape[2]
    own = step_plan(ring.rank, ring.rank, T_local, causal)
    visit = step_plan(ring.rank, (ring.rank - 1) % ring.world, T_local, causal)
    o, lse = local_forward(q, k, v, own.causal, scale)
    o_part, lse_part = local_forward(q[..., visit.q_rows, :], k[..., visit.k_rows, :], v[..., visit.k_rows, :],
                                     visit.causal, scale)  # fmt: skip

    def exchange_kv():
        k_next, v_next = torch.empty_like(k), torch.empty_like(v)
        wait(exchange(ring, [k, v], [k_next, v_next]))

    def step0_with_exchange():
        k_next, v_next = torch.empty_like(k), torch.empty_like(v)
        requests = exchange(ring, [k, v], [k_next, v_next])
        local_forward(q, k, v, own.causal, scale)
        wait(requests)

    parts = {
        "1gpu_full": lambda: local_forward(*full, causal, scale),
        "ring": lambda: ring_attention(q, k, v, is_causal=causal, scale=scale),
        "ring_nocheck": lambda: ring_attention(q, k, v, is_causal=causal, scale=scale, check_shards=False),
        "step0_kernel": lambda: local_forward(q, k, v, own.causal, scale),
        "step1_kernel": lambda: local_forward(q[..., visit.q_rows, :], k[..., visit.k_rows, :],
                                              v[..., visit.k_rows, :], visit.causal, scale),  # fmt: skip
        "merge": lambda: merge_into(o[..., visit.q_rows, :], lse[..., visit.q_rows], o_part, lse_part),
        "exchange_kv": exchange_kv,
        "step0_with_exchange": step0_with_exchange,
        "check_shards": lambda: check_shards_agree(q, k, is_causal=causal, scale=scale, ring=ring),
    }
    with torch.no_grad():
        times = {name: timed(fn, reps, device) for name, fn in parts.items()}
    sync(device)
    return times, own, visit


def parts_worker(rank, world_size, shapes, dtype):
    """Runs on both ranks; rank 0 returns the rows."""
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    rows = []
    for H, T, D, causal, reps in shapes:
        generator = torch.Generator(device=device).manual_seed(T + H)
        full = [torch.randn(1, H, T, D, device=device, dtype=dtype, generator=generator) for _ in range(3)]
        q, k, v = (shard_sequence(x, world_size, rank, is_causal=causal).contiguous() for x in full)
        scale = D**-0.5
        times, own, visit = part_times(q, k, v, full, causal, scale, reps, device)
        T_local = T // world_size
        rows_1, keys_1 = span(visit.q_rows, T_local), span(visit.k_rows, T_local)
        arithmetic = {
            "1gpu_full": block_flops(H, T, T, D, causal),
            "ring": block_flops(H, T, T, D, causal),
            "ring_nocheck": block_flops(H, T, T, D, causal),
            "step0_kernel": block_flops(H, T_local, T_local, D, own.causal),
            "step0_with_exchange": block_flops(H, T_local, T_local, D, own.causal),
            "step1_kernel": block_flops(H, rows_1, keys_1, D, visit.causal),
        }
        for name, ms in times.items():
            row = {"pass": "ring", "provider": "flashtile" if name == "1gpu_full" else "flashtile_ring",
                   "measures": f"forward:{name}", "world_size": 1 if name == "1gpu_full" else world_size,
                   "B": 1, "H": H, "H_kv": H, "Tq": T, "Tk": T, "D": D, "causal": causal, "layout": "bhtd",
                   "dtype": str(dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float32", "fp32"),
                   "ms": round(ms, 4)}  # fmt: skip
            flops = arithmetic.get(name)
            row["tflops"] = round(flops / (ms * 1e-3) / 1e12, 1) if flops else None
            if name.startswith("ring"):
                row["speedup_vs_1gpu"] = round(times["1gpu_full"] / ms, 3)
            if name == "step1_kernel":
                row["step1_query_rows"], row["step1_key_rows"] = rows_1, keys_1
            rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows if rank == 0 else None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "sweeps" / "ring-parts.json"), help="where to write the JSON")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--T", type=int, nargs="+", default=[32768])
    parser.add_argument("--H", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--D", type=int, default=128)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--cpu-smoke", action="store_true", help="gloo on CPU, fp32, small shapes allowed")
    args = parser.parse_args(argv)
    if any(T % (2 * WORLD) for T in args.T):
        parser.error(f"every --T must be a multiple of {2 * WORLD} (the zig-zag layout of {WORLD} ranks)")
    shapes = [(H, T, args.D, causal, args.reps) for H in args.H for T in args.T for causal in (True, False)]
    backend, dtype = ("gloo", torch.float32) if args.cpu_smoke else ("nccl", torch.bfloat16)
    rows = run_local_ring(parts_worker, WORLD, shapes, dtype, backend=backend, timeout_s=600)[0]
    meta = provenance(args.commit) if not args.cpu_smoke else {"cpu_smoke": True}
    meta["method"] = (
        "python -m flashtile.bench ring_parts: two ranks; each part of one ring forward timed alone, no autograd, "
        "between a barrier+device sync and a device sync, slowest rank, median of the repeats after one warm-up; "
        "tflops = the part's own attention arithmetic (4*H*rows*keys*D, x0.5 for a causal square block) / time"
    )
    with open(args.out, "w") as f:
        json.dump({"provenance": meta, "rows": rows}, f, indent=1)
    print(f"wrote {len(rows)} rows to {args.out}")
    for row in rows:
        print(f"H={row['H']} T={row['Tq']} causal={row['causal']} {row['measures']:>30} {row['ms']:9.3f} ms")


if __name__ == "__main__":
    main()

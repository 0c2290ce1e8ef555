"""A ring on one machine: W processes joined by a process group over loopback, with a time limit.

The tests and the ring attention chapter run ``ring_attention`` for real with this: with gloo on CPUs,
and with NCCL on the GPUs of one host (one process per GPU, NVLink multicast left off). Each
process is started fresh (the "spawn" method: no state is inherited), talks only to 127.0.0.1, and is
killed if the whole run has not finished within ``timeout_s``, so a schedule that deadlocks fails
instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank raised; the message holds its traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, backend, fn, args, result_dir, timeout_s):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "gloo":
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    else:
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on shared hosts
        torch.cuda.set_device(rank)
    torch.set_num_threads(1)  # W processes share the machine's cores
    path = Path(result_dir) / f"rank{rank}.pt"
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
        try:
            torch.save(("ok", fn(rank, world_size, *args)), path)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        torch.save(("error", traceback.format_exc()), path)


def run_local_ring(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 60.0) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` new processes; their return values in rank order.

    ``backend``: "gloo" (CPU, loopback) or "nccl" (rank r on GPU r). ``fn`` must be importable by name
    (a module-level function), and its arguments and return value picklable (return CPU tensors).
    Raises ``TimeoutError`` (after killing every process) when the run takes longer than ``timeout_s``
    seconds, and ``RankFailed`` with the traceback when a rank raised.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as result_dir:
        port = free_port()
        rank_args = [(r, world_size, port, backend, fn, args, result_dir, timeout_s) for r in range(world_size)]
        procs = [ctx.Process(target=_rank_main, args=a, daemon=True) for a in rank_args]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise TimeoutError(f"ranks {hung} of {world_size} did not finish within {timeout_s} s; killed")
        results = []
        for r in range(world_size):
            path = Path(result_dir) / f"rank{r}.pt"
            if not path.exists():
                raise RankFailed(f"rank {r} exited with code {procs[r].exitcode} and left no result")
            status, value = torch.load(path, weights_only=False)
            if status == "error":
                raise RankFailed(f"rank {r} raised:\n{value}")
            results.append(value)
        return results


# --8<-- [start:on_shards]
def ring_attention_on_shards(
    rank, world_size, q, k, v, do, is_causal=False, scale=None, sinks=None
):
    """Run on every rank of a group: shard the full q, k, v, do, run ring attention
    forward and backward on this rank's shards, and return this rank's (o, dq, dk, dv)
    shards, on the CPU; with ``sinks`` (H,) also this rank's share of their gradient."""
    from .ring import ring_attention
    from .sharding import shard_sequence

    device = (
        f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    )
    q, k, v, do = (
        shard_sequence(x, world_size, rank, is_causal).to(device) for x in (q, k, v, do)
    )
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    if sinks is not None:  # replicated: every rank holds all of them
        sinks = sinks.to(device).requires_grad_()
    o = ring_attention(q, k, v, is_causal=is_causal, scale=scale, sinks=sinks)
    o.backward(do)
    leaves = (q, k, v) if sinks is None else (q, k, v, sinks)
    return tuple(x.cpu() for x in (o.detach(), *(leaf.grad for leaf in leaves)))
# --8<-- [end:on_shards]

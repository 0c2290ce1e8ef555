"""Ring attention: one attention over a sequence sharded across the ranks of a process group.

Each of the W ranks holds a shard of the queries, keys and values (see ``sharding``). The key/value
shards travel around the ring (rank r sends to r + 1 and receives from r - 1), so after W steps every
rank has seen every key once. Each step produces a partial result (o, lse) over the visiting keys,
and ``merge_into`` folds it into the running one with the rescale identity of the online softmax
(``reference.merge.merge_partials``), in fp32 (float64 for float64 inputs). The backward sends the
keys around once more, and the dK, dV accumulated for them travel along and arrive at their owner
after the last step.

Attention sinks (``sinks``, one logit per query head, ``reference.sinks``) join each row once: every
ring step merges keys only, and the sinks are folded into the finished (o, lse) as a partial of their
own (o = 0, lse = sink). The saved lse then holds them, so the backward's steps are unchanged, and each
rank's dsinks is its query rows' share, -sum of e^(sink - lse) D over them.

Status and caveats:

* Supports: fp16, bf16, fp32 on CUDA (flashtile's Triton kernels do the local attention), any float
  dtype on CPU and float64 everywhere (the reference tier); GQA (H a multiple of H_kv; only the H_kv
  key/value heads travel); causal (zig-zag layout) and non-causal (contiguous layout); attention
  sinks, differentiable (the sinks never travel; their gradient on each rank is that rank's share).
* Does not support: cross-attention (query and key shards must hold the same tokens), masks other
  than causal, dropout, uneven shards.
* Every call checks that all ranks hold shards of one shape, dtype and device type, with one is_causal
  and scale, and the same sinks on all of them or none: a small all_gather and, on CUDA, a host sync;
  every rank raises the same ValueError naming what differs. A rank whose arguments fail its own checks
  raises its error, and the others a ValueError naming that rank, instead of waiting for it.
  ``check_shards=False`` skips it.
* Transport is torch.distributed's ``batch_isend_irecv`` (NCCL on GPUs, gloo on CPUs); the transfer
  of the next key/value shard is started before the local attention and waited for after it.
* Measured status: bench/results/ring.json (1.74-2.09x on two H200s from 32k tokens, except the causal
  forward at 32k with 16 heads: 1.64x).
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

import torch
import torch.distributed as dist

from .._checks import (
    FLOAT_DTYPES,
    check_attention_inputs,
    check_causal,
    check_sinks,
    resolve_neg_bits,
    resolve_scale,
)
from .._plans import recall_fact, remember_fact
from ..reference.backward import backward_delta
from ..reference.merge import merge_partials
from ..reference.sinks import merge_sink, sink_gradient
from .sharding import LAYOUTS, layout_for

REFERENCE_BLOCK = 64  # tile size of the reference tier on CPU: any value gives the same result up to rounding


def stats_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 for float64 inputs, else float32: the dtype of lse, of the merge and of the accumulators."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class StepPlan(NamedTuple):
    """One ring step: local query rows ``q_rows`` attend to rows ``k_rows`` of the visiting key shard."""

    q_rows: slice
    k_rows: slice
    causal: bool


# --8<-- [start:plan]
def step_plan(rank: int, source: int, T_local: int, is_causal: bool) -> StepPlan:
    """Which queries of ``rank`` attend to which keys of ``source``'s shard, and whether
    with a mask."""
    everything = slice(0, T_local)
    if not is_causal:
        return StepPlan(everything, everything, False)  # every query sees every key
    # zig-zag: rows [0, c) are chunk `rank`, rows [c, 2c) are chunk 2W - 1 - rank
    c = T_local // 2
    first, second = slice(0, c), slice(c, T_local)
    # own keys: local order is position order, so this is a causal square
    if source == rank:
        return StepPlan(everything, everything, True)
    # key chunk `source` precedes both query chunks; chunk 2W - 1 - source follows both
    if source < rank:
        return StepPlan(everything, first, False)
    # both key chunks lie between query chunk `rank` and 2W - 1 - rank
    return StepPlan(second, everything, False)
# --8<-- [end:plan]


def uses_kernels(q: torch.Tensor) -> bool:
    """The local attention runs flashtile's Triton kernels for CUDA tensors up to fp32, else the reference tier."""
    return q.is_cuda and q.dtype != torch.float64


def local_forward(q, k, v, causal: bool, scale: float):
    """(o, lse) of q against k, v on this device: flashtile's Triton kernel on CUDA, the reference tier
    otherwise (and for float64). lse is natural-log, fp32 (float64 for float64)."""
    if uses_kernels(q):
        from ..kernels.forward import flash_attention

        return flash_attention(q, k, v, causal=causal, scale=scale, alignment="upper_left")
    from ..reference.forward import flash_attention_forward

    c = stats_dtype(q)
    return flash_attention_forward(q.to(c), k.to(c), v.to(c), causal, scale, REFERENCE_BLOCK, REFERENCE_BLOCK)


def local_backward(q, k, v, o, lse, do, *, causal: bool, scale: float):
    """(dq, dk, dv) of one (query rows, key rows) pair, given the *final* o and lse of those query rows."""
    lse = lse.contiguous()
    if uses_kernels(q):
        from ..kernels.backward import flash_attention_backward

        return flash_attention_backward(q, k, v, o, lse.float(), do, causal=causal, scale=scale)
    from ..reference.backward import flash_attention_backward

    c = stats_dtype(q)
    q, k, v, o, lse, do = (t.to(c) for t in (q, k, v, o, lse, do))
    return flash_attention_backward(q, k, v, o, lse, do, causal, scale, REFERENCE_BLOCK, REFERENCE_BLOCK)


# --8<-- [start:steps]
def merge_into(o, lse, o_part, lse_part) -> None:
    """(o, lse) <- their merge with (o_part, lse_part), in place:
    ``kernels.merge.merge_into`` on CUDA (one Triton kernel, a single pass over o where
    the PyTorch formula takes a dozen), the reference tier's ``merge_partials``
    otherwise. Either way the merge is computed in lse's dtype (fp32, or float64 for
    float64 inputs) and rounded once, to o's."""
    if o.is_cuda and lse.dtype == torch.float32:
        from ..kernels import merge as kernel_merge

        kernel_merge.merge_into(o, lse, o_part, lse_part)
    else:
        o_new, lse_new = merge_partials(o, lse, o_part, lse_part)
        o.copy_(o_new)
        lse.copy_(lse_new)


def first_step(q, k, v, plan: StepPlan, scale: float, dtype: torch.dtype):
    """The running (o, lse) after a rank's own keys (step 0's plan covers every row): o
    in ``dtype``, lse in the merge dtype."""
    o, lse = local_forward(
        q, k[..., plan.k_rows, :], v[..., plan.k_rows, :], plan.causal, scale
    )
    return o.to(dtype), lse.to(stats_dtype(q))


def forward_step(q, k, v, o, lse, *, plan: StepPlan, scale: float) -> None:
    """Attend q[plan.q_rows] to the visiting k, v[plan.k_rows] and merge the result into
    (o, lse) in place."""
    rows, keys = plan.q_rows, plan.k_rows
    o_part, lse_part = local_forward(
        q[..., rows, :], k[..., keys, :], v[..., keys, :], plan.causal, scale
    )
    merge_into(o[..., rows, :], lse[..., rows], o_part, lse_part)


def backward_step(
    q, k, v, o, lse, do, *, plan: StepPlan, scale: float, dq, dk, dv
) -> None:
    """Add this step's share of the gradients to dq (local queries) and dk, dv (visiting
    keys) in place.

    o and lse are the final forward results, so exp(S - lse) is the true softmax
    restricted to the visiting keys, and delta = rowsum(dO * O) is the true one: the
    shares add up to the whole gradient.
    """
    rows, keys = plan.q_rows, plan.k_rows
    dq_part, dk_part, dv_part = local_backward(
        q[..., rows, :], k[..., keys, :], v[..., keys, :], o[..., rows, :],
        lse[..., rows], do[..., rows, :], causal=plan.causal, scale=scale,
    )  # fmt: skip
    dq[..., rows, :] += dq_part
    dk[..., keys, :] += dk_part
    dv[..., keys, :] += dv_part
# --8<-- [end:steps]


# --8<-- [start:sinks]
def fold_sinks(o, lse, sinks):
    """(o, lse) over every key, with the sinks joined once: merged as a partial of
    their own, o = 0 and lse = sink (``reference.sinks.merge_sink``), in lse's dtype.
    Unchanged without sinks. After it, o = o * e^(lse - lse') and lse' = log(e^lse +
    e^sink)."""
    if sinks is None:
        return o, lse
    return merge_sink(o, lse, sinks)


def sink_share(sinks, o, lse, do):
    """This rank's share of dsinks: -sum over its rows of e^(sink - lse) D, with the
    final o and the lse that holds the sinks (``reference.sinks.sink_gradient``)."""
    c = lse.dtype
    return sink_gradient(sinks, lse, backward_delta(o.to(c), do.to(c)))
# --8<-- [end:sinks]


def check_simulated_shards(q_shards, k_shards, v_shards, do_shards, sinks, *, is_causal, scale):
    """``simulate_ring``'s arguments checked as ``ring_attention`` checks one rank's (``check_ring_call``),
    for every rank, and the ranks' shards of one shape and dtype: (q_shards, k_shards, v_shards, sinks,
    scale) with negative bits and τ resolved."""
    lists = (q_shards, k_shards, v_shards) + (() if do_shards is None else (do_shards,))
    if not all(isinstance(x, (list, tuple)) for x in lists) or not q_shards \
            or len({len(x) for x in lists}) != 1:  # fmt: skip
        raise ValueError(
            "q_shards, k_shards, v_shards (and do_shards) must be non-empty lists of one shard per rank, of "
            f"one length, got lengths {[len(x) if isinstance(x, (list, tuple)) else type(x).__name__ for x in lists]}"
        )
    checked = [check_ring_call(q, k, v, sinks, is_causal=is_causal, scale=scale, layout=None)
               for q, k, v in zip(q_shards, k_shards, v_shards)]  # fmt: skip
    kinds = {(c[0].shape, c[1].shape, c[0].dtype) for c in checked}
    if len(kinds) != 1:
        raise ValueError(f"every rank's shards must have one shape and dtype, got {sorted(map(str, kinds))}")
    if do_shards is not None and any(not isinstance(do, torch.Tensor) or do.shape != c[0].shape
                                     for do, c in zip(do_shards, checked)):  # fmt: skip
        raise ValueError("do_shards must hold one tensor per rank shaped like that rank's query shard")
    q_shards, k_shards, v_shards = ([c[i] for c in checked] for i in range(3))
    return q_shards, k_shards, v_shards, checked[0][3], checked[0][4]


# --8<-- [start:simulate]
def simulate_ring(
    q_shards,
    k_shards,
    v_shards,
    is_causal: bool,
    scale: float | None = None,
    do_shards=None,
    *,
    sinks=None,
):
    """Ring attention for W = len(q_shards) ranks in one process: the same plans and
    steps as ``ring_attention``, with "the shard that arrived from the previous rank"
    replaced by indexing.

    Returns the list of o shards (in the merge dtype), and when ``do_shards`` is given
    also the lists of dq, dk and dv shards, every one of them in rank order, and with
    ``sinks`` the list of each rank's share of dsinks (they sum to dsinks).
    """
    q_shards, k_shards, v_shards, sinks, scale = check_simulated_shards(
        q_shards, k_shards, v_shards, do_shards, sinks, is_causal=is_causal, scale=scale
    )
    world, T_local = len(q_shards), q_shards[0].shape[2]
    outs, lses = [], []
    for rank in range(world):
        o, lse = first_step(
            q_shards[rank], k_shards[rank], v_shards[rank],
            step_plan(rank, rank, T_local, is_causal), scale,
            stats_dtype(q_shards[rank]),
        )  # fmt: skip
        for step in range(1, world):
            source = (rank - step) % world  # step s: the keys that started s ranks back
            plan = step_plan(rank, source, T_local, is_causal)
            forward_step(
                q_shards[rank], k_shards[source], v_shards[source], o, lse,
                plan=plan, scale=scale,
            )  # fmt: skip
        o, lse = fold_sinks(o, lse, sinks)
        outs.append(o)
        lses.append(lse)
    if do_shards is None:
        return outs
    c = stats_dtype(q_shards[0])
    dqs = [torch.zeros(q.shape, dtype=c, device=q.device) for q in q_shards]
    # dks[j]: what rank j's keys receive
    dks = [torch.zeros(k.shape, dtype=c, device=k.device) for k in k_shards]
    dvs = [torch.zeros(k.shape, dtype=c, device=k.device) for k in k_shards]
    for rank in range(world):
        # the o the backward sees is the returned one
        o = outs[rank].to(q_shards[rank].dtype)
        for step in range(world):
            source = (rank - step) % world
            plan = step_plan(rank, source, T_local, is_causal)
            backward_step(
                q_shards[rank], k_shards[source], v_shards[source], o, lses[rank],
                do_shards[rank], plan=plan, scale=scale, dq=dqs[rank],
                dk=dks[source], dv=dvs[source],
            )  # fmt: skip
    if sinks is None:
        return outs, dqs, dks, dvs
    shares = [
        sink_share(sinks, outs[r].to(q_shards[r].dtype), lses[r], do_shards[r])
        for r in range(world)
    ]
    return outs, dqs, dks, dvs, shares
# --8<-- [end:simulate]


class Ring(NamedTuple):
    """This rank's place in the ring: group ranks, and the global ranks of its two neighbours."""

    rank: int
    world: int
    next: int
    prev: int
    group: object


def ring_of(group) -> Ring:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    to_global = (lambda i: i) if group is None else (lambda i: dist.get_global_rank(group, i))
    return Ring(rank, world, to_global((rank + 1) % world), to_global((rank - 1) % world), group)


def exchange(ring: Ring, sends: list, recvs: list) -> list:
    """Start sending each of ``sends`` to the next rank and receiving each of ``recvs`` from the previous one."""
    ops = [dist.P2POp(dist.isend, t, ring.next, ring.group) for t in sends]
    ops += [dist.P2POp(dist.irecv, t, ring.prev, ring.group) for t in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


def wait(requests: list) -> None:
    for request in requests:
        request.wait()


# --8<-- [start:ring_forward]
def ring_forward(q, k, v, *, is_causal: bool, scale: float, ring: Ring, sinks=None):
    """This rank's (o, lse): o in q's dtype, lse in the merge dtype, sinks included.

    With two ranks and no sinks each row is merged once, so o stays in q's dtype and is
    rounded once; otherwise it is kept in the merge dtype and rounded at the end.
    """
    one_merge = ring.world <= 2 and sinks is None
    running = q.dtype if one_merge else stats_dtype(q)
    for step in range(ring.world):
        source = (ring.rank - step) % ring.world
        last = step == ring.world - 1
        if not last:  # start passing the visiting shard on before computing with it
            k_next, v_next = torch.empty_like(k), torch.empty_like(v)
            requests = exchange(ring, [k, v], [k_next, v_next])
        plan = step_plan(ring.rank, source, q.shape[2], is_causal)
        if step == 0:  # the rank's own keys: the running result starts as their partial
            o, lse = first_step(q, k, v, plan, scale, running)
        else:
            forward_step(q, k, v, o, lse, plan=plan, scale=scale)
        if not last:
            wait(requests)
            k, v = k_next, v_next
    o, lse = fold_sinks(o, lse, sinks)  # once, after every key shard
    return o.to(q.dtype), lse
# --8<-- [end:ring_forward]


# --8<-- [start:ring_backward]
def ring_backward(q, k, v, o, lse, do, *, is_causal: bool, scale: float, ring: Ring):
    """(dq, dk, dv) of this rank's shards, in the merge dtype."""
    dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
    kv = torch.stack((k, v))
    # dk, dv summed so far over the ranks the visiting keys have passed through
    dkv = None
    for step in range(ring.world):
        source = (ring.rank - step) % ring.world
        sends, recvs = [], []
        if step < ring.world - 1:  # the keys move on, as in the forward
            kv_next = torch.empty_like(kv)
            sends.append(kv)
            recvs.append(kv_next)
        # the previous step's sums move on with their keys; ours arrive with the new
        # keys
        if step > 0:
            dkv_in = torch.empty_like(dkv)
            sends.append(dkv)
            recvs.append(dkv_in)
        requests = exchange(ring, sends, recvs)
        dkv_mine = torch.zeros((2, *k.shape), dtype=lse.dtype, device=k.device)
        plan = step_plan(ring.rank, source, q.shape[2], is_causal)
        backward_step(
            q, kv[0], kv[1], o, lse, do, plan=plan, scale=scale, dq=dq,
            dk=dkv_mine[0], dv=dkv_mine[1],
        )  # fmt: skip
        wait(requests)
        dkv = dkv_mine if step == 0 else dkv_in.add_(dkv_mine)
        if step < ring.world - 1:
            kv = kv_next
    # one last hop: the sums for the last visitors belong to the next rank
    if ring.world > 1:
        dkv_own = torch.empty_like(dkv)
        wait(exchange(ring, [dkv], [dkv_own]))
        dkv = dkv_own
    return dq, dkv[0], dkv[1]
# --8<-- [end:ring_backward]


class RingAttention(torch.autograd.Function):
    """Saves q, k, v, o and lse of this rank's shard (and the (H,) sinks): O(T / W) memory, never a score
    matrix."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, is_causal, scale, ring):
        o, lse = ring_forward(q, k, v, is_causal=is_causal, scale=scale, ring=ring, sinks=sinks)
        ctx.save_for_backward(q, k, v, o, lse, *([] if sinks is None else [sinks]))
        ctx.config = dict(is_causal=is_causal, scale=scale, ring=ring)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, *sinks = ctx.saved_tensors
        (do,) = resolve_neg_bits(do)  # a negative view's memory holds -do; the kernels and the transfers read memory
        do = do.contiguous()
        # the lse that holds the sinks: exp(S - lse) is each key's share, so the steps are as without them
        dq, dk, dv = ring_backward(q, k, v, o, lse, do, **ctx.config)
        dsinks = sink_share(sinks[0], o, lse, do) if sinks and ctx.needs_input_grad[3] else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None


def check_group(group):
    """The process group to use, or a ValueError saying how to make one."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "ring_attention needs a torch.distributed process group: call torch.distributed.init_process_group "
            "on every rank first (world_size=1 is fine for a single process)"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    return group


DEVICE_TYPES = ("cpu", "cuda")  # a signature's device code: the index here, or len(DEVICE_TYPES) for another


def sinks_digest(sinks) -> int:
    """A CRC-32 of the sinks' bytes (0 without sinks), so that ranks can compare their values in a few ints:
    read from the device once per write of the tensor (``remember_fact``)."""
    if sinks is None:
        return 0
    digest = recall_fact("sinks digest", sinks)
    if digest is None:
        digest = zlib.crc32(sinks.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()) + 1
        remember_fact("sinks digest", sinks, digest)
    return digest


SIGNATURE_LENGTH = 15


def signature_of(q, k, is_causal: bool, scale: float, sinks=None) -> list[int]:
    """What every rank must agree on, as ints: the two shapes, is_causal, the scale's bits, the dtype and the
    device type (query's; check_attention_inputs made key and value match it), the sinks' digest (0 without
    sinks), and a last 0: this rank's arguments passed its own checks (``refused_signature`` has a 1)."""
    scale_bits = struct.unpack("<q", struct.pack("<d", scale))[0]
    device_code = DEVICE_TYPES.index(q.device.type) if q.device.type in DEVICE_TYPES else len(DEVICE_TYPES)
    return [*q.shape, *k.shape, int(is_causal), scale_bits, FLOAT_DTYPES.index(q.dtype), device_code,
            int(sinks is not None), sinks_digest(sinks), 0]  # fmt: skip


def refused_signature() -> list[int]:
    """The signature of a rank whose arguments failed its own checks: zeros and a last 1."""
    return [0] * (SIGNATURE_LENGTH - 1) + [1]


SIGNATURE_FIELDS = ("query shape", "key shape", "is_causal", "scale", "dtype", "device type", "sinks",
                    "sinks' values")  # fmt: skip
SIGNATURE_SPANS = (slice(0, 4), slice(4, 8), slice(8, 9), slice(9, 10), slice(10, 11), slice(11, 12),
                   slice(12, 13), slice(13, 14))  # fmt: skip


def describe_signature(t: list[int]) -> str:
    dtype = str(FLOAT_DTYPES[t[10]]).replace("torch.", "")
    device = DEVICE_TYPES[t[11]] if t[11] < len(DEVICE_TYPES) else "another device type"
    scale = struct.unpack("<d", struct.pack("<q", t[9]))[0]
    sinks = f", with sinks (digest {t[13] - 1:08x})" if t[12] else ""
    return (f"query {tuple(t[:4])}, key {tuple(t[4:8])}, is_causal={bool(t[8])}, scale={scale}, {dtype} on "
            f"{device}{sinks}")


def signature_device(query, ring: Ring) -> torch.device:
    """Where the signatures meet: query's GPU for CUDA shards, the current GPU where the group is NCCL's and
    query is no CUDA tensor (a refused call), the CPU otherwise (gloo)."""
    if isinstance(query, torch.Tensor) and query.is_cuda:
        return query.device
    if dist.get_backend(ring.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_shards_agree(query, key, *, is_causal: bool, scale: float, ring: Ring, sinks=None,
                       refused: Exception | None = None) -> None:  # fmt: skip
    """Every rank must hold shards of one shape, dtype and device type, and call with the same is_causal
    and scale, and the same sinks on every rank or none; and every rank's arguments must pass its own
    checks (``refused``: the error they raised on this rank, or None).

    One all_gather of a few ints, so that every rank sees every other rank's signature and all of them
    raise, instead of some hanging in a transfer that never comes, or aborting inside the transport when
    the byte counts of a transfer differ (shards of two dtypes): a rank whose arguments were refused
    raises its own error, and the others a ValueError naming it.
    """
    mine = refused_signature() if refused is not None else signature_of(query, key, is_causal, scale, sinks)
    device = signature_device(query, ring)
    # One collective into one buffer and one copy back: every extra launch or host read here is paid
    # on every call, before any attention work is queued.
    signature = torch.tensor(mine, dtype=torch.int64).to(device, non_blocking=True)
    everyone = torch.empty(ring.world * len(mine), dtype=torch.int64, device=device)  # flat, as gloo wants it
    # torch 2.13 deprecates all_gather_into_tensor for all_gather_single; 2.11 may have only the former
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_into(everyone, signature, group=ring.group)
    signatures = everyone.view(ring.world, len(mine)).cpu().tolist()
    if refused is not None:
        raise refused
    refusing = [r for r, t in enumerate(signatures) if t[-1]]
    if refusing:
        raise ValueError(
            f"ring_attention: the arguments of rank{'s' if len(refusing) > 1 else ''} "
            f"{', '.join(map(str, refusing))} failed their checks (the error is raised there); every rank "
            "stops with it"
        )
    if any(theirs != signatures[0] for theirs in signatures):
        differ = [f for f, at in zip(SIGNATURE_FIELDS, SIGNATURE_SPANS)
                  if any(t[at] != signatures[0][at] for t in signatures)]  # fmt: skip
        if "sinks" in differ:  # with sinks on some ranks only, their values are not the news
            differ.remove("sinks' values")
        described = "; ".join(f"rank {r}: {describe_signature(t)}" for r, t in enumerate(signatures))
        raise ValueError(
            f"ring_attention was called with a different {', '.join(differ)} on different ranks ({described}): "
            "every rank must hold an equal shard (see shard_sequence) of one dtype on one device type, and use "
            "the same is_causal and scale, and the same sinks on every rank or none"
        )


def check_ring_call(query, key, value, sinks, *, is_causal, scale, layout):
    """One rank's own checks of a ``ring_attention`` call: (query, key, value, sinks, scale) with negative
    bits resolved and τ resolved; raises on bad input, before any communication."""
    # a negative view's memory holds the negated values, and the transfers and kernels
    # read memory
    query, key, value, sinks = resolve_neg_bits(query, key, value, sinks)
    shape = check_attention_inputs(query, key, value, names=("query", "key", "value"))
    check_causal(is_causal, "is_causal")
    sinks = check_sinks(sinks, shape, query)
    expected = layout_for(is_causal)
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} or None, got {layout!r}")
    if layout is not None and layout != expected:
        raise ValueError(
            f"layout={layout!r} does not match is_causal={is_causal}: ring_attention "
            f"expects {expected!r} shards for is_causal={is_causal}; cut them with "
            f"shard_sequence(x, world_size, rank, is_causal={is_causal})"
        )
    if shape.Tq != shape.Tk:
        raise ValueError(
            f"query holds {shape.Tq} tokens but key and value hold {shape.Tk}: ring "
            "attention is self-attention, each rank's query, key and value shards "
            "cover the same tokens"
        )
    if is_causal and shape.Tq % 2 != 0:
        raise ValueError(
            "a zig-zag shard holds 2 equal chunks, so its length must be even, got "
            f"{shape.Tq}"
        )
    return query, key, value, sinks, resolve_scale(scale, shape.D)


# --8<-- [start:ring_attention]
def ring_attention(
    query,
    key,
    value,
    is_causal=False,
    scale=None,
    group=None,
    *,
    sinks=None,
    layout=None,
    check_shards=True,
):
    """Attention over a sequence sharded across the ranks of ``group``; call it on every
    rank.

    Args:
        query: this rank's shard, (B, H, T / W, D). key, value: (B, H_kv, T / W, D), H a
            multiple of H_kv (GQA). Shards as ``shard_sequence(x, W, rank, is_causal)``
            cuts them; any strides.
        is_causal: causal attention over the whole sequence (the shards must be
            zig-zag).
        scale: multiplies Q K^T; defaults to 1/sqrt(D).
        group: the torch.distributed process group (None: the default one, which must
            exist).
        sinks: None or (H,), float32 or query's dtype, on query's device: one logit per
            query head that joins every row's softmax once, with a value of zero, as in
            ``flashtile.attention``; -inf is no sink. The same on every rank (a
            replicated parameter); differentiable: each rank's gradient is its query
            rows' share, and the shares sum to the whole, as a replicated weight's do.
        layout: optional, "zigzag" or "contiguous": states the layout of the shards, and
            must be the one ``shard_sequence`` uses for ``is_causal`` (zig-zag for
            causal, contiguous otherwise).
        check_shards: check that every rank holds shards of one shape, dtype and device
            type and passes the same is_causal and scale, and the same sinks on every
            rank or none, and that every rank's arguments passed its own checks (a small
            all_gather per call).

    Returns:
        This rank's shard of the output, like query, differentiable with respect to
            query, key, value.
    """
    # This rank's own checks first; where a process group exists, every rank then
    # learns whether the others' passed theirs, so that none waits for a transfer
    # from a rank that stopped.
    try:
        query, key, value, sinks, scale = check_ring_call(
            query, key, value, sinks, is_causal=is_causal, scale=scale, layout=layout
        )
        refused = None
    except (TypeError, ValueError) as error:
        refused = error
    try:
        ring = ring_of(check_group(group))
    except (TypeError, ValueError):
        if refused is not None:  # nothing to share it with: this rank's own error first
            raise refused from None
        raise
    if check_shards:
        check_shards_agree(query, key, is_causal=is_causal, scale=scale, ring=ring,
                           sinks=sinks, refused=refused)  # fmt: skip
    elif refused is not None:
        raise refused
    # The key and value shards travel (isend/irecv send dense memory): any layout is
    # taken, as a dense copy where it is not dense already, at every world size alike.
    # The gradients flow back through the copy.
    key, value = key.contiguous(), value.contiguous()
    return RingAttention.apply(query, key, value, sinks, is_causal, scale, ring)
# --8<-- [end:ring_attention]

"""Inputs and the float64 truth for the ring tests.

The truth is the suite's one float64 formula, tests/_truth.py (einsum and torch.softmax, no import from
flashtile), so a bug shared by the ring and the reference tier cannot hide in it; this module only
adapts it to the ring tests' shape of call and draws their inputs. With sinks the truth is the same
dense softmax with one more column per row, the sink's, whose value is zero (``sink_attention_truth``,
written here from the definition).
"""

from __future__ import annotations

import math
import sys

import torch

from tests._truth import truth_with_grads


def attention_truth(q, k, v, do, is_causal: bool, scale: float | None = None):
    """(o, dq, dk, dv) in float64 for q (B, H, T, D), k, v (B, H_kv, T, D), do like q."""
    o, _lse, (dq, dk, dv) = truth_with_grads(q, k, v, do, is_causal, scale)
    return o, dq, dk, dv


def sink_attention_truth(q, k, v, do, sinks, is_causal: bool, scale: float | None = None):
    """(o, dq, dk, dv, dsinks) in float64 for q (B, H, T, D), k, v (B, H_kv, T, D), sinks (H,): the row
    softmax over the visible keys and the sink's column (score: the sink, after the scale; value: zero),
    the gradients by torch autograd. Query head h reads key/value head h // (H // H_kv)."""
    q, k, v, sinks = (x.detach().double().cpu().requires_grad_() for x in (q, k, v, sinks))
    group = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    tau = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = tau * torch.einsum("bhid,bhjd->bhij", q, keys)
    if is_causal:
        T = q.shape[2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    column = sinks[None, :, None, None].expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1]  # the sink's share dropped
    o = torch.einsum("bhij,bhjd->bhid", p, values)
    grads = torch.autograd.grad(o, (q, k, v, sinks), do.detach().double().cpu())
    return (o.detach(), *grads)


def random_qkv(B, H, H_kv, T, D, seed, dtype=torch.float64):
    """q, k, v, do drawn from one seeded generator (never zeros)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=gen, dtype=dtype)
    k = torch.randn(B, H_kv, T, D, generator=gen, dtype=dtype)
    v = torch.randn(B, H_kv, T, D, generator=gen, dtype=dtype)
    do = torch.randn(B, H, T, D, generator=gen, dtype=dtype)
    return q, k, v, do


def run_ring_from_the_tests(worker, world_size: int, *args, **kwargs):
    """``flashtile.distributed.run_local_ring`` for a worker defined in a test module.

    The ranks are started fresh ("spawn") with this process's ``sys.path``, and unpickle ``worker`` by its
    module's full name (``tests.distributed.test_ring_gloo``). The test session has no entry for the
    repository on its path (``tests/conftest.py``), so the repository root goes first on the path while the
    ranks run, for them to import ``tests``, and is taken off again before this returns."""
    from flashtile.distributed import run_local_ring
    from tests._imports import REPO

    saved = sys.path.copy()
    sys.path.insert(0, str(REPO))
    try:
        return run_local_ring(worker, world_size, *args, **kwargs)
    finally:
        sys.path[:] = saved

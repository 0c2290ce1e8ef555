"""Unequal head dims: q and k are d_qk wide, v and o are d_v wide (DeepSeek's MLA prefill: 192 and 128).

Nothing in attention ties the two widths. S = tau Q K^T contracts over d_qk, and O = P V carries V's
d_v; P is (Tq, Tk) whatever either is. Through the tiled forward, the scores, m and l do not see d_v,
and acc, O are d_v wide. Through the backward, D = rowsum(dO * O) sums over d_v, dP = dO V^T contracts
over d_v, dV = P^T dO is d_v wide, and dQ = tau dS K, dK = tau dS^T Q are d_qk wide. The default scale
1/sqrt(d_qk) normalises the dot product q . k, so it takes d_qk.

Per kept (query, key) pair the matmuls cost 2 d_qk FLOPs for S and 2 d_v for O = P V in the forward,
and 2 d_qk (S again), 2 d_v (dP), 2 d_v (dV), 2 d_qk (dQ) and 2 d_qk (dK) in the backward
(``head_dim_flops``). Padding v from d_v to d_qk, what a kernel that accepts only one width forces,
pays d_qk - d_v of every d_v-wide term for columns that are then dropped.
"""

from __future__ import annotations

import torch

from .._checks import (
    MAX_HEAD_DIM,
    AttentionShape,
    check_attention_inputs,
    check_int,
    check_same,
    check_tensor,
    check_values_in_memory,
)


def check_head_dims(q, k, v) -> tuple[AttentionShape, int]:
    """q (B, H, Tq, d_qk), k (B, H_kv, Tk, d_qk), v (B, H_kv, Tk, d_v) with 1 <= d_v <= 256.

    q and k are checked as every attention call checks them; v must match k in every dim but the last,
    and share q's dtype and device. Returns (the sizes with D = d_qk, d_v).
    """
    shape = check_attention_inputs(q, k, k)  # q and k as always; v on its own below
    check_tensor("v", v, rank=4)
    check_same("v", v, "q", q)
    check_values_in_memory("v", v)
    if tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise ValueError(
            f"v must have the same shape as k {tuple(k.shape)} in every dim but the last (the value head dim "
            f"d_v may differ), got {tuple(v.shape)}"
        )
    d_v = v.shape[-1]
    if not 1 <= d_v <= MAX_HEAD_DIM:
        raise ValueError(f"v has head dim d_v = {d_v}; flashtile supports value head dims 1 to {MAX_HEAD_DIM}")
    return shape, d_v


def check_output_like(name: str, x, q: torch.Tensor, d_v: int) -> torch.Tensor:
    """x (o or do) is (B, H, Tq, d_v): q's shape with v's head dim, in q's dtype on q's device."""
    check_tensor(name, x, dtypes=None)
    check_same(name, x, "q", q)
    check_values_in_memory(name, x)
    expected = (*q.shape[:-1], d_v)
    if tuple(x.shape) != expected:
        raise ValueError(f"{name} must have shape (B, H, Tq, d_v) = {expected}, got {tuple(x.shape)}")
    return x


# --8<-- [start:flops]
def head_dim_flops(pairs: int, d_qk: int, d_v: int) -> tuple[int, int]:
    """Matmul FLOPs (forward, backward) over ``pairs`` kept (query, key) pairs.

    forward:  S = tau Q K^T (2 d_qk), O = P V (2 d_v);
    backward: S again (2 d_qk), dP = dO V^T (2 d_v), dV = P^T dO (2 d_v),
              dQ = tau dS K (2 d_qk), dK = tau dS^T Q (2 d_qk).
    """
    pairs = check_int("pairs", pairs, minimum=0)
    d_qk, d_v = check_int("d_qk", d_qk), check_int("d_v", d_v)
    forward = pairs * (2 * d_qk + 2 * d_v)
    backward = pairs * (3 * 2 * d_qk + 2 * 2 * d_v)
    return forward, backward
# --8<-- [end:flops]

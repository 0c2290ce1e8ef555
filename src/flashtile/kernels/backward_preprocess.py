"""The backward's first kernel, delta = rowsum(dO * O), and the tile loader the backward kernels share.

The paper calls rowsum(dO * O) D; in code it is ``delta`` so it cannot be confused with the head dim
(``head_dim`` / ``HEAD_DIM`` here). It is one float32 number per query row, computed once up front so
that neither the dK/dV kernel nor the dQ kernel has to read O: both only need delta[i].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def load_tile(ptr, stride_t, stride_d, rows, cols, n_rows, head_dim):
    """Load the (len(rows), len(cols)) tile ptr[rows, cols], zero outside [0, n_rows) x [0, head_dim).

    ``ptr`` already points at the (batch, head) slice. Rows and columns are widened to int64 before
    they meet a stride: row * stride_t, or col * stride_d when the head dim is an outer axis of the
    storage, overflows int32 once a tensor passes 2**31 elements.
    """
    offsets = rows.to(tl.int64)[:, None] * stride_t + cols.to(tl.int64)[None, :] * stride_d
    mask = (rows[:, None] < n_rows) & (cols[None, :] < head_dim)
    return tl.load(ptr + offsets, mask=mask, other=0.0)


@triton.jit
def store_tile(ptr, stride_t, stride_d, rows, cols, n_rows, head_dim, value):
    """Store ``value`` into ptr[rows, cols] inside [0, n_rows) x [0, head_dim), cast to ptr's dtype."""
    offsets = rows.to(tl.int64)[:, None] * stride_t + cols.to(tl.int64)[None, :] * stride_d
    mask = (rows[:, None] < n_rows) & (cols[None, :] < head_dim)
    tl.store(ptr + offsets, value.to(ptr.dtype.element_ty), mask=mask)


# --8<-- [start:preprocess]
@triton.jit
def backward_preprocess_kernel(
    O, DO, DELTA,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_dob, stride_doh, stride_dot, stride_dod,
    H, Tq, head_dim,
    BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """One program per (query tile, batch * head): delta[b, h, i] = sum_d dO[i, d] * O[i, d] in fp32."""
    q_tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64 so b * stride_b cannot overflow
    b = bh // H
    h = bh % H
    rows = q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    cols = tl.arange(0, HEAD_DIM)
    o = load_tile(O + b * stride_ob + h * stride_oh, stride_ot, stride_od, rows, cols, Tq, head_dim)
    do = load_tile(DO + b * stride_dob + h * stride_doh, stride_dot, stride_dod, rows, cols, Tq, head_dim)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # padded columns are 0 in both
    tl.store(DELTA + bh * Tq + rows, delta, mask=rows < Tq)
# --8<-- [end:preprocess]


def backward_preprocess(o: torch.Tensor, do: torch.Tensor, block_q: int, head_dim_padded: int) -> torch.Tensor:
    """delta = rowsum(dO * O): (B, H, Tq) float32, contiguous. o and do are (B, H, Tq, D), any strides."""
    B, H, Tq, D = o.shape
    delta = torch.empty((B, H, Tq), dtype=torch.float32, device=o.device)
    grid = (triton.cdiv(Tq, block_q), B * H)
    backward_preprocess_kernel[grid](
        o, do, delta, *o.stride(), *do.stride(), H, Tq, D, BLOCK_Q=block_q, HEAD_DIM=head_dim_padded
    )
    return delta

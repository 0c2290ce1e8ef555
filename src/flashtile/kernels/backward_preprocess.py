"""The backward's first kernel, delta = rowsum(dO * O).

The paper calls rowsum(dO * O) D; in code it is ``delta`` so it cannot be confused with the head dim
(``head_dim`` / ``HEAD_DIM`` here). It is one float32 number per query row, computed once up front so
that neither the dK/dV kernel nor the dQ kernel has to read O: both only need delta[i].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import KernelLaunch, head_batch_grid, head_dim_pad, load_tile


# --8<-- [start:preprocess]
@triton.jit
def backward_preprocess_kernel(
    O, DO, DELTA,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_dob, stride_doh, stride_dot, stride_dod,
    H, Tq, head_dim,
    BLOCK_Q: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):  # fmt: skip
    """One program per (query tile, head, batch): delta[b, h, i] = sum_d dO[i, d] * O[i, d] in fp32."""
    q_index = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)  # int64 so b * stride_b cannot overflow
    b = tl.program_id(2).to(tl.int64)
    bh = b * H + h
    rows = q_index * BLOCK_Q + tl.arange(0, BLOCK_Q)
    cols = tl.arange(0, HEAD_DIM_PAD)
    o = load_tile(O + b * stride_ob + h * stride_oh, stride_ot, stride_od, rows, cols, Tq, head_dim)
    do = load_tile(DO + b * stride_dob + h * stride_doh, stride_dot, stride_dod, rows, cols, Tq, head_dim)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # padded columns are 0 in both
    tl.store(DELTA + bh * Tq + rows, delta, mask=rows < Tq)
# --8<-- [end:preprocess]


def preprocess_launch(o: torch.Tensor, do: torch.Tensor, block_q: int) -> KernelLaunch:
    """The preprocess kernel's launch for o and do of one layout (part of the backward's plan)."""
    B, H, Tq, D = o.shape
    return KernelLaunch(backward_preprocess_kernel, head_batch_grid(triton.cdiv(Tq, block_q), H, B),
                        (*o.stride(), *do.stride(), H, Tq, D), dict(BLOCK_Q=block_q, HEAD_DIM_PAD=head_dim_pad(D)),
                        4, 3)  # Triton's default warps and stages  # fmt: skip


def backward_preprocess(o: torch.Tensor, do: torch.Tensor, launch: KernelLaunch) -> torch.Tensor:
    """delta = rowsum(dO * O): (B, H, Tq) float32, contiguous. o and do are (B, H, Tq, D), any strides;
    ``launch`` is ``preprocess_launch`` of their layout."""
    delta = torch.empty(o.shape[:3], dtype=torch.float32, device=o.device)
    launch(o, do, delta)
    return delta

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
    O, DO, M, L, ROWS,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_dob, stride_doh, stride_dot, stride_dod,
    H, Tq, head_dim, n_rows,
    BLOCK_Q: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):  # fmt: skip
    """One program per (query tile, head, batch). ROWS is (3, B, H, Tq) float32: delta = sum_d dO * O,
    then the forward's (m, l) as the two kernels use them, m and log2 l, each worked out once per row
    here instead of once per tile there. A row that sees no key (l = 0) gets m = +inf and log2 l = 0,
    so that u - m = -inf and p = 0; a NaN in m or l is kept."""
    q_index = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)  # int64 so b * stride_b cannot overflow
    b = tl.program_id(2).to(tl.int64)
    bh = b * H + h
    rows = q_index * BLOCK_Q + tl.arange(0, BLOCK_Q)
    cols = tl.arange(0, HEAD_DIM_PAD)
    o = load_tile(O + b * stride_ob + h * stride_oh, stride_ot, stride_od, rows, cols, Tq, head_dim)
    do = load_tile(DO + b * stride_dob + h * stride_doh, stride_dot, stride_dod, rows, cols, Tq, head_dim)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # padded columns are 0 in both
    m = tl.load(M + bh * Tq + rows, mask=rows < Tq, other=0.0)
    l = tl.load(L + bh * Tq + rows, mask=rows < Tq, other=1.0)
    empty = l == 0.0
    out = ROWS + bh * Tq + rows
    tl.store(out, delta, mask=rows < Tq)
    tl.store(out + n_rows, tl.where(empty, float("inf"), m), mask=rows < Tq)
    tl.store(out + 2 * n_rows, tl.math.log2(tl.where(empty, 1.0, l)), mask=rows < Tq)
# --8<-- [end:preprocess]


def preprocess_launch(o: torch.Tensor, do: torch.Tensor, block_q: int) -> KernelLaunch:
    """The preprocess kernel's launch for o and do of one layout (part of the backward's plan)."""
    B, H, Tq, D = o.shape
    return KernelLaunch(backward_preprocess_kernel, head_batch_grid(triton.cdiv(Tq, block_q), H, B),
                        (*o.stride(), *do.stride(), H, Tq, D, B * H * Tq),
                        dict(BLOCK_Q=block_q, HEAD_DIM_PAD=head_dim_pad(D)), 4, 3)  # Triton's defaults  # fmt: skip


def backward_preprocess(o: torch.Tensor, do: torch.Tensor, stats: torch.Tensor, launch: KernelLaunch) -> torch.Tensor:
    """(3, B, H, Tq) float32, contiguous: delta = rowsum(dO * O), m and log2 l (see the kernel). o and do
    are (B, H, Tq, D), any strides; stats is the forward's (2, B, H, Tq) (m, l), contiguous; ``launch``
    is ``preprocess_launch`` of their layout."""
    rows = torch.empty((3, *o.shape[:3]), dtype=torch.float32, device=o.device)
    launch(o, do, stats[0], stats[1], rows)
    return rows

"""The backward's row terms: delta = rowsum(dO * O), and the forward's (m, l) made ready for the loops.

The paper calls rowsum(dO * O) D; in code it is ``delta`` so it cannot be confused with the head dim
(``head_dim`` / ``HEAD_DIM`` here). It is one float32 number per query row, worked out once per row so
that the dK/dV loop never has to read O: it only needs delta[i].

Who works them out: the deterministic backward's dQ kernel, which runs first and holds each query
tile's dO anyway, computes them for its own rows (``row_terms``) and stores them (``store_row_terms``)
for the dK/dV kernel that follows. The atomic-dQ backward has no dQ kernel, so a separate kernel
(``backward_preprocess_kernel``) does only that, before the dK/dV kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._host import KernelLaunch, head_batch_grid, head_dim_pad
from ._jit import load_tile


# --8<-- [start:row_terms]
@triton.jit
def row_terms(o, do, m, l):
    """(delta, m, log2 l) of a tile's rows from its o and do tiles and the forward's
    (m, l).

    delta = sum_d dO * O over the d_v columns of o and do, in float32 whatever the input
    dtype (padded columns load as 0 in both). m and log2 l are what
    p = exp2((u - m) * qk_scale - log2 l) reads: worked out once per row here instead of
    once per tile in the loops. A row that sees no key (l = 0) gets m = +inf and
    log2 l = 0, so that u - m = -inf and p = 0; a NaN in m or l is kept."""
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    empty = l == 0.0
    log2_l = tl.math.log2(tl.where(empty, 1.0, l))
    return delta, tl.where(empty, float("inf"), m), log2_l


@triton.jit
def load_stats(STATS, row_base, rows, Tq, n_rows):
    """The forward's (m, l) of ``rows`` from STATS, (2, B, H, Tq) float32 contiguous,
    n_rows = B * H * Tq apart; rows past Tq read m = 0, l = 1 (finite, and never
    stored)."""
    m = tl.load(STATS + row_base + rows, mask=rows < Tq, other=0.0)
    l = tl.load(STATS + n_rows + row_base + rows, mask=rows < Tq, other=1.0)
    return m, l


@triton.jit
def store_row_terms(ROWS, row_base, rows, Tq, n_rows, delta, m, log2_l):
    """Store a tile's (delta, m, log2 l) into ROWS, (3, B, H, Tq) float32 contiguous,
    rows < Tq only."""
    out = ROWS + row_base + rows
    tl.store(out, delta, mask=rows < Tq)
    tl.store(out + n_rows, m, mask=rows < Tq)
    tl.store(out + 2 * n_rows, log2_l, mask=rows < Tq)
# --8<-- [end:row_terms]


# --8<-- [start:preprocess]
@triton.jit
def backward_preprocess_kernel(
    O, DO, STATS, ROWS,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_dob, stride_doh, stride_dot, stride_dod,
    H, Tq, head_dim, n_rows,
    BLOCK_Q: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):  # fmt: skip
    """One program per (query tile, head, batch): the row terms of that tile, for the
    atomic-dQ backward (the deterministic one computes them in its dQ kernel). ROWS is
    (3, B, H, Tq) float32: delta, m, log2 l (``row_terms``). O and DO are d_v wide
    (head_dim, padded to HEAD_DIM_PAD)."""
    q_index = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)  # int64 so b * stride_b cannot overflow
    b = tl.program_id(2).to(tl.int64)
    row_base = (b * H + h) * Tq
    rows = q_index * BLOCK_Q + tl.arange(0, BLOCK_Q)
    cols = tl.arange(0, HEAD_DIM_PAD)
    o_base = O + b * stride_ob + h * stride_oh
    do_base = DO + b * stride_dob + h * stride_doh
    o = load_tile(o_base, stride_ot, stride_od, rows, cols, Tq, head_dim)
    do = load_tile(do_base, stride_dot, stride_dod, rows, cols, Tq, head_dim)
    m, l = load_stats(STATS, row_base, rows, Tq, n_rows)
    delta, m, log2_l = row_terms(o, do, m, l)
    store_row_terms(ROWS, row_base, rows, Tq, n_rows, delta, m, log2_l)
# --8<-- [end:preprocess]


def preprocess_launch(o: torch.Tensor, do: torch.Tensor, block_q: int) -> KernelLaunch:
    """The preprocess kernel's launch for o and do of one layout (part of the atomic backward's plan)."""
    B, H, Tq, D = o.shape
    return KernelLaunch(backward_preprocess_kernel, grid=head_batch_grid(triton.cdiv(Tq, block_q), H, B),
                        scalars=(*o.stride(), *do.stride(), H, Tq, D, B * H * Tq),
                        constexprs=dict(BLOCK_Q=block_q, HEAD_DIM_PAD=head_dim_pad(D)),
                        num_warps=4, num_stages=3,  # Triton's defaults
                        plan_keyed=True)  # o, do, stats keyed by the backward plan, rows allocated  # fmt: skip


def backward_preprocess(o: torch.Tensor, do: torch.Tensor, stats: torch.Tensor, launch: KernelLaunch) -> torch.Tensor:
    """(3, B, H, Tq) float32, contiguous: delta = rowsum(dO * O), m and log2 l (``row_terms``). o and do
    are (B, H, Tq, D), any strides; stats is the forward's (2, B, H, Tq) (m, l), contiguous; ``launch``
    is ``preprocess_launch`` of their layout."""
    rows = torch.empty((3, *o.shape[:3]), dtype=torch.float32, device=o.device)
    launch(o, do, stats, rows)
    return rows

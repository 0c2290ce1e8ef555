"""Merging two partial attention results in place, as one Triton kernel: ``reference.merge.merge_partials``
on the GPU.

Ring attention (``flashtile.distributed``) folds each visiting key shard's (o_part, lse_part) into its
running (o, lse). Written as PyTorch operations, that merge is a dozen elementwise kernels, each a full
pass over o (134 MB in float32 at 16k rows per GPU, 16 heads, D = 128). This kernel reads o, lse,
o_part and lse_part once and writes o and lse once. With it (and the running result started from the
first step's partial) the two-H200 ring's causal forward at 32k tokens got faster (bench/PERF_LOG.md).

The arithmetic is the reference's: m = max(lse, lse_part), the weights e^(lse - m) and
e^(lse_part - m) (0 for a part that saw no key, lse = -inf), l their sum, o = (w o + w_part o_part) / l
and lse = m + ln l; a row that no part saw stays o = 0, lse = -inf, and a NaN stays NaN.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._checks import check_tensor
from ._host import head_batch_grid, head_dim_pad
from ._jit import program_offset

LOG2E = tl.constexpr(math.log2(math.e))
LN2 = tl.constexpr(math.log(2.0))
ELEMENTS_PER_PROGRAM = 4096  # rows x head dim of one program: 32 registers per thread and tensor at 4 warps


# --8<-- [start:kernel]
@triton.jit
def _merge_into_kernel(
    O, LSE, O_PART, LSE_PART,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_lb, stride_lh, stride_lt,
    stride_pb, stride_ph, stride_pt, stride_pd,
    stride_qb, stride_qh, stride_qt,
    T, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """(o, lse) <- the merge of (o, lse) and (o_part, lse_part), for BLOCK_T rows of one
    (b, h)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    b = tl.program_id(2)
    d = tl.arange(0, HEAD_DIM_PAD)
    row_ok = t < T
    tile_ok = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    t64, d64 = t.to(tl.int64), d.to(tl.int64)
    lse_ptrs = (
        LSE
        + program_offset(b, stride_lb)
        + program_offset(h, stride_lh)
        + t64 * stride_lt
    )
    part_lse_ptrs = (
        LSE_PART
        + program_offset(b, stride_qb)
        + program_offset(h, stride_qh)
        + t64 * stride_qt
    )
    lse_a = tl.load(lse_ptrs, mask=row_ok, other=float("-inf"))
    lse_b = tl.load(part_lse_ptrs, mask=row_ok, other=float("-inf")).to(tl.float32)
    m = tl.maximum(lse_a, lse_b)
    # e^(lse - m) in base 2. A max of -inf means both parts are empty: any finite m
    # gives the weights 0.
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.math.exp2((lse_a - m_safe) * LOG2E)
    w_b = tl.math.exp2((lse_b - m_safe) * LOG2E)
    l = w_a + w_b
    empty = l == 0.0
    o_ptrs = (
        O
        + program_offset(b, stride_ob)
        + program_offset(h, stride_oh)
        + t64[:, None] * stride_ot
        + d64[None, :] * stride_od
    )
    part_ptrs = (
        O_PART
        + program_offset(b, stride_pb)
        + program_offset(h, stride_ph)
        + t64[:, None] * stride_pt
        + d64[None, :] * stride_pd
    )
    o_a = tl.load(o_ptrs, mask=tile_ok, other=0.0).to(tl.float32)
    o_b = tl.load(part_ptrs, mask=tile_ok, other=0.0).to(tl.float32)
    o = (w_a[:, None] * o_a + w_b[:, None] * o_b) / tl.where(empty, 1.0, l)[:, None]
    o = tl.where(empty[:, None], 0.0, o)
    lse = m_safe + tl.math.log2(tl.where(empty, 1.0, l)) * LN2
    # a +inf score: lse is +inf, as torch.logsumexp gives
    lse = tl.where(m == float("inf"), m, lse)
    lse = tl.where(empty, float("-inf"), lse)
    # In place: a row's lse is read by every warp that holds a slice of the row's
    # columns, and written by one. Without a barrier a fast warp can store the merged
    # lse before a slow one has read the old value, and that slow warp then weights its
    # columns with the wrong lse. Triton orders a thread's own loads and stores, not
    # those of different warps.
    tl.debug_barrier()
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=tile_ok)
    tl.store(lse_ptrs, lse.to(LSE.dtype.element_ty), mask=row_ok)
# --8<-- [end:kernel]


def merge_into(o: torch.Tensor, lse: torch.Tensor, o_part: torch.Tensor, lse_part: torch.Tensor) -> None:
    """Fold the partial (o_part, lse_part) into (o, lse), in place.

    o: (B, H, T, D), lse: (B, H, T) float32: the running result, any strides (a row slice of a larger
    buffer is fine); o_part like o, lse_part like lse. o and o_part may be fp16, bf16 or fp32, each its
    own: the kernel computes in fp32 and rounds the merged o once, to o's dtype. The two must cover
    disjoint sets of keys for the same rows.
    """
    check_tensor("o", o, rank=4, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    check_tensor("lse", lse, rank=3, dtypes=(torch.float32,))
    check_tensor("o_part", o_part, rank=4, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    check_tensor("lse_part", lse_part, rank=3, dtypes=(torch.float32,))
    if o_part.shape != o.shape:
        raise ValueError(f"o_part must have the shape of o {tuple(o.shape)}, got {tuple(o_part.shape)}")
    for name, x in (("lse", lse), ("lse_part", lse_part)):
        if x.shape != o.shape[:3]:
            raise ValueError(f"{name} must have shape (B, H, T) = {tuple(o.shape[:3])}, got {tuple(x.shape)}")
    for name, x in (("lse", lse), ("o_part", o_part), ("lse_part", lse_part)):
        if x.device != o.device:
            raise ValueError(f"{name} is on {x.device} but o is on {o.device}")
    B, H, T, D = o.shape
    if o.numel() == 0:
        return
    pad = head_dim_pad(D)
    block_t = max(1, min(triton.next_power_of_2(T), ELEMENTS_PER_PROGRAM // pad))
    _merge_into_kernel[head_batch_grid(triton.cdiv(T, block_t), H, B)](
        o, lse, o_part, lse_part, *o.stride(), *lse.stride(), *o_part.stride(), *lse_part.stride(), T,
        HEAD_DIM=D, HEAD_DIM_PAD=pad, BLOCK_T=block_t, num_warps=4,
    )  # fmt: skip

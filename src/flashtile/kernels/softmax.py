"""Row softmax as one Triton kernel: the smallest fused kernel that already needs online softmax.

One program owns one row. If the row fits in one block, it is read once, reduced in registers and
written once: N elements in, N out, against three round trips through HBM for the unfused
max / exp-and-sum / divide sequence. A row wider than the block streams through column blocks
twice: the first pass keeps the running max ``m`` and running sum ``l`` (the online-softmax update
of ``flashtile.reference.online_softmax``), the second writes exp(x - m) / l.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._checks import check_tensor
from .._env import is_interpreting
from ._host import KERNEL_DTYPES, check_kernel_device, check_tile_size

MAX_BLOCK = 8192  # widest row held in registers at once (fp32: 32 KiB per program)
INTERPRETER_MAX_BLOCK = 1024


# --8<-- [start:one_block]
@triton.jit
def _softmax_one_block(
    X, Y, stride_xr, stride_xc, stride_yr, n_cols, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    # Padding with -inf makes the padded lanes vanish: they never win the max and
    # exp(-inf) = 0.
    x = tl.load(
        X + row * stride_xr + cols * stride_xc, mask=inside, other=float("-inf")
    )
    x = x.to(tl.float32)  # statistics in fp32 whatever the input dtype
    m = tl.max(x, 0)
    p = tl.exp(x - m)
    l = tl.sum(p, 0)
    tl.store(Y + row * stride_yr + cols, (p / l).to(Y.dtype.element_ty), mask=inside)
# --8<-- [end:one_block]


# --8<-- [start:streaming]
@triton.jit
def _softmax_streaming(
    X, Y, stride_xr, stride_xc, stride_yr, n_cols, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_xr
    # Pass 1: running max m and running sum l, one column block at a time.
    m = tl.full([], float("-inf"), dtype=tl.float32)
    l = tl.zeros([], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(
            x_row + cols * stride_xc, mask=cols < n_cols, other=float("-inf")
        ).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        # Until a finite value shows up (a -inf-masked prefix, say) m_new is -inf, and
        # exp(-inf - (-inf)) would be NaN; subtracting 0 instead keeps alpha and the sum
        # at 0.
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_new_safe)
        l = alpha * l + tl.sum(tl.exp(x - m_new_safe), 0)
        m = m_new
    # Pass 2: now that m and l are final, normalise and write.
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(x_row + cols * stride_xc, mask=inside, other=float("-inf")).to(
            tl.float32
        )
        y = tl.exp(x - m) / l
        tl.store(Y + row * stride_yr + cols, y.to(Y.dtype.element_ty), mask=inside)
# --8<-- [end:streaming]


# --8<-- [start:launcher]
def softmax(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Softmax over the last dimension of ``x`` (any rank >= 1, any strides).

    Args:
        x: fp16, bf16 or fp32 tensor on a CUDA device (or the CPU under
            TRITON_INTERPRET=1).
        block: columns per block, a power of two; by default the row's width rounded up
            to a power of two, capped at MAX_BLOCK. A row wider than ``block`` streams
            in two passes.

    Returns:
        A contiguous tensor of x's shape and dtype; statistics are computed in fp32.
    """
    check_tensor("x", x, dtypes=KERNEL_DTYPES)
    if x.dim() == 0:
        raise ValueError(
            "x must have at least one dimension (softmax runs over the last one), got "
            "a scalar"
        )
    check_kernel_device("x", x)
    n_cols = x.shape[-1]
    cap = INTERPRETER_MAX_BLOCK if is_interpreting() else MAX_BLOCK
    if block is None:
        block = min(triton.next_power_of_2(max(n_cols, 1)), cap)
    else:
        block = check_tile_size("block", block, minimum=1)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return y
    x2 = x.reshape(-1, n_cols)  # a view whenever the leading dims can be merged
    y2 = y.view(-1, n_cols)
    kernel = _softmax_one_block if n_cols <= block else _softmax_streaming
    num_warps = 4 if block <= 2048 else 8 if block <= 4096 else 16
    kernel[(x2.shape[0],)](
        x2,
        y2,
        x2.stride(0),
        x2.stride(1),
        y2.stride(0),
        n_cols,
        BLOCK=block,
        num_warps=num_warps,
    )
    return y
# --8<-- [end:launcher]

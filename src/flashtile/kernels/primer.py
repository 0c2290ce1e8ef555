"""Two small kernels for the Triton primer (docs/part-b/triton-primer.md), nothing else uses them.

* ``matmul``: C = A @ B with one program per (BLOCK_M, BLOCK_N) tile of C: program ids, a 2-D grid,
  power-of-two blocks with masks for the ragged edges, and ``tl.dot`` accumulating in fp32.
* ``double_with_pointers`` / ``double_with_descriptor``: the same tile-by-tile y = 2x, addressed by
  pointer arithmetic and by a tensor descriptor, to show what each one accepts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._checks import check_tensor
from ._host import KERNEL_DTYPES, check_kernel_device


# --8<-- [start:matmul_kernel]
@triton.jit
def _matmul_kernel(
    A, B, C, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Which tile of C is mine? The grid is (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # fp32 however narrow A and B are
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        # Lanes past the matrix edge load 0, which adds nothing to a dot product.
        a = tl.load(A + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(B + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)  # tensor cores: fp16/bf16 products, fp32 sums
    c_ptrs = C + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(
        c_ptrs,
        acc.to(C.dtype.element_ty),
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )
# --8<-- [end:matmul_kernel]


def matmul(a: torch.Tensor, b: torch.Tensor, block: int = 32) -> torch.Tensor:
    """a (M, K) @ b (K, N) in a's dtype, accumulated in fp32. Any strides."""
    check_tensor("a", a, rank=2, dtypes=KERNEL_DTYPES)
    check_tensor("b", b, rank=2, dtypes=KERNEL_DTYPES)
    check_kernel_device("a", a)
    if a.shape[1] != b.shape[0] or a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype} cannot be multiplied")
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    # --8<-- [start:matmul_grid]
    grid = (triton.cdiv(M, block), triton.cdiv(N, block))  # one program per tile of C
    _matmul_kernel[grid](a, b, c, M, N, K, *a.stride(), *b.stride(), *c.stride(),
                         BLOCK_M=block, BLOCK_N=block, BLOCK_K=block)
    # --8<-- [end:matmul_grid]
    return c


# --8<-- [start:two_ways]
@triton.jit
def _double_with_pointers(
    X, Y, M, N, stride_xm, stride_xn, stride_ym, BLOCK: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = (rows[:, None] < M) & (cols[None, :] < N)  # the edges are ours to mask
    x = tl.load(X + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=inside)
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], 2 * x, mask=inside)


@triton.jit
def _double_with_descriptor(X, Y, M, N, stride_xm, stride_ym, BLOCK: tl.constexpr):
    # The descriptor knows the shape, so it clips the edges itself; it needs a unit
    # inner stride and every other stride a multiple of 16 bytes, because the hardware
    # copies in 16-byte units.
    x_desc = tl.make_tensor_descriptor(
        X, shape=[M, N], strides=[stride_xm, 1], block_shape=[BLOCK, BLOCK]
    )
    y_desc = tl.make_tensor_descriptor(
        Y, shape=[M, N], strides=[stride_ym, 1], block_shape=[BLOCK, BLOCK]
    )
    corner = [tl.program_id(0) * BLOCK, tl.program_id(1) * BLOCK]
    y_desc.store(corner, 2 * x_desc.load(corner))
# --8<-- [end:two_ways]


def double(x: torch.Tensor, use_descriptor: bool = False, block: int = 16) -> torch.Tensor:
    """y = 2x for a 2-D tensor, tile by tile, addressed with pointers or with a tensor descriptor."""
    check_tensor("x", x, rank=2, dtypes=KERNEL_DTYPES)
    check_kernel_device("x", x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(x.shape[0], block), triton.cdiv(x.shape[1], block))
    if use_descriptor:
        if not tensor_descriptor_compatible(x):
            raise ValueError(f"x with strides {x.stride()} ({x.element_size()}-byte elements) cannot be described "
                             "by a tensor descriptor: inner stride must be 1, the others multiples of 16 bytes")
        _double_with_descriptor[grid](x, y, *x.shape, x.stride(0), y.stride(0), BLOCK=block)
    else:
        _double_with_pointers[grid](x, y, *x.shape, *x.stride(), y.stride(0), BLOCK=block)
    return y


# --8<-- [start:descriptor_rule]
def tensor_descriptor_compatible(x: torch.Tensor) -> bool:
    """Can a tensor descriptor (the TMA unit on Hopper) address x? Innermost stride 1,
    every other stride a multiple of 16 bytes, base address 16-byte aligned."""
    size = x.element_size()
    inner_ok = x.stride(-1) == 1
    outer_ok = all((s * size) % 16 == 0 for s in x.stride()[:-1])
    return inner_ok and outer_ok and x.data_ptr() % 16 == 0
# --8<-- [end:descriptor_rule]

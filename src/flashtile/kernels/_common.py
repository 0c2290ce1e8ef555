"""Pieces every Triton kernel in flashtile shares: launcher checks and small ``@triton.jit`` helpers.

The launcher checks add what only a kernel needs on top of ``flashtile._checks`` (which stays the
one place for shape, dtype and argument validation): a device Triton can run on, a head dim the
kernels were written for, and tile sizes ``tl.arange`` and ``tl.dot`` accept.

The jit helpers are the integer bookkeeping of the causal tile rules in
``flashtile.reference.causal``, written once so that the forward and backward kernels count tiles
the same way the reference does.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
MIN_DOT_BLOCK = 16  # tl.dot needs every dimension of its operands to be at least 16


def is_interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_kernel_device(name: str, x: torch.Tensor) -> None:
    """A compiled Triton kernel needs a CUDA tensor; the interpreter also takes CPU tensors."""
    if x.device.type != "cuda" and not is_interpreting():
        raise ValueError(
            f"{name} is on {x.device}, but Triton kernels need a CUDA device "
            "(or set TRITON_INTERPRET=1 before importing flashtile to run them on the CPU)"
        )


def check_head_dim(head_dim: int) -> None:
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"head dim (q.shape[-1]) must be between {MIN_HEAD_DIM} and {MAX_HEAD_DIM}, got {head_dim}"
        )


def check_tile_size(name: str, value: int, minimum: int = MIN_DOT_BLOCK) -> int:
    """A constexpr tile size: a power of two (tl.arange needs one) and at least ``minimum``."""
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")
    return value


# --8<-- [start:program_offset]
@triton.jit
def program_offset(index, stride):
    """index * stride in 64 bits. Program ids and tl.arange are int32, and so is a stride below
    2**31; their product silently wraps once a tensor passes 2**31 elements unless one side is
    widened first. The cast is assigned, not just called: ``index.to(tl.int64)`` alone does nothing.
    """
    index = index.to(tl.int64)
    return index * stride
# --8<-- [end:program_offset]


# --8<-- [start:tile_counts]
@triton.jit
def last_key_tile(q_end, Tk, offset, BLOCK_K: tl.constexpr):
    """Number of key tiles a query tile ending at q_end needs (reference.causal.last_key_tile).

    The last row q_end - 1 sees keys up to q_end - 1 + offset. Clamping that to -1 makes the count 0
    for a tile that sees nothing, and keeps every division on non-negative numbers (Triton's // on
    integers truncates toward zero like C, it does not floor like Python).
    """
    last_visible_key = tl.maximum(q_end - 1 + offset, -1)
    return tl.minimum(tl.cdiv(Tk, BLOCK_K), (last_visible_key + BLOCK_K) // BLOCK_K)


@triton.jit
def full_key_tiles(q_start, Tk, offset, BLOCK_K: tl.constexpr):
    """Number of leading key tiles that are FULL for every row of a query tile starting at q_start.

    Key tile t is full when its last column (t + 1) * BLOCK_K - 1 is visible from the first row,
    (t + 1) * BLOCK_K - 1 <= q_start + offset, and lies inside the keys, (t + 1) * BLOCK_K <= Tk.
    """
    first_row_sees = tl.maximum(q_start + offset + 1, 0)  # keys visible from row q_start
    return tl.minimum(first_row_sees // BLOCK_K, Tk // BLOCK_K)
# --8<-- [end:tile_counts]

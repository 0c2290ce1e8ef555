"""Strides of tensors that do not exist yet: what a launcher's outputs will have, known when its plan is made.

A plan fixes every stride a kernel is launched with, so it must know the strides of the outputs before
they are allocated. Two kinds: the contiguous strides ``torch.empty(shape)`` gives, and the strides of
a tensor laid out like an input, which is what a gradient should have. A model's query, key and value
are usually (B, H, T, D) views of (B, T, H, D) projections; autograd stores the gradient of such a view
in the view's own layout, and copies a gradient that arrives in another one. This module imports no
Triton, so the API's fake implementations can use it too.
"""

from __future__ import annotations

import torch


# --8<-- [start:layouts]
def contiguous_strides(shape) -> tuple:
    """The strides torch.empty(shape) gets (a dim of size 0 counts as 1, as in
    torch)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def strides_like(x: torch.Tensor) -> tuple:
    """Strides for a new tensor of x's shape laid out as x is in memory: x's own where x
    covers its memory densely in some order of its dims (a (B, H, T, D) view of (B, T,
    H, D) storage, say), else contiguous ones (a slice, an expanded tensor). A gradient
    allocated with them is the layout autograd keeps, so it is stored as it is and not
    copied."""
    if x.numel() == 0:
        return contiguous_strides(x.shape)
    step = 1
    for stride, size in sorted((s, n) for s, n in zip(x.stride(), x.shape) if n != 1):
        if stride != step:  # a gap, an overlap or a negative stride: not dense
            return contiguous_strides(x.shape)
        step *= size
    return tuple(x.stride())


def empty_like_layout(
    x: torch.Tensor, strides: tuple, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """An uninitialised tensor of x's shape, dtype (or ``dtype``) and device, with
    ``strides``."""
    return torch.empty_strided(
        x.shape, strides, dtype=dtype or x.dtype, device=x.device
    )
# --8<-- [end:layouts]

"""Memory footprint, measured rather than asserted.

FlashAttention's memory claims are two: the forward never forms a Tq x Tk tensor, and training keeps
only q, k, v, o and lse for the backward. Both can be watched directly in PyTorch:

* ``largest_tensor()`` records the element count of the largest tensor any torch function returns
  inside the block (every intermediate, not only what survives);
* ``saved_tensor_shapes()`` records the shape of every tensor autograd saves for the backward.

The tests and the chapters use these two instruments, so the claims on the pages are measurements.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode


# --8<-- [start:largest]
# lower case: it reads as a function, ``with largest_tensor() as seen``
class largest_tensor(TorchFunctionMode):
    """Inside the block, ``.numel`` is the size of the largest tensor any torch function
    has returned."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out
# --8<-- [end:largest]


# --8<-- [start:saved]
@contextlib.contextmanager
def saved_tensor_shapes():
    """Yield a list that fills with the shape of every tensor autograd saves inside the
    block."""
    shapes: list[tuple[int, ...]] = []

    def record(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t  # keep the tensor itself: we only watch, the backward still needs it

    with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
        yield shapes
# --8<-- [end:saved]

"""Step 5: the fused softmax kernel in Triton. Read part-b/triton-primer and part-b/fused-softmax.

One program per row: load the row (or stream it in blocks when it is wider than BLOCK), reduce in
registers, write once. On a machine without CUDA the checker runs this file through the Triton
interpreter (TRITON_INTERPRET=1). Check with:  python -m flashtile.practice check DIR --step fused_softmax
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_kernel(X, Y, stride_xr, stride_xc, stride_yr, n_cols, BLOCK: tl.constexpr):
    """One program = one row. TODO: columns tl.arange(0, BLOCK), masked loads, m, l, store exp(x - m) / l."""
    pass


def softmax(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Softmax over the last dimension of a float16 or float32 tensor x (any rank >= 1).

    Args:
        x: on a CUDA device, or on the CPU under TRITON_INTERPRET=1.
        block: columns per block, a power of two; by default the row width rounded up to one. A row
            wider than ``block`` streams through in blocks (online softmax, then a second pass).

    Returns:
        A tensor of x's shape and dtype; the statistics m and l are computed in float32.
    """
    raise NotImplementedError("TODO: pick BLOCK, launch one program per row, return y")

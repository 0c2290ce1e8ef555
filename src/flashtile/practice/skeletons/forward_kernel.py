"""Step 6: the forward kernel in Triton. Read part-b/forward-kernel first.

The PyTorch loop of step 2, one program per (query tile, head, batch), plus what the GPU forces:
masks for padded rows, keys and head dims, pointers from the tensors' own strides, float32 statistics.
Check with:  python -m flashtile.practice check DIR --step forward_kernel
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _forward_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    H, Tq, Tk, offset, scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr,
):
    """TODO: load the Q tile once; loop over key tiles keeping m, l, acc in float32; write O and lse."""
    pass


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, scale: float | None = None,
    alignment: str = "upper_left", block_q: int | None = None, block_k: int | None = None,
):
    """Attention forward in one Triton kernel.

    Args:
        q: (B, H, Tq, D); k, v: (B, H, Tk, D); float16 or float32, ANY strides (a transposed view too).
        causal, alignment, scale: as in step 2.
        block_q, block_k: powers of two >= 16 (tl.dot needs 16); pick a default when None.

    Returns:
        o: (B, H, Tq, D) in q's dtype; lse: (B, H, Tq) float32. A row that sees no key: o = 0, lse = -inf.
    """
    raise NotImplementedError("TODO: allocate o and lse, launch _forward_kernel on a (tiles, H, B) grid")

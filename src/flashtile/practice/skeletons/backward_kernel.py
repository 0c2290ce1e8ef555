"""Step 7: the backward in Triton. Read part-b/backward-kernel first.

The equations of step 4 in three launches: D = rowsum(dO * O) once per row (call it ``delta``:
D is also the head dim), then one program per key tile that owns dK and dV and loops over the
query tiles that see it, then one program per query tile that owns dQ and loops over the key
tiles it sees. Each recomputes P from the saved lse. Check with:
    python -m flashtile.practice check DIR --step backward_kernel
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# --8<-- [start:skeleton]
@triton.jit
def _delta_kernel(
    O, DO, DELTA, stride_b, stride_h, stride_t, H, Tq,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    """TODO: delta = rowsum(dO * O) for one query tile, in float32, into DELTA
    (B, H, Tq)."""
    pass


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    H, Tq, Tk, offset, scale, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr,
):
    """TODO: one key tile; loop over the query tiles that see it, P recomputed from lse
    and masked as in the forward; dV += Pᵀ dO, dK += dSᵀ Q with dS = P * (dP - delta);
    dK times τ once at the end."""
    pass


@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    H, Tq, Tk, offset, scale, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr,
):
    """TODO: one query tile; loop over the key tiles it sees; dQ += dS K, times τ at
    the end."""
    pass


def flash_attention_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, do: torch.Tensor, causal: bool = False,
    scale: float | None = None, block_q: int | None = None,
    block_k: int | None = None, alignment: str = "upper_left",
):
    """Gradients of attention in Triton, from the saved (q, k, v, o, lse) and dO.

    Args:
        q, o, do: (B, H, Tq, D); k, v: (B, H, Tk, D); float32 (the checker's dtype:
            the interpreter's bfloat16 is wrong). lse: (B, H, Tq) float32, natural
            log, -inf on a row that sees no key (its gradients are 0, not NaN).
        causal, scale, alignment: as in the forward; the mask must be the same.
        block_q, block_k: powers of two >= 16 (tl.dot needs 16); a default when None.

    Returns:
        (dq, dk, dv), shaped like q, k, v and in their dtype.

    Hint: make q, k, v, o, do contiguous, so that q, o, do, dq share strides and k,
    v, dk, dv share theirs. With exp2, qk_scale = τ log2(e) and lse times log2(e).
    On a GPU, tl.dot of float32 rounds to tf32 unless input_precision="ieee".
    """
    raise NotImplementedError(
        "TODO: delta, then _dkdv_kernel on a (key tiles, H, B) grid and _dq_kernel "
        "on a (query tiles, H, B) grid")
# --8<-- [end:skeleton]

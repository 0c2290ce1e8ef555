"""Step 4: the tiled backward. Read part-a/backward first.

Recompute P = exp(S - lse) tile by tile from the saved lse, and use D = rowsum(dO * O) (call it
``delta`` in code: D is also the head dim). Check with:  python -m flashtile.practice check DIR --step backward
"""

from __future__ import annotations

import torch


def flash_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = 16,
    block_k: int = 16,
    alignment: str = "upper_left",
):
    """Gradients of attention from the saved (q, k, v, o, lse) and the incoming dO.

    Args:
        q, o, do: (B, H, Tq, D); k, v: (B, H, Tk, D); lse: (B, H, Tq) from the forward.
        causal, scale, alignment: as in the forward; the mask must be the same.
        block_q, block_k: tile sizes, any positive ints.

    Returns:
        (dq, dk, dv), shaped like q, k, v.
    """
    raise NotImplementedError("TODO: dV = P^T dO, dP = dO V^T, dS = P * (dP - D), dQ = τ dS K, dK = τ dS^T Q")

"""Step 8: wire your forward and backward into torch.autograd. Read part-a/backward (the listing).

The forward runs your tiled forward and saves what the backward needs: q, k, v, o and lse, never P
(one case counts what autograd saved). The backward calls your tiled backward with the same causal,
scale, block sizes and alignment the forward was given. Import your own steps inside the methods
(``from forward import flash_attention_forward``, ``from backward import flash_attention_backward``):
this folder is on sys.path when the checker runs. Check with:
    python -m flashtile.practice check DIR --step autograd
"""

from __future__ import annotations

import torch


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_q, block_k, alignment):
        """Return (o, lse) from your forward; keep q, k, v, o, lse and the settings on ctx."""
        raise NotImplementedError("TODO: o, lse = flash_attention_forward(...); ctx.save_for_backward(...)")

    @staticmethod
    def backward(ctx, do, dlse):
        """Return one gradient per input of forward: dq, dk, dv, then None for each setting."""
        raise NotImplementedError("TODO: dq, dk, dv = flash_attention_backward(..., ctx's settings)")


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = 16,
    block_k: int = 16,
    alignment: str = "upper_left",
) -> torch.Tensor:
    """Differentiable attention: o (B, H, Tq, D), its gradients through your tiled backward."""
    raise NotImplementedError("TODO: o, lse = FlashAttentionFunction.apply(q, k, v, ...); return o")

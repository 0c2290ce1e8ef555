"""A ``torch.autograd.Function`` around the reference forward and backward.

It saves exactly what the backward needs, q, k, v, o and the (B, H, Tq) log-sum-exp, and never a
Tq x Tk tensor: that is the memory saving of FlashAttention in training, made checkable.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .backward import flash_attention_backward
from .forward import flash_attention_forward


# --8<-- [start:function]
class FlashAttentionFunction(torch.autograd.Function):
    """Reference FlashAttention with a tiled backward; saves (q, k, v, o, lse) only."""

    # forward and setup_context are separate so that torch.func.grad works; forward-mode AD (no jvp) and
    # vmap (the forward writes tiles in place) raise torch's own clear errors instead of a wrong tangent.
    @staticmethod
    def forward(q, k, v, causal, scale, block_q, block_k, alignment):
        return flash_attention_forward(q, k, v, causal, scale, block_q, block_k, alignment)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, causal, scale, block_q, block_k, alignment = inputs
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse)  # lse is (B, H, Tq): O(T), not O(T^2)
        ctx.config = (causal, scale, block_q, block_k, alignment)
        ctx.mark_non_differentiable(lse)

    @staticmethod
    @once_differentiable  # the backward is not itself differentiable: a second backward raises, never lies
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        causal, scale, block_q, block_k, alignment = ctx.config
        dq, dk, dv = flash_attention_backward(
            q, k, v, o, lse, do.contiguous(), causal, scale, block_q, block_k, alignment
        )
        return dq, dk, dv, None, None, None, None, None
# --8<-- [end:function]


def reference_attention(
    q, k, v, causal: bool = False, scale: float | None = None, block_q: int = 16, block_k: int = 16,
    alignment: str = "upper_left",
):
    """Differentiable reference attention: returns o; gradients flow to q, k and v."""
    o, _lse = FlashAttentionFunction.apply(q, k, v, causal, scale, block_q, block_k, alignment)
    return o

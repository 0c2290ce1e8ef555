"""A ``torch.autograd.Function`` around the reference forward and backward.

It saves exactly what the backward needs, q, k, v, o and the (B, H, Tq) log-sum-exp (and the (H,) sinks
when there are any), and never a Tq x Tk tensor: that is the memory saving of FlashAttention in training,
made checkable.

The backward is not itself differentiable. A second derivative (a gradient penalty, a Hessian-vector
product, ``torch.autograd.gradgradcheck``) raises ``NotImplementedError``, as ``flashtile.attention``
does, whether or not the incoming gradient requires a gradient: a constant one (the usual case) must
not give second-order terms of zero.
"""

from __future__ import annotations

import torch

from .backward import backward_delta, flash_attention_backward
from .forward import flash_attention_forward
from .sinks import sink_gradient

DOUBLE_BACKWARD = (
    "reference_attention supports one backward pass: double backward (a gradient of a gradient, as in "
    "gradient penalties, Hessian-vector products or gradgradcheck) is not supported; use the float64 "
    "formula of naive_attention, or torch's scaled_dot_product_attention with the math backend, for that"
)


class NoSecondDerivative(torch.autograd.Function):
    """Hands the first derivatives (dq, dk, dv, and dsinks with sinks) on unchanged, tied to q, k, v and do;
    differentiating them again raises. Applied only under ``create_graph=True``, the one case where they
    could be."""

    @staticmethod
    def forward(q, k, v, do, *grads):
        return tuple(g.clone() for g in grads)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(DOUBLE_BACKWARD)


# --8<-- [start:function]
class FlashAttentionFunction(torch.autograd.Function):
    """Reference FlashAttention with a tiled backward; saves (q, k, v, o, lse) only."""

    # forward and setup_context are separate so that torch.func.grad works;
    # forward-mode AD (no jvp) and vmap (the forward writes tiles in place) raise
    # torch's own clear errors instead of a wrong tangent.
    @staticmethod
    def forward(
        q, k, v, causal, scale, block_q, block_k, alignment,
        window=None, softcap=None, sinks=None,
    ):  # fmt: skip
        return flash_attention_forward(
            q, k, v, causal, scale, block_q, block_k, alignment,
            window=window, softcap=softcap, sinks=sinks,
        )  # fmt: skip

    @staticmethod
    def setup_context(ctx, inputs, output):
        # apply() may leave the last ones out
        q, k, v, causal, scale, block_q, block_k, alignment, *extra = inputs
        window, softcap, sinks = (*extra, None, None, None)[:3]
        o, lse = output
        # lse: O(T), not O(T^2)
        ctx.save_for_backward(q, k, v, o, lse, *([] if sinks is None else [sinks]))
        ctx.config = (causal, scale, block_q, block_k, alignment)
        # the same window and cap in both directions
        ctx.masks = dict(window=window, softcap=softcap)
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, *sinks = ctx.saved_tensors
        causal, scale, block_q, block_k, alignment = ctx.config
        # the tiled backward is not differentiable: record nothing of it
        with torch.no_grad():
            do = do.contiguous()
            grads = flash_attention_backward(
                q, k, v, o, lse, do, causal, scale, block_q, block_k, alignment,
                **ctx.masks,
            )  # fmt: skip
            if sinks:  # the sinks' column of dS, summed per head (reference.sinks)
                grads = (*grads, sink_gradient(sinks[0], lse, backward_delta(o, do)))
        # create_graph=True: a second backward through them raises, never lies
        if torch.is_grad_enabled():
            grads = NoSecondDerivative.apply(q, k, v, do, *grads)
        dq, dk, dv, *dsinks = grads
        dsinks = dsinks[0] if dsinks else None
        return (dq, dk, dv, None, None, None, None, None, None, None, dsinks)[
            : len(ctx.needs_input_grad)
        ]
# --8<-- [end:function]


def reference_attention(
    q, k, v, causal: bool = False, scale: float | None = None, block_q: int = 16, block_k: int = 16,
    alignment: str = "upper_left", *, window=None, softcap: float | None = None, sinks=None,
):
    """Differentiable reference attention: returns o; gradients flow to q, k, v and the sinks. window,
    softcap and sinks as in ``flash_attention_forward``."""
    o, _lse = FlashAttentionFunction.apply(q, k, v, causal, scale, block_q, block_k, alignment, window, softcap,
                                           sinks)  # fmt: skip
    return o

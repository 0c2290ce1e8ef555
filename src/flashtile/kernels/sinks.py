"""The sinks' gradient in one launch: dsinks_h = -sum_b,i exp(sink_h - lse_bhi) D_bhi.

``reference.sinks.sink_gradient`` derives it: a sink is one more column of the scores
whose value is zero, so its column of dP is 0 and its column of dS is P_sink * (0 -
D); the sink's gradient sums that column over every row of its head. The backward
kernels have every row's lse (it holds the sink) and D (``delta``, stored by the dQ
kernel) already, so what is left is a reduction over B * Tq numbers per head. Written
as PyTorch operations it is nine small kernels (the cast, the -inf test, the
subtraction, exp, the select, the product, the sum, the negation and the cast back)
that the GPU runs one after another after the backward's own; here it is one program
per head, which sums its rows in a fixed order (the same answer on every call). A sink
of -inf gets 0, also on a row whose lse is -inf (no key and no sink).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 1024  # rows a program reads per step


# --8<-- [start:sink_gradient_kernel]
@triton.jit
def sink_gradient_kernel(
    SINKS, LSE, DELTA, DSINKS, B, T,
    lse_b, lse_h, lse_t, delta_b, delta_h, delta_t,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Program h: dsinks[h] = -sum over b, i of exp(sink - lse[b,h,i]) delta[b,h,i]."""
    h = tl.program_id(0)
    sink = tl.load(SINKS + h).to(tl.float32)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    rows = tl.arange(0, BLOCK)
    for b in range(B):
        for start in range(0, T, BLOCK):
            i = start + rows
            ok = i < T
            lse_at = LSE + b * lse_b + h * lse_h + i * lse_t
            delta_at = DELTA + b * delta_b + h * delta_h + i * delta_t
            lse = tl.load(lse_at, mask=ok, other=float("inf"))  # p_sink = 0 past T
            delta = tl.load(delta_at, mask=ok, other=0.0)
            # sink <= lse, so p_sink <= 1: past 2^24 the rounding of lse may put
            # it below the sink (a row that saw no key, lse = sink), and
            # e^(sink - lse) must not grow from that (a NaN stays NaN)
            gap = sink - lse
            gap = tl.where(gap > 0.0, 0.0, gap)
            p_sink = tl.where(sink == float("-inf"), 0.0, tl.exp(gap))
            total += tl.where(ok, p_sink * delta, 0.0)
    tl.store(DSINKS + h, (-tl.sum(total, axis=0)).to(DSINKS.dtype.element_ty))
# --8<-- [end:sink_gradient_kernel]


def sink_gradient(sinks, lse, delta) -> torch.Tensor:
    """(H,) dsinks in sinks' dtype from ``lse`` and ``delta`` ((B, H, Tq) float32)
    and the (H,) ``sinks``, through Triton's own launch (the strides and B, Tq vary
    from call to call)."""
    B, H, T = lse.shape
    dsinks = torch.empty(sinks.shape, dtype=sinks.dtype, device=sinks.device)
    if sinks.stride(0) != 1:  # the kernel steps one element a head
        sinks = sinks.contiguous()
    sink_gradient_kernel[(H,)](
        sinks, lse, delta, dsinks, B, T, *lse.stride(), *delta.stride(),
        BLOCK=ROWS, num_warps=4, num_stages=1,
    )  # fmt: skip
    return dsinks

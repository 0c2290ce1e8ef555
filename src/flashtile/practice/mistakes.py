"""Mistakes a reader makes, written once: the practice-mode page shows them and checks
their hints.

Each wraps a correct function of the package (the reference forward, the Triton
backward's launcher) and plants one mistake in what it returns, so the battery can be
seen to name it. They are examples for the page, never called by the checker itself; the
full gallery, one line changed in a copy of each solution, is in the tests.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

from ..kernels import backward as kernel_backward
from ..reference import forward as reference_forward
from ..reference import sinks as reference_sinks


# --8<-- [start:forward_mistakes]
def lse_in_log2(*args, **kwargs):
    """lse left in log2 units: an exp2 loop's statistics, never multiplied by ln 2."""
    o, lse = reference_forward.flash_attention_forward(*args, **kwargs)
    return o, lse / math.log(2)


def alignment_ignored(*args, **kwargs):
    """The causal diagonal always at the top left, whatever alignment was asked for."""
    kwargs = dict(kwargs, alignment="upper_left")
    return reference_forward.flash_attention_forward(*args, **kwargs)


def exp_of_exp2_scores(q, k, v, **kwargs):
    """exp of scores scaled for exp2: the temperature times log2(e)."""
    tau = kwargs.get("scale") or q.shape[-1] ** -0.5
    kwargs = dict(kwargs, scale=math.log2(math.e) * tau)
    return reference_forward.flash_attention_forward(q, k, v, **kwargs)


def one_row_off(*args, **kwargs):
    """Row 5 of o 37 % too large: a mistake no symptom rule knows."""
    o, lse = reference_forward.flash_attention_forward(*args, **kwargs)
    o[..., 5, :] *= 1.37
    return o, lse
# --8<-- [end:forward_mistakes]


# --8<-- [start:interleaved_heads]
def interleaved_heads(q, k, v, **kwargs):
    """GQA with a group's heads interleaved: query head h reads kv head h % H_kv."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
    return reference_forward.flash_attention_forward(q, k, v, **kwargs)
# --8<-- [end:interleaved_heads]


# --8<-- [start:sink_mistakes]
def sink_before_scale(q, k, v, **kwargs):
    """The sink multiplied by τ, as if it were a dot product still to be scaled."""
    tau = kwargs.get("scale") or q.shape[-1] ** -0.5
    kwargs = dict(kwargs, sinks=tau * kwargs["sinks"])
    return reference_forward.flash_attention_forward(q, k, v, **kwargs)


def dsink_sign_flipped(sinks, lse, delta):
    """dsink with the wrong sign: +sum of e^(sink - lse) D."""
    return -reference_sinks.sink_gradient(sinks, lse, delta)
# --8<-- [end:sink_mistakes]


# --8<-- [start:backward_mistakes]
def backward_with(mistake: str) -> SimpleNamespace:
    """The Triton backward's launcher with one mistake: "tau", dQ without τ; "rows",
    dV's rows reversed."""
    if mistake not in ("tau", "rows"):
        raise ValueError(f'mistake must be "tau" or "rows", got {mistake!r}')

    def flash_attention_backward(
        q, k, v, o, lse, do, causal=False, scale=None, **kwargs
    ):
        dq, dk, dv = kernel_backward.flash_attention_backward(
            q, k, v, o, lse, do, causal=causal, scale=scale, **kwargs
        )
        tau = scale or q.shape[-1] ** -0.5
        return (dq / tau, dk, dv) if mistake == "tau" else (dq, dk, dv.flip(-2))

    return SimpleNamespace(flash_attention_backward=flash_attention_backward)
# --8<-- [end:backward_mistakes]

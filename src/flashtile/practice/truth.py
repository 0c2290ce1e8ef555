"""The practice battery's own float64 truth: attention and softmax straight from their definitions.

This module imports nothing from the rest of flashtile, on purpose: when the battery checks the
package's own functions, the expected values must not come from the code under test. It is the same
idea as the test suite's ``tests/_truth.py``, written again here so that an installed flashtile (which
has no tests/ folder) can still check a reader's module.

Conventions (the package's): causal query i sees key j iff j <= i + offset, with offset 0
("upper_left") or Tk - Tq ("lower_right"); a row that sees no key has o = 0 and lse = -inf.
"""

from __future__ import annotations

import math

import torch


# --8<-- [start:truth]
def visible(
    Tq: int, Tk: int, causal: bool, alignment: str = "upper_left"
) -> torch.Tensor:
    """Boolean (Tq, Tk): True where query i sees key j."""
    if not causal:
        return torch.ones(Tq, Tk, dtype=torch.bool)
    offset = 0 if alignment == "upper_left" else Tk - Tq
    return torch.arange(Tk)[None, :] <= torch.arange(Tq)[:, None] + offset


def attention_truth(
    q, k, v, causal=False, scale=None, alignment="upper_left", mask=None
):
    """(o, lse) in float64 for (B, H, Tq, D) q and (B, H, Tk, D) k, v; differentiable.
    ``mask``: a boolean (..., Tq, Tk) visibility to use instead of causal and
    alignment's."""
    q, k, v = (t.double().cpu() for t in (q, k, v))
    tau = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = tau * torch.einsum("bhid,bhjd->bhij", q, k)
    seen = visible(q.shape[2], k.shape[2], causal, alignment) if mask is None else mask
    s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    # a row that sees no key: P = 0, not softmax's NaN
    empty = torch.isneginf(lse)[..., None]
    p = torch.where(empty, 0.0, torch.softmax(torch.where(empty, 0.0, s), dim=-1))
    return torch.einsum("bhij,bhjd->bhid", p, v), lse
# --8<-- [end:truth]


def attention_grads_truth(q, k, v, do, causal=False, scale=None, alignment="upper_left"):
    """(o, lse, dq, dk, dv) in float64, the gradients by torch autograd through ``attention_truth``."""
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    o, lse = attention_truth(q64, k64, v64, causal, scale, alignment)
    # the gradients of sum(o * dO), the same vector-Jacobian product as grad(o, ..., dO); a scalar output spares
    # autograd's check of a given gradient's shape, which imports sympy (seconds) on its first use
    dq, dk, dv = torch.autograd.grad((o * do.detach().double().cpu()).sum(), (q64, k64, v64))
    return o.detach(), lse.detach(), dq, dk, dv


def backward_equations(q, k, v, o, lse, do, causal=False, scale=None, alignment="upper_left", mask=None):
    """(dq, dk, dv) in float64 from the backward's equations with the GIVEN o and lse, densely:
    P = exp(τ Q Kᵀ - lse) (0 where hidden), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O)), dQ = τ dS K,
    dK = τ dSᵀ Q. With the o and lse of the same τ and mask it equals ``attention_grads_truth``; the
    battery evaluates it at another τ or mask (``mask``: a boolean (Tq, Tk) visibility instead of causal and
    alignment's) to recognise a backward that used them."""
    q, k, v, o, lse, do = (t.detach().double().cpu() for t in (q, k, v, o, lse, do))
    tau = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    seen = visible(q.shape[2], k.shape[2], causal, alignment) if mask is None else mask
    seen = seen & ~torch.isneginf(lse)[..., None]
    p = torch.where(seen, torch.exp(tau * q @ k.transpose(-1, -2) - torch.where(seen, lse[..., None], 0.0)), 0.0)
    ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    return tau * ds @ k, tau * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ do


def softmax_truth(x: torch.Tensor) -> torch.Tensor:
    """Row softmax of x's last dimension in float64 (a row of all -inf gives NaN, as torch does)."""
    return torch.softmax(x.double().cpu(), dim=-1)


def logsumexp_truth(x: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(x.double().cpu(), dim=-1)


# --8<-- [start:sink_truth]
def sink_attention_truth(
    q, k, v, sinks, causal=False, scale=None, alignment="upper_left"
):
    """(o, lse) in float64 of attention with a sink: every row's softmax gets one
    more column, whose score is the sink and whose value is zero. q: (B, H, Tq, D);
    k, v: (B, H_kv, Tk, D), query head h reads key/value head h // (H // H_kv);
    sinks: (H,), one per query head, or (B, H, Tq), one per row; -inf is no sink.
    Differentiable."""
    q, k, v = (t.double().cpu() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    tau = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = tau * torch.einsum("bhid,bhjd->bhij", q, k)
    seen = visible(q.shape[2], k.shape[2], causal, alignment)
    s = s.masked_fill(~seen, float("-inf"))
    sink = sinks.double().cpu()
    sink = sink[None, :, None] if sink.dim() == 1 else sink
    # the sink's column, last
    s = torch.cat([s, sink.expand(s.shape[:-1])[..., None]], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)[..., None]  # no key and no sink: o = 0, lse = -inf
    p = torch.where(empty, 0.0, torch.softmax(torch.where(empty, 0.0, s), dim=-1))
    return torch.einsum("bhij,bhjd->bhid", p[..., :-1], v), lse
# --8<-- [end:sink_truth]


def sink_gradient_truth(q, k, v, sinks, do, causal=False, scale=None, alignment="upper_left"):
    """(o, lse, dsinks) in float64: dsinks, (H,), the gradient of sum(o * dO) with respect to the sinks, by
    torch autograd through ``sink_attention_truth`` (no formula for it is written here)."""
    leaf = sinks.detach().double().cpu().requires_grad_()
    o, lse = sink_attention_truth(q.detach(), k.detach(), v.detach(), leaf, causal, scale, alignment)
    (dsinks,) = torch.autograd.grad((o * do.detach().double().cpu()).sum(), leaf)
    return o.detach(), lse.detach(), dsinks

"""Answers to the interview page's coding questions, kept as code so the page can include and run them.

Each function is what a whiteboard answer should look like: short, correct at the edges, and with
the shapes written down. They are deliberately plain (no tiles, no kernels); the chapters hold the
fast versions.
"""

from __future__ import annotations

import math

import torch


# --8<-- [start:causal_attention]
def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """softmax(τ Q Kᵀ + causal mask) V for q, k, v of shape (B, H, T, D); query i sees
    keys j <= i."""
    T, D = q.shape[-2], q.shape[-1]
    # keeps the scores' variance near 1
    tau = 1.0 / math.sqrt(D) if scale is None else scale
    s = tau * (q @ k.transpose(-1, -2))  # (B, H, T, T)
    # j > i
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(diagonal=1)
    # -inf, not a large negative number: exp gives exactly 0
    s = s.masked_fill(future, float("-inf"))
    # the max trick: every exponent <= 0, no overflow
    s = s - s.amax(dim=-1, keepdim=True)
    p = torch.exp(s)
    return (p / p.sum(dim=-1, keepdim=True)) @ v  # (B, H, T, D)
# --8<-- [end:causal_attention]


# --8<-- [start:one_pass_softmax]
def one_pass_softmax_stats(row: list[float]) -> tuple[float, float]:
    """(m, l) of a row in one pass over its elements: the online softmax, one column at
    a time."""
    m, l = float("-inf"), 0.0
    for x in row:
        m_new = max(m, x)
        # nothing finite seen yet: keep (m, l) = (-inf, 0), avoid -inf - (-inf)
        if m_new == float("-inf"):
            continue
        # rescale the old sum onto the new max
        l = l * math.exp(m - m_new) + math.exp(x - m_new)
        m = m_new
    return m, l
# --8<-- [end:one_pass_softmax]

"""A forward that is not FlashAttention and has a planted causal bug (the checker must fail it).

64-row strips of queries, each with a full softmax over the keys it may see (no key tiles, no running
max), and the causal mask dropped whenever Tq = Tk is a multiple of 64: right on every other shape.
"""

from __future__ import annotations

import math

import torch


def flash_attention_forward(q, k, v, causal=False, scale=None, block_q=16, block_k=16, alignment="upper_left",
                            on_tile=None):  # fmt: skip
    Tq, Tk = q.shape[-2], k.shape[-2]
    tau = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    offset = 0 if alignment == "upper_left" else Tk - Tq
    c = torch.float64 if q.dtype == torch.float64 else torch.float32
    planted = Tq == Tk and Tq % 64 == 0  # BUG: the mask dropped on tile-multiple lengths
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=c)
    for start in range(0, Tq, 64):
        end = min(start + 64, Tq)
        s = tau * q[..., start:end, :].to(c) @ k.to(c).transpose(-1, -2)  # a 64 x Tk strip, not a tile
        if causal and not planted:
            i, j = torch.arange(start, end)[:, None], torch.arange(Tk)[None, :]
            s = s.masked_fill(j > i + offset, float("-inf"))
        strip_lse = torch.logsumexp(s, dim=-1)
        p = torch.where(torch.isneginf(strip_lse)[..., None], 0.0, torch.exp(s - strip_lse[..., None]))
        o[..., start:end, :] = (p @ v.to(c)).to(q.dtype)
        lse[..., start:end] = strip_lse
    return o, lse

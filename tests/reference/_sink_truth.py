"""The float64 truth for sinks and unequal head dims, written from the definition without importing flashtile.

softmax over the row's visible scores and one extra column, the sink, whose value is zero:

    S = cap(tau Q K^T), masked;   lse_i = logsumexp([S_i, sink_h]);   O_i = sum_j e^(S_ij - lse_i) v_j.

q is (B, H, Tq, d_qk), k (B, H_kv, Tk, d_qk), v (B, H_kv, Tk, d_v): nothing ties d_v to d_qk. The mask:
query i sees key j iff i + offset - left <= j <= i + offset + right (offset 0 upper-left, Tk - Tq
lower-right; a side of -1 unbounded; causal caps the right side at 0). Differentiable in q, k, v and
sinks through torch autograd.
"""

from __future__ import annotations

import math

import torch


def visible(Tq: int, Tk: int, causal=False, alignment="upper_left", window=None) -> torch.Tensor:
    """Boolean (Tq, Tk): True where query i sees key j."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right == -1 else min(right, 0)
    offset = 0 if alignment == "upper_left" else Tk - Tq
    i = torch.arange(Tq)[:, None]
    j = torch.arange(Tk)[None, :]
    keep = torch.ones(Tq, Tk, dtype=torch.bool)
    if left != -1:
        keep &= j >= i + offset - left
    if right != -1:
        keep &= j <= i + offset + right
    return keep


def dense_attention(q, k, v, *, sinks=None, causal=False, alignment="upper_left", window=None, softcap=None,
                    scale=None):  # fmt: skip
    """(o, lse) in float64; a row with no visible key and no sink gets o = 0, lse = -inf."""
    assert q.dtype == k.dtype == v.dtype == torch.float64
    B, H, Tq, d_qk = q.shape
    Tk = k.shape[2]
    tau = 1.0 / math.sqrt(d_qk) if scale is None else scale
    group = H // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = tau * torch.einsum("bhid,bhjd->bhij", q, k)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible(Tq, Tk, causal, alignment, window), float("-inf"))
    if sinks is not None:  # one more column: the sink's score, the same for every row of a head
        sink_column = sinks.double()[None, :, None, None].expand(B, H, Tq, 1)
        s = torch.cat([s, sink_column], dim=-1)
        v = torch.cat([v, torch.zeros_like(v[:, :, :1])], dim=2)  # its value is zero
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)  # no key and no sink: o = 0, lse = -inf
    s_safe = torch.where(empty, 0.0, s)  # keeps NaN out of the gradients of an empty row
    lse_safe = torch.logsumexp(s_safe, dim=-1, keepdim=True)
    p = torch.where(empty, 0.0, torch.exp(s_safe - lse_safe))
    o = torch.einsum("bhij,bhjd->bhid", p, v)
    return o, torch.where(empty, float("-inf"), lse_safe)[..., 0]

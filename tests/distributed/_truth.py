"""Float64 attention and its gradients from the definition (einsum, torch.softmax, autograd).

Deliberately independent of flashtile: no import from it, so a bug shared by the ring and the
reference tier cannot hide in the truth.
"""

from __future__ import annotations

import torch


def attention_truth(q, k, v, do, is_causal: bool, scale: float | None = None):
    """(o, dq, dk, dv) in float64 for q (B, H, T, D), k, v (B, H_kv, T, D), do like q."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # head h reads h // group
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = scale * torch.einsum("bhid,bhjd->bhij", q, k_rep)
    if is_causal:
        T = q.shape[2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(diagonal=1), float("-inf"))
    o = torch.einsum("bhij,bhjd->bhid", torch.softmax(s, dim=-1), v_rep)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do.double())
    return o.detach(), dq, dk, dv


def random_qkv(B, H, H_kv, T, D, seed, dtype=torch.float64):
    """q, k, v, do drawn from one seeded generator (never zeros)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=gen, dtype=dtype)
    k = torch.randn(B, H_kv, T, D, generator=gen, dtype=dtype)
    v = torch.randn(B, H_kv, T, D, generator=gen, dtype=dtype)
    do = torch.randn(B, H, T, D, generator=gen, dtype=dtype)
    return q, k, v, do

"""A reader's tiled forward and backward in PyTorch, with switches for the gallery's PyTorch-tier bugs.

* ``guard_neg_inf=False``: exp(m - m_new) with both -inf gives NaN on rows that see no key.
* ``floor_tile_count=True``: the causal key-tile count (q_end + offset) // block_k, a floor where a
  ceiling is needed: right while block_k divides T, one tile short on a ragged last query tile.
* ``lse_dtype=torch.bfloat16``: lse rounded to 16 bits before it is returned (to save memory, say).
* ``alignment_ignored=True`` (forward and backward): the diagonal always starts top-left (offset 0),
  whatever ``alignment`` says.
* ``scale_ignored=True`` (forward and backward): τ = 1/sqrt(D) always, the ``scale`` argument unused.
* ``rescale=False``: l and acc are not moved onto the new max when it grows.
* ``subtract_max=False``: p = exp(s) with no max subtracted; right until a score passes exp's range.
* ``stats_dtype=torch.float16``: m and l kept in 16 bits for 16-bit inputs (lse converted at the end).
* ``untiled=True``: the whole Tq x Tk score matrix, softmax, then P V; right, but not FlashAttention.
* ``skip_tiles=False``: every key tile visited, the hidden ones masked; right unless they hold NaN.
* backward ``mask_in_backward=False``: the causal mask applied in the forward only.
* backward ``guard_neg_inf=False``: the scores masked to -inf before P = exp(S - lse), and lse used as
  it is: a row that sees no key has lse = -inf, and exp(-inf - (-inf)) = NaN.
* backward ``untiled=True``: autograd through the full softmax (the whole Tq x Tk matrix P, no D
  trick); right, but not FlashAttention's backward.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch


def _visible(q_start, q_end, k_start, k_end, offset):
    i = torch.arange(q_start, q_end)[:, None]
    j = torch.arange(k_start, k_end)[None, :]
    return j <= i + offset


def make(guard_neg_inf=True, floor_tile_count=False, lse_dtype=None, alignment_ignored=False, scale_ignored=False,
         rescale=True, subtract_max=True, stats_dtype=None, untiled=False, skip_tiles=True) -> SimpleNamespace:
    def flash_attention_forward(q, k, v, causal=False, scale=None, block_q=16, block_k=16, alignment="upper_left",
                                on_tile=None):
        Tq, Tk = q.shape[-2], k.shape[-2]
        tau = 1 / math.sqrt(q.shape[-1]) if scale is None or scale_ignored else scale
        offset = 0 if alignment == "upper_left" or alignment_ignored else Tk - Tq
        c = torch.float64 if q.dtype == torch.float64 else torch.float32
        if stats_dtype is not None and q.dtype != torch.float64:
            c = stats_dtype  # BUG: the statistics in 16 bits
        qc, kc, vc = q.to(c), k.to(c), v.to(c)
        if untiled:  # BUG: the whole score matrix at once
            s = tau * qc @ kc.transpose(-1, -2)
            if causal:
                s = s.masked_fill(~_visible(0, Tq, 0, Tk, offset), float("-inf"))
            lse = torch.logsumexp(s, dim=-1)
            p = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
            return (p @ vc).to(q.dtype), lse
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
        for q_start in range(0, Tq, block_q):
            q_end = min(q_start + block_q, Tq)
            m = torch.full((*q.shape[:-2], q_end - q_start), float("-inf"), dtype=c)
            l = torch.zeros_like(m)
            acc = torch.zeros((*q.shape[:-2], q_end - q_start, q.shape[-1]), dtype=c)
            n_tiles = -(-Tk // block_k)
            if causal and skip_tiles:
                last = max(q_end - 1 + offset, -1)  # the last key the tile's last row sees
                needed = (q_end + offset) // block_k if floor_tile_count else last // block_k + 1
                n_tiles = min(n_tiles, needed)
            for k_start in range(0, n_tiles * block_k, block_k):
                k_end = min(k_start + block_k, Tk)
                s = tau * qc[..., q_start:q_end, :] @ kc[..., k_start:k_end, :].transpose(-1, -2)
                if causal:
                    s = s.masked_fill(~_visible(q_start, q_end, k_start, k_end, offset), float("-inf"))
                m_new = torch.maximum(m, s.max(dim=-1).values)
                m_sub = torch.where(torch.isneginf(m_new), 0.0, m_new) if guard_neg_inf else m_new
                if not subtract_max:
                    m_sub = torch.zeros_like(m_new)  # BUG: exp of the raw scores
                alpha = torch.exp(m - m_sub) if rescale and subtract_max else torch.ones_like(m)  # BUG when not
                p = torch.exp(s - m_sub[..., None])
                l = alpha * l + p.sum(-1)
                acc = alpha[..., None] * acc + p @ vc[..., k_start:k_end, :]
                m = m_new
            empty = l == 0
            o[..., q_start:q_end, :] = (acc / torch.where(empty, 1.0, l)[..., None]).to(q.dtype)
            lse[..., q_start:q_end] = torch.where(empty, float("-inf"), (m if subtract_max else 0) + torch.log(l))
        if lse_dtype is not None:
            lse = lse.to(lse_dtype).to(lse.dtype)  # BUG: the statistics kept in 16 bits
        return o, lse

    return SimpleNamespace(flash_attention_forward=flash_attention_forward)


def make_backward(mask_in_backward=True, scale_ignored=False, alignment_ignored=False, guard_neg_inf=True,
                  untiled=False) -> SimpleNamespace:
    def flash_attention_backward(q, k, v, o, lse, do, causal=False, scale=None, block_q=16, block_k=16,
                                 alignment="upper_left"):
        Tq, Tk = q.shape[-2], k.shape[-2]
        tau = 1 / math.sqrt(q.shape[-1]) if scale is None or scale_ignored else scale
        offset = 0 if alignment == "upper_left" or alignment_ignored else Tk - Tq
        if untiled:  # BUG: the whole score matrix, and autograd through softmax instead of the tiles and D
            q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
            s = tau * q_ @ k_.transpose(-1, -2)
            if causal:
                s = s.masked_fill(~_visible(0, Tq, 0, Tk, offset), float("-inf"))
            m = s.detach().amax(dim=-1, keepdim=True)
            p = torch.exp(s - torch.where(torch.isneginf(m), 0.0, m))
            total = p.sum(dim=-1, keepdim=True)
            p = p / torch.where(total == 0, 1.0, total)  # a row that sees no key: P = 0
            return torch.autograd.grad(p @ v_, (q_, k_, v_), do)
        delta = (do * o).sum(-1)  # D = rowsum(dO * O)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        lse_safe = torch.where(torch.isneginf(lse), 0.0, lse)
        for k_start in range(0, Tk, block_k):
            k_end = min(k_start + block_k, Tk)
            kt, vt = k[..., k_start:k_end, :], v[..., k_start:k_end, :]
            for q_start in range(0, Tq, block_q):
                q_end = min(q_start + block_q, Tq)
                s = tau * q[..., q_start:q_end, :] @ kt.transpose(-1, -2)
                if not guard_neg_inf:  # BUG: masked scores, and lse = -inf where a row sees no key
                    if causal:
                        s = s.masked_fill(~_visible(q_start, q_end, k_start, k_end, offset), float("-inf"))
                    p = torch.exp(s - lse[..., q_start:q_end, None])
                else:
                    p = torch.exp(s - lse_safe[..., q_start:q_end, None])
                    p = torch.where(torch.isneginf(lse[..., q_start:q_end, None]), 0.0, p)
                if causal and mask_in_backward and guard_neg_inf:  # (unguarded, the scores were masked instead)
                    p = torch.where(_visible(q_start, q_end, k_start, k_end, offset), p, 0.0)
                dot = do[..., q_start:q_end, :]
                dv[..., k_start:k_end, :] += p.transpose(-1, -2) @ dot
                ds = p * (dot @ vt.transpose(-1, -2) - delta[..., q_start:q_end, None])
                dq[..., q_start:q_end, :] += tau * ds @ kt
                dk[..., k_start:k_end, :] += tau * ds.transpose(-1, -2) @ q[..., q_start:q_end, :]
        return dq, dk, dv

    return SimpleNamespace(flash_attention_backward=flash_attention_backward)

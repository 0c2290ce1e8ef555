"""A reader's online softmax, written the way a first attempt looks, with switches for two gallery bugs.

``make()`` is right; ``make(rescale=False)`` forgets to move the old sum onto a new max;
``make(guard_neg_inf=False)`` computes exp(-inf - (-inf)) = NaN for a state that has seen only -inf.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def make(rescale: bool = True, guard_neg_inf: bool = True) -> SimpleNamespace:
    def exp_diff(a, b):
        if guard_neg_inf:
            b = torch.where(torch.isneginf(b), torch.zeros_like(b), b)  # nothing seen yet: subtract 0
        return torch.exp(a - b)

    def online_softmax_update(m, l, x_block):
        m_new = torch.maximum(m, x_block.max(dim=-1).values)
        alpha = exp_diff(m, m_new) if rescale else torch.ones_like(m)  # BUG when rescale=False
        return m_new, alpha * l + exp_diff(x_block, m_new[..., None]).sum(dim=-1)

    def online_softmax_stats(x, block):
        m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)
        l = torch.zeros(x.shape[:-1], dtype=x.dtype)
        for start in range(0, x.shape[-1], block):
            m, l = online_softmax_update(m, l, x[..., start : start + block])
        return m, l

    def lse_from_stats(m, l):
        return torch.where(l == 0, torch.full_like(m, float("-inf")), m + torch.log(l))

    def merge(m_a, l_a, m_b, l_b):
        m = torch.maximum(m_a, m_b)
        return m, exp_diff(m_a, m) * l_a + exp_diff(m_b, m) * l_b

    return SimpleNamespace(**{f.__name__: f for f in (online_softmax_update, online_softmax_stats, lse_from_stats,
                                                        merge)})

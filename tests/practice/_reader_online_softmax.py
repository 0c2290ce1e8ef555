"""A reader's online softmax, written the way a first attempt looks, with switches for the gallery's bugs.

``make()`` is right. The bugs:

* ``rescale=False``: the old sum is never moved onto a new max, in the update and in the streaming.
* ``update_rescales=False``: only ``online_softmax_update`` forgets the rescale; ``online_softmax_stats``
  takes the row's max first and sums in one go (two passes), so streaming a row never exposes it.
* ``guard_neg_inf=False``: exp(-inf - (-inf)) = NaN for a state that has seen only -inf.
* ``subtract_max=False``: l = sum exp(x) on the raw values (m kept but unused); lse = log l, right
  until a value passes exp's range.
* ``guard_merge=False``: only ``merge`` forgets the guard: exp(m_a - m) with m_a = m = -inf is NaN, so
  merging two empty states gives l = NaN, while merging an empty state with a seen one is right.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def make(rescale: bool = True, guard_neg_inf: bool = True, update_rescales: bool = True,
         subtract_max: bool = True, guard_merge: bool = True) -> SimpleNamespace:
    def exp_diff(a, b):
        if not subtract_max:
            return torch.exp(a)  # BUG: nothing subtracted, exp(1000) = inf
        if guard_neg_inf:
            b = torch.where(torch.isneginf(b), torch.zeros_like(b), b)  # nothing seen yet: subtract 0
        return torch.exp(a - b)

    def online_softmax_update(m, l, x_block):
        m_new = torch.maximum(m, x_block.max(dim=-1).values)
        keep = rescale and update_rescales and subtract_max
        alpha = exp_diff(m, m_new) if keep else torch.ones_like(m)  # BUG when not keep (and subtract_max)
        return m_new, alpha * l + exp_diff(x_block, m_new[..., None]).sum(dim=-1)

    def online_softmax_stats(x, block):
        if not update_rescales:  # two passes: the max of the whole row first, then one sum
            m = x.max(dim=-1).values
            return m, exp_diff(x, m[..., None]).sum(dim=-1)
        m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)
        l = torch.zeros(x.shape[:-1], dtype=x.dtype)
        for start in range(0, x.shape[-1], block):
            m, l = online_softmax_update(m, l, x[..., start : start + block])
        return m, l

    def lse_from_stats(m, l):
        return torch.where(l == 0, torch.full_like(m, float("-inf")), (m if subtract_max else 0) + torch.log(l))

    def merge(m_a, l_a, m_b, l_b):
        m = torch.maximum(m_a, m_b)
        if not subtract_max:
            return m, l_a + l_b
        if not guard_merge:  # BUG: exp(-inf - (-inf)) = NaN when neither side has seen anything
            return m, torch.exp(m_a - m) * l_a + torch.exp(m_b - m) * l_b
        return m, exp_diff(m_a, m) * l_a + exp_diff(m_b, m) * l_b

    return SimpleNamespace(**{f.__name__: f for f in (online_softmax_update, online_softmax_stats, lse_from_stats,
                                                        merge)})

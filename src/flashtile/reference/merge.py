"""Merging (o, lse) states: the attention result over two disjoint sets of keys, from the result over each.

A normalised partial (o, lse) over some keys is the online-softmax state m = lse, l = 1, acc = o (because
lse = m + log l), so two of them combine with Part A's ``online_softmax.merge`` of (m, l) statistics, and
the outputs follow with the same two weights:

    m = max(lse_a, lse_b),   l = e^(lse_a - m) + e^(lse_b - m),
    o = (e^(lse_a - m) o_a + e^(lse_b - m) o_b) / l,   lse = m + log l.

Split-K decoding (``reference.decode``) merges its key slices with it, ring attention
(``flashtile.distributed``) each visiting key shard's result; ``kernels.merge.merge_into`` is the same merge
in place, as one Triton kernel. An attention sink is one more part, o = 0 and lse = sink, merged exactly
once (``reference.sinks.merge_sink``): merged into every part, it would count once per part.
"""

from __future__ import annotations

import torch

from .online_softmax import lse_from_stats, merge, safe_exp_diff


# --8<-- [start:merge_partials]
def merge_partials(o_a, lse_a, o_b, lse_b):
    """Combine the normalised partials of two disjoint key sets into the partial of
    their union.

    o_a, o_b: (..., T, D), each normalised over its own keys; lse_a, lse_b: (..., T).
    Computed in lse_a's dtype (the others are cast to it), whatever the dtype of the
    outputs. Returns (o, lse) in that dtype. A part that saw no key (o = 0, lse = -inf)
    counts for nothing. Associative and commutative, like the sums it adds.
    """
    c = lse_a.dtype
    o_a, o_b, lse_b = o_a.to(c), o_b.to(c), lse_b.to(c)
    ones = torch.ones_like(lse_a)
    # m = max(lse_a, lse_b), l = e^(lse_a - m) + e^(lse_b - m)
    m, l = merge(lse_a, ones, lse_b, ones)
    acc = (
        safe_exp_diff(lse_a, m)[..., None] * o_a
        + safe_exp_diff(lse_b, m)[..., None] * o_b
    )
    # both parts saw nothing (a NaN l is not 0: NaN stays NaN)
    empty = (l == 0)[..., None]
    o = torch.where(empty, 0.0, acc / torch.where(empty, 1.0, l[..., None]))
    return o, lse_from_stats(m, l)
# --8<-- [end:merge_partials]

"""Attention sinks: one logit per query head that joins every row's softmax and carries no value.

A sink is a learned score s_h per query head h (gpt-oss has one per head and layer). Row i of head h
takes its softmax over its visible keys and the sink,

    lse_i = log(e^(s_h) + sum_j e^(S_ij)),   P_ij = e^(S_ij - lse_i),   O_i = sum_j P_ij v_j,

and the sink's own share e^(s_h - lse_i) multiplies a value of zero: the row's weights on its keys sum
to less than one, so a head can put part of its attention nowhere.

Forward: the sink is a key the row has seen before the first tile, whose value is zero. So the row
starts from the online softmax's state after that one key, m = s_h, l = e^(s_h - s_h) = 1, acc = 0,
instead of (-inf, 0, 0) (``sink_start_state``), and every rescale after it is the same identity.
lse is then the log of the whole normaliser, e^(s_h) included. A row that sees no key keeps that
start: o = 0 and lse = s_h. A sink of -inf is no sink: its start state is (-inf, 0).

Backward: given that lse, P = e^(S - lse) is already each key's share, so dQ, dK and dV are computed
as without a sink. The sink is one more column of S whose value is 0, so its dP = dO . 0 = 0 and its
dS = P_sink (0 - D) = -e^(s_h - lse_i) D_i; summed over every row that shares it (``sink_gradient``).

Merging: a partial (o, lse) over some keys merges as before (``reference.merge``), and the sink must
be counted once: one part starts from it, or it is merged at the end as a partial of its own, o = 0
and lse = s_h (``merge_sink``).
"""

from __future__ import annotations

import torch

from .._checks import check_sinks  # the one check of every tier (re-exported here)
from .merge import merge_partials
from .online_softmax import online_softmax_update, safe_exp_diff

__all__ = ["check_sinks", "merge_sink", "sink_gradient", "sink_start_state"]


# --8<-- [start:start_state]
def sink_start_state(sinks: torch.Tensor, rows: tuple[int, int, int]):
    """(m, l) of rows (B, H, n) that have seen the sink and nothing else.

    The empty state (-inf, 0) updated with one column, the sink's score: m = sink and
    l = e^(sink - sink) = 1. acc stays 0, the sink's value being zero. A sink of -inf
    leaves (-inf, 0): no sink at all.
    """
    B, H, n = rows
    m = torch.full((B, H, n), float("-inf"), dtype=torch.float64, device=sinks.device)
    l = torch.zeros_like(m)
    sink_column = sinks.double()[None, :, None, None].expand(B, H, n, 1)  # (B, H, n, 1)
    return online_softmax_update(m, l, sink_column)
# --8<-- [end:start_state]


# --8<-- [start:gradient]
def sink_gradient(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor):
    """dsink_h = -(sum over the batch and the rows of head h of e^(sink_h - lse) * D).

    sinks: (H,); lse, delta: (B, H, Tq), lse from the forward with these sinks and
    delta = D = rowsum(dO * O) (``backward_delta``). The sink's column has dP = dO . 0
    = 0, so its dS = P_sink * (0 - D). A row that saw no key has o = 0, so D = 0 there.
    Returns (H,) in sinks' dtype.
    """
    p_sink = safe_exp_diff(sinks.double()[None, :, None], lse.double())  # (B, H, Tq)
    # a probability, at most 1 (sink <= lse), whatever the rounding of an lse handed in
    # as float32 (NaN stays NaN)
    p_sink = p_sink.clamp(max=1.0)
    return -(p_sink * delta.double()).sum(dim=(0, 2)).to(sinks.dtype)
# --8<-- [end:gradient]


# --8<-- [start:merge_sink]
def merge_sink(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """Fold the sinks into a finished (o, lse) computed without them.

    The sink is the partial of one key whose value is zero, o = 0 and lse = sink, and is
    merged once like any other part. o: (B, H, T, d_v); lse: (B, H, T); sinks: (H,).
    Returns (o, lse) in lse's dtype.
    """
    sink_lse = sinks.to(lse.dtype)[None, :, None].expand_as(lse)  # (B, H, T)
    return merge_partials(o, lse, torch.zeros_like(o), sink_lse)
# --8<-- [end:merge_sink]

"""Drill: the gradient of an attention sink. Read part-a/sinks-and-head-dims.

The sink is one more column of row i's scores whose value is zero. Its dP = dO . 0 = 0, so its
dS = P_sink * (0 - D_i), with P_sink = e^(sink_h - lse_i) the sink's share of row i and
D = rowsum(dO * O) the backward's D (``delta`` in code). Every row of every batch element shares
the head's sink:
    dsink_h = -(sum over b and i of e^(sink_h - lse[b, h, i]) * D[b, h, i]).
Check with:
    python -m flashtile.practice check DIR --step sink_gradient
"""

from __future__ import annotations

import torch


def sink_gradient(
    sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor
) -> torch.Tensor:
    """The gradient of the loss with respect to the sinks.

    Args:
        sinks: (H,), as the forward got them.
        lse: (B, H, Tq) from the forward with these sinks.
        delta: (B, H, Tq), D = rowsum(dO * O).

    Returns:
        (H,): dsink_h = -(sum over b and i of e^(sink_h - lse[b, h, i]) * delta[b, h, i]).
    """
    raise NotImplementedError("TODO: each row's D, weighted by the sink's probability")

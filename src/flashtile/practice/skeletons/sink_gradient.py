"""Drill: the gradient of an attention sink. Read part-a/sinks-and-head-dims.

The sink is one more column of row i's scores, whose value is zero, and lse includes it. Find
the loss's gradient with respect to each head's sink from what the backward already has: the
forward's lse and D = rowsum(dO * O) (``delta`` in code), one number per row. Every row of
every batch element shares its head's sink. Check with:
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
        (H,): d loss / d sinks.
    """
    raise NotImplementedError("TODO: the sinks' gradient from lse and delta")

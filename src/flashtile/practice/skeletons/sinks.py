"""Drill: an attention sink. Read part-a/sinks-and-head-dims.

A sink is one logit per query head that joins every row's softmax and carries no value:
row i of head h normalises over its visible keys and the sink,

    lse_i = log(e^sink_h + sum_j e^(S_ij)),   o_i = sum_j e^(S_ij - lse_i) v_j,

with S = τ q kᵀ (the sink is in the units of the scaled scores: it is never multiplied by τ).
Work it into the tiled forward without a pass of its own and without a column of scores per
tile; a sink of -inf must give exactly the forward without one. Start from your forward of
step 3 (and the GQA drill). Check with:
    python -m flashtile.practice check DIR --step sink
"""

from __future__ import annotations

import torch


def flash_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = 16,
    block_k: int = 16,
    alignment: str = "upper_left",
    *,
    sinks: torch.Tensor | None = None,
):
    """Tiled attention forward with one sink per query head.

    Args:
        q: (B, H, Tq, D); k, v: (B, H_kv, Tk, D), H a multiple of H_kv (query head h
            reads key/value head h // (H // H_kv), as in the GQA drill).
        causal, scale, block_q, block_k, alignment: as in step 3.
        sinks: None (no sink) or (H,), one logit per query head; -inf is no sink.

    Returns:
        o: (B, H, Tq, D); lse: (B, H, Tq), the log of the whole normaliser, e^sink
        included. A row that sees no key gets o = 0 and lse = its sink.
    """
    raise NotImplementedError("TODO: the tiled forward with the sink in every row's softmax")

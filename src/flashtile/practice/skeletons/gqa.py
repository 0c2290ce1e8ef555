"""Drill: grouped-query attention. Read part-c/decode (GQA packing).

H query heads share H_kv key/value heads, H a multiple of H_kv: query head h reads key/value head
h // (H // H_kv) (the heads of a group are consecutive, as SDPA's enable_gqa has it; MQA is H_kv = 1).
Start from your forward of step 2. Check with:
    python -m flashtile.practice check DIR --step gqa
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
):
    """Tiled attention forward with shared key/value heads.

    Args:
        q: (B, H, Tq, D); k, v: (B, H_kv, Tk, D), H a multiple of H_kv.
        causal, scale, block_q, block_k, alignment: as in step 2.

    Returns:
        o: (B, H, Tq, D); lse: (B, H, Tq), as in step 2.
    """
    raise NotImplementedError("TODO: query head h reads key/value head h // (H // H_kv)")

"""Steps 2 and 3: the tiled forward, then causal masking. Read part-a/forward and part-a/causal-tiles.

One query tile of block_q rows keeps (m, l, acc) while it walks the key tiles of block_k columns;
never form the whole Tq x Tk score matrix (one case measures the largest tensor you create), and
under causal never load a key tile the query tile cannot see (one case puts NaN there). Check with:
    python -m flashtile.practice check DIR --step forward
    python -m flashtile.practice check DIR --step causal
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
    on_tile=None,
):
    """Tiled attention forward.

    Args:
        q: (B, H, Tq, D); k, v: (B, H, Tk, D).
        causal: query i sees key j iff j <= i + offset, offset = 0 for alignment "upper_left" and
            Tk - Tq for "lower_right". Skip the key tiles a query tile cannot see.
        scale: τ, multiplies Q K^T; 1/sqrt(D) when None.
        block_q, block_k: tile sizes, any positive ints (they need not divide Tq or Tk).
        on_tile: optional callback on_tile(q_index, k_index, kind); the battery does not use it.

    Returns:
        o: (B, H, Tq, D) in q's dtype; lse: (B, H, Tq), float64 for float64 inputs and float32 for
        16-bit ones (compute in float32 then). A row that sees no key gets o = 0 and lse = -inf.
    """
    raise NotImplementedError("TODO: for each query tile, (m, l, acc) over its key tiles, then o = acc / l")

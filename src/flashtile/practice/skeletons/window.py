"""Drill: a sliding window. Read part-a/beyond-causal.

window = (left, right): query i sees keys j with offset + i - left <= j <= offset + i + right, both
bounds inclusive, -1 for unbounded; offset = 0 for alignment "upper_left", Tk - Tq for "lower_right";
causal caps right at 0. Visit only the key tiles some row of the query tile can see (one case puts
NaN in the others). Start from your forward of step 3. Check with:
    python -m flashtile.practice check DIR --step window
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
    window: tuple[int, int] | None = None,
):
    """Tiled attention forward under a causal mask and/or a sliding window.

    Args:
        q: (B, H, Tq, D); k, v: (B, H, Tk, D).
        causal, scale, block_q, block_k, alignment: as in step 3.
        window: None (no window) or (left, right) as above.

    Returns:
        o: (B, H, Tq, D); lse: (B, H, Tq). A row that sees no key gets o = 0 and lse = -inf.
    """
    raise NotImplementedError("TODO: the band offset - left <= j - i <= offset + right, and its key tiles only")

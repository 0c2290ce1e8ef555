"""Drill: packed documents of different lengths. Read part-a/beyond-causal (packed documents).

Several documents are packed along one token axis; cu_seqlens_q and cu_seqlens_k hold where each
starts (0 first, the totals last). A query sees only its own document's keys; causal and alignment
apply to each document on its own, and a document with queries and no keys gives them o = 0,
lse = -inf. Start from your forward of step 3. Check with:
    python -m flashtile.practice check DIR --step varlen
"""

from __future__ import annotations

import torch


def varlen_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = 16,
    block_k: int = 16,
    alignment: str = "upper_left",
):
    """Attention within each packed document.

    Args:
        q: (total_q, H, D); k, v: (total_k, H, D).
        cu_seqlens_q, cu_seqlens_k: int32 (n_documents + 1,).
        causal, scale, block_q, block_k, alignment: as in step 3, for each document on its own.

    Returns:
        o: (total_q, H, D); lse: (H, total_q).
    """
    raise NotImplementedError("TODO: for each document d, attention of its queries to its keys")

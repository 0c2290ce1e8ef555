"""Step 1: online softmax. Read part-a/online-softmax on the site first.

Keep two numbers per row while streaming its columns block by block: m, the running max, and l, the
running sum of exp(x - m). Check with:  python -m flashtile.practice check DIR --step online_softmax
"""

from __future__ import annotations

import torch


# --8<-- [start:skeleton]
def online_softmax_update(m: torch.Tensor, l: torch.Tensor, x_block: torch.Tensor):
    """Fold one block of columns into the running state.

    Args:
        m, l: (...) the running max and the running sum of exp(x - m) of each row so
            far; a row that has seen nothing has m = -inf, l = 0.
        x_block: (..., n) the next n columns of every row.

    Returns:
        (m_new, l_new), both (...).
    """
    raise NotImplementedError(
        "TODO: new max, rescale the old sum onto it, add this block's exp-sum"
    )
# --8<-- [end:skeleton]


def online_softmax_stats(x: torch.Tensor, block: int):
    """Stream the last dimension of x in blocks of ``block`` columns (the last block may be short).

    Returns (m, l), each of shape x.shape[:-1]; lse_from_stats(m, l) must equal torch.logsumexp(x, -1).
    """
    raise NotImplementedError("TODO: start from m = -inf, l = 0 and call online_softmax_update per block")


def lse_from_stats(m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """lse = m + log l; a row that saw nothing (m = -inf, l = 0) gives -inf, not NaN."""
    raise NotImplementedError("TODO: m + log(l), with the empty row's case")


def merge(m_a: torch.Tensor, l_a: torch.Tensor, m_b: torch.Tensor, l_b: torch.Tensor):
    """The state (m, l) of the union of two disjoint parts of the same rows, from their two states."""
    raise NotImplementedError("TODO: the larger max, and both sums rescaled onto it")

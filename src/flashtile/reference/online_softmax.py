"""Online softmax: the statistics of a row, computed one block of columns at a time.

For a row x_1..x_N the softmax needs two numbers:

* m = max_j x_j, so every exponent x_j - m is <= 0 and exp never overflows;
* l = sum_j exp(x_j - m), the normaliser.

Together they give the log-sum-exp, lse = m + log l. Streaming the row in blocks, each block proposes
a new maximum m' >= m, and the sum kept so far is moved onto it with the exact identity

    sum_j exp(x_j - m') = exp(m - m') * sum_j exp(x_j - m).

``merge`` is the same identity applied to two partial states instead of a state and a block, which is
what split-K decoding and ring attention use to combine work done in different places.
"""

from __future__ import annotations

import torch

from .._checks import check_block, check_tensor


def check_same_rows(*named: tuple[str, torch.Tensor]) -> None:
    """Every state tensor must describe the same rows: broadcasting (m, l) of 3 rows against 1 would
    silently merge statistics of different rows."""
    (first_name, first), *rest = named
    for name, t in named:
        check_tensor(name, t)
    for name, t in rest:
        if tuple(t.shape) != tuple(first.shape):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {first_name} has {tuple(first.shape)}; they must match"
            )


def safe_exp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """exp(a - b), with exp(-inf - (-inf)) defined as 0 rather than NaN.

    Only possible when both are -inf: a state that has seen nothing so far (m = -inf, l = 0) rescaled
    onto a maximum that is still -inf. Its l is 0, so any finite factor gives the right answer.
    """
    return torch.where(torch.isneginf(b), torch.zeros_like(a), torch.exp(a - b))


# --8<-- [start:update]
def online_softmax_update(m: torch.Tensor, l: torch.Tensor, x_block: torch.Tensor):
    """Fold one block of columns x_block (..., n) into the running state (m, l)
    of shape (...)."""
    check_same_rows(
        ("m", m), ("l", l), ("x_block.shape[:-1]", x_block.detach()[..., 0])
    )
    m_new = torch.maximum(m, x_block.amax(dim=-1))  # the max can only grow
    # moves the old sum onto the new max: <= 1, never overflows
    alpha = safe_exp_diff(m, m_new)
    l_new = alpha * l + safe_exp_diff(x_block, m_new[..., None]).sum(dim=-1)
    return m_new, l_new
# --8<-- [end:update]


def online_softmax_stats(x: torch.Tensor, block: int):
    """Stream the last dimension of x in blocks of ``block`` columns; return (m, l).

    ``lse_from_stats(m, l)`` equals torch.logsumexp(x, -1), non-finite rows included: a row of all -inf
    gives m = -inf and l = 0 (lse = -inf), a row holding +inf gives lse = +inf, a row holding NaN gives
    NaN (m and l are NaN too).
    """
    check_tensor("x", x)
    check_block("block", block)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have at least one column in its last dimension, got shape {tuple(x.shape)}")
    # --8<-- [start:stream]
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    for start in range(0, x.shape[-1], block):
        m, l = online_softmax_update(m, l, x[..., start : start + block])
    # --8<-- [end:stream]
    return m, l


# --8<-- [start:lse]
def lse_from_stats(m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """lse = m + log l, with the conventions of torch.logsumexp at the edges.

    A row that saw nothing (m = -inf, l = 0) gets -inf, not -inf + log 0 = NaN. A row
    whose max is +inf gets +inf (its l is exp(inf - inf) = NaN). A NaN anywhere in the
    row stays NaN: NaN == 0 is False, so such a row never passes for an empty one.
    """
    check_same_rows(("m", m), ("l", l))
    lse = torch.where(torch.isposinf(m), m, m + torch.log(l))
    return torch.where(l == 0, torch.full_like(m, float("-inf")), lse)
# --8<-- [end:lse]


# --8<-- [start:merge]
def merge(m_a: torch.Tensor, l_a: torch.Tensor, m_b: torch.Tensor, l_b: torch.Tensor):
    """Combine the states of two disjoint parts of the same row into the state of their
    union."""
    check_same_rows(("m_a", m_a), ("l_a", l_a), ("m_b", m_b), ("l_b", l_b))
    m = torch.maximum(m_a, m_b)
    l = safe_exp_diff(m_a, m) * l_a + safe_exp_diff(m_b, m) * l_b
    return m, l
# --8<-- [end:merge]

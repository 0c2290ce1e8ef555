"""Standard attention, written the slow way on purpose.

``naive_attention`` materialises the full score matrix S = scale * Q K^T and the probability matrix
P = softmax(S) for every (batch, head). That is exactly what FlashAttention avoids; keeping it here
gives the rest of the package an unambiguous ground truth (run it in float64) and gives the site
something concrete to count bytes against.
"""

from __future__ import annotations

import torch

from .._checks import check_alignment, check_attention_inputs, check_causal, check_int, resolve_scale, stats_dtype
from .causal import causal_mask


def expand_kv_heads(x: torch.Tensor, H: int) -> torch.Tensor:
    """Repeat each key/value head for the query heads of its group: (B, H_kv, T, D) -> (B, H, T, D).

    Query head h reads key/value head h // (H // H_kv), the convention of SDPA's ``enable_gqa``.
    Only the reference does this; the kernels index the shared head instead of copying it.
    """
    return x.repeat_interleave(H // x.shape[1], dim=1)


# --8<-- [start:naive]
def naive_attention(
    q,
    k,
    v,
    causal: bool = False,
    scale: float | None = None,
    alignment: str = "upper_left",
):
    """Softmax attention through the full T x T matrices.

    Args:
        q: (B, H, Tq, D). k, v: (B, H_kv, Tk, D) with H a multiple of H_kv.
        causal: apply the causal mask of ``alignment``
            (see ``flashtile.reference.causal``).
        scale: τ, multiplies Q K^T; defaults to 1/sqrt(D).

    Returns:
        o: (B, H, Tq, D) in q's dtype, and lse: (B, H, Tq), the natural-log log-sum-exp
        of each row of the scaled, masked scores, in float32 (float64 for float64
        inputs). Rows that see no key get o = 0 and lse = -inf; a row that sees a NaN
        gets NaN.
    """
    shape = check_attention_inputs(q, k, v)
    check_causal(causal)
    check_alignment(alignment)
    scale = resolve_scale(scale, shape.D, q.dtype)
    # 16-bit inputs are computed in float32, like the kernels' accumulators
    c = stats_dtype(q.dtype)
    k, v = expand_kv_heads(k.to(c), shape.H), expand_kv_heads(v.to(c), shape.H)

    # (B, H, Tq, Tk): the matrix FlashAttention never stores
    s = scale * (q.to(c) @ k.transpose(-1, -2))
    if causal:
        s = s.masked_fill(
            ~causal_mask(shape.Tq, shape.Tk, alignment, q.device), float("-inf")
        )
    # -inf for a row that sees no key, NaN for a row that sees a NaN
    lse = torch.logsumexp(s, dim=-1)
    # exp(s - lse) would be exp(-inf - (-inf)) = NaN on a row that sees no key; give it
    # P = 0 instead. Only that row: a NaN or +inf lse must stay in, so the row that saw
    # it comes out NaN.
    empty = torch.isneginf(lse)[..., None]
    p = torch.where(empty, 0.0, torch.exp(s - torch.where(empty, 0.0, lse[..., None])))
    o = p @ v
    return o.to(q.dtype), lse
# --8<-- [end:naive]


# --8<-- [start:counts]
def score_matrix_bytes(
    B: int, H: int, Tq: int, Tk: int, dtype: torch.dtype = torch.bfloat16
) -> int:
    """Bytes of one materialised (B, H, Tq, Tk) score matrix; P costs the same again."""
    return B * H * Tq * Tk * torch.empty((), dtype=dtype).element_size()


def naive_hbm_bytes(
    B: int, H: int, Tq: int, Tk: int, D: int, dtype: torch.dtype = torch.bfloat16
) -> int:
    """HBM bytes moved by unfused attention: three kernels, S and P each written once
    and read once.

    read Q, K (write S) -> read S (write P) -> read P, V (write O). S and P are the T^2
    terms.
    """
    size = torch.empty((), dtype=dtype).element_size()
    qkvo = B * H * (2 * Tq * D + 2 * Tk * D)
    scores = B * H * Tq * Tk
    return size * (qkvo + 4 * scores)


def visible_pairs(
    Tq: int, Tk: int, causal: bool = False, alignment: str = "upper_left"
) -> int:
    """Number of (query, key) pairs that contribute, counted exactly."""
    Tq, Tk = check_int("Tq", Tq), check_int("Tk", Tk)
    check_causal(causal)
    check_alignment(alignment)
    if not causal:
        return Tq * Tk
    offset = Tk - Tq if alignment == "lower_right" else 0
    # Row i sees keys 0..min(Tk-1, i+offset): clamp(i + offset + 1, 0, Tk) of them.
    return sum(min(Tk, max(0, i + offset + 1)) for i in range(Tq))


def attention_flops(
    B: int,
    H: int,
    Tq: int,
    Tk: int,
    D: int,
    causal: bool = False,
    alignment: str = "upper_left",
) -> int:
    """Matmul FLOPs of the forward: 2*D for S = Q K^T and 2*D for O = P V, per visible
    pair.

    The backward does 2.5x this (five matmuls instead of two).
    """
    B, H, D = check_int("B", B), check_int("H", H), check_int("D", D)
    return 4 * B * H * D * visible_pairs(Tq, Tk, causal, alignment)
# --8<-- [end:counts]


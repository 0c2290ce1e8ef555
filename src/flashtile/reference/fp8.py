"""FP8 (E4M3) attention, emulated in float64: exactly the rounding the FP8 kernel does, and nothing more.

The FP8 forward multiplies E4M3 codes on the tensor cores and accumulates in float32. Three things are
rounded to E4M3 on the way, and this module rounds exactly those three, doing every other operation in
float64, so that its answer is "exact attention of the quantised inputs":

* q, k and v, by ``flashtile.fp8.quantize``, before the call: each row r of a (B, H, T, D) tensor is
  stored as codes ``x8[r]`` with a float32 factor ``descale[r]``, its value being ``x8[r] * descale[r]``;
* P, the tile of probabilities, before the PV product. ``p = exp(s - m)`` lies in [0, 1] because m is
  the running row max, so P is scaled by the fixed 448 (E4M3's largest value) and its factor is the
  fixed 1/448, as FlashAttention-3 does: no max over P is needed, and P's small entries keep
  E4M3's 2^-4 relative precision down to p = 2^-6 / 448;
* V's per-row factors cannot leave the sum over keys the way q's and k's leave a dot product, so each
  column of P is multiplied by ``descale_v[j] / v_scale`` (at most 1) before P is rounded, where
  ``v_scale`` is the largest V factor of the head, multiplied back after the sum. With one factor per
  tensor or per head that ratio is exactly 1 and P is rounded as it stands (the kernel then reads no ratio).

l sums the unrounded p (the kernel keeps it in float32 registers): the normaliser is the exact one,
and only the PV product sees rounded probabilities. P is rounded tile by tile against the running max
of that moment, so the answer depends on ``block_k``; the kernel must use the same ``block_k`` for the
two to agree to float32 rounding (``fp8_block_k(D)``, the default of both). The kernel's float32 steps
come in its own order (448 p as exp2(s - m + log2 448); a per-head k factor folded into q's row factor
before the scores, not after): every such order is float64 arithmetic here, and the two agree to float32
rounding of s, which moves a code of P only where 448 r p lies within that rounding of an E4M3 midpoint.
``torch``'s cast to float8_e4m3fn goes through float32, as the kernel's float32 P does, and saturates at 448.

The checks of the FP8 contract (E4M3 tensors and their factors) live here, below the kernel and
``flashtile.fp8``, which both check with them.
"""

from __future__ import annotations

import torch

from .._checks import (
    _dtype_name,
    check_alignment,
    check_attention_inputs,
    check_block,
    check_causal,
    check_tensor,
    check_values_in_memory,
    recall_fact,
    remember_fact,
    resolve_neg_bits,
    resolve_scale,
)
from .causal import diagonal_offset
from .naive import expand_kv_heads
from .online_softmax import lse_from_stats, safe_exp_diff

FP8_DTYPES = (torch.float8_e4m3fn,)
E4M3_MAX = 448.0  # the largest finite E4M3 value: 1.75 * 2^8 (e4m3fn has no infinity)
P_SCALE = E4M3_MAX  # P in [0, 1] is stored as P * 448; its factor is the fixed 1 / 448
SMALL_HEAD_BLOCK_K, LARGE_HEAD_BLOCK_K = 128, 64  # the FP8 kernel's key tiles, to D = 128 and above


def fp8_block_k(head_dim: int) -> int:
    """The FP8 kernel's key tile at head dim D: 128 keys to D = 128, 64 above (where 128 x D tiles of k and V
    crowd shared memory and registers). P is rounded tile by tile against the running max, so the emulation
    rounds it in the same tiles by default."""
    return SMALL_HEAD_BLOCK_K if head_dim <= 128 else LARGE_HEAD_BLOCK_K


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest E4M3 value (ties to even), saturating: |x| > 448 becomes +-448, not NaN."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def vouch_for_factors(descale: torch.Tensor) -> None:
    """Record that descale's values are positive and finite as they stand (its maker knows, or a check just
    read them), so that ``check_descale`` need not read them again until they are written to
    (``_checks.remember_fact``: writes through PyTorch are seen, writes behind its back are not; tensors
    made under ``torch.inference_mode`` are read on every call)."""
    remember_fact("positive finite factors", descale, True)


def vouched_for(descale: torch.Tensor) -> bool:
    """descale is the very tensor recorded by ``vouch_for_factors`` and has not been written to since."""
    return recall_fact("positive finite factors", descale, False)


def check_descale(name: str, descale, x: torch.Tensor, x_name: str) -> torch.Tensor:
    """descale holds x's per-row factors: float32, shape x.shape[:-1] = (B, H, T), on x's device, every
    factor positive and finite (a factor of 0, inf or NaN would turn every value of its row into garbage):
    ``check_descale_layout``, then ``check_descale_values``."""
    check_descale_layout(name, descale, x, x_name)
    check_descale_values(name, descale)
    return descale


def check_descale_layout(name: str, descale, x: torch.Tensor, x_name: str) -> None:
    """What ``check_descale`` reads without the values: type, dtype, shape (B, H, T) and device; a launcher
    keeps this part in its plan, per layout."""
    check_tensor(name, descale, rank=3, dtypes=(torch.float32,))
    check_values_in_memory(name, descale)
    if tuple(descale.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"{name} must have shape (B, H, T) = {tuple(x.shape[:-1])}, one factor per row of {x_name} (as "
            f"flashtile.fp8.quantize returns it), got {tuple(descale.shape)}"
        )
    if descale.device != x.device:
        raise ValueError(f"{name} is on {descale.device} but {x_name} is on {x.device}; they must match")


def check_descale_values(name: str, descale: torch.Tensor) -> None:
    """Every factor of descale (of any shape) positive and finite. Reading the values waits for the device (a
    host synchronisation); it is done once per tensor and write: factors from ``flashtile.fp8.quantize``, or
    checked by an earlier call and unchanged, are not read."""
    if vouched_for(descale):
        return
    if not bool(((descale > 0) & torch.isfinite(descale)).all()):
        if descale.dim() == 0:
            raise ValueError(f"{name} must be a positive finite factor, got {descale.item()!r}")
        raise ValueError(f"{name} must hold positive finite factors; it has a zero, negative, inf or NaN entry")
    vouch_for_factors(descale)


def check_fp8_inputs(q8, k8, v8, descale_q, descale_k, descale_v, values: bool = True):
    """Validate E4M3 q, k, v (the attention contract, with dtype float8_e4m3fn) and their factors; with
    ``values=False`` the factors' layouts only (``check_descale_layout``), as a launcher's plan keeps them."""
    try:
        shape = check_attention_inputs(q8, k8, v8, dtypes=FP8_DTYPES)
    except TypeError as error:  # say how to get there from a float tensor
        dtypes = [_dtype_name(t.dtype) for t in (q8, k8, v8) if isinstance(t, torch.Tensor)]
        raise TypeError(f"{error}; quantise float tensors with flashtile.fp8.quantize (got {dtypes})") from None
    for name, descale, x, x_name in (("descale_q", descale_q, q8, "q"), ("descale_k", descale_k, k8, "k"),
                                     ("descale_v", descale_v, v8, "v")):  # fmt: skip
        (check_descale if values else check_descale_layout)(name, descale, x, x_name)
    return shape


# --8<-- [start:fp8-emulation]
def fp8_attention_forward(
    q8, k8, v8, descale_q, descale_k, descale_v, causal=False, scale=None,
    block_k=None, alignment="upper_left",
):  # fmt: skip
    """Attention of E4M3 inputs as the FP8 kernel computes it, every step but the
    roundings in float64.

    Args:
        q8: (B, H, Tq, D), k8 and v8: (B, H_kv, Tk, D), float8_e4m3fn, H a multiple
            of H_kv.
        descale_q: (B, H, Tq), descale_k and descale_v: (B, H_kv, Tk), float32,
            positive: row r of x stands for ``x8[r] * descale[r]`` (what
            ``flashtile.fp8.quantize`` returns).
        causal, alignment, scale: as ``flashtile.attention``; scale τ defaults to
            1/sqrt(D).
        block_k: the key tile; P is rounded tile by tile against the running max, as in
            the kernel. None: the kernel's own, ``fp8_block_k(D)``.

    Returns:
        o (B, H, Tq, D) and lse (B, H, Tq), float64. A row that sees no key gets o = 0,
        lse = -inf.
    """
    q8, k8, v8, descale_q, descale_k, descale_v = resolve_neg_bits(
        q8, k8, v8, descale_q, descale_k, descale_v
    )
    shape = check_fp8_inputs(q8, k8, v8, descale_q, descale_k, descale_v)
    check_causal(causal)
    check_alignment(alignment)
    block_k = check_block(
        "block_k", fp8_block_k(shape.D) if block_k is None else block_k
    )
    # the kernel's statistics are float32
    scale = resolve_scale(scale, shape.D, torch.float32)
    # (B, H, Tq, D): the values the codes stand for
    q = q8.double() * descale_q.double()[..., None]
    # (B, H, Tk, D)
    k = expand_kv_heads(k8.double() * descale_k.double()[..., None], shape.H)
    v = expand_kv_heads(v8.double(), shape.H)  # V stays in codes: its factors ride on P
    # (B, H_kv, 1), the head's largest V factor
    v_scale = descale_v.double().amax(dim=-1, keepdim=True)
    # (B, H, Tk), in (0, 1]
    v_ratio = expand_kv_heads(
        (descale_v.double() / v_scale)[..., None], shape.H
    )[..., 0]
    offset = diagonal_offset(shape.Tq, shape.Tk, alignment)
    i = torch.arange(shape.Tq, device=q.device)[:, None]

    m = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float64, device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    for k_start in range(0, shape.Tk, block_k):
        k_end = min(k_start + block_k, shape.Tk)
        # (B, H, Tq, block_k)
        s = scale * (q @ k[..., k_start:k_end, :].transpose(-1, -2))
        if causal:
            j = torch.arange(k_start, k_end, device=q.device)[None, :]
            s = s.masked_fill(j > i + offset, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))
        alpha = safe_exp_diff(m, m_new)
        # in [0, 1]: m_new is at least every score of the row
        p = safe_exp_diff(s, m_new[..., None])
        l = alpha * l + p.sum(dim=-1)  # the normaliser sums the unrounded p
        # P rounded to E4M3, V's factors on it
        p8 = to_e4m3(p * v_ratio[..., None, k_start:k_end] * P_SCALE)
        acc = alpha[..., None] * acc + p8.double() @ v[..., k_start:k_end, :]
        m = m_new
    # (B, H, 1): P's and V's factors
    o_scale = expand_kv_heads(v_scale[..., None], shape.H)[..., 0] / P_SCALE
    empty = (l == 0)[..., None]  # a row that saw no key: o = 0, not 0 / 0
    o = torch.where(
        empty, 0.0, acc * o_scale[..., None] / torch.where(empty, 1.0, l[..., None])
    )
    return o, lse_from_stats(m, l)
# --8<-- [end:fp8-emulation]

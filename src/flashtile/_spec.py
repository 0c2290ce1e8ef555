"""One call's options, checked once into one immutable value that every layer below reads by name.

``flashtile.attention`` (and the kernels' own launchers, for a direct call) turn their arguments into an
``AttentionSpec`` with ``check_spec``; the dispatch, the custom ops' implementations and the plan builders
read its fields and check none of them again. The mask has one form from the entry point to the launch, a
``MaskBand``: query i sees key j when

    i + offset - left <= j <= i + offset + right,

offset the alignment's diagonal (0 for "upper_left", Tk - Tq for "lower_right"), -1 an unbounded side.
``is_causal`` is no separate flag: it caps the right side at 0, so a causal mask is the band (-1, 0), and a
window (left, right) with ``is_causal`` is (left, 0). Only the custom ops' schemas, which take no
structured values, carry the band as its two ints (with the alignment beside them), as FlashAttention-3's
interface carries ``window_size``; ``MaskBand`` rebuilds it on the other side of the op.

A new option of the call is one more field here, checked in ``check_spec`` and read by name where it is
used. Attention sinks are one: a (H,) tensor whose values change between calls (a trained logit per head),
so the spec keeps what its layout fixes, ``has_sinks``, checked with the tensor's shape, dtype and device
(``_checks.check_sinks_layout``), and the largest |sink| the call's scale, soft-cap and dtype allow,
``sink_limit``; the tensor itself travels beside q, k and v, and its values are read on every eager call
(``_checks.check_sink_values``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ._checks import (
    UNBOUNDED,
    AttentionShape,
    check_alignment,
    check_causal,
    check_flag,
    check_sinks_layout,
    check_softcap,
    check_window,
    resolve_scale,
    sink_limit,
)
from ._layouts import contiguous_strides, strides_like


class MaskBand(NamedTuple):
    """The mask of one call: the window's two sides around the alignment's diagonal, -1 unbounded; causal is
    a right side of 0. (-1, -1) keeps every pair."""

    left: int
    right: int
    alignment: str  # "upper_left" or "lower_right": which diagonal the sides count from

    @property
    def window(self) -> tuple[int, int] | None:
        """The sides as the reference tier's ``window`` argument takes them: None where the band keeps every pair."""
        return None if self.left == self.right == UNBOUNDED else (self.left, self.right)

    def offset(self, Tq: int, Tk: int) -> int:
        """The alignment's diagonal on a (Tq, Tk) score matrix, as ``reference.causal.diagonal_offset``."""
        return 0 if self.alignment == "upper_left" else Tk - Tq


def check_mask(causal, window, alignment, causal_name: str = "is_causal") -> MaskBand:
    """The band of ``causal`` (a bool), ``window`` (None or (left, right)) and ``alignment``; raises on bad input."""
    causal = check_causal(causal, causal_name)
    alignment = check_alignment(alignment)
    left, right = check_window(window) or (UNBOUNDED, UNBOUNDED)
    return MaskBand(left, 0 if causal else right, alignment)


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """The checked options of one attention call, the same for every tier and every layer below the checks."""

    scale: float  # τ resolved (1/sqrt(D) by default), finite, within float32's range below float64
    mask: MaskBand
    softcap: float | None  # the cap s of s * tanh(x / s), or None
    group: int  # query heads per key/value head (1 without GQA)
    return_lse: bool
    has_sinks: bool = False  # a (H,) sinks tensor travels beside q, k, v: each row starts from (m, l) = (sink, 1)
    sink_limit: float = math.inf  # the largest |sink| the call takes (``_checks.sink_limit``); inf without sinks


def check_spec(shape: AttentionShape, dtype: torch.dtype, *, causal, scale, alignment, window, softcap,
               return_lse=False, enable_gqa=True, causal_name: str = "is_causal", sinks=None,
               device=None) -> AttentionSpec:  # fmt: skip
    """Every option of a call on inputs of ``shape``, ``dtype`` and ``device`` (already checked), checked once.

    ``enable_gqa``: whether H_kv < H is allowed (``flashtile.attention`` asks for it, as SDPA does; the
    kernels' launchers always allow it). ``sinks``: None or the call's sinks tensor, whose layout is checked
    here (its values are not: ``_checks.check_sink_values``)."""
    causal = check_causal(causal, causal_name)
    enable_gqa = check_flag("enable_gqa", enable_gqa)
    return_lse = check_flag("return_lse", return_lse)
    mask = check_mask(causal, window, alignment, causal_name)
    softcap = check_softcap(softcap, dtype)
    if shape.H != shape.H_kv and not enable_gqa:
        raise ValueError(
            f"query has {shape.H} heads but key and value have {shape.H_kv}; pass enable_gqa=True for "
            "grouped-query attention (as with scaled_dot_product_attention)"
        )
    has_sinks = check_sinks_layout(sinks, shape, dtype, device) is not None
    scale = resolve_scale(scale, shape.D, dtype)
    limit = sink_limit(scale, softcap, dtype) if has_sinks else math.inf
    return AttentionSpec(scale=scale, mask=mask, softcap=softcap, group=shape.group, return_lse=return_lse,
                         has_sinks=has_sinks, sink_limit=limit)  # fmt: skip


def spec_from_op(q: torch.Tensor, k: torch.Tensor, *, scale: float, alignment: str, window_left: int,
                 window_right: int, softcap: float | None,
                 sinks: torch.Tensor | None = None) -> AttentionSpec:  # fmt: skip
    """The spec a custom op's arguments carry (q and k (B, H, T, D), or (total, H, D) packed: heads on dim 1).
    The ops are reached with values ``check_spec`` made (by the entry points, eagerly or while tracing), so
    they are read as they are, not checked again."""
    return AttentionSpec(scale=scale, mask=MaskBand(window_left, window_right, alignment), softcap=softcap,
                         group=q.shape[1] // k.shape[1], return_lse=True, has_sinks=sinks is not None)  # fmt: skip


def op_arguments(spec: AttentionSpec) -> tuple:
    """The spec as a custom op's arguments after the tensors: scale, alignment, the band's two ints, softcap."""
    return spec.scale, spec.mask.alignment, spec.mask.left, spec.mask.right, spec.softcap


def output_strides(q: torch.Tensor, d_v: int) -> tuple:
    """The strides of o, (..., d_v) of q's other sizes, laid out as q is where q is dense (``_layouts.strides_like``:
    a model's (B, H, T, D) view of (B, T, H, D) gives o that view too), contiguous otherwise. With d_v = q's head
    dim they are ``strides_like(q)``; with another d_v, o's dims are stacked in the order of q's strides, so
    that the fake implementations and every tier allocate the same layout."""
    strides = strides_like(q)
    if q.shape[-1] == d_v:
        return strides
    shape = (*q.shape[:-1], d_v)
    if strides == contiguous_strides(q.shape):
        return contiguous_strides(shape)
    out, step = [0] * q.dim(), 1
    for dim in sorted(range(q.dim()), key=lambda i: (strides[i], -i)):  # innermost first; ties: the later dim
        out[dim] = step
        step *= max(shape[dim], 1)
    return tuple(out)

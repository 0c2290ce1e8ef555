"""``flashtile.decode_attention``'s floor: the checked call (``DecodeCall``), kept per layout and flags, the
eager run on its tier, and the custom op ``flashtile::decode_attention`` that carries a call through
``torch.compile`` as one opaque node (its eager run checks the values of cache_seqlens, block_table and the
sinks when the graph runs).

The sinks travel beside the tensors (their layout is part of the kept call's key; their values are checked on
every eager call, ``check_sink_values``, which reads them once until they are written to). Decoding is
inference: the sinks get no gradient, like every other input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .._checks import (
    DecodeShape,
    check_decode_inputs,
    check_decode_values,
    check_flag,
    check_num_splits,
    check_sink_values,
    check_sinks_layout,
    check_softcap,
    resolve_scale,
    sink_limit,
    stats_dtype,
)
from .._plans import cached_plan
from .._spec import MaskBand, check_mask
from .tiers import no_autocast, pick_backend, use_backend


@dataclass(slots=True)
class DecodePlans:
    """The kernels' plan of one kept ``decode_attention`` call, filled by the first call that runs the kernels."""

    kernels: object = None  # kernels.decode.DecodePlan


class DecodeCall(NamedTuple):
    """A ``decode_attention`` call's checked shapes and flags, worked out once per layout of its tensors and
    flag values (``_plans.cached_plan``): what the hot path would otherwise recompute on every token."""

    shape: DecodeShape
    scale: float  # τ resolved
    num_splits: int | None
    return_lse: bool
    mask: MaskBand  # (left, 0) around each sequence's lower-right diagonal: the new tokens are causal
    softcap: float | None
    has_sinks: bool  # a (H,) sink per query head joins every row's softmax, once
    sink_limit: float  # the largest |sink| the call takes (``_checks.sink_limit``); inf without sinks
    plans: DecodePlans


def check_decode_call(query, key_cache, value_cache, cache_seqlens, block_table, sinks, *, scale, num_splits,
                      return_lse, window, softcap) -> DecodeCall:  # fmt: skip
    """Every check of ``decode_attention`` that reads only layouts and flags; raises on bad input. The scale
    defaults to 1/sqrt(d_qk)."""
    shape = check_decode_inputs(query, key_cache, value_cache, cache_seqlens, block_table, check_values=False)
    has_sinks = check_sinks_layout(sinks, shape, query.dtype, query.device) is not None
    scale = resolve_scale(scale, shape.D, query.dtype)
    num_splits = check_num_splits(num_splits)
    return_lse = check_flag("return_lse", return_lse)
    softcap = check_softcap(softcap, query.dtype)
    mask = check_mask(True, window, "lower_right")  # right capped at 0
    limit = sink_limit(scale, softcap, query.dtype) if has_sinks else math.inf
    return DecodeCall(shape=shape, scale=scale, num_splits=num_splits, return_lse=return_lse, mask=mask,
                      softcap=softcap, has_sinks=has_sinks, sink_limit=limit, plans=DecodePlans())  # fmt: skip


def _empty_outputs(query, D_v: int):
    """(o, lse) of the right shapes and dtypes, not computed: o (B, H, Tq, d_v), lse (B, H, Tq)."""
    return query.new_empty((*query.shape[:-1], D_v)), query.new_empty(query.shape[:-1], dtype=stats_dtype(query.dtype))


def run_decode(query, key_cache, value_cache, cache_seqlens, block_table, sinks, *, scale, num_splits, return_lse,
               window, softcap):  # fmt: skip
    """``decode_attention`` after its arguments' negative bits are resolved and the window checked: the
    layouts and flags checked once per key, then the values, then the call on its tier."""
    call = cached_plan(check_decode_call, (query, key_cache, value_cache, cache_seqlens, block_table, sinks), scale,
                       num_splits, return_lse, window, softcap,
                       names=("scale", "num_splits", "return_lse", "window", "softcap"))  # fmt: skip
    if query.is_meta:  # shapes only, nothing computed (and no values to check)
        o, lse = _empty_outputs(query, call.shape.D_v)
        return (o, lse) if call.return_lse else o
    if torch.compiler.is_compiling():  # one opaque node, whose eager run checks the values (``decode_op``)
        # inference: detached, so that a model's sinks (a parameter) ask the graph for no backward
        tensors = (t if t is None else t.detach() for t in (query, key_cache, value_cache, cache_seqlens,
                                                               block_table, sinks))  # fmt: skip
        query, key_cache, value_cache, cache_seqlens, block_table, sinks = tensors
        o, lse = decode_op(query, key_cache, value_cache, cache_seqlens, block_table, call.scale, call.num_splits,
                           call.mask.left, call.mask.right, call.softcap, pick_backend(query), sinks)  # fmt: skip
        return (o, lse) if call.return_lse else o
    if cache_seqlens is not None or block_table is not None:  # their values: one copy to the host
        check_decode_values(call.shape, cache_seqlens, block_table)
    if sinks is not None:  # no NaN, no +inf: read once until the tensor is written to
        check_sink_values(sinks, call.sink_limit)
    if pick_backend(query) == "triton":  # the dispatch of flashtile.attention, use_backend included
        # no autograd and no autocast to switch off: the kernels record nothing and choose their own precision
        plan = call.plans.kernels
        if plan is None:
            from ..kernels.decode import plan_decode

            plan = call.plans.kernels = plan_decode(
                query, key_cache, value_cache, cache_seqlens, block_table, shape=call.shape, scale=call.scale,
                mask=call.mask, softcap=call.softcap, num_splits=call.num_splits, store_lse=call.return_lse,
                o_like_q=False, sinks=sinks,
            )  # fmt: skip
        o, lse = plan.run(query, key_cache, value_cache, cache_seqlens, block_table, sinks)
        return (o, lse) if call.return_lse else o
    from ..reference.decode import decode_attention_reference

    with torch.no_grad(), no_autocast(query.device.type):  # inference only; the tiers choose their precision
        o, lse = decode_attention_reference(query, key_cache, value_cache, cache_seqlens, scale=call.scale,
                                            num_splits=call.num_splits, block_table=block_table,
                                            window=call.mask.window, softcap=call.softcap, sinks=sinks)  # fmt: skip
    return (o, lse) if call.return_lse else o


@torch.library.custom_op("flashtile::decode_attention", mutates_args=())
def decode_op(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, cache_seqlens: torch.Tensor | None,
    block_table: torch.Tensor | None, scale: float, num_splits: int | None, window_left: int, window_right: int,
    softcap: float | None, backend: str, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of ``decode_attention`` as one node of a torch.compile graph: what the graph runs is the eager
    call, on the tier chosen at trace time, so the values of cache_seqlens, block_table and sinks are checked
    where they exist, at run time (tracing them would guard on data: torch's data-dependent error under
    fullgraph). sinks, None or (H,), last."""
    with use_backend(backend):
        o, lse = run_decode(query, key_cache, value_cache, cache_seqlens, block_table, sinks, scale=scale,
                            num_splits=num_splits, return_lse=True, window=(window_left, window_right),
                            softcap=softcap)  # fmt: skip
    return o.contiguous(), lse.contiguous()


@decode_op.register_fake
def _(query, key_cache, value_cache, cache_seqlens, block_table, scale, num_splits, window_left, window_right, softcap,
      backend, sinks=None):  # fmt: skip
    return _empty_outputs(query, value_cache.shape[-1])

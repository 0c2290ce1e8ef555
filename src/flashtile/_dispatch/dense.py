"""``flashtile.attention``'s floor below the entry point: the custom ops (``flashtile::attention_fwd``,
``flashtile::attention_bwd``, ``flashtile::attention_decode``) with their fake and autograd
registrations, the eager path that runs the same implementations without the op's dispatcher, the
checked call (``AttentionCall``) kept per layout and flags, and the dispatch of one checked call to its tier.

The forward and the backward are two custom ops. To ``torch.compile`` each is one opaque node: it never
traces into Triton launches or Python tile loops, and it learns output shapes from the fake
implementations below. Eager calls on plain CPU or CUDA tensors run the same implementations without
the op's dispatcher (``run_forward``), which costs a fraction of the op's host time per call
(``bench/results/overhead.json``). An eager call whose layout and flags were seen before finds its
checked call by one key (``call_key``); its backward runs from a plan kept with the call
(``backward_from_kept_plan``).

Attention sinks (``sinks``, a (H,) tensor) travel beside q, k and v as one more tensor argument of the ops
(``Tensor? sinks``, last, None without them) and of ``_EagerAttention``, so autograd hands back their
gradient; the spec says whether a call has them (``AttentionSpec.has_sinks``). Both tiers take them: the
reference tier through ``reference.sinks``, the Triton tier from the forward kernel's start state
(``kernels.forward.sink_start``) and the backward's row terms (``kernels.sinks.sink_gradient``).
A short call with sinks takes the decode kernels like any other (the merge counts the sink once); eagerly on
the Triton tier it runs from the call's kept kernel plans, as any other call does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .._checks import MAX_NEW_TOKENS, check_attention_inputs, resolve_neg_bits, stats_dtype
from .._layouts import empty_like_layout, strides_like
from .._plans import cached_plan, layout_key
from .._spec import AttentionSpec, check_spec, op_arguments, output_strides, spec_from_op
from .tiers import (
    PLAIN_TENSORS,
    REFERENCE_BLOCK,
    any_autocast,
    autocast_inputs,
    autocast_on,
    autocast_sinks,
    check_backend,
    pick_backend,
    plain_inputs,
    records_gradient,
)


# --8<-- [start:impl]
def forward_impl(q, k, v, spec: AttentionSpec, backend: str, sinks=None):
    """What the forward op computes, callable without the op: (o, lse, stats), see
    ``attention_fwd``."""
    if check_backend(backend) == "triton":
        from ..kernels.forward import forward_with_spec

        return forward_with_spec(q, k, v, spec, sinks)
    from ..reference.forward import flash_attention_forward

    o, lse = flash_attention_forward(q, k, v, False, spec.scale, REFERENCE_BLOCK,
                                     REFERENCE_BLOCK, spec.mask.alignment,
                                     window=spec.mask.window, softcap=spec.softcap,
                                     sinks=sinks)  # fmt: skip
    # o laid out as q is, as the kernels give it (and as the fake says, whichever tier
    # runs)
    o = empty_like_layout(o, output_strides(q, v.shape[-1])).copy_(o)
    return o, lse.contiguous(), lse.new_empty((0,))


def backward_impl(do, q, k, v, o, lse, stats, *, spec: AttentionSpec, backend: str,
                  sinks=None):  # fmt: skip
    """What the backward op computes, callable without the op: (dq, dk, dv, dsinks), see
    ``attention_bwd``; dsinks None without sinks."""
    # an upstream gradient may be a negative view: the kernels read memory
    (do,) = resolve_neg_bits(do)
    # the launcher's gradients are new tensors, laid out like q, k, v
    if check_backend(backend) == "triton":
        from ..kernels.backward import backward_with_spec

        return backward_with_spec(q, k, v, o, lse, do, stats, spec=spec, sinks=sinks)
    from ..reference.backward import backward_delta, flash_attention_backward
    from ..reference.sinks import sink_gradient

    grads = flash_attention_backward(q, k, v, o, lse, do, False, spec.scale,
                                     REFERENCE_BLOCK, REFERENCE_BLOCK,
                                     spec.mask.alignment, window=spec.mask.window,
                                     softcap=spec.softcap)  # fmt: skip
    # given the sink-including lse, dq, dk, dv are as without a sink; the sink's own
    # column gives dsinks
    dsinks = None if sinks is None else sink_gradient(sinks, lse, backward_delta(o, do))
    grads = (empty_like_layout(x, strides_like(x)).copy_(g)
             for x, g in zip((q, k, v), grads))
    return (*grads, dsinks)
# --8<-- [end:impl]


# --8<-- [start:forward_op]
@torch.library.custom_op("flashtile::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, alignment: str,
    window_left: int, window_right: int, softcap: float | None, backend: str,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, lse, stats): o (B, H, Tq, d_v) in q's dtype (d_v, v's head dim, may differ
    from q's), laid out like q where q is dense (``_spec.output_strides``), contiguous
    otherwise; lse (B, H, Tq) float32 (float64 for float64), with sinks the log of the
    whole normaliser, e^sink included; stats, what the backward needs besides lse: the
    kernels' final (m, l), (2, B, H, Tq), or empty. The mask travels as its band's two
    sides around the alignment's diagonal, -1 unbounded (``_spec.MaskBand``); sinks,
    None or (H,), last."""
    spec = spec_from_op(q, k, scale=scale, alignment=alignment, window_left=window_left,
                        window_right=window_right, softcap=softcap, sinks=sinks)
    o, lse, stats = forward_impl(q, k, v, spec, backend, sinks)
    # The kernels write lse and (m, l) into one buffer, and an op's outputs may not
    # share memory.
    return o, lse, (stats.clone() if stats.numel() else stats)


@attention_fwd.register_fake
def _(q, k, v, scale, alignment, window_left, window_right, softcap, backend,
      sinks=None):  # fmt: skip
    # Only shapes, dtypes and devices: what torch.compile needs to trace past the op
    # without running it.
    B, H, Tq, _ = q.shape
    c = stats_dtype(q.dtype)
    stats_shape = (2, B, H, Tq) if backend == "triton" else (0,)
    o = q.new_empty_strided((B, H, Tq, v.shape[-1]), output_strides(q, v.shape[-1]))
    return o, q.new_empty((B, H, Tq), dtype=c), q.new_empty(stats_shape, dtype=c)
# --8<-- [end:forward_op]


# --8<-- [start:backward_op]
@torch.library.custom_op("flashtile::attention_bwd", mutates_args=())
def attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    stats: torch.Tensor,
    scale: float,
    alignment: str,
    window_left: int,
    window_right: int,
    softcap: float | None,
    backend: str,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks): dq, dk, dv in the inputs' dtype, each laid out like its
    input where that is dense (``_layouts.strides_like``), contiguous otherwise, dk and
    dv summed over each GQA group; dsinks (H,) in sinks' dtype, or an empty tensor
    without sinks (an op's output cannot be None)."""
    spec = spec_from_op(q, k, scale=scale, alignment=alignment, window_left=window_left,
                        window_right=window_right, softcap=softcap, sinks=sinks)
    dq, dk, dv, dsinks = backward_impl(do, q, k, v, o, lse, stats, spec=spec,
                                       backend=backend, sinks=sinks)
    return dq, dk, dv, (lse.new_empty((0,)) if dsinks is None else dsinks)


@attention_bwd.register_fake
def _(do, q, k, v, o, lse, stats, scale, alignment, window_left, window_right, softcap,
      backend, sinks=None):  # fmt: skip
    dsinks = lse.new_empty((0,)) if sinks is None else torch.empty_like(sinks)
    return (*(empty_like_layout(x, strides_like(x)) for x in (q, k, v)), dsinks)
# --8<-- [end:backward_op]


# --8<-- [start:autograd]
def _setup_context(ctx, inputs, output):
    # scale, alignment, the band's two sides, softcap, backend[, sinks]
    q, k, v, *arguments = inputs
    arguments = arguments[:6]
    sinks = inputs[9] if len(inputs) > 9 else None
    o, lse, stats = output
    # O(T) extra memory: o, lse and (m, l), never P; and the (H,) sinks
    ctx.save_for_backward(q, k, v, o, lse, stats, *([] if sinks is None else [sinks]))
    ctx.arguments = tuple(arguments)
    ctx.mark_non_differentiable(lse, stats)


def _backward(ctx, do, _dlse, _dstats):
    # o's gradient undefined (a Function upstream returned None, gradcheck's check):
    # zero
    if do is None:
        return (None,) * (4 + len(ctx.arguments))
    q, k, v, o, lse, stats, *sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = attention_bwd(do, q, k, v, o, lse, stats, *ctx.arguments,
                                       *sinks)
    return dq, dk, dv, *(None,) * len(ctx.arguments), (dsinks if sinks else None)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)
# --8<-- [end:autograd]


# --8<-- [start:eager]
class _EagerAttention(torch.autograd.Function):
    """The same forward and backward as the two custom ops, for eager calls.

    Each call through a custom op pays for the dispatcher's generic checks, which on the
    H200's host took longer than the whole kernel at small shapes. Outside
    ``torch.compile`` nothing needs the op's graph node, so eager calls run the
    implementations through this plain autograd function; under ``torch.compile`` the op
    is traced as one node, as before. Both save the same tensors and give the same
    numbers. With ``create_graph=True`` the backward goes through the backward op, whose
    own backward refuses a second derivative with a clear error.

    ``spec`` and ``backend`` are what the ops' arguments after the tensors carry
    (``_spec.op_arguments``); ``sinks``, the (H,) sinks or None, an input autograd
    tracks. The outputs are o, and lse only where the caller returns it: every output
    costs autograd work, and (m, l) never leaves the function.
    """

    @staticmethod
    def forward(ctx, q, k, v, spec, backend, return_lse, call=None, sinks=None):
        # a flashtile.attention call with its kept kernel plan: no second plan lookup
        if call is not None:
            o, row_stats = forward_from_kept_plan(q, k, v, call, True, sinks)
            # (lse, m, l) in one buffer: views only where needed; sinks saved as None
            # without them
            ctx.save_for_backward(q, k, v, o, row_stats, sinks)
            lse = row_stats[0] if return_lse else None
        else:
            o, lse, stats = forward_impl(q, k, v, spec, backend, sinks)
            ctx.save_for_backward(q, k, v, o, lse, stats, sinks)
        ctx.spec, ctx.backend, ctx.call = spec, backend, call
        if return_lse:
            ctx.mark_non_differentiable(lse)
            # o is the only differentiable output, so the engine calls backward only
            # when do exists; by default it would still fill a zero tensor for lse's
            # gradient before every backward.
            ctx.set_materialize_grads(False)
            return o, lse
        return o

    @staticmethod
    def backward(ctx, do, *_dlse):
        # Grad mode is on inside a backward only under create_graph=True: then take the
        # op, whose registered backward raises at the second derivative instead of
        # returning a wrong one.
        graph = torch.is_grad_enabled()
        # o's gradient undefined (a Function upstream returned None, gradcheck's check):
        # an undefined gradient means zero: q's, k's, v's and the sinks' too
        if do is None:
            return (None,) * 8
        if ctx.call is not None:
            q, k, v, o, row_stats, sinks = ctx.saved_tensors
            if not graph:  # the call's kept backward plan: straight to the kernels
                grads = backward_from_kept_plan(do, q, k, v, o, row_stats, ctx.call,
                                                sinks)  # fmt: skip
                dq, dk, dv, dsinks = grads
                return dq, dk, dv, None, None, None, None, dsinks
            lse, stats = row_stats[0], row_stats[1:]
        else:
            q, k, v, o, lse, stats, sinks = ctx.saved_tensors
        if graph:
            dq, dk, dv, dsinks = attention_bwd(do, q, k, v, o, lse, stats,
                                               *op_arguments(ctx.spec), ctx.backend,
                                               sinks)  # fmt: skip
            dsinks = None if sinks is None else dsinks
        else:
            dq, dk, dv, dsinks = backward_impl(do, q, k, v, o, lse, stats,
                                               spec=ctx.spec, backend=ctx.backend,
                                               sinks=sinks)  # fmt: skip
        return dq, dk, dv, None, None, None, None, dsinks


# Function.apply without its Python layer: that layer sends calls under torch.func
# transforms elsewhere and unwraps inputs a finished transform left wrapped ("dead
# wrappers"). Every caller below has refused the transforms already
# (``refuse_unsupported_autograd_modes``, ``refused_mode``), and ``attention`` unwraps
# dead wrappers itself before its checks, so the C function is called directly.
_eager_apply = super(torch.autograd.Function, _EagerAttention).apply


def run_forward(q, k, v, spec: AttentionSpec, backend: str, sinks=None):
    """(o, lse) through the custom op when compiling or for anything but plain CPU or
    CUDA tensors (meta tensors, fake tensors, subclasses: the op's fake implementation
    serves them); through ``_EagerAttention`` otherwise, and straight to the
    implementation when no gradient can flow (to q, k, v or the sinks)."""
    if torch.compiler.is_compiling() or not plain_inputs(q, k, v) or (
            sinks is not None and type(sinks) not in PLAIN_TENSORS):  # fmt: skip
        return attention_fwd(q, k, v, *op_arguments(spec), backend, sinks)[:2]
    if records_gradient(q, k, v, sinks):
        return _eager_apply(q, k, v, spec, backend, True, None, sinks)
    return forward_impl(q, k, v, spec, backend, sinks)[:2]
# --8<-- [end:eager]


def _no_double_backward(ctx, *grads):
    raise NotImplementedError(
        "flashtile.attention supports one backward pass: double backward (a gradient of a gradient, as in "
        "gradient penalties or Hessian-vector products) is not supported; use torch's "
        "scaled_dot_product_attention with the math backend for that"
    )


attention_bwd.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


@dataclass(slots=True)
class KernelPlans:
    """The kernels' plans of one kept ``flashtile.attention`` call, each filled by the first eager call that
    needs it (the call's key fixes the layouts of query, key and value)."""

    forward: object = None  # kernels.forward.ForwardPlan
    decode: object = None  # kernels.decode.DecodePlan, for a call the decode kernels run (``decode_route``)
    backward: dict = field(default_factory=dict)  # layout of do -> kernels.backward.BackwardPlan


class AttentionCall(NamedTuple):
    """A ``flashtile.attention`` call's checked options, worked out once per layout of (query, key, value)
    and flag values, and kept (``call_key``)."""

    spec: AttentionSpec  # τ resolved (float64 or not is all it reads of the dtype; autocast never changes that)
    plans: KernelPlans
    short: bool  # Tq <= 16: the decode kernels may run it (``decode_route``)
    plain: bool  # plain_inputs(query, key, value): their types and device are part of the key


def check_attention_call(query, key, value, *, is_causal, scale, enable_gqa, alignment, return_lse, window,
                         softcap, sinks=None) -> AttentionCall:  # fmt: skip
    """Every check of ``flashtile.attention`` that reads only layouts and flags (of the sinks: their layout,
    not their values); raises on bad input."""
    shape = check_attention_inputs(query, key, value, names=("query", "key", "value"), unequal_head_dims=True)
    spec = check_spec(shape, query.dtype, causal=is_causal, scale=scale, alignment=alignment, window=window,
                      softcap=softcap, return_lse=return_lse, enable_gqa=enable_gqa, sinks=sinks,
                      device=query.device)  # fmt: skip
    # a short call (a decode step, a speculative or chunked one) may run on the decode kernels, which take
    # sinks and a value head dim of its own as the forward kernel does
    short = shape.Tq <= MAX_NEW_TOKENS
    return AttentionCall(spec=spec, plans=KernelPlans(), short=short, plain=plain_inputs(query, key, value))


def call_key(query, key, value, flags: tuple, sinks=None) -> tuple | None:
    """The key a checked call is kept under: everything ``check_attention_call`` and the kernel plans read
    (``_plans.layout_key`` of each tensor, flat in one tuple: one hash, no nested tuples to build), each flag
    with its type, the types inside a window (``(True, 0) == (1, 0)``, but only one is valid), and the sinks'
    layout; None for what cannot form a key (a non-tensor, a list), which the checks then judge."""
    if sinks is not None:
        try:
            sinks_key = layout_key(sinks) if isinstance(sinks, torch.Tensor) else None
        except RuntimeError:  # no storage (a sparse tensor): the checks judge it
            return None
        base = None if sinks_key is None else call_key(query, key, value, flags)
        return None if base is None else (*base, *sinks_key)
    try:
        return (type(query), query.shape, query.stride(), query.dtype, query.device, query.data_ptr() % 16 == 0,
                query.is_neg(), type(key), key.shape, key.stride(), key.dtype, key.device, key.data_ptr() % 16 == 0,
                key.is_neg(), type(value), value.shape, value.stride(), value.dtype, value.device,
                value.data_ptr() % 16 == 0, value.is_neg(), *map(type, flags), *flags,
                flags[5] if flags[5] is None else tuple(map(type, flags[5])))  # fmt: skip
    except (AttributeError, TypeError, RuntimeError):
        return None



# --8<-- [start:dispatch_call]
def cast_and_dispatch(query, key, value, call: AttentionCall, compiling: bool,
                      sinks=None):  # fmt: skip
    """``dispatch``, on the inputs cast to the autocast dtype where torch.autocast is on
    for their device; the kept plans only for the call's own inputs (eager, and not cast
    copies). The sinks keep their dtype where the cast inputs take it, else become
    float32 (``autocast_sinks``)."""
    # eagerly, one C call where no autocast is on (torch.compile traces the rest)
    if compiling or any_autocast():
        # the flag first: no device object on the GPU
        device = "cuda" if query.is_cuda else query.device.type
        if autocast_on(device):
            uncast = query
            # all three cast, or none
            query, key, value = autocast_inputs(query, key, value, device)
            sinks = autocast_sinks(sinks, query.dtype)
            # the tiers choose their own precision
            with torch.autocast(device, enabled=False):
                own = not compiling and query is uncast
                return dispatch(query, key, value, call, own_inputs=own, sinks=sinks)
    return dispatch(query, key, value, call, own_inputs=not compiling, sinks=sinks)


def dispatch(query, key, value, call: AttentionCall, own_inputs: bool, sinks=None):
    """Run one checked call on its tier: on the decode kernels where ``decode_route``
    says so; else from the call's kept kernel plan where it fits (``own_inputs``: eager,
    and the inputs are the call's own, not autocast copies), through ``run_forward``
    otherwise."""
    backend = pick_backend(query)
    spec = call.spec
    # Tq <= 16 rows only
    if call.short and decode_route(query, key, value, call, backend, sinks):
        o, lse = decode_forward(query, key, value, call, own_inputs, sinks)
        return (o, lse) if spec.return_lse else o
    if own_inputs and call.plain and backend == "triton" and (
            sinks is None or type(sinks) in PLAIN_TENSORS):  # fmt: skip
        if records_gradient(query, key, value, sinks):
            return _eager_apply(query, key, value, spec, "triton", spec.return_lse,
                                call, sinks)  # fmt: skip
        o, row_stats = forward_from_kept_plan(query, key, value, call,
                                              stats=spec.return_lse, sinks=sinks)
        return (o, row_stats[0]) if spec.return_lse else o
    o, lse = run_forward(query, key, value, spec, backend, sinks)
    return (o, lse) if spec.return_lse else o
# --8<-- [end:dispatch_call]


# --8<-- [start:decode_route]
def decode_route(q, k, v, call: AttentionCall, backend: str, sinks=None) -> bool:
    """Whether a call runs on the split-K decode kernels (``kernels.decode``) instead of
    the forward kernel.

    Every call with Tq <= 16 query rows on the Triton tier that autograd does not
    record: the forward kernel gives such a call one program per (batch, head) and
    leaves most of the GPU idle, while the decode kernels split the keys across it. They
    take every mask ``attention`` has, as a band around the lower-right diagonal
    (``kernels.decode.plan_decode``: causal in either alignment, windows, no mask), GQA,
    any scale, the soft-cap, sinks (counted once, in the merge's start state) and a
    value head dim of its own. A call that needs a gradient (of q, k, v or the sinks)
    keeps the forward kernel, whose (m, l) the backward reads; the reference tier is
    unchanged. Plain Python on the call's flags, so torch.compile traces it into the
    graph like the rest of the dispatch.
    """
    return (call.short and backend == "triton"
            and not records_gradient(q, k, v, sinks))  # fmt: skip


def decode_forward(q, k, v, call: AttentionCall, own_inputs: bool, sinks=None):
    """(o, lse) of a routed call (lse None unless the call returns it): from the call's
    kept decode plan eagerly, through the ``attention_decode`` op under torch.compile
    and for fake or meta tensors (or sinks of another tensor type)."""
    spec = call.spec
    if torch.compiler.is_compiling() or not plain_inputs(q, k, v) or (
            sinks is not None and type(sinks) not in PLAIN_TENSORS):  # fmt: skip
        return attention_decode(q, k, v, *op_arguments(spec), sinks)
    plan = call.plans.decode if own_inputs else None
    if plan is None:
        from ..kernels.decode import make_attention_decode_plan

        # autocast copies: not the call's own inputs, so the plan is kept by layout
        # instead (the sinks' too: the plan keeps their stride)
        if not own_inputs:
            tensors = (q, k, v) if sinks is None else (q, k, v, sinks)
            plan = cached_plan(make_attention_decode_plan, tensors, spec,
                               spec.return_lse,
                               names=("spec", "store_lse"))  # fmt: skip
        else:  # the call's key holds the sinks' layout
            plan = make_attention_decode_plan(q, k, v, sinks, spec=spec,
                                              store_lse=spec.return_lse)  # fmt: skip
            call.plans.decode = plan
    return plan.run(q, k, v, None, None, sinks)


@torch.library.custom_op("flashtile::attention_decode", mutates_args=())
def attention_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, alignment: str,
    window_left: int, window_right: int, softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of ``attention`` on the decode kernels: o (B, H, Tq, d_v) laid out like
    q where q is dense (``_spec.output_strides``), lse (B, H, Tq) float32, with sinks
    the log of the whole normaliser. The arguments are ``attention_fwd``'s but the
    tier."""
    from ..kernels.decode import make_attention_decode_plan

    spec = spec_from_op(q, k, scale=scale, alignment=alignment, window_left=window_left,
                        window_right=window_right, softcap=softcap, sinks=sinks)
    tensors = (q, k, v) if sinks is None else (q, k, v, sinks)
    plan = cached_plan(make_attention_decode_plan, tensors, spec, True,
                       names=("spec", "store_lse"))  # fmt: skip
    return plan.run(q, k, v, None, None, sinks)


@attention_decode.register_fake
def _(q, k, v, scale, alignment, window_left, window_right, softcap, sinks=None):
    o = q.new_empty_strided((*q.shape[:3], v.shape[-1]), output_strides(q, v.shape[-1]))
    return o, q.new_empty(q.shape[:3], dtype=torch.float32)
# --8<-- [end:decode_route]


def forward_from_kept_plan(q, k, v, call: AttentionCall, stats: bool = True, sinks=None):
    """The Triton forward from the call's kept plan (worked out from the call's spec the first time): o and
    the row statistics (lse, m, l), with no view made that the caller does not ask for; without ``stats``,
    o and None (the kernel then stores no statistics). ``sinks``: the call's (H,) sinks, where it has them."""
    plan = call.plans.forward
    if plan is None:  # the first kernel call of this layout and these flags
        from ..kernels.forward import make_forward_plan

        plan = call.plans.forward = make_forward_plan(q, k, v, spec=call.spec, return_stats=True)
    return plan.run(q, k, v, stats, sinks)  # a method of the plan: no import on every call


MAX_GRADIENT_LAYOUTS = 8  # layouts of do whose backward plans one kept call holds; past that it starts over


def backward_from_kept_plan(do, q, k, v, o, row_stats, call: AttentionCall, sinks=None):
    """(dq, dk, dv, dsinks) from the call's kept backward plan, for a call ``_EagerAttention`` ran from its
    kept forward plan (dsinks None without sinks). The call's key fixes the layouts of q, k and v, and o and
    the row statistics are that forward's fresh outputs, so the one input whose layout can change is do: the
    plans are kept by its layout alone (one ``layout_key``, where the launcher's own lookup reads seven
    tensors)."""
    do_key = layout_key(do)
    if do_key[-1]:  # do.is_neg(): an upstream gradient may be a negative view, and the kernels read memory
        do = do.resolve_neg()
        do_key = layout_key(do)
    plans = call.plans.backward
    plan = plans.get(do_key)
    stats = row_stats[1:]  # the forward's (m, l): the exact hand-off
    if plan is None:  # the first backward of this call with this layout of do: every launcher check runs
        from ..kernels.backward import make_backward_plan

        plan = make_backward_plan(q, k, v, o, row_stats[0], do, stats, spec=call.spec, deterministic=True)
        if len(plans) >= MAX_GRADIENT_LAYOUTS:
            plans.clear()
        plans[do_key] = plan
    rows = torch.empty_like(row_stats)  # the row terms (delta, m, log2 l): row_stats' shape and dtype
    dq, dk, dv = plan.run(q, k, v, o, do, stats, rows)
    if sinks is None:
        return dq, dk, dv, None
    from ..kernels.sinks import sink_gradient

    return dq, dk, dv, sink_gradient(sinks, row_stats[0], rows[0])  # from the delta the dQ kernel stored

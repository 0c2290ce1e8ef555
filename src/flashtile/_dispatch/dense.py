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
(``backward_kernel``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._checks import (
    MAX_NEW_TOKENS,
    check_alignment,
    check_attention_inputs,
    check_causal,
    check_flag,
    check_softcap,
    check_window,
    resolve_neg_bits,
    resolve_scale,
    stats_dtype,
)
from .._layouts import empty_like_layout, strides_like
from .._plans import cached_plan, layout_key
from ..reference.decode import decode_band
from .tiers import (
    REFERENCE_BLOCK,
    any_autocast,
    autocast_inputs,
    autocast_on,
    check_backend,
    pick_backend,
    plain_inputs,
    records_gradient,
)


# --8<-- [start:impl]
def op_window(window_left: int, window_right: int):
    """The ops carry a window as two ints (a schema has no optional pair): (-1, -1), unbounded on both
    sides, is no window."""
    return None if window_left == window_right == -1 else (window_left, window_right)


def forward_impl(q, k, v, causal, scale, alignment, backend, window_left=-1, window_right=-1, softcap=None):
    """What the forward op computes, callable without the op: (o, lse, stats), see ``attention_fwd``."""
    window = op_window(window_left, window_right)
    if check_backend(backend) == "triton":
        from ..kernels.forward import flash_attention

        return flash_attention(q, k, v, causal=causal, scale=scale, alignment=alignment, return_stats=True,
                               window=window, softcap=softcap)  # fmt: skip
    from ..reference.forward import flash_attention_forward

    o, lse = flash_attention_forward(q, k, v, causal, scale, REFERENCE_BLOCK, REFERENCE_BLOCK, alignment,
                                     window=window, softcap=softcap)  # fmt: skip
    # o laid out as q is, as the kernels give it (and as the fake says, whichever tier runs)
    return empty_like_layout(o, strides_like(q)).copy_(o), lse.contiguous(), lse.new_empty((0,))


def backward_impl(do, q, k, v, o, lse, stats, causal, scale, alignment, backend, window_left=-1, window_right=-1,
                  softcap=None):  # fmt: skip
    """What the backward op computes, callable without the op: (dq, dk, dv), see ``attention_bwd``."""
    (do,) = resolve_neg_bits(do)  # an upstream gradient may be a negative view: the kernels read memory
    window = op_window(window_left, window_right)
    if check_backend(backend) == "triton":  # the launcher's gradients are new tensors, laid out like q, k, v
        from ..kernels.backward import flash_attention_backward

        return flash_attention_backward(q, k, v, o, lse, do, causal, scale, alignment=alignment, stats=stats,
                                        window=window, softcap=softcap)  # fmt: skip
    from ..reference.backward import flash_attention_backward

    grads = flash_attention_backward(q, k, v, o, lse, do, causal, scale, REFERENCE_BLOCK, REFERENCE_BLOCK, alignment,
                                     window=window, softcap=softcap)  # fmt: skip
    return tuple(empty_like_layout(x, strides_like(x)).copy_(g) for x, g in zip((q, k, v), grads))
# --8<-- [end:impl]


# --8<-- [start:forward_op]
@torch.library.custom_op("flashtile::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, alignment: str, backend: str,
    window_left: int = -1, window_right: int = -1, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, lse, stats): o (B, H, Tq, D) in q's dtype, laid out like q where q is dense (``_layouts.strides_like``),
    contiguous otherwise; lse (B, H, Tq) float32 (float64 for float64);
    stats, what the backward needs besides lse: the kernels' final (m, l), (2, B, H, Tq), or empty.
    The window travels as its two sides, (-1, -1) for none (``op_window``)."""
    o, lse, stats = forward_impl(q, k, v, causal, scale, alignment, backend, window_left, window_right, softcap)
    # The kernels write lse and (m, l) into one buffer, and an op's outputs may not share memory.
    return o, lse, (stats.clone() if stats.numel() else stats)


@attention_fwd.register_fake
def _(q, k, v, causal, scale, alignment, backend, window_left=-1, window_right=-1, softcap=None):
    # Only shapes, dtypes and devices: what torch.compile needs to trace past the op without running it.
    B, H, Tq, D = q.shape
    c = stats_dtype(q.dtype)
    stats_shape = (2, B, H, Tq) if backend == "triton" else (0,)
    return empty_like_layout(q, strides_like(q)), q.new_empty((B, H, Tq), dtype=c), q.new_empty(stats_shape, dtype=c)
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
    causal: bool,
    scale: float,
    alignment: str,
    backend: str,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the inputs' dtype, each laid out like its input where that is dense
    (``_layouts.strides_like``), contiguous otherwise; dk and dv summed over each GQA group."""
    return backward_impl(do, q, k, v, o, lse, stats, causal, scale, alignment, backend, window_left, window_right,
                         softcap)  # fmt: skip


@attention_bwd.register_fake
def _(do, q, k, v, o, lse, stats, causal, scale, alignment, backend, window_left=-1, window_right=-1, softcap=None):
    return tuple(empty_like_layout(x, strides_like(x)) for x in (q, k, v))
# --8<-- [end:backward_op]


# --8<-- [start:autograd]
def _setup_context(ctx, inputs, output):
    q, k, v, *config = inputs  # causal, scale, alignment, backend, and the window and cap where given
    o, lse, stats = output
    ctx.save_for_backward(q, k, v, o, lse, stats)  # O(T) extra memory: o, lse and (m, l), never P
    ctx.config = tuple(config)
    ctx.mark_non_differentiable(lse, stats)


def _backward(ctx, do, _dlse, _dstats):
    if do is None:  # o's gradient undefined (a Function upstream returned None, gradcheck's check): zero
        return (None,) * (3 + len(ctx.config))
    q, k, v, o, lse, stats = ctx.saved_tensors
    dq, dk, dv = attention_bwd(do, q, k, v, o, lse, stats, *ctx.config)
    return dq, dk, dv, *(None,) * len(ctx.config)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)
# --8<-- [end:autograd]


# --8<-- [start:eager]
class _EagerAttention(torch.autograd.Function):
    """The same forward and backward as the two custom ops, for eager calls.

    Each call through a custom op pays for the dispatcher's generic checks, which on the H200's host
    took longer than the whole kernel at small shapes. Outside ``torch.compile``
    nothing needs the op's graph node, so eager calls run the implementations through this plain
    autograd function; under ``torch.compile`` the op is traced as one node, as before. Both save the
    same tensors and give the same numbers. With ``create_graph=True`` the backward goes through the
    backward op, whose own backward refuses a second derivative with a clear error.

    ``config`` is the ops' arguments after the tensors (causal, scale, alignment, backend, window_left,
    window_right, softcap), as one tuple: autograd handles each argument of ``apply`` in turn. The outputs
    are o, and lse only where the caller returns it: every output costs autograd work, and (m, l) never
    leaves the function.
    """

    @staticmethod
    def forward(ctx, q, k, v, config, return_lse, call=None):
        if call is not None:  # a flashtile.attention call with its kept kernel plan: no second plan lookup
            o, row_stats = forward_kernel(q, k, v, call, config[2])
            ctx.save_for_backward(q, k, v, o, row_stats)  # (lse, m, l) in one buffer: views only where needed
            lse = row_stats[0] if return_lse else None
        else:
            o, lse, stats = forward_impl(q, k, v, *config)
            ctx.save_for_backward(q, k, v, o, lse, stats)
        ctx.config, ctx.call = config, call
        if return_lse:
            ctx.mark_non_differentiable(lse)
            # o is the only differentiable output, so the engine calls backward only when do exists; by
            # default it would still fill a zero tensor for lse's gradient before every backward.
            ctx.set_materialize_grads(False)
            return o, lse
        return o

    @staticmethod
    def backward(ctx, do, *_dlse):
        # Grad mode is on inside a backward only under create_graph=True: then take the op, whose
        # registered backward raises at the second derivative instead of returning a wrong one.
        graph = torch.is_grad_enabled()
        if do is None:  # o's gradient undefined (a Function upstream returned None, gradcheck's check): an
            return None, None, None, None, None, None  # undefined gradient means zero, and so do q's, k's, v's
        if ctx.call is not None:
            q, k, v, o, row_stats = ctx.saved_tensors
            if not graph:  # the call's kept backward plan: straight to the kernels
                return (*backward_kernel(do, q, k, v, o, row_stats, ctx.call), None, None, None)
            lse, stats = row_stats[0], row_stats[1:]
        else:
            q, k, v, o, lse, stats = ctx.saved_tensors
        args = (do, q, k, v, o, lse, stats, *ctx.config)
        dq, dk, dv = attention_bwd(*args) if graph else backward_impl(*args)
        return dq, dk, dv, None, None, None


# Function.apply without its Python layer: that layer sends calls under torch.func transforms elsewhere and
# unwraps inputs a finished transform left wrapped ("dead wrappers"). Every caller below has refused the
# transforms already (``refuse_unsupported_autograd_modes``, ``refused_mode``), and ``attention`` unwraps
# dead wrappers itself before its checks, so the C function is called directly.
_eager_apply = super(torch.autograd.Function, _EagerAttention).apply



def run_forward(q, k, v, causal, scale, alignment, backend, window_left=-1, window_right=-1, softcap=None):
    """(o, lse) through the custom op when compiling or for anything but plain CPU or CUDA tensors (meta
    tensors, fake tensors, subclasses: the op's fake implementation serves them); through ``_EagerAttention``
    otherwise, and straight to the implementation when no gradient can flow."""
    config = (causal, scale, alignment, backend, window_left, window_right, softcap)
    if torch.compiler.is_compiling() or not plain_inputs(q, k, v):
        return attention_fwd(q, k, v, *config)[:2]
    if records_gradient(q, k, v):
        return _eager_apply(q, k, v, config, True)
    return forward_impl(q, k, v, *config)[:2]
# --8<-- [end:eager]


def _no_double_backward(ctx, *grads):
    raise NotImplementedError(
        "flashtile.attention supports one backward pass: double backward (a gradient of a gradient, as in "
        "gradient penalties or Hessian-vector products) is not supported; use torch's "
        "scaled_dot_product_attention with the math backend for that"
    )


attention_bwd.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


class AttentionCall(NamedTuple):
    """A ``flashtile.attention`` call's checked flags, worked out once per layout of (query, key, value)
    and flag values, and kept (``call_key``)."""

    is_causal: bool
    scale: float  # τ resolved: float64 or not is all it reads of the dtype, and autocast never changes that
    return_lse: bool
    # [the Triton forward's plan, the decode kernels' plan, {layout of do: the Triton backward's plan}],
    # each filled by the first eager call that needs it
    kernel_plan: list
    window: tuple[int, int]  # (left, right) checked; (-1, -1), unbounded, without a window
    softcap: float | None
    decode_band: tuple[int, int] | None  # Tq <= 16: the mask as the decode kernels take it (``decode_route``)
    alignment: str
    plain: bool  # plain_inputs(query, key, value): their types and device are part of the key
    kernel_config: tuple  # the ops' arguments after the tensors on the Triton tier (``_EagerAttention``)


def check_attention_call(query, key, value, is_causal, scale, enable_gqa, alignment, return_lse, window=None,
                         softcap=None) -> AttentionCall:  # fmt: skip
    """Every check of ``flashtile.attention`` that reads only layouts and flags; raises on bad input."""
    shape = check_attention_inputs(query, key, value, names=("query", "key", "value"))
    is_causal = check_causal(is_causal, "is_causal")
    enable_gqa = check_flag("enable_gqa", enable_gqa)
    return_lse = check_flag("return_lse", return_lse)
    check_alignment(alignment)
    window = check_window(window) or (-1, -1)
    softcap = check_softcap(softcap, query.dtype)
    if shape.H != shape.H_kv and not enable_gqa:
        raise ValueError(
            f"query has {shape.H} heads but key and value have {shape.H_kv}; pass enable_gqa=True for "
            "grouped-query attention (as with scaled_dot_product_attention)"
        )
    # a short call (a decode step, a speculative or chunked one) may run on the decode kernels: its mask as a band
    band = None
    if shape.Tq <= MAX_NEW_TOKENS:
        band = decode_band(shape.Tq, shape.Tk, op_window(*window), is_causal, alignment)
    scale = resolve_scale(scale, shape.D, query.dtype)
    return AttentionCall(is_causal, scale, return_lse, [None, None, {}], window, softcap, band, alignment,
                         plain_inputs(query, key, value),
                         (is_causal, scale, alignment, "triton", *window, softcap))  # fmt: skip


def call_key(query, key, value, flags: tuple) -> tuple | None:
    """The key a checked call is kept under: everything ``check_attention_call`` and the kernel plans read
    (``_plans.layout_key`` of each tensor, flat in one tuple: one hash, no nested tuples to build), each flag
    with its type, and the types inside a window (``(True, 0) == (1, 0)``, but only one is valid); None
    for what cannot form a key (a non-tensor, a list), which the checks then judge."""
    try:
        return (type(query), query.shape, query.stride(), query.dtype, query.device, query.data_ptr() % 16 == 0,
                query.is_neg(), type(key), key.shape, key.stride(), key.dtype, key.device, key.data_ptr() % 16 == 0,
                key.is_neg(), type(value), value.shape, value.stride(), value.dtype, value.device,
                value.data_ptr() % 16 == 0, value.is_neg(), *map(type, flags), *flags,
                flags[5] if flags[5] is None else tuple(map(type, flags[5])))  # fmt: skip
    except (AttributeError, TypeError, RuntimeError):
        return None



# --8<-- [start:dispatch_call]
def cast_and_dispatch(query, key, value, call: AttentionCall, compiling: bool):
    """``dispatch``, on the inputs cast to the autocast dtype where torch.autocast is on for their device;
    the kept plans only for the call's own inputs (eager, and not cast copies)."""
    if compiling or any_autocast():  # eagerly, one C call where no autocast is on (torch.compile traces the rest)
        device = "cuda" if query.is_cuda else query.device.type  # the flag first: no device object on the GPU
        if autocast_on(device):
            uncast = query
            query, key, value = autocast_inputs(query, key, value, device)  # all three cast, or none
            with torch.autocast(device, enabled=False):  # the tiers choose their own precision
                return dispatch(query, key, value, call, kept=not compiling and query is uncast)
    return dispatch(query, key, value, call, kept=not compiling)


def dispatch(query, key, value, call: AttentionCall, kept: bool):
    """Run one checked call on its tier: on the decode kernels where ``decode_route`` says so; else from the
    call's kept kernel plan where it fits (``kept``: eager, and the inputs are the call's own, not autocast
    copies), through ``run_forward`` otherwise."""
    backend = pick_backend(query)
    if call.decode_band is not None and decode_route(query, key, value, call, backend):  # Tq <= 16 rows only
        o, lse = decode_forward(query, key, value, call, kept)
        return (o, lse) if call.return_lse else o
    if kept and call.plain and backend == "triton":
        if records_gradient(query, key, value):
            return _eager_apply(query, key, value, call.kernel_config, call.return_lse, call)
        o, row_stats = forward_kernel(query, key, value, call, call.alignment, stats=call.return_lse)
        return (o, row_stats[0]) if call.return_lse else o
    o, lse = run_forward(query, key, value, call.is_causal, call.scale, call.alignment, backend, *call.window,
                         call.softcap)  # fmt: skip
    return (o, lse) if call.return_lse else o
# --8<-- [end:dispatch_call]


# --8<-- [start:decode_route]
def decode_route(q, k, v, call: AttentionCall, backend: str) -> bool:
    """Whether a call runs on the split-K decode kernels (``kernels.decode``) instead of the forward kernel.

    Every call with Tq <= 16 query rows on the Triton tier that autograd does not record: the forward
    kernel gives such a call one program per (batch, head) and leaves most of the GPU idle, while the
    decode kernels split the keys across it. They take every mask ``attention`` has, as a band around
    the lower-right diagonal (``reference.decode.decode_band``: causal in either alignment, windows, no
    mask), GQA, any scale and the soft-cap, so the route needs no other condition. A call that needs a
    gradient keeps the forward kernel, whose (m, l) the backward reads; the reference tier is unchanged.
    Plain Python on the call's flags, so torch.compile traces it into the graph like the rest of the dispatch.
    """
    return call.decode_band is not None and backend == "triton" and not records_gradient(q, k, v)


def decode_forward(q, k, v, call: AttentionCall, kept: bool):
    """(o, lse) of a routed call (lse None unless the call returns it): from the call's kept decode plan
    eagerly, through the ``attention_decode`` op under torch.compile and for fake or meta tensors."""
    if torch.compiler.is_compiling() or not plain_inputs(q, k, v):
        return attention_decode(q, k, v, call.scale, *call.decode_band, call.softcap)
    plan = call.kernel_plan[1] if kept else None
    if plan is None:
        from ..kernels.decode import make_attention_decode_plan

        if not kept:  # autocast copies: not the call's own inputs, so the plan is kept by layout instead
            plan = cached_plan(make_attention_decode_plan, (q, k, v), call.scale, call.decode_band, call.softcap,
                               call.return_lse)  # fmt: skip
        else:
            plan = call.kernel_plan[1] = make_attention_decode_plan(q, k, v, call.scale, call.decode_band,
                                                                    call.softcap, call.return_lse)  # fmt: skip
    return plan.run(q, k, v)


@torch.library.custom_op("flashtile::attention_decode", mutates_args=())
def attention_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, band_lo: int, band_hi: int,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of ``attention`` on the decode kernels: o laid out like q where q is dense
    (``_layouts.strides_like``), lse (B, H, Tq) float32. The band is ``decode_route``'s."""
    from ..kernels.decode import make_attention_decode_plan

    plan = cached_plan(make_attention_decode_plan, (q, k, v), scale, (band_lo, band_hi), softcap, True)
    return plan.run(q, k, v)


@attention_decode.register_fake
def _(q, k, v, scale, band_lo, band_hi, softcap=None):
    return empty_like_layout(q, strides_like(q)), q.new_empty(q.shape[:3], dtype=torch.float32)
# --8<-- [end:decode_route]


def forward_kernel(q, k, v, call: AttentionCall, alignment: str, stats: bool = True):
    """The Triton forward from the call's kept plan (worked out by the launcher's own checks the first
    time): o and the row statistics (lse, m, l), with no view made that the caller does not ask for; without
    ``stats``, o and None (the kernel then stores no statistics)."""
    plan = call.kernel_plan[0]
    if plan is None:  # the first kernel call of this layout and these flags
        from ..kernels.forward import make_forward_plan

        plan = call.kernel_plan[0] = make_forward_plan(q, k, v, call.is_causal, call.scale, alignment, None, None,
                                                       None, None, None, True, op_window(*call.window),
                                                       call.softcap)  # fmt: skip
    return plan.run(q, k, v, stats)  # a method of the plan: no import on every call


MAX_GRADIENT_LAYOUTS = 8  # layouts of do whose backward plans one kept call holds; past that it starts over


def backward_kernel(do, q, k, v, o, row_stats, call: AttentionCall):
    """(dq, dk, dv) from the call's kept backward plan, for a call ``_EagerAttention`` ran from its kept
    forward plan. The call's key fixes the layouts of q, k and v, and o and the row statistics are that
    forward's fresh outputs, so the one input whose layout can change is do: the plans are kept by its
    layout alone (one ``layout_key``, where the launcher's own lookup reads seven tensors)."""
    do_key = layout_key(do)
    if do_key[-1]:  # do.is_neg(): an upstream gradient may be a negative view, and the kernels read memory
        do = do.resolve_neg()
        do_key = layout_key(do)
    plans = call.kernel_plan[2]
    plan = plans.get(do_key)
    stats = row_stats[1:]  # the forward's (m, l): the exact hand-off
    if plan is None:  # the first backward of this call with this layout of do: every launcher check runs
        from ..kernels.backward import make_backward_plan

        plan = make_backward_plan(q, k, v, o, row_stats[0], do, stats, call.is_causal, call.scale, call.alignment,
                                  None, None, None, True, None, op_window(*call.window), call.softcap)  # fmt: skip
        if len(plans) >= MAX_GRADIENT_LAYOUTS:
            plans.clear()
        plans[do_key] = plan
    return plan.run(q, k, v, o, do, stats, torch.empty_like(row_stats))  # the row terms: row_stats' shape and dtype


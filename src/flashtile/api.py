"""``flashtile.attention``: an SDPA-shaped entry point, registered as a torch.library custom op.

A call site written for ``torch.nn.functional.scaled_dot_product_attention(query, key, value,
is_causal=..., scale=..., enable_gqa=...)`` can call ``flashtile.attention`` with the same arguments.
What SDPA has and flashtile does not: ``attn_mask`` and ``dropout_p`` (both raise if used), inputs of
rank other than 4, and a value head dim different from the query's.

What runs (the dispatch):

* CUDA tensors run the Triton kernels (``flashtile.kernels.forward`` and ``.backward``).
  Calls of Tq <= 16 query rows that autograd does not record run the split-K decode kernels
  (``flashtile.kernels.decode``) instead of the forward kernel, with every mask, the same answer and
  the same contract (``decode_route``).
* CPU tensors run the same Triton kernels through Triton's interpreter when ``TRITON_INTERPRET`` is on
  (read exactly as Triton reads it; set it before flashtile's kernel modules are imported), and the
  PyTorch reference tier (``flashtile.reference.forward`` / ``.backward``, in float32) otherwise.
* float64 inputs always take the reference tier, computed in float64: the kernels stop at fp32.
  So do bfloat16 CPU tensors, whose arithmetic the interpreter gets wrong (Triton issue 11584).
* ``use_backend("reference")`` / ``use_backend("triton")`` overrides the choice inside a ``with``
  block, for the current thread (or asyncio task) only.

Every tier takes the same inputs and refuses the same inputs (``flashtile._checks``), reads a view with
the negative bit (``z.conj().imag``) as its values and refuses complex tensors, and follows one
rule for NaN and inf (the site's "flashtile.attention" page): a row that sees a NaN, or an infinite
score, comes out NaN; a row that sees no key gives o = 0 and lse = -inf.

The forward and the backward are two custom ops, ``flashtile::attention_fwd`` and
``flashtile::attention_bwd``. To ``torch.compile`` each is one opaque node: it never traces into
Triton launches or Python tile loops, and it learns output shapes from the fake implementations below.
Eager calls on plain CPU or CUDA tensors run the same implementations without the op's dispatcher
(``run_forward``), which costs a fraction of the op's host time per call (bench/PERF_LOG.md, v5;
``bench/results/overhead.json``). An eager call whose layout and flags were seen before finds its checked
call by one key (``call_key``) and reads again only what may change between two such calls; its backward
runs from a plan kept with the call (``backward_kernel``).
Reverse-mode autograd is supported once (no double backward); forward-mode AD and ``torch.func``
transforms raise ``NotImplementedError`` rather than return a wrong tangent. Under ``torch.autocast``
the inputs are cast to the autocast dtype first, as ``scaled_dot_product_attention`` does.
"""

from __future__ import annotations

import contextlib
import contextvars
import numbers
from typing import NamedTuple

import torch
from torch._functorch.utils import unwrap_dead_wrappers
from torch.autograd import forward_ad as _forward_ad

from ._checks import (
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
from ._env import constant_under_compile, is_interpreting
from ._layouts import empty_like_layout, strides_like
from ._plans import cached_plan, keep, kept, layout_key
from .reference.decode import decode_band

BACKENDS = ("triton", "reference")
_forced_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar("flashtile_backend", default=None)


@contextlib.contextmanager
def use_backend(name: str):
    """Run every ``flashtile.attention`` call in the block on ``name`` ("triton" or "reference").

    float64 inputs take the reference tier even inside ``use_backend("triton")``: the kernels stop at fp32, and
    the module docstring's "float64 inputs always take the reference tier" holds with or without the override.

    The choice is a context variable: it holds for this thread (or asyncio task) only, so one thread's
    override never changes another's dispatch.
    """
    check_backend(name)
    token = _forced_backend.set(name)
    try:
        yield
    finally:
        _forced_backend.reset(token)


@constant_under_compile  # torch.compile reads it once, at trace time, like the rest of the dispatch
def forced_backend() -> str | None:
    """The backend a ``use_backend`` block forces in this thread or task, or None."""
    return _forced_backend.get()


def check_backend(name) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


# --8<-- [start:dispatch]
def pick_backend(q: torch.Tensor) -> str:
    """Which tier runs: see the module docstring. Read at trace time under torch.compile."""
    if q.dtype == torch.float64:  # before the forced tier: the kernels stop at fp32, use_backend or not
        return "reference"
    forced = forced_backend()
    if forced is not None:
        return forced
    if q.is_cuda:  # a flag read, not a device object made and compared: every call passes here
        return "triton"
    if is_interpreting() and q.dtype != torch.bfloat16:  # the interpreter's bf16 is wrong: Triton issue 11584
        return "triton"
    return "reference"
# --8<-- [end:dispatch]


REFERENCE_BLOCK = 64  # the reference tier's tile size: any value gives the same result up to rounding


# --8<-- [start:impl]
def op_window(window_left: int, window_right: int):
    """The ops carry a window as two ints (a schema has no optional pair): (-1, -1), unbounded on both
    sides, is no window."""
    return None if window_left == window_right == -1 else (window_left, window_right)


def forward_impl(q, k, v, causal, scale, alignment, backend, window_left=-1, window_right=-1, softcap=None):
    """What the forward op computes, callable without the op: (o, lse, stats), see ``attention_fwd``."""
    window = op_window(window_left, window_right)
    if check_backend(backend) == "triton":
        from .kernels.forward import flash_attention

        return flash_attention(q, k, v, causal=causal, scale=scale, alignment=alignment, return_stats=True,
                               window=window, softcap=softcap)  # fmt: skip
    from .reference.forward import flash_attention_forward

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
        from .kernels.backward import flash_attention_backward

        return flash_attention_backward(q, k, v, o, lse, do, causal, scale, alignment=alignment, stats=stats,
                                        window=window, softcap=softcap)  # fmt: skip
    from .reference.backward import flash_attention_backward

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

PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


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


def refused_mode() -> bool:
    """Whether torch.func transforms or forward-mode AD are on, which ``refuse_unsupported_autograd_modes``
    refuses: one C call and one attribute, for the kept call's path (which then takes the full one)."""
    return _functorch_active() or _forward_ad._current_level >= 0


_functorch_active = torch._C._are_functorch_transforms_active
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"))  # fmt: skip


# --8<-- [start:attention]
def attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    alignment="upper_left",
    return_lse=False,
    window=None,
    softcap=None,
    descale_q=None,
    descale_k=None,
    descale_v=None,
    out_dtype=None,
):
    """Softmax attention with SDPA's argument names, differentiable, torch.compile-clean.

    Args:
        query: (B, H, Tq, D). key, value: (B, H_kv, Tk, D), 1 <= D <= 256. fp16, bf16, fp32, float64;
            any strides; CUDA, or CPU (see the module docstring for which tier runs).
        attn_mask, dropout_p: accepted for signature compatibility only; must be None and 0.0.
        is_causal: causal mask; with Tq != Tk its diagonal follows ``alignment``.
        scale: τ, multiplies Q K^T; defaults to 1/sqrt(D), as in SDPA. Zero and negative allowed.
        enable_gqa: allow H_kv < H (H a multiple of H_kv); without it H must equal H_kv, as in SDPA.
        alignment: "upper_left" (SDPA's is_causal) or "lower_right" (the last query sees every key).
        return_lse: also return lse (B, H, Tq), natural log, float32 (float64 for float64 inputs);
            it carries no gradient.
        window: None or (left, right), ints: query i sees key j when i - left <= j <= i + right
            (for Tq != Tk shifted by the alignment's offset, 0 or Tk - Tq: i + offset - left <= j <=
            i + offset + right); -1 leaves that side unbounded; with is_causal the right side is
            capped at 0. A sliding window W back is (W - 1, 0), or (W - 1, -1) with is_causal.
        softcap: None or s > 0: each scaled score x becomes s * tanh(x / s) before the mask and the
            softmax (Gemma-2's logit soft-capping), in the forward and the backward.
        descale_q, descale_k, descale_v, out_dtype: for float8_e4m3fn query, key and value (forward only),
            their float32 factors as ``flashtile.fp8.quantize`` returns them, and o's dtype (bf16 by
            default); see ``flashtile.fp8.attention.fp8_attention``.

    Returns:
        o (B, H, Tq, D) in query's dtype (the autocast dtype under autocast), laid out as query is where
        query is dense (a model's (B, H, T, D) view of (B, T, H, D) gives o that view too), contiguous
        otherwise; or (o, lse) if return_lse.
    """
    flags = (is_causal, scale, enable_gqa, alignment, return_lse, window, softcap)
    # The common eager call first: no mask, no dropout, no FP8 argument, and a layout and flags seen before.
    # Its key finds the call the checks below kept for it, and only what may change between two calls of
    # one key is read again (modes, autocast, the forced tier, whether autograd records); a call with
    # anything else, and the first call of a key, goes through every check below.
    if attn_mask is descale_q is descale_k is descale_v is out_dtype is None and dropout_p.__class__ is float \
            and dropout_p == 0.0 and not torch.compiler.is_compiling():  # fmt: skip
        call = kept(call_key(query, key, value, flags))
        if call is not None and not refused_mode():
            return cast_and_dispatch(query, key, value, call, compiling=False)
    if descale_q is not None or descale_k is not None or descale_v is not None or out_dtype is not None or getattr(
            query, "dtype", None) is torch.float8_e4m3fn:  # FP8 inputs: forward only, their own checks and tiers
        from .fp8.attention import fp8_attention

        return fp8_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, alignment=alignment,
                             return_lse=return_lse, window=window, softcap=softcap, descale_q=descale_q,
                             descale_k=descale_k, descale_v=descale_v, out_dtype=out_dtype,
                             backend=forced_backend())  # fmt: skip
    # A view's negative bit (z.conj().imag) is a flag the kernels cannot see: resolve it before the checks,
    # so that every tier, and the kept plans, only ever meet tensors that hold their own values.
    query, key, value = resolve_neg_bits(query, key, value)
    if attn_mask is not None:
        raise ValueError("attn_mask is not supported by flashtile.attention; pass is_causal=True for a causal mask")
    if dropout_p.__class__ is not float or dropout_p != 0.0:  # the default, 0.0, passes on this one comparison
        check_no_dropout(dropout_p)
    if window is not None:  # the window's own error before any other: its checks read no tensor
        check_window(window)
    compiling = torch.compiler.is_compiling()
    if compiling:  # traced once: no table of plans inside the graph
        call = check_attention_call(query, key, value, *flags)
    else:  # eager: the checks run once per layout and flags, then the call is kept under its key
        query, key, value = unwrap_dead_wrappers((query, key, value))  # as Function.apply would (_eager_apply)
        plan_key = call_key(query, key, value, flags)
        call = kept(plan_key)
        if call is None:
            call = check_attention_call(query, key, value, *flags)
            keep(plan_key, call)
        refuse_unsupported_autograd_modes()
    return cast_and_dispatch(query, key, value, call, compiling)


def cast_and_dispatch(query, key, value, call: AttentionCall, compiling: bool):
    """``dispatch``, on the inputs cast to the autocast dtype where torch.autocast is on for their device;
    the kept plans only for the call's own inputs (eager, and not cast copies)."""
    if compiling or _any_autocast():  # eagerly, one C call where no autocast is on (torch.compile traces the rest)
        device = "cuda" if query.is_cuda else query.device.type  # the flag first: no device object on the GPU
        if autocast_on(device):
            uncast = query
            query, key, value = autocast_inputs(query, key, value, device)  # all three cast, or none
            with torch.autocast(device, enabled=False):  # the tiers choose their own precision
                return dispatch(query, key, value, call, kept=not compiling and query is uncast)
    return dispatch(query, key, value, call, kept=not compiling)
# --8<-- [end:attention]


# --8<-- [start:dispatch_call]
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
        from .kernels.decode import make_attention_decode_plan

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
    from .kernels.decode import make_attention_decode_plan

    plan = cached_plan(make_attention_decode_plan, (q, k, v), scale, (band_lo, band_hi), softcap, True)
    return plan.run(q, k, v)


@attention_decode.register_fake
def _(q, k, v, scale, band_lo, band_hi, softcap=None):
    return empty_like_layout(q, strides_like(q)), q.new_empty(q.shape[:3], dtype=torch.float32)
# --8<-- [end:decode_route]


def check_no_dropout(dropout_p) -> None:
    """dropout_p must be zero (an int or float 0, not a bool): flashtile has no dropout."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0.0: flashtile.attention has no dropout, got {dropout_p!r}")


def plain_inputs(q, k, v) -> bool:
    """Plain tensors on a device the tiers take; anything else (meta tensors, fake tensors, subclasses)
    takes the custom op, whose fake implementation serves it."""
    return (
        type(q) in PLAIN_TENSORS and type(k) in PLAIN_TENSORS and type(v) in PLAIN_TENSORS
        and (q.is_cuda or q.is_cpu)
    )  # fmt: skip


def records_gradient(q, k, v) -> bool:
    """Whether autograd records this call: grad mode on and an input that requires a gradient."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def forward_kernel(q, k, v, call: AttentionCall, alignment: str, stats: bool = True):
    """The Triton forward from the call's kept plan (worked out by the launcher's own checks the first
    time): o and the row statistics (lse, m, l), with no view made that the caller does not ask for; without
    ``stats``, o and None (the kernel then stores no statistics)."""
    plan = call.kernel_plan[0]
    if plan is None:  # the first kernel call of this layout and these flags
        from .kernels.forward import make_forward_plan

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
        from .kernels.backward import make_backward_plan

        plan = make_backward_plan(q, k, v, o, row_stats[0], do, stats, call.is_causal, call.scale, call.alignment,
                                  None, None, None, True, None, op_window(*call.window), call.softcap)  # fmt: skip
        if len(plans) >= MAX_GRADIENT_LAYOUTS:
            plans.clear()
        plans[do_key] = plan
    return plan.run(q, k, v, o, do, stats, torch.empty_like(row_stats))  # the row terms: row_stats' shape and dtype


def autocast_on(device: str) -> bool:
    """Whether torch.autocast is on for ``device`` (a device type), on the devices flashtile runs on."""
    return device in ("cuda", "cpu") and torch.is_autocast_enabled(device)


def no_autocast(device: str):
    """Autocast off for the tiers' own arithmetic; nothing to switch off (a no-op) where it is not on,
    which skips the context manager's cost on every ordinary call."""
    return torch.autocast(device, enabled=False) if autocast_on(device) else contextlib.nullcontext()


def autocast_inputs(query, key, value, device: str):
    """With torch.autocast on for ``device`` (the caller checked ``autocast_on``), the inputs cast to the
    autocast dtype, as scaled_dot_product_attention does (it is on autocast's lower-precision list);
    float64 inputs are left alone, as autocast leaves them."""
    if query.dtype == torch.float64:
        return query, key, value
    dtype = torch.get_autocast_dtype(device)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def refuse_unsupported_autograd_modes() -> None:
    """Forward-mode AD and torch.func transforms would get a zero or missing tangent from the custom ops
    (they define a reverse-mode formula only): refuse them with a clear error instead."""
    if torch._C._are_functorch_transforms_active():
        raise NotImplementedError(
            "flashtile.attention does not support torch.func transforms (grad, vmap, jvp, jacrev, ...); "
            "use torch.autograd (loss.backward() or torch.autograd.grad)"
        )
    if torch.autograd.forward_ad._current_level >= 0:
        raise NotImplementedError(
            "flashtile.attention does not support forward-mode AD (torch.autograd.forward_ad); its gradient is "
            "reverse-mode only: use loss.backward() or torch.autograd.grad"
        )

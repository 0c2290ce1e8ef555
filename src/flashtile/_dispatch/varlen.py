"""``flashtile.attention_varlen``'s floor: the custom ops ``flashtile::attention_varlen_fwd`` and
``flashtile::attention_varlen_bwd``, their fake and autograd registrations, and the implementations they run
on each tier. Every call goes through the ops (a varlen call's host work, its checks read cu_seqlens on the
host, dwarfs the dispatcher's).

v, o, dO and dV may have a head dim d_v of their own. Attention sinks (a (H,) tensor, ``Tensor? sinks``,
the ops' last argument) join every row's softmax on both tiers, as in ``_dispatch.dense``: the kernels
start each row from the sink (``kernels.forward.sink_start``), and dsinks comes from the backward's row
terms (``kernels.sinks.sink_gradient``; ``reference.varlen.varlen_sink_gradient``).
"""

from __future__ import annotations

import torch

from .._checks import resolve_neg_bits, stats_dtype
from .._spec import AttentionSpec, MaskBand, spec_from_op
from .tiers import REFERENCE_BLOCK, check_backend


def index_memory(x: torch.Tensor) -> torch.Tensor:
    """An index tensor (cu_seqlens) as the varlen kernels read it: contiguous int32 memory holding its values.

    The checks read cu_seqlens through its strides and offset (``_checks.host_values``); the kernels load
    ``CU + d`` from its first element, as if contiguous. A view (``cu[::2]``, a column of a table) is copied
    once here, so what the kernels read is what was checked; a contiguous tensor comes back as it is."""
    return x.contiguous()  # int32 already: the checks refuse any other dtype


def clamp_band(mask: MaskBand, longest: int) -> MaskBand:
    """The band's sides, each at most ``longest`` (the longest document's query or key count), -1 kept.

    A side of at least a document's max(Tq, Tk) keeps every key on its side in that document, so the clamp
    changes no answer; it keeps the kernels' per-document band (offset - left, offset + right, int32 there)
    from overflowing, as ``reference.masks.window_band`` clamps the band of ``flashtile.attention`` on the host."""
    return mask._replace(left=min(mask.left, longest), right=min(mask.right, longest))


def varlen_forward_impl(q, k, v, cu_q, cu_k, *, max_q: int, spec: AttentionSpec, backend: str, sinks=None):
    """(o, lse, stats): o (total_q, H, d_v) contiguous in q's dtype, lse (H, total_q), and stats (2, H, total_q),
    the kernels' final (m, l), or an empty tensor from the reference tier. With ``sinks`` (H,), lse holds them."""
    if check_backend(backend) == "triton":
        from ..kernels.forward import varlen_forward_with_spec

        cu_q, cu_k = index_memory(cu_q), index_memory(cu_k)  # the kernels read raw memory, not strides
        return varlen_forward_with_spec(q, k, v, cu_q, cu_k, max_seqlen_q=max_q, spec=spec, sinks=sinks)
    from ..reference.varlen import varlen_attention_forward

    o, lse = varlen_attention_forward(q, k, v, cu_q, cu_k, False, spec.scale, REFERENCE_BLOCK, REFERENCE_BLOCK,
                                      spec.mask.alignment, window=spec.mask.window, softcap=spec.softcap,
                                      sinks=sinks)  # fmt: skip
    return o.contiguous(), lse.contiguous(), lse.new_empty((0,))


def varlen_backward_impl(do, q, k, v, o, lse, stats, cu_q, cu_k, *, max_q: int, max_k: int, spec: AttentionSpec,
                         backend: str, sinks=None):  # fmt: skip
    """(dq, dk, dv, dsinks), contiguous, in the inputs' dtype; dk and dv summed over each GQA group; dsinks (H,)
    in sinks' dtype, None without sinks."""
    (do,) = resolve_neg_bits(do)
    if check_backend(backend) == "triton":
        from ..kernels.backward import varlen_backward_with_spec

        cu_q, cu_k = index_memory(cu_q), index_memory(cu_k)
        return varlen_backward_with_spec(q, k, v, o, lse, do, cu_q, cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                                         spec=spec, stats=stats, sinks=sinks)  # fmt: skip
    from ..reference.varlen import varlen_attention_backward, varlen_sink_gradient

    do = do.contiguous()
    grads = varlen_attention_backward(q, k, v, o, lse, do, cu_q, cu_k, False, spec.scale,
                                      REFERENCE_BLOCK, REFERENCE_BLOCK, spec.mask.alignment, window=spec.mask.window,
                                      softcap=spec.softcap)  # fmt: skip
    dsinks = None if sinks is None else varlen_sink_gradient(sinks, lse, o, do)
    return (*(g.contiguous() for g in grads), dsinks)


@torch.library.custom_op("flashtile::attention_varlen_fwd", mutates_args=())
def attention_varlen_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
    max_k: int, scale: float, alignment: str, window_left: int, window_right: int, softcap: float | None,
    backend: str, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, lse, stats): see ``varlen_forward_impl``. The mask travels as its band's two sides (``_spec.MaskBand``);
    sinks, None or (H,), last."""
    spec = spec_from_op(q, k, scale=scale, alignment=alignment, window_left=window_left, window_right=window_right,
                        softcap=softcap, sinks=sinks)  # fmt: skip
    o, lse, stats = varlen_forward_impl(q, k, v, cu_q, cu_k, max_q=max_q, spec=spec, backend=backend, sinks=sinks)
    return o, lse, (stats.clone() if stats.numel() else stats)  # an op's outputs may not share memory


@attention_varlen_fwd.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, scale, alignment, window_left, window_right, softcap, backend, sinks=None):
    total_q, H, _ = q.shape
    c = stats_dtype(q.dtype)
    stats_shape = (2, H, total_q) if backend == "triton" else (0,)
    return q.new_empty((total_q, H, v.shape[2])), q.new_empty((H, total_q), dtype=c), \
        q.new_empty(stats_shape, dtype=c)  # fmt: skip


@torch.library.custom_op("flashtile::attention_varlen_bwd", mutates_args=())
def attention_varlen_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    stats: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, scale: float,
    alignment: str, window_left: int, window_right: int, softcap: float | None, backend: str,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks): see ``varlen_backward_impl``; dsinks an empty tensor without sinks (an op's output
    cannot be None)."""
    spec = spec_from_op(q, k, scale=scale, alignment=alignment, window_left=window_left, window_right=window_right,
                        softcap=softcap, sinks=sinks)  # fmt: skip
    dq, dk, dv, dsinks = varlen_backward_impl(do, q, k, v, o, lse, stats, cu_q, cu_k, max_q=max_q, max_k=max_k,
                                              spec=spec, backend=backend, sinks=sinks)  # fmt: skip
    return dq, dk, dv, (lse.new_empty((0,)) if dsinks is None else dsinks)


@attention_varlen_bwd.register_fake
def _(do, q, k, v, o, lse, stats, cu_q, cu_k, max_q, max_k, scale, alignment, window_left, window_right, softcap,
      backend, sinks=None):  # fmt: skip
    dsinks = lse.new_empty((0,)) if sinks is None else torch.empty_like(sinks)
    return (*(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v)), dsinks)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *arguments = inputs  # max_q, max_k, scale, alignment, the band's sides, softcap, backend
    sinks = inputs[13] if len(inputs) > 13 else None
    arguments = arguments[:8]
    o, lse, stats = output
    # O(total) extra memory, never P; and the (H,) sinks
    ctx.save_for_backward(q, k, v, o, lse, stats, cu_q, cu_k, *([] if sinks is None else [sinks]))
    ctx.arguments = tuple(arguments)
    ctx.mark_non_differentiable(lse, stats)


def _backward(ctx, do, _dlse, _dstats):
    if do is None:  # o's gradient undefined (gradcheck's undefined-gradient check, a Function returning None): zero
        return (None,) * (6 + len(ctx.arguments))
    q, k, v, o, lse, stats, cu_q, cu_k, *sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = attention_varlen_bwd(do, q, k, v, o, lse, stats, cu_q, cu_k, *ctx.arguments, *sinks)
    return dq, dk, dv, None, None, *(None,) * len(ctx.arguments), (dsinks if sinks else None)


attention_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise NotImplementedError(
        "flashtile.attention_varlen supports one backward pass: double backward (a gradient of a gradient) is "
        "not supported"
    )


attention_varlen_bwd.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)

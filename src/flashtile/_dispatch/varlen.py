"""``flashtile.attention_varlen``'s floor: the custom ops ``flashtile::attention_varlen_fwd`` and
``flashtile::attention_varlen_bwd``, their fake and autograd registrations, and the implementations they run
on each tier. Every call goes through the ops (a varlen call's host work, its checks read cu_seqlens on the
host, dwarfs the dispatcher's).
"""

from __future__ import annotations

import torch

from .._checks import resolve_neg_bits, stats_dtype
from .dense import op_window
from .tiers import REFERENCE_BLOCK, check_backend


def index_memory(x: torch.Tensor) -> torch.Tensor:
    """An index tensor (cu_seqlens) as the varlen kernels read it: contiguous int32 memory holding its values.

    The checks read cu_seqlens through its strides and offset (``_checks.host_values``); the kernels load
    ``CU + d`` from its first element, as if contiguous. A view (``cu[::2]``, a column of a table) is copied
    once here, so what the kernels read is what was checked; a contiguous tensor comes back as it is."""
    return x.contiguous()  # int32 already: the checks refuse any other dtype


def clamp_window(window: tuple[int, int], longest: int) -> tuple[int, int]:
    """The window's sides, each at most ``longest`` (the longest document's query or key count), -1 kept.

    A side of at least a document's max(Tq, Tk) keeps every key on its side in that document, so the clamp
    changes no answer; it keeps the kernels' per-document band (offset - left, offset + right, int32 there)
    from overflowing, as ``reference.masks.window_band`` clamps the band of ``flashtile.attention`` on the host."""
    return tuple(side if side <= longest else longest for side in window)


def varlen_forward_impl(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, alignment, backend, window_left=-1,
                        window_right=-1, softcap=None):  # fmt: skip
    """(o, lse, stats): o (total_q, H, D) contiguous in q's dtype, lse (H, total_q), and stats (2, H, total_q),
    the kernels' final (m, l), or an empty tensor from the reference tier."""
    window = op_window(window_left, window_right)
    if check_backend(backend) == "triton":
        from ..kernels.forward import flash_attention_varlen

        cu_q, cu_k = index_memory(cu_q), index_memory(cu_k)  # the kernels read raw memory, not strides
        return flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale,
                                      alignment=alignment, window=window, softcap=softcap, checked=True)  # fmt: skip
    from ..reference.varlen import varlen_attention_forward

    o, lse = varlen_attention_forward(q, k, v, cu_q, cu_k, causal, scale, REFERENCE_BLOCK, REFERENCE_BLOCK, alignment,
                                      window=window, softcap=softcap)  # fmt: skip
    return o.contiguous(), lse.contiguous(), lse.new_empty((0,))


def varlen_backward_impl(do, q, k, v, o, lse, stats, cu_q, cu_k, max_q, max_k, causal, scale, alignment, backend,
                         window_left=-1, window_right=-1, softcap=None):  # fmt: skip
    """(dq, dk, dv), contiguous, in the inputs' dtype; dk and dv summed over each GQA group."""
    (do,) = resolve_neg_bits(do)
    window = op_window(window_left, window_right)
    if check_backend(backend) == "triton":
        from ..kernels.backward import flash_attention_varlen_backward

        cu_q, cu_k = index_memory(cu_q), index_memory(cu_k)
        return flash_attention_varlen_backward(q, k, v, o, lse, do, cu_q, cu_k, max_q, max_k, causal=causal,
                                               scale=scale, alignment=alignment, stats=stats, window=window,
                                               softcap=softcap, checked=True)  # fmt: skip
    from ..reference.varlen import varlen_attention_backward

    grads = varlen_attention_backward(q, k, v, o, lse, do.contiguous(), cu_q, cu_k, causal, scale, REFERENCE_BLOCK,
                                      REFERENCE_BLOCK, alignment, window=window, softcap=softcap)  # fmt: skip
    return tuple(g.contiguous() for g in grads)


@torch.library.custom_op("flashtile::attention_varlen_fwd", mutates_args=())
def attention_varlen_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
    max_k: int, causal: bool, scale: float, alignment: str, backend: str, window_left: int = -1,
    window_right: int = -1, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, lse, stats): see ``varlen_forward_impl``."""
    o, lse, stats = varlen_forward_impl(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, alignment, backend,
                                        window_left, window_right, softcap)  # fmt: skip
    return o, lse, (stats.clone() if stats.numel() else stats)  # an op's outputs may not share memory


@attention_varlen_fwd.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, alignment, backend, window_left=-1, window_right=-1,
      softcap=None):  # fmt: skip
    total_q, H, _ = q.shape
    c = stats_dtype(q.dtype)
    stats_shape = (2, H, total_q) if backend == "triton" else (0,)
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((H, total_q), dtype=c), \
        q.new_empty(stats_shape, dtype=c)  # fmt: skip


@torch.library.custom_op("flashtile::attention_varlen_bwd", mutates_args=())
def attention_varlen_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    stats: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool, scale: float,
    alignment: str, backend: str, window_left: int = -1, window_right: int = -1, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv): see ``varlen_backward_impl``."""
    return varlen_backward_impl(do, q, k, v, o, lse, stats, cu_q, cu_k, max_q, max_k, causal, scale, alignment,
                                backend, window_left, window_right, softcap)  # fmt: skip


@attention_varlen_bwd.register_fake
def _(do, q, k, v, o, lse, stats, cu_q, cu_k, max_q, max_k, causal, scale, alignment, backend, window_left=-1,
      window_right=-1, softcap=None):  # fmt: skip
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *config = inputs  # max_q, max_k, causal, scale, alignment, backend, window, cap
    o, lse, stats = output
    ctx.save_for_backward(q, k, v, o, lse, stats, cu_q, cu_k)  # O(total) extra memory, never P
    ctx.config = tuple(config)
    ctx.mark_non_differentiable(lse, stats)


def _backward(ctx, do, _dlse, _dstats):
    if do is None:  # o's gradient undefined (gradcheck's undefined-gradient check, a Function returning None): zero
        return (None,) * (5 + len(ctx.config))
    q, k, v, o, lse, stats, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = attention_varlen_bwd(do, q, k, v, o, lse, stats, cu_q, cu_k, *ctx.config)
    return dq, dk, dv, None, None, *(None,) * len(ctx.config)


attention_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise NotImplementedError(
        "flashtile.attention_varlen supports one backward pass: double backward (a gradient of a gradient) is "
        "not supported"
    )


attention_varlen_bwd.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)

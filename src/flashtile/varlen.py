"""``flashtile.attention_varlen``: packed documents, FlashAttention-2's varlen layout, registered as custom ops.

Training without padding concatenates the documents of a batch into one row of tokens: query, key and
value are (total_tokens, H, D), and ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32, 0 first, one entry more
than there are documents) say where each document starts. A query sees the keys of its own document
only, under the same mask rules as ``flashtile.attention`` (causal, window, alignment, softcap), each
document with its own Tq and Tk.

What runs is what ``flashtile.attention`` runs (``api.pick_backend``, ``api.use_backend``): CUDA tensors
take the Triton kernels' varlen mode (``kernels.forward.flash_attention_varlen``, ``kernels.backward.
flash_attention_varlen_backward``: one program per (document, query tile), no padding); CPU tensors take
the same kernels under ``TRITON_INTERPRET`` and the reference tier (``reference.varlen``) otherwise;
float64 and bf16 CPU tensors always take the reference tier.

The forward and the backward are two custom ops, ``flashtile::attention_varlen_fwd`` and
``flashtile::attention_varlen_bwd``, each one opaque node under ``torch.compile``; every call goes through
them (a varlen call's host work, its checks read cu_seqlens on the host, dwarfs the dispatcher's). The
checks read cu_seqlens on the host: under ``torch.compile`` that is a graph break before the op, by design.

Supported: GQA (H a multiple of H_kv, always on, as in FlashAttention-2's varlen function), empty
documents, documents with queries but no keys (their rows: o = 0, lse = -inf, zero gradients), one
reverse-mode backward. Not supported: double backward, forward-mode AD and ``torch.func`` transforms (each
raises), dropout and arbitrary masks.
"""

from __future__ import annotations

import torch

from ._checks import (
    check_alignment,
    check_causal,
    check_flag,
    check_max_seqlen,
    check_softcap,
    check_varlen_inputs,
    check_window,
    resolve_neg_bits,
    resolve_scale,
    stats_dtype,
)
from .api import (
    REFERENCE_BLOCK,
    autocast_inputs,
    autocast_on,
    check_backend,
    no_autocast,
    op_window,
    pick_backend,
    refuse_unsupported_autograd_modes,
)


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
        from .kernels.forward import flash_attention_varlen

        cu_q, cu_k = index_memory(cu_q), index_memory(cu_k)  # the kernels read raw memory, not strides
        return flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale,
                                      alignment=alignment, window=window, softcap=softcap, checked=True)  # fmt: skip
    from .reference.varlen import varlen_attention_forward

    o, lse = varlen_attention_forward(q, k, v, cu_q, cu_k, causal, scale, REFERENCE_BLOCK, REFERENCE_BLOCK, alignment,
                                      window=window, softcap=softcap)  # fmt: skip
    return o.contiguous(), lse.contiguous(), lse.new_empty((0,))


def varlen_backward_impl(do, q, k, v, o, lse, stats, cu_q, cu_k, max_q, max_k, causal, scale, alignment, backend,
                         window_left=-1, window_right=-1, softcap=None):  # fmt: skip
    """(dq, dk, dv), contiguous, in the inputs' dtype; dk and dv summed over each GQA group."""
    (do,) = resolve_neg_bits(do)
    window = op_window(window_left, window_right)
    if check_backend(backend) == "triton":
        from .kernels.backward import flash_attention_varlen_backward

        cu_q, cu_k = index_memory(cu_q), index_memory(cu_k)
        return flash_attention_varlen_backward(q, k, v, o, lse, do, cu_q, cu_k, max_q, max_k, causal=causal,
                                               scale=scale, alignment=alignment, stats=stats, window=window,
                                               softcap=softcap, checked=True)  # fmt: skip
    from .reference.varlen import varlen_attention_backward

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


def attention_varlen(
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    is_causal=False,
    scale=None,
    window=None,
    softcap=None,
    alignment="upper_left",
    return_lse=False,
):
    """Softmax attention within each packed document, differentiable, on (total_tokens, H, D) tensors.

    Args:
        query: (total_q, H, D); key, value: (total_k, H_kv, D), H a multiple of H_kv, 1 <= D <= 256. fp16,
            bf16, fp32, float64; any strides; CUDA or CPU (see the module docstring for which tier runs).
        cu_seqlens_q, cu_seqlens_k: int32 1-D tensors on the tokens' device, [0, n_1, n_1 + n_2, ..., total],
            non-decreasing, the same number of entries: document d owns queries cu_seqlens_q[d] ..
            cu_seqlens_q[d + 1] - 1 and keys cu_seqlens_k[d] .. cu_seqlens_k[d + 1] - 1.
        max_seqlen_q, max_seqlen_k: ints at least the longest document's query and key counts (a smaller one
            is refused). A larger bound is accepted and changes nothing: the checks read cu_seqlens anyway, so
            every tier works from the longest document itself (the kernels' grid is sized by it).
        is_causal, scale, window, softcap, alignment: as ``flashtile.attention``, applied to each document on
            its own (its own Tq and Tk, so with "lower_right" each document's last query sees its last key).
        return_lse: also return lse (H, total_q), natural log, float32 (float64 for float64 inputs), as
            FlashAttention-2's varlen function lays it out; it carries no gradient.

    Returns:
        o (total_q, H, D) in query's dtype, contiguous; or (o, lse) if return_lse. A query of a document
        without keys gets o = 0 and lse = -inf.
    """
    query, key, value = resolve_neg_bits(query, key, value)
    H, _, D, documents = check_varlen_inputs(query, key, value, cu_seqlens_q, cu_seqlens_k,
                                             names=("query", "key", "value"))  # fmt: skip
    # max_seqlen must bound the documents (as FlashAttention-2's varlen function requires); a larger bound is
    # accepted, but every tier works from the longest document itself, which the checks just read: the
    # kernels' grid is sized by it, so an oversized bound costs no time (a bound of 2**40 no endless grid)
    longest_q = max((e - s for (s, e), _ in documents), default=0)
    longest_k = max((e - s for _, (s, e) in documents), default=0)
    check_max_seqlen("max_seqlen_q", max_seqlen_q, longest_q)
    check_max_seqlen("max_seqlen_k", max_seqlen_k, longest_k)
    causal = check_causal(is_causal, "is_causal")
    check_alignment(alignment)
    return_lse = check_flag("return_lse", return_lse)
    window = clamp_window(check_window(window) or (-1, -1), max(longest_q, longest_k))
    softcap = check_softcap(softcap, query.dtype)
    refuse_unsupported_autograd_modes()
    device = query.device.type
    if autocast_on(device):
        query, key, value = autocast_inputs(query, key, value, device)
    tau = resolve_scale(scale, D, query.dtype)
    backend = pick_backend(query)
    with no_autocast(device):  # the tiers choose their own precision
        o, lse, _stats = attention_varlen_fwd(query, key, value, cu_seqlens_q, cu_seqlens_k, longest_q, longest_k,
                                              causal, tau, alignment, backend, *window, softcap)  # fmt: skip
    return (o, lse) if return_lse else o


"""``flashtile.attention``: an SDPA-shaped entry point, registered as a torch.library custom op.

A call site written for ``torch.nn.functional.scaled_dot_product_attention(query, key, value,
is_causal=..., scale=..., enable_gqa=...)`` can call ``flashtile.attention`` with the same arguments.
What SDPA has and flashtile does not: ``attn_mask`` and ``dropout_p`` (both raise if used), inputs of
rank other than 4, and a value head dim different from the query's.

What runs (the dispatch):

* CUDA tensors run the Triton kernels (``flashtile.kernels.forward`` and ``.backward``).
* CPU tensors run the same Triton kernels through Triton's interpreter when ``TRITON_INTERPRET=1``
  is set (it must be set before flashtile's kernel modules are imported), and the PyTorch reference
  tier (``flashtile.reference.forward`` / ``.backward``, computed in float32) otherwise.
* float64 inputs always take the reference tier, computed in float64: the kernels stop at fp32.
* ``use_backend("reference")`` / ``use_backend("triton")`` overrides the choice inside a ``with``
  block; the tests use it to compile the reference path while the interpreter is on.

The forward and the backward are two custom ops, ``flashtile::attention_fwd`` and
``flashtile::attention_bwd``. To ``torch.compile`` each is one opaque node: it never traces into
Triton launches or Python tile loops, and it learns output shapes from the fake implementations below.
"""

from __future__ import annotations

import contextlib
import os

import torch

from ._checks import check_alignment, check_attention_inputs, check_causal, resolve_scale

BACKENDS = ("triton", "reference")
_forced_backend: str | None = None


@contextlib.contextmanager
def use_backend(name: str):
    """Run every ``flashtile.attention`` call in the block on ``name`` ("triton" or "reference")."""
    global _forced_backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    previous, _forced_backend = _forced_backend, name
    try:
        yield
    finally:
        _forced_backend = previous


# --8<-- [start:dispatch]
def pick_backend(q: torch.Tensor) -> str:
    """Which tier runs: see the module docstring. Read at trace time under torch.compile."""
    if _forced_backend is not None:
        return _forced_backend
    if q.dtype == torch.float64:
        return "reference"
    if q.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return "triton"
    return "reference"
# --8<-- [end:dispatch]


def _stats_dtype(q: torch.Tensor) -> torch.dtype:
    """float64 for float64 inputs, else float32: the dtype of lse, and of the reference tier's arithmetic
    on 16-bit inputs (like the kernels' fp32 accumulators)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


REFERENCE_BLOCK = 64  # the reference tier's tile size: any value gives the same result up to rounding


# --8<-- [start:forward_op]
@torch.library.custom_op("flashtile::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, alignment: str, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse): o (B, H, Tq, D) contiguous in q's dtype, lse (B, H, Tq) float32 (float64 for float64)."""
    if backend == "triton":
        from .kernels.forward import flash_attention

        o, lse = flash_attention(q, k, v, causal=causal, scale=scale, alignment=alignment)
    else:
        from .reference.forward import flash_attention_forward

        c = _stats_dtype(q)
        o, lse = flash_attention_forward(
            q.to(c), k.to(c), v.to(c), causal, scale, REFERENCE_BLOCK, REFERENCE_BLOCK, alignment
        )
    return o.to(q.dtype).contiguous(), lse.to(_stats_dtype(q)).contiguous()


@attention_fwd.register_fake
def _(q, k, v, causal, scale, alignment, backend):
    # Only shapes, dtypes and devices: what torch.compile needs to trace past the op without running it.
    B, H, Tq, D = q.shape
    return q.new_empty((B, H, Tq, D)), q.new_empty((B, H, Tq), dtype=_stats_dtype(q))
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
    causal: bool,
    scale: float,
    alignment: str,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), contiguous, in the inputs' dtype; dk and dv summed over each GQA group."""
    if backend == "triton":
        from .kernels.backward import flash_attention_backward

        dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do, causal=causal, scale=scale, alignment=alignment)
    else:
        from .reference.backward import flash_attention_backward

        c = _stats_dtype(q)
        dq, dk, dv = flash_attention_backward(
            q.to(c), k.to(c), v.to(c), o.to(c), lse.to(c), do.to(c),
            causal, scale, REFERENCE_BLOCK, REFERENCE_BLOCK, alignment,
        )  # fmt: skip
    return tuple(g.to(q.dtype).contiguous() for g in (dq, dk, dv))


@attention_bwd.register_fake
def _(do, q, k, v, o, lse, causal, scale, alignment, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
# --8<-- [end:backward_op]


# --8<-- [start:autograd]
def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, alignment, backend = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)  # O(T) extra memory: o and lse, never P
    ctx.config = (causal, scale, alignment, backend)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    causal, scale, alignment, backend = ctx.config
    dq, dk, dv = attention_bwd(do, q, k, v, o, lse, causal, scale, alignment, backend)
    return dq, dk, dv, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)
# --8<-- [end:autograd]


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
):
    """Softmax attention with SDPA's argument names, differentiable, torch.compile-clean.

    Args:
        query: (B, H, Tq, D). key, value: (B, H_kv, Tk, D). fp16, bf16, fp32 (float64 via reference).
        attn_mask, dropout_p: accepted for signature compatibility only; must be None and 0.0.
        is_causal: causal mask; with Tq != Tk its diagonal follows ``alignment``.
        scale: multiplies Q K^T; defaults to 1/sqrt(D), as in SDPA.
        enable_gqa: allow H_kv < H (H a multiple of H_kv); without it H must equal H_kv, as in SDPA.
        alignment: "upper_left" (SDPA's is_causal) or "lower_right" (the last query sees every key).
        return_lse: also return lse (B, H, Tq), natural log, float32; it carries no gradient.

    Returns:
        o (B, H, Tq, D) in query's dtype, or (o, lse) if return_lse.
    """
    if attn_mask is not None:
        raise ValueError("attn_mask is not supported by flashtile.attention; pass is_causal=True for a causal mask")
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0.0: flashtile.attention has no dropout, got {dropout_p!r}")
    shape = check_attention_inputs(query, key, value, names=("query", "key", "value"))
    check_causal(is_causal, "is_causal")
    check_alignment(alignment)
    if shape.H != shape.H_kv and not enable_gqa:
        raise ValueError(
            f"query has {shape.H} heads but key and value have {shape.H_kv}; pass enable_gqa=True for "
            "grouped-query attention (as with scaled_dot_product_attention)"
        )
    scale = resolve_scale(scale, shape.D)
    o, lse = attention_fwd(query, key, value, is_causal, scale, alignment, pick_backend(query))
    return (o, lse) if return_lse else o
# --8<-- [end:attention]

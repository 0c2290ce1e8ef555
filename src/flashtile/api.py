"""``flashtile.attention``: an SDPA-shaped entry point, registered as a torch.library custom op.

A call site written for ``torch.nn.functional.scaled_dot_product_attention(query, key, value,
is_causal=..., scale=..., enable_gqa=...)`` can call ``flashtile.attention`` with the same arguments.
What SDPA has and flashtile does not: ``attn_mask`` and ``dropout_p`` (both raise if used), and inputs of
rank other than 4. Like SDPA, the value head dim d_v may differ from the query's (1 to 256, on every tier;
float8 inputs excepted).
What flashtile has and SDPA does not: windows, soft-capping, ``return_lse`` and attention sinks (``sinks``).

What runs (the dispatch):

* CUDA tensors run the Triton kernels (``flashtile.kernels.forward`` and ``.backward``).
  Calls of Tq <= 16 query rows that autograd does not record run the split-K decode kernels
  (``flashtile.kernels.decode``) instead of the forward kernel, with every mask, the same answer and
  the same contract (``decode_route``): sinks and a value head dim of its own included.
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
``flashtile::attention_bwd`` (``flashtile._dispatch.dense``, the floor this module and its peers
``flashtile.varlen`` and ``flashtile.decode`` share). To ``torch.compile`` each is one opaque node: it never traces into
Triton launches or Python tile loops, and it learns output shapes from the fake implementations below.
Eager calls on plain CPU or CUDA tensors run the same implementations without the op's dispatcher
(``run_forward``), which costs a fraction of the op's host time per call (bench/PERF_LOG.md, v5;
``bench/results/overhead.json``). An eager call whose layout and flags were seen before finds its checked
call by one key (``call_key``) and reads again only what may change between two such calls; its backward
runs from a plan kept with the call (``backward_from_kept_plan``).
Reverse-mode autograd is supported once (no double backward); forward-mode AD and ``torch.func``
transforms raise ``NotImplementedError`` rather than return a wrong tangent. Under ``torch.autocast``
the inputs are cast to the autocast dtype first, as ``scaled_dot_product_attention`` does.
"""

from __future__ import annotations

import numbers

import torch
from torch._functorch.utils import unwrap_dead_wrappers

from ._checks import check_sink_values, resolve_neg_bits
from ._dispatch.dense import (
    AttentionCall,
    attention_bwd,
    attention_decode,
    attention_fwd,
    backward_impl,
    call_key,
    cast_and_dispatch,
    check_attention_call,
    decode_route,
    forward_impl,
)
from ._dispatch.tiers import (
    BACKENDS,
    forced_backend,
    pick_backend,
    refuse_unsupported_autograd_modes,
    refused_mode,
    use_backend,
)
from ._plans import keep_plan, kept_plan

__all__ = [  # the entry point; the tier choice and the ops live in flashtile._dispatch, named here too
    "BACKENDS",
    "AttentionCall",
    "attention",
    "attention_bwd",
    "attention_decode",
    "attention_fwd",
    "backward_impl",
    "check_attention_call",
    "decode_route",
    "forced_backend",
    "forward_impl",
    "pick_backend",
    "use_backend",
]


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
    sinks=None,
    descale_q=None,
    descale_k=None,
    descale_v=None,
    out_dtype=None,
):
    """Softmax attention with SDPA's argument names, differentiable, and clean under
    torch.compile.

    Args:
        query: (B, H, Tq, D). key: (B, H_kv, Tk, D), value: (B, H_kv, Tk, d_v),
            1 <= D, d_v <= 256 (d_v may differ from D: q . k contracts over D, o is d_v
            wide; not for float8 inputs). fp16, bf16, fp32, float64; any strides; CUDA,
            or CPU (see the module docstring for which tier runs).
        attn_mask, dropout_p: accepted for signature compatibility only; must be None
            and 0.0.
        is_causal: causal mask; with Tq != Tk its diagonal follows ``alignment``.
        scale: τ, multiplies Q K^T; defaults to 1/sqrt(D) (query's head dim), as in
            SDPA. Zero and negative allowed.
        enable_gqa: allow H_kv < H (H a multiple of H_kv); without it H must equal H_kv,
            as in SDPA.
        alignment: "upper_left" (SDPA's is_causal) or "lower_right" (the last query
            sees every key).
        return_lse: also return lse (B, H, Tq), natural log, float32 (float64 for
            float64 inputs); it carries no gradient. With sinks it is the log of the
            whole normaliser, e^sink included.
        window: None or (left, right), ints: query i sees key j when
            i - left <= j <= i + right (for Tq != Tk shifted by the alignment's offset,
            0 or Tk - Tq: i + offset - left <= j <= i + offset + right); -1 leaves that
            side unbounded; with is_causal the right side is capped at 0. A sliding
            window W back is (W - 1, 0), or (W - 1, -1) with is_causal.
        softcap: None or s > 0: each scaled score x becomes s * tanh(x / s) before the
            mask and the softmax (Gemma-2's logit soft-capping), in the forward and the
            backward.
        sinks: None or (H,), float32 or query's dtype, on query's device: one logit per
            query head, in the units of the scaled (and capped; the sink itself is not
            capped) score, that joins every row's softmax with a value of zero
            (gpt-oss): lse_i = log(e^sink + sum_j e^(S_ij)). Finite or -inf (-inf is no
            sink, bit for bit), and below float64 at most ``_checks.sink_limit`` in
            magnitude (half of float32's largest over log2(e), and over 1/|scale|
            without a softcap: 6.0e37 at d = 8); differentiable (its gradient is
            -sum_{b,i} e^(sink - lse) D). With sinks, lse is the log of the whole
            normaliser, e^sink included, and a row that sees no key gets o = 0 and
            lse = sink. Both tiers take them (the kernels start each row from m = sink,
            l = 1; the decode kernels' merge counts it once). Eager calls read
            their values (NaN and +inf are refused) once per write of the tensor
            (``_checks.check_sink_values``); under torch.compile the values are not
            read. float8 inputs refuse them.
        descale_q, descale_k, descale_v, out_dtype: for float8_e4m3fn query, key and
            value (forward only), their float32 factors as ``flashtile.fp8.quantize``
            returns them, and o's dtype (bf16 by default); see
            ``flashtile.fp8.attention.fp8_attention``.

    Returns:
        o (B, H, Tq, d_v) in query's dtype (the autocast dtype under autocast), laid out
        as query is where query is dense (a model's (B, H, T, D) view of (B, T, H, D)
        gives o that view too), contiguous otherwise; or (o, lse) if return_lse.
    """
    flags = (is_causal, scale, enable_gqa, alignment, return_lse, window, softcap)
    compiling = torch.compiler.is_compiling()
    # The common eager call first: no mask, no dropout, no FP8 argument, and a layout
    # and flags seen before. Its key finds the call the checks below kept for it, and
    # only what may change between two calls of one key is read again (modes, autocast,
    # the forced tier, whether autograd records); a call with anything else, and the
    # first call of a key, goes through every check below.
    if attn_mask is descale_q is descale_k is descale_v is out_dtype is None \
            and dropout_p.__class__ is float and dropout_p == 0.0 \
            and not compiling:  # fmt: skip
        call = kept_plan(call_key(query, key, value, flags, sinks))
        if call is not None and not refused_mode():
            # the key fixed their layout; their values change between calls
            if sinks is not None:
                check_sink_values(sinks, call.spec.sink_limit)
            return cast_and_dispatch(query, key, value, call, compiling=False,
                                     sinks=sinks)  # fmt: skip
    # FP8 inputs: forward only, their own checks and tiers
    if descale_q is not None or descale_k is not None or descale_v is not None \
            or out_dtype is not None \
            or getattr(query, "dtype", None) is torch.float8_e4m3fn:  # fmt: skip
        from .fp8.attention import fp8_attention

        # never dropped: the FP8 forward starts every row from m = -inf
        if sinks is not None:
            raise ValueError("sinks are not supported with float8_e4m3fn inputs "
                             "(flashtile.fp8): pass sinks=None, or call "
                             "flashtile.attention with 16-bit, float32 or float64 "
                             "inputs")  # fmt: skip
        return fp8_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                             enable_gqa, alignment=alignment, return_lse=return_lse,
                             window=window, softcap=softcap, descale_q=descale_q,
                             descale_k=descale_k, descale_v=descale_v,
                             out_dtype=out_dtype, backend=forced_backend())  # fmt: skip
    # A view's negative bit (z.conj().imag) is a flag the kernels cannot see: resolve it
    # before the checks, so that every tier, and the kept plans, only ever meet tensors
    # that hold their own values.
    query, key, value, sinks = resolve_neg_bits(query, key, value, sinks)
    if attn_mask is not None:
        raise ValueError("attn_mask is not supported by flashtile.attention; pass "
                         "is_causal=True for a causal mask")  # fmt: skip
    # the default, 0.0, passes on this one comparison
    if dropout_p.__class__ is not float or dropout_p != 0.0:
        check_no_dropout(dropout_p)
    if compiling:  # traced once: no table of plans inside the graph
        call = check_attention_call(query, key, value, is_causal=is_causal, scale=scale,
                                    enable_gqa=enable_gqa, alignment=alignment,
                                    return_lse=return_lse, window=window,
                                    softcap=softcap, sinks=sinks)  # fmt: skip
    else:  # eager: the checks run once per layout and flags, then the call is kept
        # as Function.apply would (_eager_apply)
        query, key, value = unwrap_dead_wrappers((query, key, value))
        plan_key = call_key(query, key, value, flags, sinks)
        call = kept_plan(plan_key)
        if call is None:
            call = check_attention_call(query, key, value, is_causal=is_causal,
                                        scale=scale, enable_gqa=enable_gqa,
                                        alignment=alignment, return_lse=return_lse,
                                        window=window, softcap=softcap,
                                        sinks=sinks)  # fmt: skip
            keep_plan(plan_key, call)
        if sinks is not None:  # the layout is checked; the values, every call
            check_sink_values(sinks, call.spec.sink_limit)
        refuse_unsupported_autograd_modes()
    return cast_and_dispatch(query, key, value, call, compiling, sinks=sinks)
# --8<-- [end:attention]


def check_no_dropout(dropout_p) -> None:
    """dropout_p must be zero (an int or float 0, not a bool): flashtile has no dropout."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0.0: flashtile.attention has no dropout, got {dropout_p!r}")


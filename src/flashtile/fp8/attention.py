"""``flashtile.attention`` on E4M3 inputs: the checks and the two tiers of the FP8 forward.

``flashtile.attention`` hands a call here when query is float8_e4m3fn, or when a descale factor or
``out_dtype`` is given (the hook at the top of ``flashtile.api.attention``; a float8 key or value with a
float query is refused by the ordinary checks). What runs:

* CUDA tensors: the Triton FP8 kernel (``flashtile.kernels.fp8_forward``), or the float64 emulation on the
  GPU under ``use_backend("reference")``;
* CPU tensors: the float64 emulation (``flashtile.reference.fp8``), which rounds exactly what the kernel
  rounds (q, k, v and P), so the chapter's claims run without a GPU. ``use_backend("triton")`` on the CPU
  runs the kernel through Triton's interpreter, whose E4M3 cast loses the carry when rounding reaches a
  power of two (tests/kernels/test_fp8_forward.py): use it on inputs where nothing rounds.

The two tiers take the same inputs, refuse the same inputs with the same errors and compute the same
thing; they differ by the sm_90 E4M3 dot's short accumulator (the chapter's note on it), not by design.

The FP8 path is forward only (inference and prefill): a call whose inputs require a gradient returns o
whose backward raises. It has no window, soft-cap, attn_mask or dropout, and under ``torch.compile`` it
is not a custom op (it runs in eager mode only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from .._checks import check_attention_inputs, check_tensor, check_values_in_memory, resolve_neg_bits
from .._plans import cached_plan
from .._spec import AttentionSpec, check_spec
from ..reference.fp8 import (
    FP8_DTYPES,
    check_descale_layout,
    check_descale_values,
    fp8_attention_forward,
    vouch_for_factors,
)

if TYPE_CHECKING:
    from ..kernels.fp8_forward import Fp8Plan

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the kernel can store
DEFAULT_OUT_DTYPE = torch.bfloat16
NAMES = ("query", "key", "value")
FACTOR_NAMES = ("descale_q", "descale_k", "descale_v")


def check_out_dtype(out_dtype) -> torch.dtype:
    """None means bf16; otherwise one of the dtypes the kernel stores o in."""
    if out_dtype is None:
        return DEFAULT_OUT_DTYPE
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be None (bfloat16) or one of {OUT_DTYPES}, got {out_dtype!r}")
    return out_dtype


# --8<-- [start:row-factors]
def check_factor_layout(name: str, descale, x: torch.Tensor, x_name: str) -> None:
    """What a factor argument may be, read from its layout alone: None (the codes are
    the values: every factor 1), a 0-dim float32 tensor (one factor for the tensor) or a
    (B, H, T) float32 tensor (what ``flashtile.fp8.quantize`` returns, whatever its
    granularity), on x's device."""
    if descale is None:
        return
    check_tensor(name, descale, dtypes=(torch.float32,))
    if descale.dim() != 0:  # one per row: shape and device
        check_descale_layout(name, descale, x, x_name)
        return
    check_values_in_memory(name, descale)
    if descale.device != x.device:
        raise ValueError(
            f"{name} is on {descale.device} but {x_name} is on {x.device}; they must "
            "match"
        )


def row_factors(
    name: str, descale, rows: tuple, ones: torch.Tensor | None
) -> torch.Tensor:
    """A factor argument (its layout checked) as one float32 per row, (B, H, T) =
    ``rows``, the layout both tiers read: None as ``ones``, a 0-dim factor as a view of
    it with stride 0 (which the kernel reads as one factor a head), a (B, H, T) tensor
    as it is. Factors must be positive and finite; a tensor from ``quantize`` (or
    checked by an earlier call and not written to since) is not read again, so the call
    waits on nothing the device computes (``check_descale_values``)."""
    if descale is None:
        return ones
    check_descale_values(name, descale)
    if descale.dim() != 0:
        return descale
    expanded = descale.expand(rows)  # a view of a checked factor: the same values
    vouch_for_factors(expanded)
    return expanded
# --8<-- [end:row-factors]


class _ForwardOnly(torch.autograd.Function):
    """Passes o through, and refuses a backward: the FP8 path has none."""

    @staticmethod
    def forward(ctx, o, *inputs):
        return o.view_as(o)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            "flashtile.attention has no backward for float8_e4m3fn inputs (the FP8 path is forward only: inference "
            "and prefill); train in bf16 or fp16 and quantise for inference"
        )


# --8<-- [start:fp8-attention]
def fp8_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False, *, alignment="upper_left", return_lse=False, window=None,
    softcap=None, descale_q=None, descale_k=None, descale_v=None, out_dtype=None,
    backend=None,
):  # fmt: skip
    """``flashtile.attention`` for float8_e4m3fn query, key, value, with their factors.

    Args:
        query: (B, H, Tq, D), key and value: (B, H_kv, Tk, D), float8_e4m3fn, 1 <= D <=
            256, any strides (value is copied once per call unless its keys are
            contiguous, as ``quantize(v, keys_contiguous=True)`` lays it out).
        descale_q, descale_k, descale_v: float32, one per row (B, H, T) as
            ``flashtile.fp8.quantize`` returns them, a 0-dim tensor (one per tensor), or
            None (factor 1); row r stands for x8[r] * descale[r].
        out_dtype: o's dtype: None (bfloat16), torch.bfloat16, torch.float16 or
            torch.float32.
        is_causal, scale, enable_gqa, alignment, return_lse: as ``flashtile.attention``.
        attn_mask, dropout_p, window, softcap: must be None, 0.0, None, None (not
            supported with FP8).
        backend: the ``use_backend`` choice, or None: the kernel on CUDA, the emulation
            on the CPU.

    Returns:
        o (B, H, Tq, D) in out_dtype, contiguous, or (o, lse) with lse (B, H, Tq)
            float32, natural log.
    """
    query, key, value = resolve_neg_bits(query, key, value)
    fp8 = [getattr(x, "dtype", None) in FP8_DTYPES for x in (query, key, value)]
    if not all(fp8):
        given = [
            n for n, d in zip(("descale_q", "descale_k", "descale_v", "out_dtype"),
                              (descale_q, descale_k, descale_v, out_dtype))
            if d is not None
        ]  # fmt: skip
        dtypes = [
            str(getattr(x, "dtype", type(x).__name__)) for x in (query, key, value)
        ]
        what = f"{', '.join(given)} given" if given else "a float8_e4m3fn input"
        raise TypeError(
            f"{what}: the FP8 path needs query, key and value all float8_e4m3fn, got "
            f"{dtypes}; quantise float tensors with flashtile.fp8.quantize (descale_q, "
            "descale_k, descale_v and out_dtype are for FP8 inputs only)"
        )
    if attn_mask is not None or window is not None or softcap is not None:
        raise ValueError(
            "attn_mask, window and softcap are not supported with float8_e4m3fn "
            "inputs; pass is_causal=True for a causal mask"
        )
    # the checks of the layouts and flags, and the kernel's launch, once per layout
    # (``check_fp8_call``)
    call = cached_plan(
        check_fp8_call,
        (query, key, value, descale_q, descale_k, descale_v),
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        alignment,
        return_lse,
        out_dtype,
        backend,
        names=FP8_CALL_OPTIONS,
    )
    factors = [
        row_factors(name, d, rows, ones) for name, d, rows, ones in
        zip(FACTOR_NAMES, (descale_q, descale_k, descale_v), call.rows, call.ones)
    ]  # fmt: skip
    if call.kernel_plan is not None:
        o, lse = call.kernel_plan.run(query, key, value, *factors)
    else:
        # no window here: the band is causal (-1, 0) or keeps every pair (-1, -1)
        band, scale = call.spec.mask, call.spec.scale
        o, lse = fp8_attention_forward(
            query, key, value, *factors, band.right == 0, scale, None, band.alignment
        )
        o, lse = o.to(call.out_dtype), lse.float()
    if torch.is_grad_enabled() and any(
        t.requires_grad for t in (query, key, value, *factors)
    ):
        o = _ForwardOnly.apply(
            o, *(t for t in (query, key, value, *factors) if t.requires_grad)
        )
    return (o, lse) if call.spec.return_lse else o
# --8<-- [end:fp8-attention]


class Fp8Call(NamedTuple):
    """An FP8 ``flashtile.attention`` call's checked options and what follows from its layouts, worked out once
    per layout of (query, key, value and the factors) and option values (``_plans.cached_plan``)."""

    spec: AttentionSpec  # scale, mask band, GQA group, return_lse: checked once (``_spec.check_spec``)
    out_dtype: torch.dtype
    rows: tuple  # (B, H, Tq), (B, H_kv, Tk), (B, H_kv, Tk): the factors' shapes, one per row
    ones: tuple  # for a factor given as None, an all-ones (B, H, T) view (stride 0) to stand for it; else None
    kernel_plan: Fp8Plan | None  # the Triton tier's launch, made from the spec; None on the emulation's tier


FP8_CALL_OPTIONS = ("dropout_p", "is_causal", "scale", "enable_gqa", "alignment", "return_lse", "out_dtype",
                    "backend")  # check_fp8_call's, as fp8_attention keys its calls


def check_fp8_call(query, key, value, descale_q, descale_k, descale_v, *, dropout_p, is_causal, scale, enable_gqa,
                   alignment, return_lse, out_dtype, backend) -> Fp8Call:  # fmt: skip
    """Every check of an FP8 call but the factors' values, and its tier: the kernel's plan on CUDA (or under
    ``use_backend("triton")``), the emulation otherwise. The options are checked into the spec the bf16 path
    builds (``_spec.check_spec``; τ within float32's range, the statistics being float32 on both tiers), which
    the kernel's plan reads by name."""
    shape = check_attention_inputs(query, key, value, dtypes=FP8_DTYPES, names=NAMES)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0.0: flashtile.attention has no dropout, got {dropout_p!r}")
    spec = check_spec(shape, query.dtype, causal=is_causal, scale=scale, alignment=alignment, window=None,
                      softcap=None, return_lse=return_lse, enable_gqa=enable_gqa)  # fmt: skip
    out_dtype = check_out_dtype(out_dtype)
    inputs = (query, key, value)
    descales = (descale_q, descale_k, descale_v)
    for name, descale, x, x_name in zip(FACTOR_NAMES, descales, inputs, NAMES):
        check_factor_layout(name, descale, x, x_name)
    rows = tuple(tuple(x.shape[:-1]) for x in inputs)
    ones = tuple(unit_factors(x) if d is None else None for d, x in zip(descales, inputs))
    if backend is None:
        backend = "triton" if query.device.type == "cuda" else "reference"
    kernel_plan = None
    if backend == "triton":
        from ..kernels.fp8_forward import make_fp8_forward_plan

        factors = [o if d is None else (d if d.dim() else d.expand(r)) for d, r, o in zip(descales, rows, ones)]
        kernel_plan = make_fp8_forward_plan(query, key, value, *factors, spec=spec, out_dtype=out_dtype)
    return Fp8Call(spec, out_dtype, rows, ones, kernel_plan)


def unit_factors(x: torch.Tensor) -> torch.Tensor:
    """Factor 1 for every row of x, (B, H, T) with stride 0 (one factor a head to the kernel), vouched for."""
    ones = torch.ones((), dtype=torch.float32, device=x.device).expand(x.shape[:-1])
    vouch_for_factors(ones)
    return ones

"""flashtile.attention with Tq <= 16 and no gradient runs the split-K decode kernels (``api.decode_route``).

The route is checked two ways: ``decode_route`` says so, and the answer equals ``decode_attention``'s bit
for bit (the same kernels, the same split count). Every answer is held to the float64 formula through
the mask built from the definition, on the Triton tier (the route) and on the reference tier (no route).
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile.api import check_attention_call, decode_route, pick_backend, use_backend
from tests._truth import assert_close_to_truth, definition_mask, masked_truth


def make(B, H, H_kv, Tq, Tk, D, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, t, D, generator=gen).to(dtype) for h, t in ((H, Tq), (H_kv, Tk), (H_kv, Tk)))


def test_the_route_is_the_decode_kernel_bit_for_bit():
    q, k, v = make(2, 4, 2, 3, 50, 16, seed=1)
    for window, softcap in [(None, None), ((9, 0), 2.0)]:
        o, lse = flashtile.attention(q, k, v, is_causal=True, alignment="lower_right", enable_gqa=True,
                                     return_lse=True, window=window, softcap=softcap)  # fmt: skip
        o_decode, lse_decode = flashtile.decode_attention(q, k, v, window=window, softcap=softcap, return_lse=True)
        assert torch.equal(o, o_decode) and torch.equal(lse, lse_decode)
    q1 = q[:, :, :1]  # one row, no mask: it sees every key, as the last new token of a decode step does
    assert torch.equal(flashtile.attention(q1, k, v, enable_gqa=True), flashtile.decode_attention(q1, k, v))


def test_decode_route_takes_short_calls_without_a_gradient_on_the_triton_tier_only():
    q, k, v = make(1, 2, 2, 16, 40, 8)
    options = dict(is_causal=True, scale=None, enable_gqa=False, alignment="lower_right", return_lse=False,
                   window=None, softcap=None)
    call = check_attention_call(q, k, v, **options)
    assert pick_backend(q) == "triton"  # the interpreter (conftest)
    assert decode_route(q, k, v, call, "triton")
    assert not decode_route(q, k, v, call, "reference")
    assert not decode_route(q, k.requires_grad_(), v, call, "triton")  # autograd records it: the forward kernel
    with torch.no_grad():
        assert decode_route(q, k, v, call, "triton")
    long = check_attention_call(*make(1, 2, 2, 17, 40, 8), **options)
    assert not long.short and not decode_route(q, k, v, long, "triton")  # 17 rows: the forward kernel


# (Tq, Tk, is_causal, alignment, window, softcap): both alignments with rows that see no key (Tq > Tk),
# upper-left causal with Tq < Tk, no mask, windows with either side open, a cap
MASKS = [
    (1, 70, False, "upper_left", None, None),
    (4, 70, True, "upper_left", None, None),
    (5, 3, True, "lower_right", None, 1.5),
    (6, 4, True, "upper_left", (1, 0), None),
    (3, 40, False, "upper_left", (5, 2), 1.5),
    (16, 16, True, "upper_left", (3, -1), None),
    (7, 50, False, "lower_right", (-1, 3), None),
]


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("Tq,Tk,causal,alignment,window,softcap", MASKS)
def test_short_calls_match_the_float64_formula_on_every_tier(backend, Tq, Tk, causal, alignment, window, softcap):
    q, k, v = make(2, 4, 2, Tq, Tk, 16, seed=Tq + Tk)
    with use_backend(backend):
        o, lse = flashtile.attention(q, k, v, is_causal=causal, alignment=alignment, window=window, softcap=softcap,
                                     enable_gqa=True, return_lse=True, scale=-0.3)  # fmt: skip
    keep = definition_mask(Tq, Tk, window, causal, alignment)
    o_true, lse_true = masked_truth(q.double(), k.double(), v.double(), keep, -0.3, softcap)
    assert_close_to_truth(o, o_true, "o", rtol=2e-5, atol=2e-5)  # rows that see no key: o = 0, lse = -inf
    assert_close_to_truth(lse, lse_true, "lse", rtol=2e-5, atol=2e-5)


def test_a_call_that_needs_a_gradient_keeps_the_forward_kernel_and_agrees():
    q, k, v = make(1, 2, 1, 4, 33, 16, seed=2)
    o_route = flashtile.attention(q, k, v, is_causal=True, alignment="lower_right", enable_gqa=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = flashtile.attention(*leaves, is_causal=True, alignment="lower_right", enable_gqa=True)
    assert o.requires_grad
    torch.testing.assert_close(o.detach(), o_route, rtol=2e-5, atol=2e-5)
    torch.autograd.grad(o, leaves, torch.ones_like(o))  # and it trains


def test_the_route_lays_o_out_like_a_dense_query_and_keeps_nan_rows():
    # a model's (B, H, T, D) view of (B, T, H, D) projections: o in that layout, as the forward kernel gives it
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, t, 2, 8, generator=gen).transpose(1, 2) for t in (4, 30, 30))  # (B, H, T, D) views
    q[0, 1, 2, 0] = float("nan")  # a NaN query row: that row, and only it, is NaN
    o, lse = flashtile.attention(q, k, v, is_causal=True, alignment="lower_right", return_lse=True)
    assert o.stride() == q.stride()
    o_true, lse_true = masked_truth(q.double(), k.double(), v.double(), definition_mask(4, 30, None, True,
                                                                                       "lower_right"))  # fmt: skip
    assert_close_to_truth(o, o_true, "o", rtol=2e-5, atol=2e-5)
    assert_close_to_truth(lse, lse_true, "lse", rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(window=(2, 0.5)), TypeError, r"window\[1\] \(right\) must be an int"),
        (dict(softcap=-1.0), ValueError, "softcap must be a positive finite number"),
        (dict(scale=float("nan")), ValueError, "scale must be finite"),
        (dict(dropout_p=0.1), ValueError, "dropout_p must be 0.0"),
    ],
)
def test_short_calls_refuse_bad_input_by_name_on_every_tier(backend, kwargs, error, match):
    q, k, v = make(1, 2, 2, 1, 20, 8, seed=4)
    with use_backend(backend):
        flashtile.attention(q, k, v)  # a good call first: its plan is kept
        with pytest.raises(error, match=match):
            flashtile.attention(q, k, v, **kwargs)

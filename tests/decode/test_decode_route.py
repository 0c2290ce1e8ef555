"""flashtile.attention with Tq <= 16 and no gradient runs the split-K decode kernels (``api.decode_route``).

The route is checked two ways: ``decode_route`` says so, and the answer equals ``decode_attention``'s bit
for bit (the same kernels, the same split count). Every answer is held to the float64 formula through
the mask built from the definition, on the Triton tier (the route) and on the reference tier (no route).
"""

from __future__ import annotations

import math

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
        # the sinks: the short calls' route takes them, so their checks are the same as everywhere else
        (dict(sinks=torch.tensor([0.0, math.inf])), ValueError, r"sinks must be finite or -inf"),
        (dict(sinks=torch.tensor([math.nan, 0.0])), ValueError, r"sinks must be finite or -inf"),
        (dict(sinks=torch.zeros(3)), ValueError, r"sinks must have shape \(H,\) = \(2,\)"),
        (dict(sinks=torch.zeros(2, dtype=torch.float64)), TypeError, r"sinks must have dtype in \(float32\)"),
        (dict(sinks=torch.zeros(2, 1)), ValueError, r"sinks must be a rank-1 tensor"),
    ],
)
def test_short_calls_refuse_bad_input_by_name_on_every_tier(backend, kwargs, error, match):
    q, k, v = make(1, 2, 2, 1, 20, 8, seed=4)
    with use_backend(backend):
        flashtile.attention(q, k, v)  # a good call first: its plan is kept
        with pytest.raises(error, match=match):
            flashtile.attention(q, k, v, **kwargs)


def sink_and_wide_inputs(seed, Tq=3, Tk=45, D=16, D_v=24):
    """q, k, v with a value head dim of its own (d_v = 24 beside d_qk = 16), four query heads on two
    key/value heads, and (4,) sinks of either sign."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, h, t, D, generator=gen) for h, t in ((4, Tq), (2, Tk)))
    v = torch.randn(2, 2, Tk, D_v, generator=gen)
    sinks = torch.tensor([1.5, -0.5, 0.0, 3.0])
    return q, k, v, sinks


def sink_truth(q, k, v, sinks, keep, scale, softcap=None):
    """The float64 softmax over each row's kept keys and one more column, the head's sink, whose value is 0:
    (o, lse). Written out here from the definition: a row that sees no key gets o = 0 and lse = its sink
    (-inf for a sink of -inf, which is no sink: o = 0 there too, as without sinks)."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = scale * q @ k.transpose(-1, -2)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep, float("-inf"))
    sink_column = sinks.view(1, -1, 1, 1).expand(*s.shape[:3], 1)
    lse = torch.logsumexp(torch.cat([s, sink_column], dim=-1), dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(nan=0.0)  # nan only where lse = -inf: no key, no sink
    return p @ v, lse


@pytest.mark.parametrize("window,softcap", [(None, None), ((9, 0), 2.0)])
def test_the_route_takes_sinks_and_a_value_head_dim_as_decode_attention_does(window, softcap):
    """With sinks and d_v != d_qk the route is still the decode kernels: decode_attention's answer bit for bit,
    and the float64 formula's, o d_v wide."""
    q, k, v, sinks = sink_and_wide_inputs(seed=5)
    call = check_attention_call(q, k, v, is_causal=True, scale=None, enable_gqa=True, alignment="lower_right",
                                return_lse=True, window=window, softcap=softcap, sinks=sinks)  # fmt: skip
    assert decode_route(q, k, v, call, "triton", sinks)
    o, lse = flashtile.attention(q, k, v, is_causal=True, alignment="lower_right", enable_gqa=True,
                                 return_lse=True, window=window, softcap=softcap, sinks=sinks)  # fmt: skip
    o_decode, lse_decode = flashtile.decode_attention(q, k, v, window=window, softcap=softcap, sinks=sinks,
                                                      return_lse=True)  # fmt: skip
    assert o.shape == (2, 4, 3, 24)
    assert torch.equal(o, o_decode) and torch.equal(lse, lse_decode)
    keep = definition_mask(3, 45, window, True, "lower_right")
    o_true, lse_true = sink_truth(q, k, v, sinks, keep, 16**-0.5, softcap)
    assert_close_to_truth(o, o_true, "o", rtol=2e-5, atol=2e-5)
    assert_close_to_truth(lse, lse_true, "lse", rtol=2e-5, atol=2e-5)


def test_rows_that_see_no_key_get_zero_and_their_sink_on_the_route():
    """Upper-left causal with Tq > Tk: rows past the last key see none, and with a sink their o is 0 and their
    lse is the sink (not NaN, not -inf); a sink of -inf there gives lse -inf, as no sink does."""
    q, k, v, _ = sink_and_wide_inputs(seed=6, Tq=6, Tk=4)
    sinks = torch.tensor([0.5, float("-inf"), -2.0, 1.0])
    o, lse = flashtile.attention(q, k, v, is_causal=True, alignment="lower_right", enable_gqa=True,
                                 return_lse=True, sinks=sinks)  # fmt: skip
    blind = slice(0, 2)  # lower-right with Tq = 6 > Tk = 4: rows 0 and 1 see no key
    assert torch.equal(o[:, :, blind], torch.zeros_like(o[:, :, blind]))
    assert torch.equal(lse[:, :, blind], sinks.view(1, 4, 1).expand(2, 4, 2))
    keep = definition_mask(6, 4, None, True, "lower_right")
    o_true, lse_true = sink_truth(q, k, v, sinks, keep, 16**-0.5)
    assert_close_to_truth(o, o_true, "o", rtol=2e-5, atol=2e-5)
    assert_close_to_truth(lse, lse_true, "lse", rtol=2e-5, atol=2e-5)


def test_sinks_that_need_a_gradient_keep_the_forward_kernel():
    q, k, v, sinks = sink_and_wide_inputs(seed=7)
    options = dict(is_causal=True, scale=None, enable_gqa=True, alignment="lower_right", return_lse=False,
                   window=None, softcap=None)
    leaf = sinks.clone().requires_grad_()
    call = check_attention_call(q, k, v, sinks=leaf, **options)
    assert not decode_route(q, k, v, call, "triton", leaf)  # autograd records the sinks
    with torch.no_grad():
        assert decode_route(q, k, v, call, "triton", leaf)
    o = flashtile.attention(q, k, v, is_causal=True, alignment="lower_right", enable_gqa=True, sinks=leaf)
    (dsinks,) = torch.autograd.grad(o.sum(), leaf)
    with torch.no_grad():
        o_routed = flashtile.attention(q, k, v, is_causal=True, alignment="lower_right", enable_gqa=True,
                                       sinks=leaf)  # fmt: skip
    torch.testing.assert_close(o.detach(), o_routed, rtol=2e-5, atol=2e-5)
    sinks_64 = sinks.double().requires_grad_()
    o_true, _ = sink_truth(q, k, v, sinks_64, definition_mask(3, 45, None, True, "lower_right"), 16**-0.5)
    (dsinks_true,) = torch.autograd.grad(o_true.sum(), sinks_64)
    assert_close_to_truth(dsinks, dsinks_true, "dsinks", rtol=2e-5, atol=2e-5)


def test_the_decode_op_with_sinks_and_a_value_head_dim_passes_opcheck_and_compiles():
    from flashtile.api import attention_decode

    q, k, v, sinks = sink_and_wide_inputs(seed=8, Tq=2, Tk=30)
    torch.library.opcheck(attention_decode, (q, k, v, 0.25, "lower_right", 4, 0, 2.0, sinks))

    def fn(q, k, v, sinks):
        return flashtile.attention(q, k, v, is_causal=True, alignment="lower_right", enable_gqa=True, scale=0.25,
                                   window=(4, 0), softcap=2.0, sinks=sinks, return_lse=True)  # fmt: skip

    torch._dynamo.reset()
    o, lse = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, sinks)
    o_eager, lse_eager = fn(q, k, v, sinks)
    assert o.shape == (2, 4, 2, 24)
    assert torch.equal(o, o_eager) and torch.equal(lse, lse_eager)

"""flashtile.attention on float8_e4m3fn inputs (flashtile.fp8.attention), against float64 formulas.

The truth is float64 attention of the dequantised inputs (tests/_truth.py, no flashtile inside), and the
bound on what rounding P may add to it, written from E4M3's definition: P_ij is stored as 448 r_j p_ij
(r_j = descale_v[j] / max descale_v, at most 1), within 2^-4 of itself where that is normal and within
2^-10 absolutely below 2^-6, so row i of o moves by at most
    (2^-4 sum_j P_ij |v_j| + 2^-10 / 448 * max descale_v * sum_j |v8_j| / l_i) ,
l_i the row's sum of exp(s_ij - m_i).
"""

from __future__ import annotations

import math

import pytest
import torch

import flashtile
from flashtile.fp8 import quantize
from tests._truth import attention_truth, visible_pairs_mask

HALF_ULP = 2.0**-4
SUBNORMAL_HALF_STEP = 2.0**-10


def draw(B, H, T, D, seed, outliers=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)
    if outliers:
        pick = torch.rand(B, H, T, D, generator=gen, dtype=torch.float64) < 1e-2
        x = torch.where(pick, 10 * torch.randn(B, H, T, D, generator=gen, dtype=torch.float64), x)
    return x


def quantised(B=1, H=2, H_kv=2, Tq=80, Tk=96, D=32, seed=0, granularity="block", rotate=True):
    q, k, v = draw(B, H, Tq, D, seed), draw(B, H_kv, Tk, D, seed + 1), draw(B, H_kv, Tk, D, seed + 2)
    (q8, dq), (k8, dk) = (quantize(x, granularity, rotate=rotate) for x in (q, k))
    v8, dv = quantize(v, granularity)
    return q8, k8, v8, dq, dk, dv


def dequantised(x8, descale):
    return x8.double() * descale.double()[..., None]


def p_rounding_bound(q8, k8, v8, dq, dk, dv, causal, alignment="upper_left"):
    """(B, H, Tq, 1): the most rounding P to E4M3 can move a row of o, from the float64 scores."""
    q, k = dequantised(q8, dq), dequantised(k8, dk)
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v_abs = dequantised(v8, dv).abs().repeat_interleave(group, 1)
    v8_abs = v8.double().abs().repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~visible_pairs_mask(s.shape[2], s.shape[3], causal, alignment), float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    v_scale = dv.double().amax(-1).repeat_interleave(group, 1)[..., None, None]  # (B, H, 1, 1)
    return HALF_ULP * (p / l) @ v_abs + SUBNORMAL_HALF_STEP / 448 * v_scale * v8_abs.sum(-2, keepdim=True) / l


@pytest.mark.parametrize("causal, alignment", [(False, "upper_left"), (True, "upper_left"), (True, "lower_right")])
@pytest.mark.parametrize("H_kv", [2, 1])
def test_fp8_attention_is_exact_attention_of_its_inputs_up_to_ps_rounding(causal, alignment, H_kv):
    q8, k8, v8, dq, dk, dv = quantised(H_kv=H_kv)
    o, lse = flashtile.attention(q8, k8, v8, is_causal=causal, enable_gqa=True, alignment=alignment, return_lse=True,
                                 descale_q=dq, descale_k=dk, descale_v=dv, out_dtype=torch.float32)  # fmt: skip
    o_true, lse_true = attention_truth(dequantised(q8, dq), dequantised(k8, dk), dequantised(v8, dv), causal,
                                       alignment=alignment)  # fmt: skip
    bound = p_rounding_bound(q8, k8, v8, dq, dk, dv, causal, alignment) + 1e-6 * o_true.abs()  # + float32's o
    error = (o.double() - o_true).abs()
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    assert (error <= bound).all(), f"{(error / bound).max().item():.3f} of the bound"
    assert (error / bound).max() > 0.05  # P is rounded: not exact attention of the dequantised inputs
    torch.testing.assert_close(lse.double(), lse_true, rtol=2e-6, atol=2e-6)  # l sums the unrounded p


def test_output_is_bf16_by_default_and_float_dtypes_on_request():
    q8, k8, v8, dq, dk, dv = quantised()
    factors = dict(descale_q=dq, descale_k=dk, descale_v=dv)
    o32 = flashtile.attention(q8, k8, v8, **factors, out_dtype=torch.float32)
    for out_dtype, expected in ((None, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                (torch.float16, torch.float16)):  # fmt: skip
        o = flashtile.attention(q8, k8, v8, **factors, out_dtype=out_dtype)
        assert o.dtype == expected and o.shape == q8.shape
        assert torch.equal(o, o32.to(expected))  # the same float32 answer, rounded once to out_dtype


def test_a_per_tensor_factor_and_no_factor_mean_the_same_as_their_rows():
    q8, k8, v8, dq, dk, dv = quantised(granularity="tensor")
    per_row = flashtile.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, out_dtype=torch.float32)
    per_tensor = flashtile.attention(q8, k8, v8, descale_q=dq[0, 0, 0].clone(), descale_k=dk[0, 0, 0].clone(),
                                     descale_v=dv[0, 0, 0].clone(), out_dtype=torch.float32)  # fmt: skip
    assert torch.equal(per_row, per_tensor)
    ones = torch.ones_like(dq)
    implicit = flashtile.attention(q8, k8, v8, descale_k=dk, descale_v=dv, out_dtype=torch.float32)
    assert torch.equal(implicit, flashtile.attention(q8, k8, v8, descale_q=ones, descale_k=dk, descale_v=dv,
                                                     out_dtype=torch.float32))  # fmt: skip


def test_a_backward_through_fp8_inputs_raises_with_the_reason():
    q8, k8, v8, dq, dk, dv = quantised()
    q8.requires_grad_()
    o = flashtile.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv)
    with pytest.raises(NotImplementedError, match="forward only"):
        o.float().sum().backward()
    with torch.no_grad():  # inference under no_grad: no autograd node, nothing to refuse
        assert not flashtile.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv).requires_grad


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(descale_q="dq64"), TypeError, "descale_q must have dtype"),
        (dict(descale_v="short"), ValueError, r"descale_v must have shape \(B, H, T\)"),
        (dict(descale_k="zero"), ValueError, "descale_k must hold positive finite"),
        (dict(descale_q="scalar_nan"), ValueError, "descale_q must be a positive finite factor"),
        (dict(out_dtype=torch.float64), TypeError, "out_dtype must be None"),
        (dict(window=(4, 0)), ValueError, "not supported with float8_e4m3fn"),
        (dict(softcap=30.0), ValueError, "not supported with float8_e4m3fn"),
        (dict(dropout_p=0.1), ValueError, "dropout_p must be 0.0"),
        (dict(is_causal="yes"), TypeError, "is_causal"),
        (dict(key="bf16"), TypeError, "FP8 path needs query, key and value all float8_e4m3fn"),
        (dict(query="fp32", descale_q=None), TypeError, "descale_k, descale_v given"),
        (dict(key="one_head"), ValueError, "enable_gqa=True"),
        (dict(scale=1e39), ValueError, "scale must be at most .* for float8_e4m3fn inputs"),
        (dict(alignment="lower-right"), ValueError, "alignment must be one of"),
    ],
)
def test_bad_inputs_are_refused_by_name(change, error, message):
    q8, k8, v8, dq, dk, dv = quantised()
    args = dict(query=q8, key=k8, value=v8, descale_q=dq, descale_k=dk, descale_v=dv)
    made = dict(dq64=dq.double(), short=dv[..., :-1], zero=torch.zeros_like(dk), scalar_nan=torch.tensor(float("nan")),
                bf16=k8.to(torch.bfloat16), fp32=q8.float(), one_head=k8[:, :1])  # fmt: skip
    args.update({name: made.get(value, value) if isinstance(value, str) and name != "is_causal" else value
                 for name, value in change.items()})  # fmt: skip
    if "one_head" in change.values():
        args.update(value=v8[:, :1], descale_k=dk[:, :1], descale_v=dv[:, :1])
    with pytest.raises(error, match=message):
        flashtile.attention(**args)


def test_float_inputs_without_fp8_keywords_take_the_ordinary_path():
    q, k, v = (draw(1, 2, 16, 8, seed, outliers=False) for seed in (5, 6, 7))
    o = flashtile.attention(q, k, v)
    assert o.dtype == torch.float64
    torch.testing.assert_close(o, attention_truth(q, k, v)[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_runs_the_kernel_and_use_backend_reference_the_emulation(causal):
    from flashtile.api import use_backend
    from flashtile.kernels.fp8_forward import fp8_forward
    from flashtile.reference.fp8 import fp8_attention_forward

    inputs = [x.cuda() for x in quantised(B=2, H=4, H_kv=2, Tq=300, Tk=500, D=128)]
    q8, k8, v8, dq, dk, dv = inputs
    kw = dict(is_causal=causal, enable_gqa=True, alignment="lower_right", return_lse=True)
    o, lse = flashtile.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, **kw)
    o_kernel, lse_kernel = fp8_forward(*inputs, causal, alignment="lower_right")
    assert o.dtype == torch.bfloat16 and torch.equal(o, o_kernel) and torch.equal(lse, lse_kernel)
    with use_backend("reference"):
        o_ref, lse_ref = flashtile.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, **kw)
    o_e, lse_e = fp8_attention_forward(*(x.cpu() for x in inputs), causal, alignment="lower_right")
    # the emulation in float64 on the GPU and on the CPU: the same roundings, up to float64's last bits
    torch.testing.assert_close(o_ref.cpu().float(), o_e.float(), rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(lse_ref.cpu(), lse_e.float())
    # the kernel and the emulation differ by the E4M3 dot's short accumulator only: far less than FP8's own error
    o_true, _ = attention_truth(*(dequantised(x8.cpu(), d.cpu()) for x8, d in ((q8, dq), (k8, dk), (v8, dv))),
                                causal, alignment="lower_right")  # fmt: skip
    gap = (o.cpu().double() - o_e).pow(2).mean().sqrt()
    assert gap < 0.5 * (o_e - o_true).pow(2).mean().sqrt() + 2.0**-9 * o_e.abs().mean()


def test_a_kept_call_still_reads_new_or_rewritten_factors():
    """The checks of a layout run once (``check_fp8_call`` is kept per layout), the factors' values on every
    call they may have changed: a fresh tensor of bad factors in a layout seen before, and a checked factor
    written to in place, are refused like a first call's; a None factor and a 0-dim one keep their meaning."""
    q8, k8, v8, dq, dk, dv = quantised(seed=7)
    o = flashtile.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, out_dtype=torch.float32)
    again = flashtile.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, out_dtype=torch.float32)
    assert torch.equal(o, again)
    with pytest.raises(ValueError, match="descale_k must hold positive finite factors"):
        flashtile.attention(q8, k8, v8, descale_q=dq, descale_k=torch.zeros_like(dk), descale_v=dv)
    written = dv.clone()
    flashtile.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=written, out_dtype=torch.float32)
    written[0, 0, 3] = float("nan")  # after a call checked it: its version moves, so the next call reads it
    with pytest.raises(ValueError, match="descale_v must hold positive finite factors"):
        flashtile.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=written, out_dtype=torch.float32)
    one = torch.tensor(0.5, dtype=torch.float32)
    for _ in range(2):  # the first call makes the plan, the second runs from it
        halved = flashtile.attention(q8, k8, v8, descale_q=one, descale_k=None, descale_v=None, out_dtype=torch.float32)
        rows = flashtile.attention(q8, k8, v8, descale_q=torch.full(dq.shape, 0.5), out_dtype=torch.float32)
        torch.testing.assert_close(halved, rows, rtol=0, atol=0)
    with pytest.raises(ValueError, match="descale_q must be a positive finite factor"):
        flashtile.attention(q8, k8, v8, descale_q=torch.tensor(-1.0), out_dtype=torch.float32)


@pytest.mark.parametrize("causal, alignment", [(False, "upper_left"), (True, "lower_right")])
def test_an_fp8_call_is_checked_into_the_spec_the_bf16_path_builds_and_its_plan_reads_it(causal, alignment):
    """One form of the options from the entry point to the launch: the FP8 call keeps the spec ``check_spec``
    makes for the same options (the band, τ, the GQA group), and the kernel's plan is made from it: the
    causal band runs as the causal mask on the band's diagonal, τ as its sign and |τ| log2 e."""
    from flashtile._checks import check_attention_inputs
    from flashtile._spec import MaskBand, check_spec
    from flashtile.fp8.attention import check_fp8_call
    from flashtile.kernels.fp8_forward import LOG2E

    q8, k8, v8, dq, dk, dv = quantised(H=4, H_kv=2, Tq=48, Tk=80)
    options = dict(is_causal=causal, scale=-0.3, enable_gqa=True, alignment=alignment, return_lse=True)
    call = check_fp8_call(q8, k8, v8, dq, dk, dv, dropout_p=0.0, out_dtype=torch.float32, backend="triton",
                          **options)  # fmt: skip
    shape = check_attention_inputs(q8, k8, v8, dtypes=(torch.float8_e4m3fn,))
    assert call.spec == check_spec(shape, q8.dtype, causal=causal, scale=-0.3, alignment=alignment, window=None,
                                   softcap=None, return_lse=True)  # fmt: skip
    assert call.spec.mask == MaskBand(-1, 0 if causal else -1, alignment) and call.spec.group == 2
    launch = call.kernel_plan.launch
    offset, qk_scale = launch.scalars[-3:-1]
    assert launch.constexprs["CAUSAL"] is causal and offset == (80 - 48 if alignment == "lower_right" else 0)
    assert launch.constexprs["SIGN"] == -1 and qk_scale == 0.3 * LOG2E


@pytest.mark.parametrize("option", ["window", "softcap", "sinks"])
def test_the_fp8_plan_refuses_a_spec_it_cannot_run(option):
    """The kernel's plan builder reads the spec it is given, and says so when the spec holds what the FP8
    kernel has no step for (``flashtile.attention`` refuses those options before: this is the builder's own
    guard for a direct caller)."""
    from flashtile._checks import check_attention_inputs
    from flashtile._spec import check_spec
    from flashtile.kernels.fp8_forward import make_fp8_forward_plan

    q8, k8, v8, dq, dk, dv = quantised()
    shape = check_attention_inputs(q8, k8, v8, dtypes=(torch.float8_e4m3fn,))
    given = dict(window=(8, 0), softcap=30.0, sinks=torch.zeros(shape.H))
    kwargs = dict(window=None, softcap=None, sinks=None) | {option: given[option]}
    spec = check_spec(shape, q8.dtype, causal=False, scale=None, alignment="upper_left", device=q8.device,
                      **kwargs)  # fmt: skip
    with pytest.raises(ValueError, match="the FP8 kernel takes a causal mask or none, with no soft-cap and no sinks"):
        make_fp8_forward_plan(q8, k8, v8, dq, dk, dv, spec=spec, out_dtype=torch.float32)
    plain = check_spec(shape, q8.dtype, causal=False, scale=None, alignment="upper_left", window=None, softcap=None)
    assert make_fp8_forward_plan(q8, k8, v8, dq, dk, dv, spec=plain, out_dtype=torch.float32).launch is not None

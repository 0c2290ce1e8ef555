"""The FP8 emulation (flashtile.reference.fp8) against a closed form written from E4M3's definition.

The truth below rounds with its own E4M3 formula and sums the online softmax in closed form: the key
tile t(j) holding key j has seen the running max m_t = max of the scores of tiles 0..t, so

    o_i = (c / 448) * sum_j exp(m_t(j) - lse_i) * E4M3(448 * r_j * exp(s_ij - m_t(j))) * v8_j,

with r_j = descale_v[j] / c and c the head's largest V factor, and lse_i = logsumexp_j s_ij exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashtile.fp8 import GRANULARITIES, quantize
from flashtile.reference.fp8 import check_fp8_inputs, fp8_attention_forward, to_e4m3
from tests._truth import attention_truth, visible_pairs_mask

F64 = dict(rtol=1e-12, atol=1e-12)


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """float64 x to the nearest E4M3 value, ties to even, saturating at 448: 3 mantissa bits for exponents
    -6 to 8, and below 2^-6 the subnormal spacing 2^-9."""
    a = x.abs().clamp(max=448.0)
    exponent = (torch.frexp(a).exponent - 1).clamp(min=-6).double()  # a in [2^e, 2^(e+1))
    ulp = torch.exp2(exponent - 3)
    return torch.sign(x) * torch.round(a / ulp) * ulp  # a / ulp is exact; torch.round ties to even


def fp8_truth(q8, k8, v8, dq, dk, dv, causal, alignment, block_k, scale=None):
    tau = 1 / math.sqrt(q8.shape[-1]) if scale is None else scale
    group = q8.shape[1] // k8.shape[1]
    q = q8.double() * dq.double()[..., None]
    k = (k8.double() * dk.double()[..., None]).repeat_interleave(group, 1)
    v = v8.double().repeat_interleave(group, 1)
    c = dv.double().amax(-1, keepdim=True).repeat_interleave(group, 1)  # (B, H, 1)
    r = dv.double().repeat_interleave(group, 1) / c  # (B, H, Tk)
    Tq, Tk = q.shape[2], k.shape[2]
    s = tau * torch.einsum("bhid,bhjd->bhij", q, k)
    s = s.masked_fill(~visible_pairs_mask(Tq, Tk, causal, alignment), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    tile_max = torch.stack([s[..., t : t + block_k].amax(-1) for t in range(0, Tk, block_k)], -1)
    running = tile_max.cummax(dim=-1).values.repeat_interleave(block_k, -1)[..., :Tk]  # m_t(j), (B, H, Tq, Tk)
    seen = ~torch.isneginf(running)
    p = torch.where(seen, torch.exp(s - torch.where(seen, running, 0.0)), 0.0)
    p8 = e4m3_round((p * r[:, :, None, :] * 448).float().double())  # the kernel's P is float32
    weight = torch.where(seen, torch.exp(running - lse[..., None]), 0.0)
    o = (c[..., None] / 448) * torch.einsum("bhij,bhjd->bhid", weight * p8, v)
    return torch.where(torch.isneginf(lse)[..., None], 0.0, o), lse


def quantised(B, H, T, D, seed, granularity="block", outliers=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)
    if outliers:
        pick = torch.rand(B, H, T, D, generator=gen, dtype=torch.float64) < 1e-2
        x = torch.where(pick, 10 * x, x)
    return quantize(x, granularity, block=16 if granularity == "block" else None)


def test_e4m3_cast_rounds_to_nearest_even_and_saturates():
    binades = torch.exp2(torch.arange(-12, 9, dtype=torch.float64))[:, None]
    grid = binades * torch.linspace(1, 2, 257, dtype=torch.float64)  # 32 steps per E4M3 step: midpoints too
    x = torch.cat([grid.flatten(), -grid.flatten(), torch.tensor([0.0, 447.9, 448.0, 460.0, 1e30, -1e30])])
    x = x.float().double()  # ties included: the grid holds every midpoint between E4M3 values
    torch.testing.assert_close(to_e4m3(x).double(), e4m3_round(x), rtol=0, atol=0)


CASES = [  # (B, H, H_kv, Tq, Tk, causal, alignment, block_k, granularity)
    (1, 2, 2, 37, 37, False, "upper_left", 64, "tensor"),  # one key tile: P against the final max
    (1, 2, 2, 37, 37, True, "upper_left", 8, "head"),
    (2, 4, 2, 19, 45, True, "lower_right", 16, "block"),  # GQA, Tq < Tk, ragged tiles
    (1, 2, 1, 45, 19, True, "upper_left", 7, "block"),  # MQA, Tq > Tk
    (1, 2, 2, 21, 13, True, "lower_right", 5, "block"),  # Tq > Tk lower-right: the first rows see no key
]


@pytest.mark.parametrize("B, H, H_kv, Tq, Tk, causal, alignment, block_k, granularity", CASES)
def test_emulation_matches_the_closed_form(B, H, H_kv, Tq, Tk, causal, alignment, block_k, granularity):
    q8, dq = quantised(B, H, Tq, 16, 1, granularity)
    k8, dk = quantised(B, H_kv, Tk, 16, 2, granularity)
    v8, dv = quantised(B, H_kv, Tk, 16, 3, granularity)
    o, lse = fp8_attention_forward(q8, k8, v8, dq, dk, dv, causal, None, block_k, alignment)
    o_t, lse_t = fp8_truth(q8, k8, v8, dq, dk, dv, causal, alignment, block_k)
    assert o.dtype == lse.dtype == torch.float64
    torch.testing.assert_close(lse, lse_t, **F64)
    torch.testing.assert_close(o, o_t, **F64)
    if Tq > Tk and alignment == "lower_right":
        assert torch.all(o[..., : Tq - Tk, :] == 0) and torch.all(torch.isneginf(lse[..., : Tq - Tk]))


def test_rounding_p_moves_o_by_at_most_the_derived_bound():
    """|o - o_dequantised| <= 2^-4 sum_j P_ij |v_j| + (c / 448) 2^-10 sum_j exp(m_t(j) - lse_i) |v8_j|:
    each rounded entry of 448 r_j p is off by 2^-4 of itself, or by 2^-10 where it is subnormal."""
    q8, dq = quantised(1, 2, 40, 32, 4)
    k8, dk = quantised(1, 2, 300, 32, 5)
    v8, dv = quantised(1, 2, 300, 32, 6)
    o, lse = fp8_attention_forward(q8, k8, v8, dq, dk, dv, block_k=64)
    q, k, v = (x8.double() * d.double()[..., None] for x8, d in ((q8, dq), (k8, dk), (v8, dv)))
    o_exact, lse_exact = attention_truth(q, k, v)
    torch.testing.assert_close(lse, lse_exact, **F64)  # l sums the unrounded p
    p = torch.softmax(torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(32), dim=-1)
    s = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(32)
    tile_max = torch.stack([s[..., t : t + 64].amax(-1) for t in range(0, 300, 64)], -1)
    running = tile_max.cummax(-1).values.repeat_interleave(64, -1)[..., :300]
    c = dv.double().amax(-1)[..., None, None]
    bound = 2**-4 * p @ v.abs() + c / 448 * 2**-10 * torch.exp(running - lse[..., None]) @ v8.double().abs()
    error = (o - o_exact).abs()
    assert torch.all(error <= bound * (1 + 1e-9))
    assert error.max() > 0.05 * bound.max()  # P's rounding is really there


def test_views_read_their_values():
    q8, dq = quantised(1, 2, 24, 16, 7)
    k8, dk = quantised(1, 2, 24, 16, 8)
    v8, dv = quantised(1, 2, 24, 16, 9)
    expected = fp8_attention_forward(q8, k8, v8, dq, dk, dv, True, None, 8)
    q8_view = q8.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, T, D) view of a (B, T, H, D) tensor
    dq_view = torch._neg_view(-dq)  # a negative-bit view that holds dq
    got = fp8_attention_forward(q8_view, k8, v8, dq_view, dk.transpose(1, 2).contiguous().transpose(1, 2), dv,
                                True, None, 8)  # fmt: skip
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)


def _bad(which, value):
    q8, dq = quantised(1, 2, 4, 8, 10)
    args = dict(q8=q8, k8=q8, v8=q8, descale_q=dq, descale_k=dq, descale_v=dq)
    args[which] = value(args[which]) if callable(value) else value
    return args


BAD = [
    ("q8", lambda x: x.float(), TypeError, r"q must have dtype in \(float8_e4m3fn\).*flashtile.fp8.quantize"),
    ("v8", lambda x: x.to(torch.float8_e5m2), TypeError, "v must have dtype"),
    ("descale_k", lambda d: d.double(), TypeError, "descale_k must have dtype in"),
    ("descale_q", lambda d: d[..., :3], ValueError, r"descale_q must have shape \(B, H, T\) = \(1, 2, 4\)"),
    ("descale_v", lambda d: d[0], ValueError, "descale_v must be a rank-3 tensor"),
    ("descale_v", lambda d: torch.zeros_like(d), ValueError, "descale_v must hold positive finite factors"),
    ("descale_q", lambda d: torch.full_like(d, float("nan")), ValueError, "descale_q must hold positive finite"),
    ("descale_k", lambda d: -d, ValueError, "descale_k must hold positive finite factors"),
    ("descale_q", 0.5, TypeError, "descale_q must be a torch.Tensor"),
]


@pytest.mark.parametrize("which, value, error, message", BAD, ids=[m[:30] for *_, m in BAD])
def test_bad_inputs_are_refused_by_name(which, value, error, message):
    with pytest.raises(error, match=message):
        fp8_attention_forward(**_bad(which, value))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(block_k=0), ValueError, "block_k must be a positive int"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(alignment="diagonal"), ValueError, "alignment must be one of"),
    (dict(scale=float("inf")), ValueError, "scale must be finite"),
])  # fmt: skip
def test_bad_options_are_refused_by_name(kwargs, error, message):
    with pytest.raises(error, match=message):
        fp8_attention_forward(**_bad("q8", lambda x: x), **kwargs)


class _NoHostReads:
    """Within this block, reading a tensor's value on the host (bool, item, a Python number) raises: on a GPU
    each would wait for the device."""

    def __enter__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in ("__bool__", "item", "__float__", "__int__")}

        def refuse(*_):
            raise AssertionError("a tensor's value was read on the host")

        for name in self.saved:
            setattr(torch.Tensor, name, refuse)

    def __exit__(self, *_):
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, method)


def test_factors_from_quantize_are_not_read_again():
    gen = torch.Generator().manual_seed(9)
    (q8, dq), (k8, dk), (v8, dv) = (quantize(torch.randn(1, 2, 20, 8, generator=gen), g) for g in GRANULARITIES)
    with _NoHostReads():
        check_fp8_inputs(q8, k8, v8, dq, dk, dv)
    with pytest.raises(AssertionError, match="read on the host"), _NoHostReads():  # the control: a copy is read
        check_fp8_inputs(q8, k8, v8, dq.clone(), dk, dv)


def test_factors_checked_once_are_not_read_again_until_written_to():
    args = _bad("q8", lambda x: x)
    args.update({name: args[name].clone() for name in ("descale_q", "descale_k", "descale_v")})  # user-made
    fp8_attention_forward(**args)  # reads and vouches for the three
    with _NoHostReads():
        check_fp8_inputs(*(args[name] for name in ("q8", "k8", "v8", "descale_q", "descale_k", "descale_v")))
    args["descale_k"][0, 0, 1] = 0.0  # an in-place write, through the tensor itself
    with pytest.raises(ValueError, match="descale_k must hold positive finite factors"):
        fp8_attention_forward(**args)
    _, descale = quantize(torch.ones(1, 1, 4, 8))
    descale[..., 2:].fill_(float("nan"))  # a write through a view advances the shared version count
    with pytest.raises(ValueError, match="descale_q must hold positive finite factors"):
        check_fp8_inputs(*(torch.ones(1, 1, 4, 8).to(torch.float8_e4m3fn) for _ in range(3)), descale,
                         torch.ones(1, 1, 4), torch.ones(1, 1, 4))  # fmt: skip


def test_factors_made_in_inference_mode_are_read_every_call():
    with torch.inference_mode():
        (q8, dq), (k8, dk), (v8, dv) = (quantize(torch.randn(1, 1, 4, 8)) for _ in range(3))
        check_fp8_inputs(q8, k8, v8, dq, dk, dv)
        dq.zero_()  # inference tensors keep no version count: only reading them again sees this
        with pytest.raises(ValueError, match="descale_q must hold positive finite factors"):
            check_fp8_inputs(q8, k8, v8, dq, dk, dv)

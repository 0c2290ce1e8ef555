"""Attention sinks through ``flashtile.attention`` in bfloat16 on the GPU, equal head dims: gpt-oss's shape
(64 query heads on 8 key/value heads, D = 64) and smaller ones, with its sliding window, a soft-cap, a
lower-right causal mask whose first rows see no key, and the ``bthd`` layout a model gives, forward and
backward, against the float64 formula with a sink column (``tests/reference/_sink_truth.py``, which
imports nothing of flashtile). The interpreter's bfloat16 is wrong, so these run on a GPU only."""

import pytest
import torch

import flashtile
from tests.reference._sink_truth import dense_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CASES = {  # (B, H, H_kv, Tq, Tk, D), flashtile's keywords and the truth's, layout
    "gpt-oss-causal": ((1, 64, 8, 600, 600, 64), dict(is_causal=True), dict(causal=True), "bthd"),
    "gpt-oss-window": ((2, 64, 8, 700, 700, 64), dict(is_causal=True, window=(127, 0)),
                       dict(causal=True, window=(127, 0)), "bthd"),
    "d128-softcap-lower-right": ((2, 8, 2, 300, 900, 128), dict(is_causal=True, alignment="lower_right", softcap=20.0),
                                 dict(causal=True, alignment="lower_right", softcap=20.0), "bhtd"),
    "keyless-rows": ((1, 4, 4, 200, 150, 64), dict(is_causal=True, alignment="lower_right"),
                     dict(causal=True, alignment="lower_right"), "bhtd"),
}  # fmt: skip


def inputs(shape, layout, seed):
    B, H, H_kv, Tq, Tk, D = shape
    gen = torch.Generator().manual_seed(seed)

    def one(heads, T):
        if layout == "bthd":
            return torch.randn(B, T, heads, D, generator=gen).transpose(1, 2)
        return torch.randn(B, heads, T, D, generator=gen)

    return one(H, Tq), one(H_kv, Tk), one(H_kv, Tk), one(H, Tq), 2 * torch.randn(H, generator=gen)


def within_bf16(got, expected, name):
    """bf16 inputs, float32 accumulation: within a few bf16 units of the largest float64 entry."""
    scale = max(1.0, expected.abs().max().item())
    error = (got.double().cpu() - expected).abs().max().item()
    assert error <= 2e-2 * scale, f"{name}: max error {error:.3e} against a largest entry of {scale:.3e}"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sinks_dtype", [torch.float32, torch.bfloat16])
def test_sinks_bf16_on_the_gpu_match_the_float64_formula(case, sinks_dtype):
    shape, kwargs, truth_kwargs, layout = CASES[case]
    q, k, v, do, sinks = inputs(shape, layout, seed=3)
    q, k, v, do = (t.bfloat16() for t in (q, k, v, do))  # the truth sees the same rounded values
    sinks = sinks.to(sinks_dtype)
    leaves = [t.cuda().detach().requires_grad_() for t in (q, k, v, sinks)]
    o, lse = flashtile.attention(*leaves[:3], enable_gqa=True, sinks=leaves[3], return_lse=True, **kwargs)
    grads = torch.autograd.grad(o, leaves, do.cuda())
    ref = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    o_ref, lse_ref = dense_attention(*ref[:3], sinks=ref[3], **truth_kwargs)
    grads_ref = torch.autograd.grad(o_ref, ref, do.double())
    assert o.dtype == torch.bfloat16 and grads[3].dtype == sinks_dtype
    within_bf16(o, o_ref, "o")
    torch.testing.assert_close(lse.double().cpu(), lse_ref, rtol=0, atol=1e-2)
    for name, g, g_ref in zip(("dq", "dk", "dv", "dsinks"), grads, grads_ref):
        within_bf16(g, g_ref, name)
    if case == "keyless-rows":  # query rows 0..49 see no key: o = 0 and lse = their head's sink
        assert torch.equal(o[:, :, :50].cpu(), torch.zeros_like(o[:, :, :50].cpu()))
        torch.testing.assert_close(lse[:, :, :50].cpu(), sinks.float()[None, :, None].expand(1, 4, 50), rtol=0,
                                   atol=1e-5)  # fmt: skip


def test_a_sink_of_minus_infinity_is_no_sink_bit_for_bit_on_the_gpu():
    q, k, v, _, _ = inputs((2, 64, 8, 512, 512, 64), "bthd", seed=4)
    q, k, v = (t.cuda().bfloat16() for t in (q, k, v))
    none = torch.full((64,), float("-inf"), device="cuda")
    a = flashtile.attention(q, k, v, is_causal=True, enable_gqa=True, sinks=none, return_lse=True)
    b = flashtile.attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

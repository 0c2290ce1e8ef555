"""The numerics rules of tests/test_numerics.py on the GPU, at real sizes and in every kernel dtype.

NaN and inf reach exactly the rows that see them; the backward, fed the forward's own (m, l), stays exact
when the logits are huge; B * H beyond one grid dimension runs. Truth: tests/_truth.py in float64 on the
same (rounded) inputs.
"""

import math

import pytest
import torch

import flashtile
from tests._truth import assert_close_to_truth, assert_same_nonfinite, truth_with_grads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Tolerance per unit of |v| (outputs) or of the gradient's natural size: P is rounded to the input dtype
# before P V (fp32 dots may run in tf32 on the GPU, a 10-bit mantissa like fp16).
REL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 3e-3}


def inputs(dtype, B=2, H=8, H_kv=2, Tq=1000, Tk=1000, D=128, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(dtype)
    return make(B, H, Tq, D), make(B, H_kv, Tk, D), make(B, H_kv, Tk, D), make(B, H, Tq, D)


def forward_backward(q, k, v, do, causal, alignment="upper_left"):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = flashtile.attention(q, k, v, is_causal=causal, enable_gqa=True, alignment=alignment, return_lse=True)
    o.backward(do)
    return o.detach(), lse, (q.grad, k.grad, v.grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_nan_and_inf_reach_exactly_the_rows_that_see_them_on_the_gpu(dtype, causal):
    q, k, v, do = inputs(dtype, seed=1)
    q[0, 3, 517, 5] = float("nan")
    k[1, 1, 300, 0] = float("nan")
    k[0, 0, 700, 9] = float("inf")
    o, lse, grads = forward_backward(q, k, v, do, causal)
    o_ref, lse_ref, grads_ref = truth_with_grads(q, k, v, do, causal)
    assert not torch.isfinite(o_ref).all()
    assert_same_nonfinite(o, o_ref, "o")
    assert_same_nonfinite(lse, lse_ref, "lse")
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert not (torch.isnan(g) & torch.isfinite(g_ref)).any(), f"{name}: NaN where the truth is finite"
        finite = torch.isfinite(g_ref)
        scale = g_ref[finite].abs().max().item()
        err = (g.double()[finite] - g_ref[finite]).abs().max().item()
        assert err <= REL[dtype] * scale, (name, err, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("logit", [4e3, 4e5, 4e6, 1e12, 1e30])
def test_backward_is_exact_at_huge_logits_through_the_forwards_own_statistics(dtype, logit):
    if dtype != torch.float32 and logit > 1e4:  # bf16/fp16 inputs cannot hold entries of that size
        limit = torch.finfo(dtype).max
        if math.sqrt(logit / math.sqrt(128)) * 4 > limit:
            pytest.skip("the inputs would overflow the dtype")
    q, k, v, do = inputs(torch.float32, B=1, H=4, H_kv=4, Tq=777, Tk=777, seed=2)
    a = math.sqrt(logit / math.sqrt(q.shape[-1]))
    q, k, v, do = (q * a).to(dtype), (k * a).to(dtype), v.to(dtype), do.to(dtype)
    o, lse, (dq, dk, dv) = forward_backward(q, k, v, do, True)
    o_ref, lse_ref, (dq_ref, dk_ref, dv_ref) = truth_with_grads(q, k, v, do, True)
    rel = REL[dtype]
    assert torch.isfinite(o).all() and torch.isfinite(dv).all() and torch.isfinite(dq).all()
    assert (o.double() - o_ref).abs().max() <= rel * v.abs().max().item()
    assert (dv.double() - dv_ref).abs().max() <= rel * do.abs().max().item() * 8
    torch.testing.assert_close(lse.double(), lse_ref, rtol=1e-4, atol=1e-4)
    size = do.abs().max().item() * v.abs().max().item() / math.sqrt(q.shape[-1])
    assert (dq.double() - dq_ref).abs().max() <= rel * size * k.abs().max().item()
    assert (dk.double() - dk_ref).abs().max() <= rel * size * q.abs().max().item()


def test_more_batch_times_heads_than_one_grid_dimension_holds():
    # B * H = 70,000 > 65,535: heads and batch have a grid axis each.
    q, k, v, do = inputs(torch.bfloat16, B=1000, H=70, H_kv=70, Tq=20, Tk=20, D=16, seed=3)
    o, lse, grads = forward_backward(q, k, v, do, True)
    o_ref, lse_ref, grads_ref = truth_with_grads(q, k, v, do, True)
    assert_close_to_truth(o, o_ref, "o", atol=2e-2, rtol=2e-2)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close_to_truth(g, g_ref, name, atol=5e-2, rtol=5e-2)

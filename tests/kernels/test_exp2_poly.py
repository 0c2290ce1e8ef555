"""``_common.exp2_poly`` (2^x on the FMA units) against float64, and the forward with ``poly_exp2``.

The polynomial's claims are checked here on the values that matter: the whole range a softmax feeds
it (x <= 0), the points where the rounding of x to an integer changes (k + 1/2), the ends of the
normal floats, -inf and NaN. Runs in the interpreter on the CPU and compiled on the GPU.
"""

import math

import pytest
import torch
import triton
import triton.language as tl

from _truth import attention_truth
from flashtile.kernels._common import exp2_poly
from flashtile.kernels.forward import flash_attention

from ._helpers import DEVICE, assert_attention_close, randn

MAX_REL_ERR = 1.02e-4  # the fit's bound, evaluated in float32 when the coefficients were chosen


@triton.jit
def _exp2_poly_kernel(X, Y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + i, exp2_poly(tl.load(X + i, mask=i < n, other=0.0)), mask=i < n)


def _exp2_poly(x: torch.Tensor) -> torch.Tensor:
    x = x.to(device=DEVICE, dtype=torch.float32).contiguous()
    y = torch.empty_like(x)
    _exp2_poly_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    return y.cpu()


def test_exp2_poly_is_within_its_bound_over_the_softmax_range():
    gen = torch.Generator().manual_seed(7)
    x = torch.cat([
        -torch.rand(20000, generator=gen) * 126,  # anywhere a softmax puts x
        -torch.rand(5000, generator=gen) * 2,  # around 0, where most of P's mass is
        -torch.arange(0, 126).float() - 0.5,  # the ties of round(x), where f jumps from +1/2 to -1/2
        -torch.arange(0, 126).float() - 0.5 + 1e-5,
        -torch.arange(0, 126).float() - 0.5 - 1e-5,
    ])  # fmt: skip
    truth = torch.exp2(x.double())
    rel = ((_exp2_poly(x).double() - truth) / truth).abs()
    assert rel.max().item() <= MAX_REL_ERR, f"max relative error {rel.max().item():.3e}"
    assert rel.max().item() > 1e-5  # a control: the cubic's error is really there (it is not exp2 itself)


def test_exp2_poly_edges_are_exact():
    """1 at 0 (the row maximum's weight), 2^-k at the integers, 0 below -126 and at -inf, NaN for NaN."""
    x = torch.tensor([0.0, -1.0, -2.0, -10.0, -126.0, -126.5, -127.0, -150.0, -1e30, -math.inf, math.nan])
    y = _exp2_poly(x)
    assert y[0].item() == 1.0
    assert all(y[i].item() == 2.0 ** x[i].item() for i in (1, 2, 3, 4))
    assert (y[5:10] == 0).all()
    assert math.isnan(y[10].item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16])
@pytest.mark.parametrize("causal,alignment,Tq,Tk", [(False, "upper_left", 45, 100), (True, "lower_right", 37, 100),
                                                    (True, "upper_left", 64, 64)])
def test_forward_with_poly_exp2_matches_float64(causal, alignment, Tq, Tk, dtype):
    """Every second column's exponential through the polynomial: still within the 16-bit tolerance of the
    float64 truth, and different from the default's output (else the switch did nothing)."""
    gen = torch.Generator().manual_seed(Tq * 13 + Tk)
    q, k, v = (randn(1, 2, T, 64, dtype=dtype, generator=gen) for T in (Tq, Tk, Tk))
    o, lse = flash_attention(q, k, v, causal=causal, alignment=alignment, block_q=16, block_k=16, poly_exp2=True)
    o_ref, lse_ref = attention_truth(q.double(), k.double(), v.double(), causal=causal, alignment=alignment)
    assert_attention_close(o, lse, o_ref, lse_ref, dtype)
    default, _ = flash_attention(q, k, v, causal=causal, alignment=alignment, block_q=16, block_k=16)
    assert not torch.equal(o, default)


def test_poly_exp2_is_refused_for_float32_and_non_bool():
    q = randn(1, 1, 16, 32)
    with pytest.raises(ValueError, match="poly_exp2=True needs fp16 or bf16 inputs"):
        flash_attention(q, q, q, poly_exp2=True)
    h = q.half()
    with pytest.raises(TypeError, match="poly_exp2 must be a bool"):
        flash_attention(h, h, h, poly_exp2=2)
    flash_attention(q, q, q, poly_exp2=False)  # control: float32 takes the flag when it is off

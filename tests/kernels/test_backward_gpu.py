"""The Triton backward on the GPU: every variant at real sizes, held to SDPA's own error in the same dtype.

The ground truth is autograd through the float64 truth of tests/_truth.py on the same (rounded) inputs. A gradient
passes when its largest error is at most twice the largest error of torch's SDPA backward, run in the same
dtype on the same inputs (FlashAttention's own test criterion).
"""

import pytest
import torch
import torch.nn.functional as F

from flashtile.kernels.backward import flash_attention_backward
from flashtile.kernels.forward import flash_attention
from flashtile.reference.naive import expand_kv_heads
from tests._grids import covering_rows
from tests._truth import truth_with_grads

from ._helpers import case_id

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BF16, F16 = torch.bfloat16, torch.float16
# (B, H, H_kv, Tq, Tk, D, causal, alignment, dtype): each head dim, dtype, mask, GQA ratio and ragged T.
CASES = [
    (2, 4, 4, 1024, 1024, 64, False, "upper_left", BF16),
    (2, 4, 4, 1000, 1000, 64, True, "upper_left", BF16),
    (1, 8, 2, 777, 1531, 128, True, "lower_right", BF16),
    (1, 8, 2, 1531, 777, 128, True, "upper_left", BF16),
    (1, 4, 1, 2048, 2048, 256, True, "upper_left", BF16),
    (1, 4, 4, 1000, 1000, 80, False, "upper_left", BF16),
    (1, 4, 4, 999, 1999, 96, True, "lower_right", BF16),
    (1, 2, 2, 8192, 8192, 128, True, "upper_left", BF16),
    (1, 2, 2, 8192, 8192, 64, False, "upper_left", BF16),
    (2, 4, 4, 1024, 1024, 64, True, "lower_right", F16),
    (1, 8, 2, 1000, 1000, 128, False, "upper_left", F16),
    (1, 4, 4, 1537, 1537, 256, False, "upper_left", F16),
    (1, 4, 1, 600, 900, 256, True, "lower_right", F16),
    (1, 2, 2, 8192, 8192, 256, True, "lower_right", F16),
    (1, 8, 2, 4096, 4096, 64, True, "upper_left", F16),
]


def features(case, *more):
    """What a case varies, for the pairwise choice of cases (tests/_grids.py): head dim, dtype, mask, GQA
    ratio, whether Tq = Tk, whether T reaches 8k, and any further argument (deterministic)."""
    B, H, H_kv, Tq, Tk, D, causal, alignment, dtype = case
    return (D, dtype, alignment if causal else "full", H // H_kv, Tq == Tk, max(Tq, Tk) >= 8192, *more)


# Each case once in each mode would be 30 runs, most of them compiling a kernel of their own; the runs kept
# still pair every feature value with every other one (make gpu-test-long runs all 30).
ERROR_RUNS = covering_rows([(case, det) for case in CASES for det in (True, False)], lambda r: features(*r))
# TMA against the pointer path: what changes is how tiles arrive, so the head dim, dtype, mask and ragged
# ends are what must pair up. 16-byte rows in 16-bit: D a multiple of 8.
TMA_CASES = covering_rows([c for c in CASES if c[5] % 8 == 0], lambda c: features(c)[:3] + features(c)[4:5])
RUN_IDS = [f"{case_id(c)}-{'deterministic' if d else 'atomic_dq'}" for c, d in ERROR_RUNS]


def make_inputs(B, H, H_kv, Tq, Tk, D, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H, Tq, D, device="cuda", generator=gen).to(dtype)
    k = torch.randn(B, H_kv, Tk, D, device="cuda", generator=gen).to(dtype)
    v = torch.randn(B, H_kv, Tk, D, device="cuda", generator=gen).to(dtype)
    do = torch.randn(B, H, Tq, D, device="cuda", generator=gen).to(dtype)
    return q, k, v, do


def float64_gradients(q, k, v, do, causal, alignment):
    return truth_with_grads(q, k, v, do, causal, None, alignment)[2]


def sdpa_gradients(q, k, v, do, causal, alignment):
    """SDPA's backward in q's dtype. K and V are expanded for GQA (summed back per group afterwards)."""
    H, H_kv, Tq, Tk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    q_, k_, v_ = (t.detach().requires_grad_() for t in (q, expand_kv_heads(k, H), expand_kv_heads(v, H)))
    mask, is_causal = None, causal
    if causal and alignment == "lower_right" and Tq != Tk:
        from torch.nn.attention.bias import causal_lower_right

        mask, is_causal = causal_lower_right(Tq, Tk), False
    o = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, is_causal=is_causal)
    dq, dk, dv = torch.autograd.grad(o, (q_, k_, v_), do)
    group = H // H_kv
    fold = lambda g: g.view(g.shape[0], H_kv, group, *g.shape[2:]).sum(2).to(q.dtype)
    return dq, fold(dk), fold(dv)


def ours(q, k, v, do, causal, alignment, deterministic=True, tma=None):
    o, lse, stats = flash_attention(q, k, v, causal=causal, alignment=alignment, return_stats=True)
    return flash_attention_backward(
        q, k, v, o, lse, do, causal=causal, alignment=alignment, stats=stats, deterministic=deterministic, tma=tma
    )


def max_error(a, ref):
    return (a.double() - ref).abs().max().item()


@pytest.mark.parametrize(
    "case,deterministic", ERROR_RUNS, ids=RUN_IDS
)
def test_backward_error_is_at_most_twice_sdpa_error(case, deterministic):
    B, H, H_kv, Tq, Tk, D, causal, alignment, dtype = case
    q, k, v, do = make_inputs(B, H, H_kv, Tq, Tk, D, dtype, seed=Tq + Tk + D)
    truth = float64_gradients(q, k, v, do, causal, alignment)
    theirs = sdpa_gradients(q, k, v, do, causal, alignment)
    mine = ours(q, k, v, do, causal, alignment, deterministic)
    for name, g, g_sdpa, g_ref in zip(("dq", "dk", "dv"), mine, theirs, truth):
        assert g.dtype == dtype and g.shape == g_ref.shape, name
        assert torch.isfinite(g).all(), f"{name} has NaN or inf"
        err, err_sdpa = max_error(g, g_ref), max_error(g_sdpa, g_ref)
        assert err <= 2 * err_sdpa + 1e-6, f"{name}: error {err:.3g} > 2 x SDPA's {err_sdpa:.3g}"


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0), reason="TMA: sm_90")
@pytest.mark.parametrize("case", TMA_CASES, ids=case_id)
def test_tma_loads_give_the_pointer_path_bits(case):
    """tma=True changes how q, do (dK/dV) and k, v (dQ) reach shared memory, not one multiplication or
    addition: the gradients must be bitwise those of the pointer path, so its error bound carries over."""
    B, H, H_kv, Tq, Tk, D, causal, alignment, dtype = case
    q, k, v, do = make_inputs(B, H, H_kv, Tq, Tk, D, dtype, seed=Tq + Tk + D)
    for name, a, b in zip(("dq", "dk", "dv"), ours(q, k, v, do, causal, alignment, tma=True),
                          ours(q, k, v, do, causal, alignment)):  # fmt: skip
        assert torch.equal(a, b), f"{name}: {(a.float() - b.float()).abs().max().item():.3g} from the pointer path"


def test_backward_is_bitwise_deterministic_on_the_gpu():
    q, k, v, do = make_inputs(2, 8, 2, 2048, 2048, 128, BF16, seed=1)
    o, lse = flash_attention(q, k, v, causal=True)
    runs = [flash_attention_backward(q, k, v, o, lse, do, causal=True) for _ in range(3)]
    for again in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], again))


def test_backward_with_non_contiguous_inputs_and_do_matches_contiguous():
    q, k, v, do = make_inputs(1, 4, 2, 1000, 1000, 64, BF16, seed=2)
    o, lse = flash_attention(q, k, v, causal=True)
    expected = flash_attention_backward(q, k, v, o, lse, do, causal=True)
    # Same values, other layouts: (B, T, H, D) storage for q, k, v and a transposed-storage dO.
    as_bthd = lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)
    do_t = do.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not do_t.is_contiguous()
    actual = flash_attention_backward(as_bthd(q), as_bthd(k), as_bthd(v), o, lse, do_t, causal=True)
    # Not bitwise: a strided dO may change how the compiler feeds the MMA units, hence the summation order.
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


def test_rows_that_see_no_key_get_zero_gradient_on_the_gpu():
    q, k, v, do = make_inputs(1, 4, 4, 1000, 300, 64, BF16, seed=3)  # lower-right: 700 rows see nothing
    o, lse = flash_attention(q, k, v, causal=True, alignment="lower_right")
    dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do, causal=True, alignment="lower_right")
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert torch.equal(dq[:, :, :700], torch.zeros_like(dq[:, :, :700]))
    truth = float64_gradients(q, k, v, do, True, "lower_right")
    for g, g_ref in zip((dq, dk, dv), truth):
        torch.testing.assert_close(g.double(), g_ref, atol=5e-2, rtol=5e-2)


def test_fp32_backward_matches_float64():
    q, k, v, do = make_inputs(1, 4, 1, 700, 500, 128, torch.float32, seed=4)
    o, lse = flash_attention(q, k, v, causal=True, alignment="lower_right")
    mine = flash_attention_backward(q, k, v, o, lse, do, causal=True, alignment="lower_right")
    truth = float64_gradients(q, k, v, do, True, "lower_right")
    # The forward's o may come from tf32 dots; the backward's own dots are exact fp32 ("ieee").
    for g, g_ref in zip(mine, truth):
        torch.testing.assert_close(g.double(), g_ref, atol=2e-2, rtol=2e-2)


def test_backward_uses_64_bit_offsets_past_2_31_elements():
    # Two batches whose storage is 2**31 elements apart: b * stride_b overflows int32 for b = 1.
    B, H, T, D = 2, 1, 256, 64
    stride_b = 2**31
    gen = torch.Generator(device="cuda").manual_seed(5)

    def spread(t):
        base = torch.zeros(stride_b + t[0].numel(), dtype=t.dtype, device="cuda")
        out = base.as_strided(t.shape, (stride_b, T * D, D, 1))
        out.copy_(t)
        return out

    q, k, v, do = (torch.randn(B, H, T, D, device="cuda", generator=gen).to(BF16) for _ in range(4))
    o, lse = flash_attention(q, k, v, causal=True)
    expected = flash_attention_backward(q, k, v, o, lse, do, causal=True)
    far = [spread(t) for t in (q, k, v, o, do)]
    actual = flash_attention_backward(*far[:4], lse, far[4], causal=True)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


def test_backward_uses_64_bit_offsets_when_the_head_dim_is_the_outer_axis():
    # Storage laid out (D, T) per tensor with a head-dim stride of 50M elements: col * stride_d passes 2**31
    # for col >= 43. Four views into one random buffer (they may overlap: only their values matter here).
    T, D, stride_d = 256, 64, 50 * 2**20
    gen = torch.Generator(device="cuda").manual_seed(6)
    base = torch.randn((D - 1) * stride_d + 4 * T, device="cuda", generator=gen).to(BF16)
    q, k, v, do = (base.as_strided((1, 1, T, D), (T, T, 1, stride_d), i * T) for i in range(4))
    o, lse = flash_attention(q, k, v, causal=True)
    expected = flash_attention_backward(*(t.contiguous() for t in (q, k, v, o, lse, do)), causal=True)
    actual = flash_attention_backward(q, k, v, o, lse, do, causal=True)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)

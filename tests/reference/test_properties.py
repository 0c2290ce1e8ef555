"""Hypothesis: random shapes, blocks and masks, always against the dense float64 formula."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashtile.reference.backward import flash_attention_backward
from flashtile.reference.forward import flash_attention_forward
from flashtile.reference.online_softmax import lse_from_stats, merge, online_softmax_stats
from tests._truth import attention_truth

# Examples per run: the hypothesis profile of the root conftest (60, or 300 in make test-long).
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def attention_problem(draw):
    H_kv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4]))
    shape = dict(
        B=draw(st.integers(1, 2)),
        H=H_kv * group,
        H_kv=H_kv,
        Tq=draw(st.integers(1, 40)),
        Tk=draw(st.integers(1, 40)),
        D=draw(st.integers(1, 12)),
    )
    causal = draw(st.booleans())
    alignment = draw(st.sampled_from(["upper_left", "lower_right"]))
    block_q = draw(st.integers(1, 33))
    block_k = draw(st.integers(1, 33))
    seed = draw(st.integers(0, 2**31 - 1))
    return shape, causal, alignment, block_q, block_k, seed


def make_inputs(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    B, H, H_kv, Tq, Tk, D = (shape[n] for n in ("B", "H", "H_kv", "Tq", "Tk", "D"))
    q = torch.randn(B, H, Tq, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, H_kv, Tk, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H_kv, Tk, D, generator=gen, dtype=torch.float64)
    do = torch.randn(B, H, Tq, D, generator=gen, dtype=torch.float64)
    return q, k, v, do


@SETTINGS
@given(attention_problem())
def test_tiled_forward_and_backward_match_dense_attention(problem):
    shape, causal, alignment, block_q, block_k, seed = problem
    q, k, v, do = make_inputs(shape, seed)
    o, lse = flash_attention_forward(q, k, v, causal, None, block_q, block_k, alignment)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = attention_truth(qr, kr, vr, causal, None, alignment)
    torch.testing.assert_close(o, o_ref.detach(), rtol=0, atol=1e-12)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    torch.testing.assert_close(lse.nan_to_num(neginf=0), lse_ref.detach().nan_to_num(neginf=0), rtol=0, atol=1e-12)

    grads = flash_attention_backward(q, k, v, o, lse, do, causal, None, block_q, block_k, alignment)
    expected = torch.autograd.grad(o_ref, (qr, kr, vr), do, allow_unused=True)
    for got, want in zip(grads, expected):
        want = torch.zeros_like(got) if want is None else want
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-11)


@SETTINGS
@given(
    n=st.integers(1, 200),
    block=st.integers(1, 64),
    split=st.integers(0, 200),
    spread=st.floats(0.1, 500.0),
    seed=st.integers(0, 2**31 - 1),
    n_inf=st.integers(0, 200),
)
def test_streamed_and_merged_stats_equal_logsumexp(n, block, split, spread, seed, n_inf):
    gen = torch.Generator().manual_seed(seed)
    x = spread * torch.randn(3, n, generator=gen, dtype=torch.float64)
    x[0, : min(n_inf, n)] = float("-inf")  # part (or all) of a row masked out
    expected = torch.logsumexp(x, -1)
    m, l = online_softmax_stats(x, block)
    lse = lse_from_stats(m, l)
    assert not torch.isnan(lse).any()
    torch.testing.assert_close(lse, expected, rtol=0, atol=1e-11)
    split = min(split, n - 1) if n > 1 else 0
    if split > 0:
        left, right = online_softmax_stats(x[:, :split], block), online_softmax_stats(x[:, split:], block)
        merged = lse_from_stats(*merge(*left, *right))
        torch.testing.assert_close(merged, expected, rtol=0, atol=1e-11)

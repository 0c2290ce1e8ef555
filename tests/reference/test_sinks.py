"""Attention sinks on the reference tier, each step against the dense float64 softmax with one extra column."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashtile.reference.backward import backward_delta, flash_attention_backward
from flashtile.reference.forward import flash_attention_forward
from flashtile.reference.merge import merge_partials
from flashtile.reference.sinks import merge_sink, sink_gradient, sink_start_state
from tests.reference._sink_truth import dense_attention

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def inputs(gen, B, H, H_kv, Tq, Tk, d_qk, d_v, dtype=torch.float64):
    q = torch.randn(B, H, Tq, d_qk, generator=gen, dtype=dtype)
    k = torch.randn(B, H_kv, Tk, d_qk, generator=gen, dtype=dtype)
    v = torch.randn(B, H_kv, Tk, d_v, generator=gen, dtype=dtype)
    do = torch.randn(B, H, Tq, d_v, generator=gen, dtype=dtype)
    return q, k, v, do


def sinks_for(gen, H, dtype=torch.float64):
    return 2 * torch.randn(H, generator=gen, dtype=dtype)


def tiled(q, k, v, do, sinks, block_q, block_k, **mask):
    """The reference tier's o, lse and (dq, dk, dv, dsinks): the backward as without a sink, plus dsink."""
    o, lse = flash_attention_forward(q, k, v, block_q=block_q, block_k=block_k, sinks=sinks, **mask)
    dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do, block_q=block_q, block_k=block_k, **mask)
    dsinks = None if sinks is None else sink_gradient(sinks, lse, backward_delta(o, do))
    return o, lse, (dq, dk, dv, dsinks)


def truth_with_grads(q, k, v, do, sinks, **mask):
    """The dense formula's o, lse and its float64 autograd gradients with respect to q, k, v and the sinks."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    o, lse = dense_attention(*leaves[:3], sinks=leaves[3], **mask)
    grads = torch.autograd.grad(o, leaves, do.double())
    return o.detach(), lse.detach(), grads


CASES = [  # (B, H, H_kv, Tq, Tk, d_qk, d_v), mask, (block_q, block_k)
    ((1, 2, 2, 9, 9, 8, 8), {}, (4, 4)),
    ((2, 4, 2, 13, 17, 6, 6), dict(causal=True), (5, 3)),  # GQA, upper-left
    ((1, 4, 1, 11, 7, 5, 5), dict(causal=True, alignment="lower_right"), (4, 3)),  # rows with no key
    ((1, 2, 1, 16, 16, 8, 8), dict(causal=True, window=(3, 0), softcap=1.5), (4, 4)),
    ((1, 2, 2, 10, 14, 12, 4), dict(window=(2, 5), alignment="lower_right", scale=0.7), (3, 6)),
]


@pytest.mark.parametrize("shape, mask, blocks", CASES)
def test_forward_and_backward_match_the_dense_softmax_with_a_sink_column(shape, mask, blocks):
    B, H, H_kv, Tq, Tk, d_qk, d_v = shape
    gen = torch.Generator().manual_seed(sum(shape))
    q, k, v, do = inputs(gen, *shape)
    sinks = sinks_for(gen, H)
    o, lse, grads = tiled(q, k, v, do, sinks, *blocks, **mask)
    o_ref, lse_ref, grads_ref = truth_with_grads(q, k, v, do, sinks, **mask)
    assert torch.allclose(o, o_ref, rtol=0, atol=1e-13)
    assert torch.allclose(lse, lse_ref, rtol=0, atol=1e-13)
    for name, g, g_ref in zip(("dq", "dk", "dv", "dsinks"), grads, grads_ref):
        assert g.shape == g_ref.shape, name
        assert torch.allclose(g, g_ref, rtol=1e-11, atol=1e-12), name


def test_the_sink_changes_the_answer_so_the_test_above_can_fail():
    """Control: the same inputs without the sink's column differ from the truth with it."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, do = inputs(gen, 1, 2, 2, 9, 9, 8, 8)
    sinks = torch.tensor([1.0, 2.0], dtype=torch.float64)
    o, lse, _ = tiled(q, k, v, do, None, 4, 4)
    o_ref, lse_ref, _ = truth_with_grads(q, k, v, do, sinks)
    assert (o - o_ref).abs().max() > 1e-2 and (lse - lse_ref).abs().min() > 1e-3


def test_lse_is_the_log_of_the_whole_normaliser_including_the_sink():
    gen = torch.Generator().manual_seed(6)
    q, k, v, _ = inputs(gen, 1, 3, 3, 5, 6, 4, 4)
    sinks = torch.tensor([-1.0, 0.0, 3.0], dtype=torch.float64)
    _, lse = flash_attention_forward(q, k, v, block_q=2, block_k=4, sinks=sinks)
    s = torch.einsum("bhid,bhjd->bhij", q, k) / 2  # tau = 1 / sqrt(4)
    normaliser = torch.exp(s).sum(-1) + torch.exp(sinks)[None, :, None]
    assert torch.allclose(lse, torch.log(normaliser), rtol=0, atol=1e-13)


def test_a_row_that_sees_no_key_gets_o_zero_lse_sink_and_no_gradient():
    gen = torch.Generator().manual_seed(7)
    q, k, v, do = inputs(gen, 1, 2, 2, 8, 3, 4, 4)  # lower-right, Tq > Tk: rows 0..4 see no key
    sinks = torch.tensor([0.5, -2.0], dtype=torch.float64)
    o, lse, (dq, dk, dv, dsinks) = tiled(q, k, v, do, sinks, 3, 2, causal=True, alignment="lower_right")
    blind = slice(0, 5)
    assert torch.equal(o[:, :, blind], torch.zeros_like(o[:, :, blind]))
    assert torch.equal(lse[:, :, blind], sinks[None, :, None].expand(1, 2, 5))
    assert torch.equal(dq[:, :, blind], torch.zeros_like(dq[:, :, blind]))
    # the blind rows add nothing to dsink: the gradient from the rows that see keys alone is the same
    only_seeing = sink_gradient(sinks, lse[:, :, 5:], backward_delta(o[:, :, 5:], do[:, :, 5:]))
    assert torch.equal(dsinks, only_seeing)
    _, _, grads_ref = truth_with_grads(q, k, v, do, sinks, causal=True, alignment="lower_right")
    assert torch.allclose(dsinks, grads_ref[3], rtol=1e-11, atol=1e-12)


def test_the_start_state_is_m_sink_l_one_and_minus_inf_is_the_empty_state():
    sinks = torch.tensor([0.25, float("-inf"), -3.0], dtype=torch.float32)
    m, l = sink_start_state(sinks, (2, 3, 4))
    assert m.shape == l.shape == (2, 3, 4) and m.dtype == l.dtype == torch.float64
    assert torch.equal(m[:, 0], torch.full((2, 4), 0.25, dtype=torch.float64))
    assert torch.equal(l[:, 0], torch.ones(2, 4, dtype=torch.float64))
    assert torch.isneginf(m[:, 1]).all() and torch.equal(l[:, 1], torch.zeros(2, 4, dtype=torch.float64))
    assert torch.equal(l[:, 2], torch.ones(2, 4, dtype=torch.float64))


@st.composite
def sink_problem(draw, with_mask=True):
    H_kv = draw(st.integers(1, 2))
    H = H_kv * draw(st.sampled_from([1, 2, 3]))
    shape = (draw(st.integers(1, 2)), H, H_kv, draw(st.integers(1, 12)), draw(st.integers(1, 12)),
             draw(st.integers(1, 6)), draw(st.integers(1, 6)))  # fmt: skip
    mask = {}
    if with_mask:
        mask = dict(
            causal=draw(st.booleans()),
            alignment=draw(st.sampled_from(["upper_left", "lower_right"])),
            window=draw(st.sampled_from([None, (2, 1), (0, -1), (4, 0)])),
            softcap=draw(st.sampled_from([None, 2.0])),
        )
    blocks = (draw(st.integers(1, 7)), draw(st.integers(1, 7)))
    seed = draw(st.integers(0, 2**31 - 1))
    return shape, mask, blocks, seed


@SETTINGS
@given(sink_problem())
def test_a_sink_of_minus_inf_is_no_sink(problem):
    shape, mask, blocks, seed = problem
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = inputs(gen, *shape)
    none = torch.full((shape[1],), float("-inf"), dtype=torch.float64)
    o, lse, (dq, dk, dv, dsinks) = tiled(q, k, v, do, none, *blocks, **mask)
    o0, lse0, (dq0, dk0, dv0, _) = tiled(q, k, v, do, None, *blocks, **mask)
    for got, expected in ((o, o0), (lse, lse0), (dq, dq0), (dk, dk0), (dv, dv0)):
        assert torch.equal(got, expected)
    assert torch.equal(dsinks, torch.zeros_like(dsinks))
    o_merged, lse_merged = merge_sink(o0, lse0, none)  # merged at the end, it is no part at all
    assert torch.equal(o_merged, o0) and torch.equal(lse_merged, lse0)


@SETTINGS
@given(sink_problem())
def test_the_tiled_sink_matches_the_dense_formula_with_its_gradients(problem):
    shape, mask, blocks, seed = problem
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = inputs(gen, *shape)
    sinks = sinks_for(gen, shape[1])
    o, lse, grads = tiled(q, k, v, do, sinks, *blocks, **mask)
    o_ref, lse_ref, grads_ref = truth_with_grads(q, k, v, do, sinks, **mask)
    assert torch.allclose(o, o_ref, rtol=0, atol=1e-12)
    assert torch.allclose(lse, lse_ref, rtol=0, atol=1e-12)
    for g, g_ref in zip(grads, grads_ref):
        assert torch.allclose(g, g_ref, rtol=1e-10, atol=1e-11)


@SETTINGS
@given(sink_problem(with_mask=False), st.booleans())
def test_a_sink_equals_one_more_key_whose_value_is_zero_and_whose_score_is_the_sink(problem, lower_right):
    """Built with the tiled code without sinks: every key gets one more coordinate, 0, and each query a 1; the
    extra key is 0 everywhere but that coordinate, sink_h / tau, so its score is sink_h in every row of head h;
    its value is zero. It goes first, and lower-right causal (Tq <= Tk) keeps every row seeing it."""
    (B, H, _H_kv, Tq, Tk, d_qk, d_v), _, blocks, seed = problem
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = inputs(gen, B, H, H, Tq, Tk, d_qk, d_v)  # MHA: each head has its own extra key
    sinks = sinks_for(gen, H)
    tau = 0.8
    mask = dict(causal=True, alignment="lower_right") if lower_right and Tq <= Tk else {}
    q1 = torch.cat([q, torch.ones(B, H, Tq, 1, dtype=q.dtype)], dim=-1)
    sink_key = torch.zeros(B, H, 1, d_qk + 1, dtype=q.dtype)
    sink_key[..., -1] = sinks[None, :, None] / tau
    k1 = torch.cat([sink_key, torch.cat([k, torch.zeros(B, H, Tk, 1, dtype=q.dtype)], dim=-1)], dim=2)
    v1 = torch.cat([torch.zeros(B, H, 1, d_v, dtype=q.dtype), v], dim=2)
    o1, lse1, (dq1, dk1, dv1, _) = tiled(q1, k1, v1, do, None, *blocks, scale=tau, **mask)
    o, lse, (dq, dk, dv, dsinks) = tiled(q, k, v, do, sinks, *blocks, scale=tau, **mask)
    assert torch.allclose(o, o1, rtol=0, atol=1e-12) and torch.allclose(lse, lse1, rtol=0, atol=1e-12)
    assert torch.allclose(dq, dq1[..., :d_qk], rtol=1e-10, atol=1e-11)
    assert torch.allclose(dk, dk1[:, :, 1:, :d_qk], rtol=1e-10, atol=1e-11)
    assert torch.allclose(dv, dv1[:, :, 1:], rtol=1e-10, atol=1e-11)
    # the extra key's last coordinate is sink / tau, so dsink = dk1[sink key, last] / tau
    assert torch.allclose(dsinks, dk1[:, :, 0, -1].sum(0) / tau, rtol=1e-10, atol=1e-11)


@SETTINGS
@given(sink_problem(), st.integers(1, 3), st.data())
def test_split_states_merged_with_the_sink_counted_once_equal_the_whole(problem, parts, data):
    shape, mask, blocks, seed = problem
    mask = {**mask, "causal": False, "window": None}  # a split of the keys: each part sees all of its keys
    gen = torch.Generator().manual_seed(seed)
    q, k, v, _ = inputs(gen, *shape)
    sinks = sinks_for(gen, shape[1])
    Tk = shape[4]
    cuts = sorted(data.draw(st.lists(st.integers(1, max(Tk - 1, 1)), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *[c for c in cuts if 0 < c < Tk], Tk]
    bounds = sorted(set(bounds))
    o_whole, lse_whole = flash_attention_forward(q, k, v, block_q=blocks[0], block_k=blocks[1], sinks=sinks, **mask)
    pieces = []
    for n, (s, e) in enumerate(zip(bounds, bounds[1:])):
        first = sinks if n == 0 else None  # only the first part starts from the sink
        pieces.append(flash_attention_forward(q, k[:, :, s:e], v[:, :, s:e], block_q=blocks[0], block_k=blocks[1],
                                              sinks=first, **mask))  # fmt: skip
    o, lse = pieces[0]
    for o_b, lse_b in pieces[1:]:
        o, lse = merge_partials(o, lse, o_b, lse_b)
    assert torch.allclose(o, o_whole, rtol=0, atol=1e-12) and torch.allclose(lse, lse_whole, rtol=0, atol=1e-12)
    # the other way to count it once: merge every part without it, then the sink as a part of its own
    o_none, lse_none = flash_attention_forward(q, k, v, block_q=blocks[0], block_k=blocks[1], **mask)
    o_late, lse_late = merge_sink(o_none, lse_none, sinks)
    assert torch.allclose(o_late, o_whole, rtol=0, atol=1e-12)
    assert torch.allclose(lse_late, lse_whole, rtol=0, atol=1e-12)


def test_a_sink_counted_twice_is_wrong():
    """Control for the merge property: every part starting from the sink counts it once per part."""
    gen = torch.Generator().manual_seed(8)
    q, k, v, _ = inputs(gen, 1, 2, 2, 6, 10, 4, 4)
    sinks = torch.tensor([1.0, 0.5], dtype=torch.float64)
    o_whole, lse_whole = flash_attention_forward(q, k, v, sinks=sinks)
    a = flash_attention_forward(q, k[:, :, :5], v[:, :, :5], sinks=sinks)
    b = flash_attention_forward(q, k[:, :, 5:], v[:, :, 5:], sinks=sinks)
    o, lse = merge_partials(*a, *b)
    twice = torch.logsumexp(torch.stack([lse_whole, sinks[None, :, None].expand_as(lse_whole)]), dim=0)
    assert torch.allclose(lse, twice, rtol=0, atol=1e-13)  # the whole normaliser plus e^sink once more
    assert (o - o_whole).abs().max() > 1e-3


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_16_and_32_bit_inputs_take_float32_or_their_own_dtype_for_the_sinks(dtype, atol):
    gen = torch.Generator().manual_seed(9)
    q, k, v, do = inputs(gen, 1, 2, 1, 7, 9, 8, 8, dtype=dtype)
    for sinks_dtype in dict.fromkeys((torch.float32, dtype)):
        sinks = torch.tensor([0.3, -1.2], dtype=sinks_dtype)
        o, lse, (*_, dsinks) = tiled(q, k, v, do, sinks, 4, 4, causal=True)
        o_ref, lse_ref, grads_ref = truth_with_grads(q, k, v, do, sinks, causal=True)
        assert o.dtype == dtype and lse.dtype == torch.float32 and dsinks.dtype == sinks_dtype
        assert torch.allclose(o.double(), o_ref, rtol=0, atol=atol)
        assert torch.allclose(lse.double(), lse_ref, rtol=0, atol=1e-5)
        assert torch.allclose(dsinks.double(), grads_ref[3], rtol=0, atol=50 * atol)


BAD_SINKS = [
    ("a list", [0.0, 1.0], TypeError, r"sinks must be a torch.Tensor, got list"),
    ("rank 2", torch.zeros(1, 2, dtype=torch.float64), ValueError, r"sinks must be a rank-1 tensor"),
    ("one per kv head", torch.zeros(1, dtype=torch.float64), ValueError, r"sinks must have shape \(H,\) = \(2,\)"),
    ("int", torch.zeros(2, dtype=torch.int64), TypeError, r"sinks must have dtype in \(float32, float64\)"),
    ("float16 for float64 q", torch.zeros(2, dtype=torch.float16), TypeError, r"sinks must have dtype in"),
    ("+inf", torch.tensor([0.0, math.inf], dtype=torch.float64), ValueError, r"sinks must be finite or -inf"),
    ("NaN", torch.tensor([math.nan, 0.0], dtype=torch.float64), ValueError, r"sinks must be finite or -inf"),
    ("another device", torch.zeros(2, dtype=torch.float64, device="meta"), ValueError, r"sinks is on meta"),
]


@pytest.mark.parametrize("name, sinks, error, message", BAD_SINKS, ids=[c[0] for c in BAD_SINKS])
def test_bad_sinks_get_a_clear_error(name, sinks, error, message):
    q, k, v, _ = inputs(torch.Generator().manual_seed(0), 1, 2, 1, 3, 3, 4, 4)
    with pytest.raises(error, match=message):
        flash_attention_forward(q, k, v, sinks=sinks)


def test_reference_attention_takes_sinks_through_autograd_gradcheck_and_refuses_a_second_derivative():
    from flashtile.reference.autograd import reference_attention

    gen = torch.Generator().manual_seed(10)
    q, k, v, _ = inputs(gen, 1, 2, 1, 5, 6, 4, 3)
    sinks = torch.tensor([0.3, -0.5], dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (q, k, v, sinks)]
    call = lambda q, k, v, s: reference_attention(q, k, v, True, None, 2, 4, "lower_right", window=(2, 0), sinks=s)
    assert torch.autograd.gradcheck(call, leaves)
    o = call(*leaves)
    dsinks = torch.autograd.grad(o.sum(), leaves[3], create_graph=True)[0]
    _, _, grads_ref = truth_with_grads(q, k, v, torch.ones_like(o), sinks, causal=True, alignment="lower_right",
                                       window=(2, 0))  # fmt: skip
    assert torch.allclose(dsinks, grads_ref[3], rtol=1e-12, atol=1e-13)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(dsinks.sum(), leaves[0])

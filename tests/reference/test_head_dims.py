"""Unequal head dims d_qk != d_v on the reference tier: forward, backward, FLOPs and HBM traffic, each against a
formula written here."""

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from flashtile.reference.backward import flash_attention_backward
from flashtile.reference.forward import flash_attention_forward
from flashtile.reference.head_dims import head_dim_flops
from flashtile.reference.io_model import (
    flash_attention_traffic,
    flash_traffic_qk_v,
    paper_tile_sizes,
    query_outer_traffic,
    query_outer_traffic_qk_v,
    standard_attention_traffic,
    standard_traffic_qk_v,
    tile_sizes_qk_v,
)
from tests.reference._sink_truth import dense_attention

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def inputs(gen, B, H, H_kv, Tq, Tk, d_qk, d_v):
    q = torch.randn(B, H, Tq, d_qk, generator=gen, dtype=torch.float64)
    k = torch.randn(B, H_kv, Tk, d_qk, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H_kv, Tk, d_v, generator=gen, dtype=torch.float64)
    do = torch.randn(B, H, Tq, d_v, generator=gen, dtype=torch.float64)
    return q, k, v, do


@pytest.mark.parametrize(
    "shape, mask",
    [
        ((1, 2, 2, 9, 11, 24, 16), {}),  # MLA's 3:2 in miniature
        ((2, 4, 2, 13, 13, 8, 4), dict(causal=True)),
        ((1, 3, 1, 7, 12, 4, 10), dict(causal=True, alignment="lower_right", window=(3, 0), softcap=2.0)),
        ((1, 2, 1, 12, 5, 6, 1), dict(causal=True, alignment="lower_right")),  # d_v = 1, blind rows
    ],
)
def test_forward_and_backward_match_the_dense_formula_with_d_v_apart(shape, mask):
    gen = torch.Generator().manual_seed(sum(shape))
    q, k, v, do = inputs(gen, *shape)
    o, lse = flash_attention_forward(q, k, v, block_q=5, block_k=3, **mask)
    grads = flash_attention_backward(q, k, v, o, lse, do, block_q=5, block_k=3, **mask)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o_ref, lse_ref = dense_attention(*leaves, **mask)
    grads_ref = torch.autograd.grad(o_ref, leaves, do)
    assert o.shape == (*q.shape[:-1], v.shape[-1])
    assert torch.allclose(o, o_ref, rtol=0, atol=1e-13) and torch.allclose(lse, lse_ref, rtol=0, atol=1e-13)
    for name, g, g_ref, like in zip(("dq", "dk", "dv"), grads, grads_ref, (q, k, v)):
        assert g.shape == like.shape, name
        assert torch.allclose(g, g_ref, rtol=1e-11, atol=1e-12), name


def test_the_default_scale_is_one_over_the_root_of_d_qk():
    gen = torch.Generator().manual_seed(3)
    q, k, v, _ = inputs(gen, 1, 1, 1, 4, 4, 9, 4)
    o, _ = flash_attention_forward(q, k, v)
    assert torch.allclose(o, dense_attention(q, k, v, scale=1 / 3)[0], rtol=0, atol=1e-14)
    assert not torch.allclose(o, dense_attention(q, k, v, scale=1 / 2)[0], rtol=0, atol=1e-3)  # not 1/sqrt(d_v)


@st.composite
def head_dim_problem(draw):
    H_kv = draw(st.integers(1, 2))
    shape = (draw(st.integers(1, 2)), H_kv * draw(st.sampled_from([1, 2])), H_kv, draw(st.integers(1, 10)),
             draw(st.integers(1, 10)), draw(st.integers(1, 9)), draw(st.integers(1, 9)))  # fmt: skip
    mask = dict(
        causal=draw(st.booleans()),
        alignment=draw(st.sampled_from(["upper_left", "lower_right"])),
        window=draw(st.sampled_from([None, (2, 1), (3, 0)])),
        softcap=draw(st.sampled_from([None, 1.5])),
    )
    with_sinks = draw(st.booleans())
    return shape, mask, (draw(st.integers(1, 6)), draw(st.integers(1, 6))), with_sinks, draw(st.integers(0, 2**31 - 1))


@settings(SETTINGS)
@given(head_dim_problem())
def test_d_v_apart_equals_the_padded_computation_with_the_padding_dropped(problem):
    """Pad the narrower side to the wider width: v's extra columns (random) with dO's zero there, or q's extra
    columns (random) against k's zero there. Every dropped column is then invisible to the rest."""
    shape, mask, (block_q, block_k), with_sinks, seed = problem
    B, H, H_kv, Tq, Tk, d_qk, d_v = shape
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = inputs(gen, *shape)
    sinks = torch.randn(H, generator=gen, dtype=torch.float64) if with_sinks else None
    width = max(d_qk, d_v)
    scale = 1 / math.sqrt(d_qk)  # the padded call's default would take the padded width
    q_pad = torch.cat([q, torch.randn(B, H, Tq, width - d_qk, generator=gen, dtype=q.dtype)], dim=-1)
    k_pad = torch.cat([k, torch.zeros(B, H_kv, Tk, width - d_qk, dtype=q.dtype)], dim=-1)
    v_pad = torch.cat([v, torch.randn(B, H_kv, Tk, width - d_v, generator=gen, dtype=q.dtype)], dim=-1)
    do_pad = torch.cat([do, torch.zeros(B, H, Tq, width - d_v, dtype=q.dtype)], dim=-1)
    kw = dict(block_q=block_q, block_k=block_k, scale=scale, **mask)
    o, lse = flash_attention_forward(q, k, v, sinks=sinks, **kw)
    dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do, **kw)
    o_pad, lse_pad = flash_attention_forward(q_pad, k_pad, v_pad, sinks=sinks, **kw)
    dq_pad, dk_pad, dv_pad = flash_attention_backward(q_pad, k_pad, v_pad, o_pad, lse_pad, do_pad, **kw)
    assert torch.allclose(o, o_pad[..., :d_v], rtol=0, atol=1e-13)
    assert torch.allclose(lse, lse_pad, rtol=0, atol=1e-13)
    assert torch.allclose(dq, dq_pad[..., :d_qk], rtol=1e-11, atol=1e-12)
    assert torch.allclose(dk, dk_pad[..., :d_qk], rtol=1e-11, atol=1e-12)
    assert torch.allclose(dv, dv_pad[..., :d_v], rtol=1e-11, atol=1e-12)


def test_the_flops_match_torchs_count_of_the_dense_matmuls():
    """Forward: the two matmuls of the dense formula. Backward: autograd's four, plus the forward's S, which the
    tiled backward computes again."""
    gen = torch.Generator().manual_seed(4)
    Tq, Tk, d_qk, d_v = 6, 10, 12, 5
    q, k, v, do = inputs(gen, 1, 1, 1, Tq, Tk, d_qk, d_v)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with FlopCounterMode(display=False) as forward_count:
        o = torch.softmax(q @ k.mT, dim=-1) @ v
    with FlopCounterMode(display=False) as backward_count:
        torch.autograd.grad(o, (q, k, v), do)
    forward, backward = head_dim_flops(Tq * Tk, d_qk, d_v)
    assert forward == forward_count.get_total_flops() == 2 * Tq * Tk * (d_qk + d_v)
    assert backward == backward_count.get_total_flops() + 2 * Tq * Tk * d_qk
    assert head_dim_flops(Tq * Tk, 64, 64)[1] * 2 == 5 * head_dim_flops(Tq * Tk, 64, 64)[0]  # 2.5x at d_qk = d_v


def simulated_traffic(T, d_qk, d_v, block_q, block_k, order):
    """Elements moved, counted by walking the loops of Algorithm 1 (keys outer) or FlashAttention-2 (queries
    outer) tile by tile: every load and store of a row of width d_qk, d_v or 1 (a statistic)."""
    reads = writes = 0
    q_tiles = [min(block_q, T - s) for s in range(0, T, block_q)]
    k_tiles = [min(block_k, T - s) for s in range(0, T, block_k)]
    if order == "keys_outer":
        for nk in k_tiles:
            reads += nk * d_qk + nk * d_v  # K_c, V_c
            for nq in q_tiles:
                reads += nq * d_qk + nq * d_v + 2 * nq  # Q_r, O_r, l, m
                writes += nq * d_v + 2 * nq  # O_r, l, m
    else:
        for nq in q_tiles:
            reads += nq * d_qk  # Q_r
            for nk in k_tiles:
                reads += nk * d_qk + nk * d_v  # K_c, V_c
            writes += nq * d_v + nq  # O_r, lse
    return reads, writes


@pytest.mark.parametrize("T", [1, 100, 1000, 4099])
@pytest.mark.parametrize("d_qk, d_v, M", [(192, 128, 100_000), (128, 64, 50_000), (16, 48, 1000), (8, 8, 256)])
def test_traffic_with_the_widths_apart_matches_the_loops_walked(T, d_qk, d_v, M):
    block_q, block_k = tile_sizes_qk_v(M, d_qk, d_v)
    assert 2 * block_k * (d_qk + d_v) <= M < 2 * (block_k + 1) * (d_qk + d_v)  # the largest tile that fits
    assert block_q * block_k <= M / 4 and block_q <= block_k
    flash = flash_traffic_qk_v(T, d_qk, d_v, M)
    assert (flash.reads, flash.writes) == simulated_traffic(T, d_qk, d_v, block_q, block_k, "keys_outer")
    outer = query_outer_traffic_qk_v(T, d_qk, d_v, M)
    assert (outer.reads, outer.writes) == simulated_traffic(T, d_qk, d_v, block_k, block_q, "queries_outer")
    standard = standard_traffic_qk_v(T, d_qk, d_v)
    assert standard.total == 2 * T * d_qk + 2 * T * d_v + 4 * T * T


@pytest.mark.parametrize("T", [1, 77, 1024, 5000])
@pytest.mark.parametrize("d, M", [(1, 4), (16, 1000), (64, 100_000), (128, 65_536), (256, 1024)])
def test_equal_widths_give_the_single_width_model_exactly(T, d, M):
    assert tile_sizes_qk_v(M, d, d) == paper_tile_sizes(M, d)
    assert flash_traffic_qk_v(T, d, d, M) == flash_attention_traffic(T, d, M)
    assert query_outer_traffic_qk_v(T, d, d, M) == query_outer_traffic(T, d, M)
    assert standard_traffic_qk_v(T, d, d) == standard_attention_traffic(T, d)


def test_mla_shapes_move_less_than_the_value_padded_to_192():
    """At large T the passes dominate: keys outer ~ 2 T^2 (d_qk + d_v)(d_qk + 2 d_v + 4) / M, queries outer
    2 T^2 (d_qk + d_v)^2 / M, exactly when the tiles divide M and T."""
    M, T = 3840 * 26, 780 * 20  # 2 (d_qk + d_v) divides M for 320 and 384; both tiles divide T
    for d_v in (128, 192):
        width = 192 + d_v
        block = M // (2 * width)
        assert M % (2 * width) == 0 and T % block == 0
        passes = T // block
        assert flash_traffic_qk_v(T, 192, d_v, M).total == T * width + passes * T * (192 + 2 * d_v + 4)
        assert query_outer_traffic_qk_v(T, 192, d_v, M).total == T * 192 + passes * T * width + T * d_v + T
    passes_term = {d_v: query_outer_traffic_qk_v(T, 192, d_v, M).total - T * (192 + d_v + 1) for d_v in (128, 192)}
    assert Fraction(passes_term[128], passes_term[192]) == Fraction(320, 384) ** 2  # the widths' ratio, squared
    assert flash_traffic_qk_v(T, 192, 128, M).total < 0.66 * flash_traffic_qk_v(T, 192, 192, M).total


BAD = [
    ("v too wide", lambda q, k, v: (q, k, torch.zeros(*k.shape[:-1], 257, dtype=q.dtype)), ValueError,
     r"v has head dim d_v = 257; flashtile supports value head dims 1 to 256"),
    ("v shorter than k", lambda q, k, v: (q, k, v[:, :, :2]), ValueError, r"v must have the same shape as k"),
    ("v with other heads", lambda q, k, v: (q, k, torch.cat([v, v], dim=1)), ValueError,
     r"v must have the same shape as k \(1, 1, 4, 6\) in every dim but the last"),
    ("v float32", lambda q, k, v: (q, k, v.float()), TypeError, r"v has dtype torch.float32 but q has"),
    ("v not a tensor", lambda q, k, v: (q, k, v.tolist()), TypeError, r"v must be a torch.Tensor"),
    ("v empty", lambda q, k, v: (q, k, v[..., :0]), ValueError, r"v has head dim d_v = 0"),
]  # fmt: skip


@pytest.mark.parametrize("name, make, error, message", BAD, ids=[b[0] for b in BAD])
def test_bad_value_head_dims_get_a_clear_error(name, make, error, message):
    q, k, v, _ = inputs(torch.Generator().manual_seed(0), 1, 2, 1, 3, 4, 6, 3)
    with pytest.raises(error, match=message):
        flash_attention_forward(*make(q, k, v))


def test_the_backward_wants_o_and_do_in_d_v():
    q, k, v, do = inputs(torch.Generator().manual_seed(1), 1, 2, 1, 3, 4, 6, 3)
    o, lse = flash_attention_forward(q, k, v)
    with pytest.raises(ValueError, match=r"o must have shape \(B, H, Tq, d_v\) = \(1, 2, 3, 3\)"):
        flash_attention_backward(q, k, v, torch.zeros_like(q), lse, do)
    with pytest.raises(ValueError, match=r"do must have shape \(B, H, Tq, d_v\)"):
        flash_attention_backward(q, k, v, o, lse, torch.zeros_like(q))


def test_the_counts_refuse_what_cannot_fit_or_count():
    with pytest.raises(ValueError, match=r"M must hold a row of each of K, V, Q, O: M >= 640, got 639"):
        tile_sizes_qk_v(639, 192, 128)
    assert tile_sizes_qk_v(640, 192, 128) == (1, 1)
    with pytest.raises(ValueError, match=r"d_v"):
        flash_traffic_qk_v(10, 8, 0, 1000)
    with pytest.raises(ValueError, match=r"pairs"):
        head_dim_flops(-1, 8, 8)
    assert head_dim_flops(0, 8, 8) == (0, 0)

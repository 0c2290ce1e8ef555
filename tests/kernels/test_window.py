"""Sliding windows and soft-capping in the Triton forward and backward (``window=``, ``softcap=``).

The truth is the float64 formula through a mask built pair by pair from the definition (``_truth``:
``definition_mask``, ``masked_truth``, ``truth_gradients``), never from ``reference.masks``. The cases are
a pairwise cover of window shapes (both edges, one side unbounded, a zero-width band, wider than T),
causal, alignment with Tq != Tk both ways, ragged T, softcap, head dim, GQA and dtype, in 16 x 16 tiles
so that FULL, DIAGONAL and SKIP tiles all occur. Poison tests show the SKIP tiles are never read; bad
windows and caps are refused by name by the launchers (the API's tiers: tests/test_api.py). GPU-marked
tests run bf16 at realistic sizes.
"""

from __future__ import annotations

import pytest
import torch

from flashtile._spec import check_mask
from flashtile.kernels._host import KernelMask, kernel_mask
from flashtile.kernels.backward import flash_attention_backward
from flashtile.kernels.forward import flash_attention
from tests._grids import covering
from tests._truth import assert_close_to_truth, definition_mask, masked_truth, truth_gradients

from ._helpers import FORWARD_TOL, LSE_TOL, ON_GPU, randn

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
GRAD_TOL = {F32: dict(atol=1e-4, rtol=1e-4), F16: dict(atol=1e-2, rtol=1e-2), BF16: dict(atol=5e-2, rtol=5e-2)}

WINDOWS = {  # (left, right); with 16 x 16 tiles
    "band": (20, 3),  # FULL tiles between two DIAGONAL edges
    "narrow": (5, 0),  # most tiles SKIP
    "zero": (0, 0),  # each query sees one key at most
    "left_open": (-1, 6),  # only a right edge
    "right_open": (9, -1),  # only a left edge
    "wider_than_T": (200, 150),  # no pair masked
}
SHAPES = {  # (Tq, Tk, alignment): ragged in both, Tq != Tk both ways under each alignment
    "45x45_ul": (45, 45, "upper_left"),
    "30x70_lr": (30, 70, "lower_right"),
    "70x30_lr": (70, 30, "lower_right"),
    "33x60_ul": (33, 60, "upper_left"),
}


def make_inputs(B, H, H_kv, Tq, Tk, D, dtype, seed, spread=1.5):
    """q and k scaled by ``spread`` (1.5: scores of a few units, where a cap of 2.5 bends them), v and do N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = randn(B, H, Tq, D, dtype=dtype, generator=gen) * spread
    k = randn(B, H_kv, Tk, D, dtype=dtype, generator=gen) * spread
    v = randn(B, H_kv, Tk, D, dtype=dtype, generator=gen)
    do = randn(B, H, Tq, D, dtype=dtype, generator=gen)
    return q, k, v, do


def truth(q, k, v, do, window, causal, alignment, softcap, scale=None):
    """(o, lse), (dq, dk, dv) in float64 from the (rounded) inputs, through the definition's mask."""
    keep = definition_mask(q.shape[2], k.shape[2], window, causal, alignment).to(q.device)
    q, k, v, do = (t.double() for t in (q, k, v, do))
    o, lse = masked_truth(q, k, v, keep, scale, softcap)
    return (o, lse), truth_gradients(q, k, v, do, keep, scale, softcap)


@pytest.mark.parametrize(
    "left,right,causal,Tq,Tk,alignment,softcap,D,H,H_kv,dtype",
    covering(window=WINDOWS, causal=[False, True], shape=SHAPES, softcap=[None, 2.5], D=[16, 64],
             heads={"mha": (2, 2), "gqa": (4, 2)}, dtype={"fp32": F32, "fp16": F16}),  # fmt: skip
)
def test_window_forward_and_backward_match_the_float64_definition(left, right, causal, Tq, Tk, alignment, softcap, D,
                                                                  H, H_kv, dtype):  # fmt: skip
    window = (left, right)
    q, k, v, do = make_inputs(1, H, H_kv, Tq, Tk, D, dtype, seed=Tq * 7 + Tk + D)
    o, lse, stats = flash_attention(q, k, v, causal=causal, scale=None, alignment=alignment, block_q=16, block_k=16,
                                    return_stats=True, window=window, softcap=softcap)  # fmt: skip
    grads = flash_attention_backward(q, k, v, o, lse, do, causal=causal, scale=None, block_q=16, block_k=16,
                                     alignment=alignment, stats=stats, window=window, softcap=softcap)  # fmt: skip
    (o_ref, lse_ref), grads_ref = truth(q, k, v, do, window, causal, alignment, softcap)
    assert o.dtype == dtype and lse.dtype == F32
    assert_close_to_truth(o, o_ref, "o", **FORWARD_TOL[dtype])
    assert_close_to_truth(lse, lse_ref, "lse", **LSE_TOL[dtype])
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert g.dtype == dtype, name
        assert_close_to_truth(g, g_ref, name, **GRAD_TOL[dtype])


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic_dq"])
def test_window_backward_from_lse_alone_in_both_dq_modes(deterministic):
    """Without the forward's stats the backward derives (m, l) from lse; under a cap the kernels' scores are
    in natural units, so m = lse there (a raw-dot m = lse / |τ| would be off by the scale)."""
    q, k, v, do = make_inputs(1, 2, 1, 40, 52, 16, F32, seed=3)
    window, softcap, scale = (11, 4), 1.5, 0.7
    o, lse = flash_attention(q, k, v, causal=False, scale=scale, alignment="lower_right", block_q=16, block_k=16,
                             window=window, softcap=softcap)  # fmt: skip
    grads = flash_attention_backward(q, k, v, o, lse, do, causal=False, scale=scale, block_q=16, block_k=16,
                                     alignment="lower_right", window=window, softcap=softcap,
                                     deterministic=deterministic)  # fmt: skip
    _, grads_ref = truth(q, k, v, do, window, False, "lower_right", softcap, scale)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close_to_truth(g, g_ref, name, **GRAD_TOL[F32])


@pytest.mark.parametrize(("block_q", "block_k"), [(32, 16), (16, 32)])
def test_window_with_query_and_key_tiles_of_different_sizes(block_q, block_k):
    """The band's tile bounds take BLOCK_Q and BLOCK_K apart (first_key_tile, band_query_tiles): a swap of the
    two in any of them shows only when they differ."""
    q, k, v, do = make_inputs(1, 2, 2, 75, 61, 16, F32, seed=block_q)
    o, lse = flash_attention(q, k, v, causal=False, scale=None, alignment="lower_right", block_q=block_q,
                             block_k=block_k, window=(21, 5))  # fmt: skip
    grads = flash_attention_backward(q, k, v, o, lse, do, causal=False, scale=None, block_q=block_q, block_k=block_k,
                                     alignment="lower_right", window=(21, 5))  # fmt: skip
    (o_ref, lse_ref), grads_ref = truth(q, k, v, do, (21, 5), False, "lower_right", None)
    assert_close_to_truth(o, o_ref, "o", **FORWARD_TOL[F32])
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close_to_truth(g, g_ref, name, **GRAD_TOL[F32])


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic_dq"])
def test_window_with_the_gqa_group_split_over_programs(deterministic, monkeypatch):
    """On the GPU a small GQA grid shares each (key tile, kv head) over several dK/dV programs (``pick_kv_split``);
    forced here, each part must walk the same band of query tiles and add up to the whole group's gradient."""
    from flashtile import _plans
    from flashtile.kernels import backward

    monkeypatch.setattr(_plans, "_plans", {})  # no plan made before the patch is reused
    monkeypatch.setattr(backward, "pick_kv_split", lambda group, programs, device: group)
    q, k, v, do = make_inputs(1, 4, 1, 40, 40, 16, F32, seed=13)
    o, lse = flash_attention(q, k, v, causal=True, scale=None, alignment="upper_left", block_q=16, block_k=16,
                             window=(9, -1), softcap=2.0)  # fmt: skip
    grads = flash_attention_backward(q, k, v, o, lse, do, causal=True, scale=None, block_q=16, block_k=16,
                                     window=(9, -1), softcap=2.0, deterministic=deterministic)  # fmt: skip
    assert any(getattr(plan, "kv_split", None) == 4 for plan in _plans._plans.values())  # the split did run
    _, grads_ref = truth(q, k, v, do, (9, -1), True, "upper_left", 2.0)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close_to_truth(g, g_ref, name, **GRAD_TOL[F32])


def test_softcap_stays_exact_where_it_barely_bends_and_where_it_saturates():
    """A cap of 1e4 over scores of a few units (tanh(x / c) ~ x / c: the kernel's tanh must keep its relative
    accuracy near 0, where 1 - exp(-2y) cancels) and a cap of 0.05 (tanh saturated, derivative ~ 0)."""
    q, k, v, do = make_inputs(1, 1, 1, 40, 40, 16, F32, seed=5)
    for softcap in (1e4, 0.05):
        o, lse = flash_attention(q, k, v, causal=False, scale=None, alignment="upper_left", block_q=16, block_k=16,
                                 window=(7, 7), softcap=softcap)  # fmt: skip
        grads = flash_attention_backward(q, k, v, o, lse, do, causal=False, scale=None, block_q=16, block_k=16,
                                         window=(7, 7), softcap=softcap)  # fmt: skip
        (o_ref, lse_ref), grads_ref = truth(q, k, v, do, (7, 7), False, "upper_left", softcap)
        assert_close_to_truth(o, o_ref, f"o, cap {softcap}", **FORWARD_TOL[F32])
        assert_close_to_truth(lse, lse_ref, f"lse, cap {softcap}", **LSE_TOL[F32])
        for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
            assert_close_to_truth(g, g_ref, f"{name}, cap {softcap}", **GRAD_TOL[F32])


def test_rows_whose_window_holds_no_key_give_zero_and_minus_inf():
    """Lower-right, Tq = 50 > Tk = 20, window (3, 0): rows 0..29 sit before the first key's diagonal and see
    nothing: o = 0, lse = -inf, dq = 0, exactly."""
    q, k, v, do = make_inputs(1, 2, 2, 50, 20, 16, F32, seed=6)
    o, lse = flash_attention(q, k, v, causal=False, scale=None, alignment="lower_right", block_q=16, block_k=16,
                             window=(3, 0))  # fmt: skip
    dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do, causal=False, scale=None, block_q=16, block_k=16,
                                          alignment="lower_right", window=(3, 0))  # fmt: skip
    assert torch.equal(o[:, :, :30], torch.zeros_like(o[:, :, :30])) and torch.isneginf(lse[:, :, :30]).all()
    assert torch.equal(dq[:, :, :30], torch.zeros_like(dq[:, :, :30]))
    (o_ref, lse_ref), grads_ref = truth(q, k, v, do, (3, 0), False, "lower_right", None)
    assert_close_to_truth(lse, lse_ref, "lse", **LSE_TOL[F32])
    for name, g, g_ref in zip(("dq", "dk", "dv"), (dq, dk, dv), grads_ref):
        assert_close_to_truth(g, g_ref, name, **GRAD_TOL[F32])


# --- SKIP tiles are never read: poison them ---------------------------------------------------------
# T = 96, window (5, 3), upper-left, 16 x 16 tiles. Query tile [32, 48) sees keys 27..50, so it visits key
# tiles 1..3 (keys 16..63); key tile [48, 64) is seen by rows 45..68, query tiles 2..4 (rows 32..79).


def poison_inputs(seed):
    q, k, v, do = make_inputs(1, 1, 1, 96, 96, 16, F32, seed=seed)
    (o, lse), _ = truth(q, k, v, do, (5, 3), False, "upper_left", None)
    return q, k, v, do, o.float(), lse.float()


@pytest.mark.parametrize("one_too_many", [False, True], ids=["skip_tiles", "control"])
def test_forward_and_dq_never_read_key_tiles_outside_the_band(one_too_many):
    q, k, v, do, o, lse = poison_inputs(seed=7)
    poison = torch.ones(96, dtype=torch.bool)
    poison[16:64] = False  # the tiles query tile [32, 48) visits
    if one_too_many:  # key 16: inside a visited (DIAGONAL) tile, outside the rows' band: loaded, so NaN arrives
        poison[16] = True
    k[:, :, poison], v[:, :, poison] = float("nan"), float("nan")
    o_kernel, _ = flash_attention(q, k, v, causal=False, scale=None, alignment="upper_left", block_q=16, block_k=16,
                                  window=(5, 3))  # fmt: skip
    dq, _, _ = flash_attention_backward(q, k, v, o, lse, do, causal=False, scale=None, block_q=16, block_k=16,
                                        window=(5, 3))  # fmt: skip
    rows = slice(32, 48)
    if one_too_many:
        assert torch.isnan(o_kernel[:, :, rows]).any() and torch.isnan(dq[:, :, rows]).any()
    else:
        assert torch.isfinite(o_kernel[:, :, rows]).all() and torch.isfinite(dq[:, :, rows]).all()
        assert torch.isnan(o_kernel).any()  # the poison is there: rows whose band reaches it are NaN


@pytest.mark.parametrize("one_too_many", [False, True], ids=["skip_tiles", "control"])
def test_dkdv_programs_never_read_query_tiles_the_band_does_not_reach(one_too_many):
    q, k, v, do, o, lse = poison_inputs(seed=8)
    poison = torch.ones(96, dtype=torch.bool)
    poison[32:80] = False  # the query tiles key tile [48, 64) visits
    if one_too_many:  # row 44: inside visited query tile 2, outside the band of keys 48..63
        poison[44] = True
    q[:, :, poison], do[:, :, poison] = float("nan"), float("nan")
    _, dk, dv = flash_attention_backward(q, k, v, o, lse, do, causal=False, scale=None, block_q=16, block_k=16,
                                         window=(5, 3))  # fmt: skip
    keys = slice(48, 64)
    if one_too_many:
        assert torch.isnan(dv[:, :, keys]).any()
    else:
        assert torch.isfinite(dk[:, :, keys]).all() and torch.isfinite(dv[:, :, keys]).all()
        assert torch.isnan(dk).any()


# --- layouts, and what a window compiles to ---------------------------------------------------------


@pytest.mark.parametrize("head_dim_outermost", [False, True], ids=["tma_layout", "pointer_layout"])
def test_window_reads_views_through_their_strides(head_dim_outermost):
    """q a (B, H, T, D) view of (B, T, H, D) storage, k every other row of a longer tensor, v a view too: the
    float64 answer, through TMA descriptors (the interpreter emulates them) where every layout allows, and
    through pointers where v's head dim is its outermost axis."""
    gen = torch.Generator().manual_seed(9)
    q = randn(1, 37, 2, 16, generator=gen).transpose(1, 2)
    k = randn(1, 2, 2 * 41, 16, generator=gen)[:, :, ::2]
    v = randn(1, 41, 2, 16, generator=gen).transpose(1, 2)
    if head_dim_outermost:
        v = randn(1, 2, 16, 41, generator=gen).transpose(2, 3)
    do = randn(1, 2, 37, 16, generator=gen)
    args = dict(window=(6, 2), softcap=3.0)
    o, lse = flash_attention(q, k, v, causal=True, scale=None, alignment="lower_right", block_q=16, block_k=16, **args)
    grads = flash_attention_backward(q, k, v, o, lse, do, causal=True, scale=None, block_q=16, block_k=16,
                                     alignment="lower_right", **args)  # fmt: skip
    (o_ref, lse_ref), grads_ref = truth(q, k, v, do, (6, 2), True, "lower_right", 3.0)
    assert_close_to_truth(o, o_ref, "o", **FORWARD_TOL[F32])
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close_to_truth(g, g_ref, name, **GRAD_TOL[F32])


def test_a_window_that_is_causal_or_no_mask_runs_the_kernels_plain_paths():
    """The band path (BAND) only where the band has an edge the plain paths lack: (-1, 0) is causal, (-1, -1)
    and windows wider than T are no mask, each compiled exactly as a call without a window."""
    def kind(Tq, Tk, causal, alignment, window):  # (CAUSAL, BAND, the band arguments) of one sequence
        return kernel_mask(check_mask(causal, window, alignment), Tq, Tk)[:3]

    assert kind(40, 40, False, "upper_left", None) == (False, False, (0, 0))
    assert kind(40, 40, False, "upper_left", (-1, -1)) == (False, False, (0, 0))
    assert kind(40, 40, False, "upper_left", (100, 100)) == (False, False, (0, 0))
    assert kind(40, 40, False, "upper_left", (-1, 0)) == (True, False, (0, 0))
    assert kind(30, 50, True, "lower_right", (-1, 7)) == (True, False, (0, 0))
    assert kind(30, 50, True, "lower_right", (4, 7)) == (False, True, (16, 20))
    assert kind(40, 40, False, "upper_left", (-1, 3)) == (False, True, (-40, 3))


def test_packed_documents_take_the_plain_paths_where_the_sides_allow_and_pass_the_sides_otherwise():
    """Without one sequence's sizes (packed documents) the kernels get the window's sides, which each document's
    programs turn into its own band; (-1, -1) is no mask and (-1, 0) causal in every document."""
    assert kernel_mask(check_mask(False, None, "upper_left")) == KernelMask(False, False, (-1, -1), None)
    assert kernel_mask(check_mask(True, None, "lower_right")) == KernelMask(True, False, (-1, 0), None)
    assert kernel_mask(check_mask(True, (5, 9), "upper_left")) == KernelMask(False, True, (5, 0), None)
    assert kernel_mask(check_mask(False, (-1, 3), "upper_left")) == KernelMask(False, True, (-1, 3), None)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(window=5), TypeError, r"window must be None or a pair"),
        (dict(window=(1, 2, 3)), TypeError, r"window must be None or a pair"),
        (dict(window=(-2, 0)), ValueError, r"window\[0\] \(left\) must be -1"),
        (dict(window=(0, 1.5)), TypeError, r"window\[1\] \(right\) must be an int"),
        (dict(window=(True, 0)), TypeError, r"window\[0\] \(left\) must be an int"),
        (dict(softcap=0.0), ValueError, "softcap must be a positive finite number"),
        (dict(softcap=float("inf")), ValueError, "softcap must be a positive finite number"),
        (dict(softcap=True), TypeError, "softcap must be a positive real number"),
        (dict(softcap="2"), TypeError, "softcap must be a positive real number"),
        (dict(softcap=1e-39), ValueError, r"softcap must lie in"),
    ],
)
def test_launchers_refuse_bad_windows_and_caps_by_name(kwargs, error, match):
    q, k, v, do = make_inputs(1, 1, 1, 16, 16, 16, F32, seed=10)
    flash_attention(q, k, v, window=(1, 0), softcap=2.0)  # a kept plan of a valid call must not let (True, 0) in
    with pytest.raises(error, match=match):
        flash_attention(q, k, v, **kwargs)
    o, lse = flash_attention(q, k, v)
    with pytest.raises(error, match=match):
        flash_attention_backward(q, k, v, o, lse, do, **kwargs)


# --- on the GPU: bf16 at realistic sizes -------------------------------------------------------------

GPU_CASES = [  # (B, H, H_kv, T, D, window, causal, softcap); N(0, 1) inputs: scores of about one unit
    (1, 8, 2, 2048, 128, (511, 0), False, None),  # Mistral-like, GQA, through TMA
    (2, 4, 4, 1536, 64, (255, -1), True, 2.0),  # Gemma-2-like: a causal window and a cap that bends the scores
    (1, 4, 4, 1000, 128, (100, 37), False, 5.0),  # ragged T, both edges
]


@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"T{c[3]}-D{c[4]}-w{c[5][0]}x{c[5][1]}-cap{c[7]}")
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic_dq"])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_window_on_the_gpu_in_bf16_against_float64(case, deterministic):
    B, H, H_kv, T, D, window, causal, softcap = case
    q, k, v, do = make_inputs(B, H, H_kv, T, T, D, BF16, seed=T + D, spread=1.0)
    o, lse = flash_attention(q, k, v, causal=causal, scale=None, alignment="upper_left", window=window, softcap=softcap)
    grads = flash_attention_backward(q, k, v, o, lse, do, causal=causal, window=window, softcap=softcap,
                                     deterministic=deterministic)  # fmt: skip
    (o_ref, lse_ref), grads_ref = truth(q, k, v, do, window, causal, "upper_left", softcap)
    assert_close_to_truth(o, o_ref, "o", **FORWARD_TOL[BF16])
    assert_close_to_truth(lse, lse_ref, "lse", **LSE_TOL[BF16])
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close_to_truth(g, g_ref, name, **GRAD_TOL[BF16])


@pytest.mark.parametrize("one_too_many", [False, True], ids=["skip_tiles", "control"])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_skip_tiles_are_never_read_by_the_compiled_kernels(one_too_many):
    """The poison test at the H200's tile sizes, through TMA where the launcher picks it: T = 1024, window
    (100, 0), bf16. Forward in 128 x 128 tiles: query tile [512, 640) sees keys 412..639, key tiles 3..4
    (keys 384..639); backward in 64 x 64 tiles: dQ of rows 512..575 reads keys 384..575, and the dK/dV
    program of keys [512, 576) reads rows 512..703 (those that see them: 512..675). The control poisons
    key 384 and row 700 too: loaded (their tiles are visited), masked, and still NaN through 0 * NaN."""
    q, k, v, do = make_inputs(1, 2, 2, 1024, 1024, 128, BF16, seed=12, spread=1.0)
    o, lse = flash_attention(q, k, v, causal=False, scale=None, alignment="upper_left", block_q=128, block_k=128,
                             window=(100, 0))  # fmt: skip
    keys, rows = torch.ones(1024, dtype=torch.bool), torch.ones(1024, dtype=torch.bool)
    keys[384:640], rows[512:704] = False, False
    if one_too_many:
        keys[384], rows[700] = True, True
    k, v, q_poisoned, do_poisoned = k.clone(), v.clone(), q.clone(), do.clone()
    k[:, :, keys], v[:, :, keys] = float("nan"), float("nan")
    q_poisoned[:, :, rows], do_poisoned[:, :, rows] = float("nan"), float("nan")
    o_poisoned, _ = flash_attention(q, k, v, causal=False, scale=None, alignment="upper_left", block_q=128, block_k=128,
                                    window=(100, 0))  # fmt: skip
    dq, _, _ = flash_attention_backward(q, k, v, o, lse, do, causal=False, scale=None, block_q=64, block_k=64,
                                        window=(100, 0))  # fmt: skip
    _, dk, dv = flash_attention_backward(q_poisoned, k.nan_to_num(), v.nan_to_num(), o, lse, do_poisoned, causal=False,
                                         scale=None, block_q=64, block_k=64, window=(100, 0))  # fmt: skip
    seen = [o_poisoned[:, :, 512:640], dq[:, :, 512:576], dk[:, :, 512:576], dv[:, :, 512:576]]
    if one_too_many:
        assert all(torch.isnan(x).any() for x in (seen[0], seen[1], seen[3]))
    else:
        assert all(torch.isfinite(x).all() for x in seen)

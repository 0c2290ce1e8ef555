"""The Triton backward against autograd through the independent float64 truth (tests/_truth.py).

Without CUDA these run in Triton's interpreter on the CPU (the root conftest sets TRITON_INTERPRET=1), so
the shapes are small. The backward runs on the kernel forward's own o, lse and (m, l), the hand-off a
training step uses; ``test_backward_from_an_external_lse_alone`` feeds it the truth's lse instead, so a
failure there is the backward's alone.
"""

import pytest
import torch

from flashtile._checks import check_attention_inputs
from flashtile._spec import check_spec
from flashtile.kernels.backward import flash_attention_backward
from flashtile.kernels.forward import flash_attention
from tests._grids import LONG, covering
from tests._truth import truth_with_grads

from ._helpers import DEVICE, randn

F32, F16 = torch.float32, torch.float16
ATTN = [(False, "upper_left"), (True, "upper_left"), (True, "lower_right")]
# Each grid below runs a pairwise covering array of its axes (tests/_grids.py); make test-long runs it whole.
MASKS = {"full": ATTN[0], "causal_ul": ATTN[1], "causal_lr": ATTN[2]}
# fp32 runs exact fp32 dots ("ieee"); fp16 rounds P and dS to fp16 before three of the five matmuls.
GRAD_TOL = {F32: dict(atol=1e-4, rtol=1e-4), F16: dict(atol=1e-2, rtol=1e-2)}


def reference_gradients(q, k, v, do, causal, alignment, scale=None):
    """(o, lse) and (dq, dk, dv) from autograd through the float64 truth on the same inputs."""
    o, lse, grads = truth_with_grads(q, k, v, do, causal, scale, alignment)
    return (o, lse), grads


def kernel_gradients(q, k, v, do, causal, alignment, scale=None, **blocks):
    """The kernel backward on the kernel forward's own o, lse and (m, l): the training hand-off."""
    o, lse, stats = flash_attention(q, k, v, causal=causal, scale=scale, alignment=alignment, return_stats=True)
    return flash_attention_backward(
        q, k, v, o, lse, do, causal=causal, scale=scale, alignment=alignment, stats=stats, **blocks
    )


def assert_gradients_close(actual, expected, dtype):
    for name, a, e, like in zip(("dq", "dk", "dv"), actual, expected, expected):
        assert a.dtype == dtype and a.shape == like.shape, name
        assert torch.isfinite(a).all(), f"{name} has NaN or inf"
        torch.testing.assert_close(a.double(), e, **GRAD_TOL[dtype], msg=lambda m, name=name: f"{name}: {m}")


def force_kv_split(monkeypatch, kv_split):
    """Backward plans made from here on share each (key tile, kv head) over kv_split programs, where
    ``pick_kv_split`` would pick 1 (the CPU runs programs one after another); returns a check that a
    plan with that split was used."""
    from flashtile import _plans
    from flashtile.kernels import backward

    monkeypatch.setattr(_plans, "_plans", {})  # no plan made before the patch is reused
    monkeypatch.setattr(backward, "pick_kv_split", lambda group, programs, device: kv_split)
    return lambda: any(getattr(plan, "kv_split", None) == kv_split for plan in _plans._plans.values())


def make_inputs(B, H, H_kv, Tq, Tk, D, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q, do = randn(B, H, Tq, D, dtype=dtype, generator=gen), randn(B, H, Tq, D, dtype=dtype, generator=gen)
    k, v = randn(B, H_kv, Tk, D, dtype=dtype, generator=gen), randn(B, H_kv, Tk, D, dtype=dtype, generator=gen)
    return q, k, v, do


@pytest.mark.parametrize(
    "causal,alignment,Tq,Tk,H,H_kv,dtype",
    covering(mask=MASKS, T=[(16, 16), (37, 37), (37, 23), (23, 37)], heads={"mha": (4, 4), "gqa4": (4, 1)},
             dtype={"fp32": F32, "fp16": F16}),
)  # fmt: skip
def test_backward_matches_float64_autograd(causal, alignment, Tq, Tk, H, H_kv, dtype):
    q, k, v, do = make_inputs(1, H, H_kv, Tq, Tk, 16, dtype, seed=Tq * 100 + Tk + H_kv)
    actual = kernel_gradients(q, k, v, do, causal, alignment, block_q=16, block_k=16)
    _, expected = reference_gradients(q, k, v, do, causal, alignment)
    assert_gradients_close(actual, expected, dtype)


@pytest.mark.parametrize(
    "causal,alignment,Tq,Tk,H,H_kv,D,dtype",
    covering(mask=MASKS, T=[(37, 37), (37, 23), (23, 53)], heads={"mha": (4, 4, 16), "gqa4-d40": (4, 1, 40)},
             dtype={"fp32": F32, "fp16": F16}),
)  # fmt: skip
def test_atomic_dq_matches_float64_autograd(causal, alignment, Tq, Tk, H, H_kv, D, dtype):
    # dQ added up with atomics inside the dK/dV kernel (deterministic=False): every key tile's share must
    # land on the right rows, head and columns, including GQA heads and a padded head dim.
    q, k, v, do = make_inputs(1, H, H_kv, Tq, Tk, D, dtype, seed=Tq * 100 + Tk + D)
    actual = kernel_gradients(q, k, v, do, causal, alignment, block_q=16, block_k=16, deterministic=False)
    _, expected = reference_gradients(q, k, v, do, causal, alignment)
    assert_gradients_close(actual, expected, dtype)
    assert all(g.is_contiguous() for g in actual)


# Both unequal pairs are test_every_kind_of_tile's too (one batch, groups of 2, D = 16), and the configured
# tiles (None, None) run in test_backward_matches_when_head_dim_is_not_a_power_of_two; the long run adds
# (32, 16) and (None, None) here at two batches, groups of 4 and D = 32.
@pytest.mark.parametrize("block_q,block_k", [(16, 32)] + ([(32, 16), (None, None)] if LONG else []))
def test_backward_matches_when_block_q_differs_from_block_k(block_q, block_k):
    q, k, v, do = make_inputs(2, 8, 2, 45, 51, 32, F32, seed=7)
    actual = kernel_gradients(q, k, v, do, True, "lower_right", block_q=block_q, block_k=block_k)
    assert_gradients_close(actual, reference_gradients(q, k, v, do, True, "lower_right")[1], F32)


@pytest.mark.parametrize(
    "causal,alignment,Tq,Tk,block_q,block_k,deterministic",
    covering(mask=MASKS, T=[(70, 100), (100, 70), (64, 96), (33, 97)], blocks=[(16, 32), (32, 16)],
             order={"deterministic": True, "atomic_dq": False}),
)  # fmt: skip
def test_every_kind_of_tile_matches_float64_autograd(causal, alignment, Tq, Tk, block_q, block_k, deterministic):
    # Shapes with several tiles of each kind in both kernels: a diagonal band wider than one tile (block_q !=
    # block_k), unmasked interior tiles, ragged last tiles of Tq and Tk (or none: 64, 96), rows that see no
    # key (lower-right, Tq > Tk), and GQA, so each program sums the masked and unmasked tiles of two heads.
    q, k, v, do = make_inputs(1, 4, 2, Tq, Tk, 16, F32, seed=Tq * 1000 + Tk + block_q)
    actual = kernel_gradients(q, k, v, do, causal, alignment, block_q=block_q, block_k=block_k,
                              deterministic=deterministic)  # fmt: skip
    assert_gradients_close(actual, reference_gradients(q, k, v, do, causal, alignment)[1], F32)


@pytest.mark.parametrize(
    "causal,alignment,Tq,Tk,D,deterministic",
    covering(mask=MASKS, T=[(70, 100), (100, 70)], D=[16, 40], order={"deterministic": True, "atomic_dq": False}),
)
def test_tma_loads_match_float64_autograd_and_the_pointer_path(causal, alignment, Tq, Tk, D, deterministic):
    """tma=True: q and do (dK/dV kernel), k and v (dQ kernel) come through descriptors, zeros past T and D,
    with no load masks. Same shapes as above (ragged tiles, GQA, rows that see no key), and a head dim that
    is not a power of two."""
    q, k, v, do = make_inputs(1, 4, 2, Tq, Tk, D, F32, seed=Tq * 1000 + Tk + D)
    blocks = dict(block_q=16, block_k=32, deterministic=deterministic)
    actual = kernel_gradients(q, k, v, do, causal, alignment, tma=True, **blocks)
    assert_gradients_close(actual, reference_gradients(q, k, v, do, causal, alignment)[1], F32)
    pointers = kernel_gradients(q, k, v, do, causal, alignment, tma=False, **blocks)
    # Equal up to the order of fp32 sums, not bitwise: the interpreter's dots are numpy matmuls, and
    # OpenBLAS's AVX-512 kernels round differently for a transposed operand than for a contiguous one
    # (measured: 200 of 200 random 32x64 @ 64x16 products differ in the last bits), and a descriptor
    # tile arrives in another layout than a pointer tile. The GPU test checks the bits.
    for name, a, b in zip(("dq", "dk", "dv"), actual, pointers):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_tma_true_is_refused_for_a_layout_the_copy_engine_cannot_step():
    q, k, v, do = make_inputs(1, 2, 2, 20, 20, 20, F16, seed=1)  # 40-byte rows: not a multiple of 16 bytes
    o, lse, stats = flash_attention(q, k, v, return_stats=True)
    with pytest.raises(ValueError, match="tma=True needs"):
        flash_attention_backward(q, k, v, o, lse, do, stats=stats, tma=True)
    with pytest.raises(TypeError, match="tma must be a bool"):
        flash_attention_backward(q, k, v, o, lse, do, stats=stats, tma="yes")
    dq, _, _ = flash_attention_backward(q, k, v, o, lse, do, stats=stats, tma=False)  # the pointer path takes it
    assert dq.shape == q.shape


@pytest.mark.parametrize("causal,alignment", ATTN, ids=["full", "causal_ul", "causal_lr"])
def test_padding_keys_stay_masked_when_every_real_score_is_very_negative(causal, alignment):
    # Every score is about -100, so a padding key past Tk (k = 0, score 0) would get P = exp(100), inf in
    # float32: a ragged key tile must stay masked in every query tile, or dS K turns inf * 0 into NaN.
    q, k, v, do = make_inputs(1, 2, 1, 40, 37, 16, F32, seed=14)
    q[..., 0], k[..., 0] = -20.0, 20.0  # q·k = -400 + O(4), scaled by 1/4
    expected = reference_gradients(q, k, v, do, causal, alignment)[1]
    for deterministic in (True, False):
        actual = kernel_gradients(q, k, v, do, causal, alignment, block_q=16, block_k=16,
                                  deterministic=deterministic)  # fmt: skip
        assert_gradients_close(actual, expected, F32)


def test_wide_offsets_are_chosen_only_where_a_tile_can_span_2_31_elements(monkeypatch):
    from flashtile.kernels import backward

    # Storage (B, H, D, T) with a 50M-element head-dim stride: 64 columns of one tile span 3.2e9 elements.
    outer_head_dim = torch.empty_strided((1, 1, 256, 64), (0, 0, 1, 50 * 2**20), device="meta")
    assert backward.wide_offsets(128, 64, torch.empty(2, 16, 8192, 128, device="meta"), outer_head_dim)
    assert not backward.wide_offsets(128, 128, torch.empty(2, 16, 8192, 128, device="meta"))
    # The int64 in-tile offsets compute the same gradients (forced on here; the GPU test covers real strides).
    monkeypatch.setattr(backward, "wide_offsets", lambda *args: True)
    q, k, v, do = make_inputs(1, 2, 1, 37, 45, 24, F32, seed=13)
    for deterministic in (True, False):
        actual = kernel_gradients(q, k, v, do, True, "lower_right", block_q=16, block_k=16,
                                  deterministic=deterministic)  # fmt: skip
        assert_gradients_close(actual, reference_gradients(q, k, v, do, True, "lower_right")[1], F32)


@pytest.mark.parametrize("D", [24, 80])
def test_backward_matches_when_head_dim_is_not_a_power_of_two(D):
    q, k, v, do = make_inputs(1, 2, 1, 37, 37, D, F32, seed=D)
    actual = kernel_gradients(q, k, v, do, True, "upper_left", scale=0.3)
    assert_gradients_close(actual, reference_gradients(q, k, v, do, True, "upper_left", scale=0.3)[1], F32)


def test_backward_from_an_external_lse_alone():
    # A natural-log lse from elsewhere (here the float64 truth, rounded to float32), no (m, l) statistics.
    q, k, v, do = make_inputs(1, 4, 2, 37, 29, 16, F32, seed=12)
    (o, lse), expected = reference_gradients(q, k, v, do, True, "lower_right", scale=-0.4)
    actual = flash_attention_backward(q, k, v, o.float(), lse.float(), do, causal=True, scale=-0.4,
                                      alignment="lower_right")  # fmt: skip
    assert_gradients_close(actual, expected, F32)


def test_backward_is_bitwise_deterministic():
    q, k, v, do = make_inputs(1, 4, 1, 37, 37, 16, F16, seed=3)
    (o, lse), _ = reference_gradients(q, k, v, do, True, "upper_left")
    args = (q, k, v, o.to(F16), lse.float(), do)
    first = flash_attention_backward(*args, causal=True, block_q=16, block_k=16)
    second = flash_attention_backward(*args, causal=True, block_q=16, block_k=16)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_backward_accepts_non_contiguous_inputs_and_do():
    gen = torch.Generator().manual_seed(11)
    # (B, T, H, D) storage viewed as (B, H, T, D), the layout of a fused qkv projection; dO transposed.
    q = randn(1, 37, 4, 16, generator=gen).transpose(1, 2)
    k = randn(1, 29, 2, 16, generator=gen).transpose(1, 2)
    v = randn(1, 29, 2, 16, generator=gen).transpose(1, 2)
    do = randn(1, 4, 16, 37, generator=gen).transpose(-1, -2)
    assert not (q.is_contiguous() or k.is_contiguous() or do.is_contiguous())
    actual = kernel_gradients(q, k, v, do, True, "lower_right", block_q=16, block_k=16)
    assert_gradients_close(actual, reference_gradients(q, k, v, do, True, "lower_right")[1], F32)


@pytest.mark.parametrize("kv_split", [1, 2], ids=["whole_groups", "split"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic_dq"])
def test_gradients_are_laid_out_like_their_inputs(kv_split, deterministic, monkeypatch):
    # A model's q, k, v are (B, H, T, D) views of (B, T, H, D) projections; autograd keeps a gradient in
    # its input's layout as it is and copies one in any other. A sliced v is not dense: contiguous dv.
    gen = torch.Generator().manual_seed(18)
    q = randn(2, 29, 4, 16, generator=gen).transpose(1, 2)
    k = randn(2, 31, 2, 16, generator=gen).transpose(1, 2)
    v = randn(2, 2, 31, 24, generator=gen)[..., :16]
    do = randn(2, 4, 29, 16, generator=gen)
    used = force_kv_split(monkeypatch, kv_split)
    dq, dk, dv = kernel_gradients(q, k, v, do, True, "upper_left", block_q=16, block_k=16,
                                  deterministic=deterministic)  # fmt: skip
    assert used()
    assert dq.stride() == q.stride() and dk.stride() == k.stride()
    assert dv.is_contiguous()
    assert_gradients_close((dq, dk, dv), reference_gradients(q, k, v, do, True, "upper_left")[1], F32)


def test_rows_that_see_no_key_contribute_zero_and_no_nan():
    # lower_right with Tq = 40 > Tk = 13: the first 27 queries see no key (lse = -inf).
    q, k, v, do = make_inputs(1, 2, 2, 40, 13, 16, F32, seed=5)
    dq, dk, dv = kernel_gradients(q, k, v, do, True, "lower_right", block_q=16, block_k=16)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert torch.equal(dq[:, :, :27], torch.zeros_like(dq[:, :, :27]))
    assert_gradients_close((dq, dk, dv), reference_gradients(q, k, v, do, True, "lower_right")[1], F32)


def test_dkdv_kernel_skips_query_tiles_that_cannot_see_the_key_tile():
    # Poison q and dO in rows 0..47 with NaN. Under upper-left causal with 16-row tiles, key tile [48, 64)
    # is seen only from rows >= 48, so its dK and dV stay finite only if those query tiles are skipped
    # (a visited, fully masked tile would give 0 * NaN = NaN through dP and P^T dO).
    q, k, v, do = make_inputs(1, 1, 1, 64, 64, 16, F32, seed=9)
    (o, lse), _ = reference_gradients(q, k, v, do, True, "upper_left")
    q[:, :, :48], do[:, :, :48] = float("nan"), float("nan")
    _, dk, dv = flash_attention_backward(q, k, v, o.float(), lse.float(), do, causal=True, block_q=16, block_k=16)
    assert torch.isfinite(dk[:, :, 48:]).all() and torch.isfinite(dv[:, :, 48:]).all()
    assert torch.isnan(dk[:, :, :48]).any()  # the poison does reach the tiles that are visited


def test_dq_kernel_stops_at_the_last_key_tile_it_needs():
    # Poison k and v in columns 16..63: query tile [0, 16) sees keys 0..15 only, so its dQ stays finite.
    q, k, v, do = make_inputs(1, 1, 1, 64, 64, 16, F32, seed=10)
    (o, lse), _ = reference_gradients(q, k, v, do, True, "upper_left")
    k[:, :, 16:], v[:, :, 16:] = float("nan"), float("nan")
    dq, _, _ = flash_attention_backward(q, k, v, o.float(), lse.float(), do, causal=True, block_q=16, block_k=16)
    assert torch.isfinite(dq[:, :, :16]).all()
    assert torch.isnan(dq[:, :, 16:]).any()


@pytest.mark.parametrize(
    "override,error,match",
    [
        (dict(block_q=24), ValueError, "block_q must be a power of two"),
        (dict(block_k=8), ValueError, "block_k must be a power of two"),
        (dict(block_k=16.0), TypeError, "block_k must be a positive int"),
        (dict(lse_shape=(1, 2, 5)), ValueError, "lse must have shape"),
        (dict(do_shape=(1, 2, 16, 8)), ValueError, "do must have shape"),
        (dict(dtype=torch.float64), TypeError, "q must have dtype in"),
        (dict(alignment="diagonal"), ValueError, "alignment must be one of"),
        (dict(deterministic="no"), TypeError, "deterministic must be a bool"),
    ],
)
def test_backward_rejects_bad_input_with_a_clear_message(override, error, match):
    dtype = override.get("dtype", F32)
    q, k, v, do = (t.to(dtype) for t in make_inputs(1, 2, 2, 16, 16, 16, F32, seed=1))
    o = torch.zeros_like(q)
    lse = torch.zeros(override.get("lse_shape", (1, 2, 16)), dtype=torch.float32, device=DEVICE)
    if "do_shape" in override:
        do = randn(*override["do_shape"])
    blocks = {name: override[name] for name in ("block_q", "block_k", "deterministic") if name in override}
    with pytest.raises(error, match=match):
        flash_attention_backward(q, k, v, o, lse, do, alignment=override.get("alignment", "upper_left"), **blocks)



@pytest.mark.parametrize(
    "causal,alignment,deterministic,kv_split",
    covering(mask=MASKS, order={"deterministic": True, "atomic_dq": False}, kv_split=[2, 4]),
)
def test_split_gqa_groups_match_float64_autograd(causal, alignment, deterministic, kv_split, monkeypatch):
    # Each (key tile, kv head) shared by kv_split programs, each summing part of the group's query heads
    # into float32 partials that the launcher adds up: every head must be counted once, in the right plane.
    q, k, v, do = make_inputs(2, 8, 2, 37, 29, 24, F32, seed=40 + kv_split)
    used = force_kv_split(monkeypatch, kv_split)
    actual = kernel_gradients(q, k, v, do, causal, alignment, block_q=16, block_k=16, deterministic=deterministic)
    assert used()
    assert_gradients_close(actual, reference_gradients(q, k, v, do, causal, alignment)[1], F32)
    storages = {g.untyped_storage().data_ptr() for g in actual}
    assert len(storages) == 3, "dq, dk and dv must be three tensors, not views of one buffer"


def test_kv_split_is_picked_by_grid_size(monkeypatch):
    from flashtile.kernels import backward

    monkeypatch.setattr(backward, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    enough = backward.PROGRAMS_PER_SM * 132
    assert backward.pick_kv_split(4, enough, cuda) == 1  # the grid fills the GPU already
    assert backward.pick_kv_split(4, enough // 2, cuda) == 2  # the smallest divisor that gets there
    assert backward.pick_kv_split(4, 128, cuda) == 4  # never past the group
    assert backward.pick_kv_split(1, 8, cuda) == 1  # no GQA, nothing to split
    assert backward.pick_kv_split(4, 8, torch.device("cpu")) == 1  # the interpreter: one after another


def test_descriptor_loads_only_where_the_work_pays_for_them(monkeypatch):
    # TMA descriptors cost host time per call; the backward takes them only from 1k tokens on and from
    # TMA_MIN_WORK on (B * H * Tq * Tk * D, halved under causal), where the GPU time hides that cost.
    from flashtile.kernels import backward

    monkeypatch.setattr(backward, "is_interpreting", lambda: False)
    bf16 = torch.bfloat16
    model_shape = 2 * 16 * 2048 * 2048 * 64 * 0.5  # B = 2, H = 16, T = 2k, D = 64, causal: 4.3e9
    long_d128 = 1 * 16 * 4096 * 4096 * 128 * 0.5  # B = 1, H = 16, T = 4k, D = 128, causal: 1.7e10
    assert backward.backward_config(64, bf16, 2048, work=model_shape)["tma"] is False
    assert backward.backward_config(128, bf16, 4096, work=long_d128)["tma"] == "auto"
    assert backward.backward_config(64, bf16, 512, work=long_d128)["tma"] is False  # short: pointers anyway
    assert backward.backward_config(64, bf16, 2048)["tma"] == "auto"  # no work given: by length alone


def test_the_atomic_mode_takes_larger_tiles_only_where_its_dq_shares_go_through_tma(monkeypatch):
    # With TMA the dQ shares are bulk adds and larger dK/dV tiles ran fastest (sweeps/atomic-dq-reduce.json);
    # where the tiles load through pointers (short calls, or a layout TMA cannot take) every share is added
    # per element, and the plan keeps that path's smaller tiles.
    from flashtile.kernels import backward

    monkeypatch.setattr(backward, "is_interpreting", lambda: False)
    bf16 = torch.bfloat16
    for D, bulk, per_element in ((64, (64, 64, 4, 2), (32, 128, 4, 3)), (128, (64, 128, 8, 2), (32, 64, 4, 3)),
                                 (256, (32, 64, 8, 2), (16, 32, 4, 2))):  # fmt: skip
        assert backward.backward_config(D, bf16, 4096, atomic_dq=True) == dict(dkdv=bulk, dq=(64, 64, 4, 3), tma="auto")
        assert backward.backward_config(D, bf16, 512, atomic_dq=True)["dkdv"] == per_element
    # fp16, which the interpreter computes right; B * H * T^2 * D / 2 = 8.6e9 >= TMA_MIN_WORK: TMA's settings
    q, k, v, do = (torch.randn(1, 8, 4096, 128, dtype=torch.float16) for _ in range(4))
    o = torch.randn_like(q)
    lse = torch.zeros(1, 8, 4096)
    spec = check_spec(check_attention_inputs(q, k, v), q.dtype, causal=True, scale=None, alignment="upper_left",
                      window=None, softcap=None)  # fmt: skip
    plan = lambda q: backward.make_backward_plan(q, k, v, o, lse, do, None, spec=spec, deterministic=False)  # noqa: E731
    tiles = lambda plan: (plan.dkdv.constexprs["BLOCK_Q"], plan.dkdv.constexprs["BLOCK_K"])  # noqa: E731
    assert tiles(plan(q)) == (64, 128) and plan(q).tma_dkdv is not None  # (the interpreter emulates TMA)
    strided = torch.randn(1, 8, 128, 4096, dtype=torch.float16).transpose(2, 3)  # head dim not contiguous: no TMA
    assert tiles(plan(strided)) == (32, 64) and plan(strided).tma_dkdv is None
    assert not plan(q).dkdv.constexprs["DQ_REDUCE"]  # the interpreter has no bulk add: it adds per element


@pytest.mark.parametrize(
    "deterministic, tma, kv_split",
    [(True, True, 1), (True, False, 2), (False, True, 2), (False, False, 1)],
    ids=["deterministic-tma", "deterministic-split", "atomic-tma-split", "atomic-pointers"],
)
def test_unequal_head_dims_match_float64_through_every_path_of_the_launchers(deterministic, tma, kv_split, monkeypatch):
    """q, k 40 wide and v, o, do 24 wide (padded to 64 and 32): through TMA descriptors of each width, the atomic
    dQ mode, and a GQA split whose partials are as wide as the wider of the two, against the float64 formula."""
    from tests.reference._sink_truth import dense_attention

    used_split = force_kv_split(monkeypatch, kv_split)
    q, k, v, do = randn(1, 4, 21, 40), randn(1, 2, 13, 40), randn(1, 2, 13, 24), randn(1, 4, 21, 24)
    o, lse, stats = flash_attention(q, k, v, causal=True, alignment="lower_right", return_stats=True, tma=tma)
    grads = flash_attention_backward(q, k, v, o, lse, do, causal=True, alignment="lower_right", stats=stats,
                                     deterministic=deterministic, tma=tma)  # fmt: skip
    assert used_split()
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    o_64, lse_64 = dense_attention(*leaves, causal=True, alignment="lower_right")
    torch.testing.assert_close(o.double().cpu(), o_64.detach(), atol=2e-6, rtol=0)
    torch.testing.assert_close(lse.double().cpu(), lse_64.detach(), atol=2e-6, rtol=0)
    expected = torch.autograd.grad(o_64, leaves, do.double().cpu())
    assert_gradients_close([g.cpu() for g in grads], expected, F32)

"""The Triton forward against float64 naive attention, on the shapes users actually meet.

Under the interpreter (no CUDA) these run on the CPU; keep the shapes small. Blocks of 16 force
several tiles, ragged last tiles and diagonal tiles even at T = 37.
"""

import pytest
import torch

from flashtile._checks import check_attention_inputs
from flashtile._spec import check_spec
from flashtile.kernels._host import tma_strides
from flashtile.kernels.forward import flash_attention, forward_config
from flashtile.reference.causal import diagonal_offset, last_key_tile
from tests._grids import covering_rows
from tests._truth import attention_truth

from ._helpers import DEVICE, assert_attention_close, case_id, randn

F32, F16 = torch.float32, torch.float16

# (B, H, H_kv, Tq, Tk, D, causal, alignment, dtype): every T, D, GQA ratio, alignment and dtype of the
# issue appears, without the full Cartesian product (the interpreter is slow).
CASES = [
    (1, 2, 2, 16, 16, 32, False, "upper_left", F32),
    (1, 2, 2, 37, 37, 32, True, "upper_left", F32),
    (1, 2, 2, 37, 37, 80, True, "lower_right", F32),
    (2, 2, 1, 100, 100, 32, True, "upper_left", F32),
    (1, 4, 1, 100, 100, 80, False, "upper_left", F16),
    (1, 4, 2, 37, 100, 32, True, "upper_left", F16),
    (1, 4, 2, 37, 100, 32, True, "lower_right", F32),
    (1, 2, 1, 100, 37, 80, True, "lower_right", F16),  # Tq > Tk: the first 63 rows see no key
    (1, 2, 1, 100, 37, 32, True, "upper_left", F32),
    (1, 4, 4, 16, 37, 80, False, "upper_left", F16),
    (1, 4, 1, 37, 16, 32, True, "lower_right", F16),
    (2, 2, 2, 16, 100, 80, True, "lower_right", F32),
]


def spec_of(q, k, v, causal=False, alignment="upper_left"):
    """The checked options a launcher's plan builder takes (``_spec.check_spec``), for plans built directly."""
    return check_spec(check_attention_inputs(q, k, v), q.dtype, causal=causal, scale=None, alignment=alignment,
                      window=None, softcap=None)


def _run_and_check(q, k, v, causal, alignment, **blocks):
    o, lse = flash_attention(q, k, v, causal=causal, alignment=alignment, **blocks)
    o_ref, lse_ref = attention_truth(q.double(), k.double(), v.double(), causal=causal, alignment=alignment)
    assert_attention_close(o, lse, o_ref, lse_ref, q.dtype)
    return o, lse


def _features(run):
    """What a run varies, for the pairwise choice of runs (tests/_grids.py): the load path, B, the GQA ratio,
    whether each length is ragged (not a multiple of the 16-row tiles), Tq against Tk, D, the mask, dtype."""
    (B, H, H_kv, Tq, Tk, D, causal, alignment, dtype), tma = run
    return (tma, B, H // H_kv, Tq % 16 == 0, Tk % 16 == 0, (Tq > Tk) - (Tq < Tk), D,
            alignment if causal else "full", dtype)


# Each case on both load paths would be 24 interpreter runs; the runs kept pair every feature value with every
# other one, the path included, and run every case on one path at least (make test-long runs all 24).
RUNS = covering_rows([(case, tma) for case in CASES for tma in (True, False)], _features)
RUNS += [(case, n % 2 == 0) for n, case in enumerate(c for c in CASES if c not in {c for c, _ in RUNS})]


@pytest.mark.parametrize("case,tma", RUNS, ids=[f"{case_id(c)}-{'tma' if t else 'pointers'}" for c, t in RUNS])
def test_forward_matches_naive_on_ragged_causal_and_gqa_shapes(case, tma):
    B, H, H_kv, Tq, Tk, D, causal, alignment, dtype = case
    gen = torch.Generator().manual_seed(Tq * 1000 + Tk + D)
    q = randn(B, H, Tq, D, dtype=dtype, generator=gen)
    k, v = randn(B, H_kv, Tk, D, dtype=dtype, generator=gen), randn(B, H_kv, Tk, D, dtype=dtype, generator=gen)
    _run_and_check(q, k, v, causal, alignment, block_q=16, block_k=16, tma=tma)


@pytest.mark.parametrize("block_q,block_k", [(16, 32), (32, 16)])
def test_forward_matches_naive_when_block_q_differs_from_block_k(block_q, block_k):
    q, k, v = randn(1, 2, 45, 32), randn(1, 2, 45, 32), randn(1, 2, 45, 32)
    _run_and_check(q, k, v, True, "upper_left", block_q=block_q, block_k=block_k)
    _run_and_check(q, k, v, True, "lower_right", block_q=block_q, block_k=block_k)


def test_forward_reads_transposed_views_without_a_copy():
    # A (B, T, H, D) projection viewed as (B, H, T, D): stride(-2) is H * D, not D.
    B, T, H, D = 1, 37, 4, 32
    q = randn(B, T, H, D).transpose(1, 2)
    k = randn(B, T, 2, D).transpose(1, 2)  # GQA on top: 2 kv heads
    v = randn(B, D, 2, T).permute(0, 2, 3, 1)  # a head dim that is not even the innermost one
    assert not q.is_contiguous() and not v.is_contiguous() and v.stride(-1) != 1
    _run_and_check(q, k, v, True, "upper_left", block_q=16, block_k=16)


def test_forward_gives_zero_output_and_minus_inf_lse_to_rows_that_see_no_key():
    Tq, Tk = 40, 13  # lower-right with Tq > Tk: rows 0 .. 26 see nothing
    q, k, v = randn(1, 2, Tq, 32), randn(1, 2, Tk, 32), randn(1, 2, Tk, 32)
    o, lse = _run_and_check(q, k, v, True, "lower_right", block_q=16, block_k=16)
    blind = Tq - Tk
    assert torch.equal(o[:, :, :blind], torch.zeros_like(o[:, :, :blind]))
    assert torch.isneginf(lse[:, :, :blind]).all() and torch.isfinite(lse[:, :, blind:]).all()


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("block_k", [16, 32])
def test_forward_never_reads_key_tiles_above_the_diagonal(block_k, tma):
    # Poison every key tile that no query tile may touch: one NaN read there would reach o through
    # P @ V (0 * NaN = NaN) even if the scores were masked. Upper-left with Tq < Tk is the layout
    # where such tiles exist for the whole tensor (lower-right's last row always sees every key).
    Tq, Tk, alignment = 37, 100, "upper_left"
    q, k, v = randn(1, 2, Tq, 32), randn(1, 2, Tk, 32), randn(1, 2, Tk, 32)
    n_key_tiles = last_key_tile(Tq, Tk, block_k, diagonal_offset(Tq, Tk, alignment))
    first_skipped_key = n_key_tiles * block_k
    assert first_skipped_key < Tk  # the test must poison something
    k_poisoned, v_poisoned = k.clone(), v.clone()
    k_poisoned[:, :, first_skipped_key:] = float("nan")
    v_poisoned[:, :, first_skipped_key:] = float("nan")
    o, lse = flash_attention(
        q, k_poisoned, v_poisoned, causal=True, alignment=alignment, block_q=16, block_k=block_k, tma=tma
    )
    o_ref, lse_ref = attention_truth(q.double(), k.double(), v.double(), causal=True, alignment=alignment)
    assert_attention_close(o, lse, o_ref, lse_ref, q.dtype)


def test_forward_uses_default_blocks_and_custom_scale():
    q, k, v = randn(1, 2, 50, 96), randn(1, 1, 70, 96), randn(1, 1, 70, 96)
    o, lse = flash_attention(q, k, v, causal=True, scale=0.3)
    o_ref, lse_ref = attention_truth(q.double(), k.double(), v.double(), causal=True, scale=0.3)
    assert_attention_close(o, lse, o_ref, lse_ref, q.dtype)
    assert set(forward_config(96, torch.float16)) == {"block_q", "block_k", "num_warps", "num_stages", "tma"}


def test_forward_handles_head_dims_at_both_ends_of_the_range():
    for D in (16, 256):
        q, k, v = randn(1, 1, 20, D), randn(1, 1, 20, D), randn(1, 1, 20, D)
        _run_and_check(q, k, v, True, "upper_left", block_q=16, block_k=16)


# --- bad input -----------------------------------------------------------------------------------


def _qkv(D=32, dtype=torch.float32, H=2, H_kv=2):
    return randn(1, H, 8, D, dtype=dtype), randn(1, H_kv, 8, D, dtype=dtype), randn(1, H_kv, 8, D, dtype=dtype)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(dtype=torch.float64), TypeError, "q must have dtype in"),
        (dict(D=264), ValueError, "q has head dim 264; flashtile supports head dims 1 to 256 on every tier"),
        (dict(H=3, H_kv=2), ValueError, "multiple of the number of key/value heads"),
    ],
)
def test_forward_rejects_bad_tensors(kwargs, error, match):
    with pytest.raises(error, match=match):
        flash_attention(*_qkv(**kwargs))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(block_q=24), ValueError, "block_q must be a power of two >= 16, got 24"),
        (dict(block_k=8), ValueError, "block_k must be a power of two >= 16, got 8"),
        (dict(block_k=0), ValueError, "block_k must be a positive int"),
        (dict(block_q=16.0), TypeError, "block_q must be a positive int"),
        (dict(causal=1), TypeError, "causal must be a bool"),
        (dict(alignment="lower_left"), ValueError, "alignment must be one of"),
        (dict(scale=float("inf")), ValueError, "scale must be finite"),
        (dict(tma="yes"), TypeError, "tma must be a bool"),
    ],
)
def test_forward_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        flash_attention(*_qkv(), **kwargs)


def test_forward_rejects_mismatched_shapes_and_dtypes():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="head dim"):
        flash_attention(q, k[..., :16], v[..., :16])
    with pytest.raises(ValueError, match="v must have the same shape as k"):
        flash_attention(q, k, v[:, :, :4])
    with pytest.raises(TypeError, match="k has dtype"):
        flash_attention(q, k.half(), v.half())
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        flash_attention(q.tolist(), k, v)


def test_forward_rejects_more_heads_than_a_grid_dimension_holds():
    # B * H may exceed 65,535 (heads and batch have a grid axis each), but each alone may not.
    q = randn(1, 65536, 1, 16)
    k = randn(1, 1, 1, 16)
    with pytest.raises(ValueError, match="number of heads must be at most 65535"):
        flash_attention(q, k, k)
    with pytest.raises(ValueError, match="batch size must be at most 65535"):
        flash_attention(randn(65536, 1, 1, 16), randn(65536, 1, 1, 16), randn(65536, 1, 1, 16))


def test_forward_rejects_cpu_tensors_when_not_interpreting(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = (t.cpu() for t in _qkv())
    with pytest.raises(ValueError, match="q is on cpu, but Triton kernels need a CUDA device"):
        flash_attention(q, k, v)


def test_forward_runs_on_the_device_the_tests_chose():
    q, k, v = _qkv()
    o, lse = flash_attention(q, k, v)
    assert o.device.type == DEVICE and lse.shape == (1, 2, 8)


# --- which path loads the tiles ------------------------------------------------------------------


def test_tma_is_refused_by_name_when_the_head_dim_is_not_contiguous():
    q, k, v = _qkv()
    k_t = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, head dim strided
    with pytest.raises(ValueError, match="tma=True needs"):
        flash_attention(q, k_t, v, tma=True)
    o, lse = flash_attention(q, k_t, v)  # tma=None falls back to pointers and gives the same answer
    o_ref, lse_ref = attention_truth(q.double(), k.double(), v.double())
    assert_attention_close(o, lse, o_ref, lse_ref, q.dtype)


def test_settings_measured_with_descriptors_give_way_to_the_pointer_settings_where_tma_cannot_run(monkeypatch):
    """A config whose tiles were measured through TMA ("auto") must not run through pointers with those
    tiles (at D = 64 without a mask, 128 x 128 tiles spill on the pointer path): where the layout, the
    caller (tma=False) or the device rules descriptors out, the plan asks ``forward_config`` again with
    tma=False. The table is replaced by a marked one, so the choice is visible on any machine."""
    from flashtile.kernels import forward

    def table(head_dim, dtype, interpreted=False, causal=False, Tq=4096, tma=True, head_dim_v=None):
        if tma:
            return dict(block_q=32, block_k=32, num_warps=4, num_stages=1, tma="auto")
        return dict(block_q=16, block_k=16, num_warps=4, num_stages=1, tma=False)

    monkeypatch.setattr(forward, "forward_config", table)
    q, k, v = _qkv()
    k_t = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # head dim strided: no descriptor for k
    for args, tma, expected in [((q, k, v), None, (32, True)), ((q, k, v), False, (16, False)),
                                ((q, k_t, v), None, (16, False))]:  # fmt: skip
        plan = forward.make_forward_plan(*args, spec=spec_of(*args), return_stats=False, tma=tma)
        constexprs = plan.launch.constexprs
        assert (constexprs["BLOCK_K"], constexprs["USE_TMA"]) == expected, (tma, expected)
    o, lse = forward.forward_with_plan(plan, q, k_t, v)  # the fallback's launch computes the same attention
    o_ref, lse_ref = attention_truth(q.double(), k.double(), v.double())
    assert_attention_close(o, lse[0], o_ref, lse_ref, q.dtype)


def test_the_masked_key_loop_is_compiled_only_where_a_tile_needs_the_mask():
    # Without a mask and with Tk a multiple of the key tile, no tile needs the mask: the masked loop is left
    # out of the compiled kernel (it would run no step, but its pipeline prologue measured 4-6% at D = 128).
    from flashtile.kernels.forward import forward_with_plan, make_forward_plan

    for Tk, causal, expected in [(32, False, False), (37, False, True), (32, True, True)]:
        q, k, v = randn(1, 2, 24, 32), randn(1, 2, Tk, 32), randn(1, 2, Tk, 32)
        plan = make_forward_plan(q, k, v, spec=spec_of(q, k, v, causal, "lower_right"), return_stats=False, block_q=16,
                                 block_k=16)  # fmt: skip
        assert plan.launch.constexprs["MASKED_TILES"] is expected, (Tk, causal)
        o, row_stats = forward_with_plan(plan, q, k, v)
        o_ref, lse_ref = attention_truth(q.double(), k.double(), v.double(), causal=causal, alignment="lower_right")
        assert_attention_close(o, row_stats[0], o_ref, lse_ref, q.dtype)


def test_forward_config_takes_wide_key_tiles_at_d64_without_a_mask_through_descriptors_only():
    wide = forward_config(64, torch.bfloat16, causal=False)
    assert (wide["block_q"], wide["block_k"], wide["tma"], wide["maxnreg"]) == (128, 128, "auto", 128)
    for config in (forward_config(64, torch.bfloat16, causal=False, tma=False),
                   forward_config(64, torch.bfloat16, causal=True)):  # fmt: skip
        assert (config["block_k"], config["tma"], config["maxnreg"]) == (64, False, 128)


def test_tma_strides_free_size_one_dims_and_refuse_what_the_copy_engine_cannot_step():
    assert tma_strides(torch.empty(2, 3, 5, 24, dtype=torch.float16)) == [360, 120, 24, 1]  # 48-byte rows
    assert tma_strides(torch.empty(2, 5, 3, 24, dtype=torch.float16).transpose(1, 2)) == [360, 24, 72, 1]
    odd = torch.empty(100, dtype=torch.float16).as_strided((1, 1, 2, 24), (3, 3, 24, 1))
    assert tma_strides(odd) == [48, 48, 24, 1]  # one batch, one head: their odd strides are replaced
    assert tma_strides(torch.empty(2, 3, 5, 20, dtype=torch.float16)) is None  # 40-byte rows
    assert tma_strides(torch.empty(2, 1, 5, 24).expand(2, 3, 5, 24)) is None  # stride 0 along heads
    assert tma_strides(torch.empty(2, 3, 5, 25, dtype=torch.float16)[..., 1:]) is None  # base off by 2 bytes
    assert tma_strides(torch.empty(2, 3, 5, 24).transpose(-1, -2)) is None  # head dim not contiguous
    assert tma_strides(torch.empty(2, 3, 0, 24)) is None  # nothing to describe


@pytest.mark.parametrize("causal, alignment", [(True, "lower_right"), (False, "upper_left")])
def test_a_call_without_statistics_writes_the_same_o_and_nothing_else(causal, alignment):
    """The launch for calls that keep no lse (STATS=False: no gradient recorded, no lse returned) stores o
    exactly as the launch with the statistics does, and no statistics: o stands in for their pointer, and
    every element of o is the output, not a statistic written over it."""
    from flashtile.kernels.forward import make_forward_plan

    q, k, v = randn(1, 2, 37, 32, dtype=torch.float32), randn(1, 1, 50, 32, dtype=torch.float32), randn(
        1, 1, 50, 32, dtype=torch.float32)  # fmt: skip
    plan = make_forward_plan(q, k, v, spec=spec_of(q, k, v, causal, alignment), return_stats=True, block_q=16,
                             block_k=16)  # fmt: skip
    o, row_stats = plan.run(q, k, v)
    o_only, nothing = plan.run(q, k, v, stats=False)
    assert nothing is None and row_stats.shape == (3, 1, 2, 37)
    assert torch.equal(o_only, o)
    o_ref, _ = attention_truth(q.double(), k.double(), v.double(), causal=causal, alignment=alignment)
    torch.testing.assert_close(o_only.double(), o_ref, rtol=1e-5, atol=1e-5)

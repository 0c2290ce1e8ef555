"""One validation contract: the same inputs are valid or invalid whatever tier runs, and every refusal is
a ValueError or TypeError that names the argument (flashtile._checks). The cases are the ones a user hit:
loose flags, odd numeric types, sparse and meta tensors, launch settings, exported helpers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashtile
from flashtile.api import attention_fwd, use_backend
from flashtile.kernels.backward import flash_attention_backward
from flashtile.kernels.forward import flash_attention
from flashtile.kernels.softmax import softmax
from flashtile.reference import (
    attention_flops,
    last_key_tile,
    lse_from_stats,
    merge,
    online_softmax_stats,
    online_softmax_update,
    visible_pairs,
)
from tests._truth import attention_truth

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TIERS = ["reference", "triton"]


def qkv(D=16, H=2, H_kv=2, T=9, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=gen).to(DEVICE, dtype)
    return make(1, H, T, D), make(1, H_kv, T, D), make(1, H_kv, T, D)


# --- flashtile.attention: the same refusals on every tier --------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(enable_gqa="no"), TypeError, "enable_gqa must be a bool, got str 'no'"),
        (dict(enable_gqa=1), TypeError, "enable_gqa must be a bool"),
        (dict(return_lse=None), TypeError, "return_lse must be a bool"),
        (dict(is_causal="yes"), TypeError, "is_causal must be a bool"),
        (dict(scale=10**400), ValueError, "scale must be finite, got an int too large"),
        (dict(scale=3e38), ValueError, "scale must be at most .* for float32 inputs"),
        (dict(scale="0.5"), TypeError, "scale must be a real number or None"),
        (dict(scale=torch.tensor(0.5)), TypeError, "scale must be a real number or None"),
        (dict(alignment=None), ValueError, "alignment must be one of"),
        (dict(dropout_p=True), ValueError, "dropout_p must be 0.0"),
    ],
)
def test_attention_refuses_loose_arguments_on_every_tier(tier, kwargs, error, match):
    q, k, v = qkv()
    with use_backend(tier), pytest.raises(error, match=match):
        flashtile.attention(q, k, v, **kwargs)


@pytest.mark.parametrize("tier", TIERS)
def test_numpy_scalars_are_accepted_where_python_ones_are(tier):
    q, k, v = qkv(seed=1)
    with use_backend(tier):
        ours = flashtile.attention(q, k, v, is_causal=np.bool_(True), scale=np.float32(0.3), enable_gqa=np.bool_(False))
    expected, _ = attention_truth(q.double(), k.double(), v.double(), True, float(np.float32(0.3)))
    torch.testing.assert_close(ours.double(), expected, atol=2e-5 if DEVICE == "cpu" else 5e-3, rtol=0)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("D", [1, 7, 15, 256])
def test_head_dims_from_1_to_256_run_on_every_tier(tier, D):
    q, k, v = qkv(D=D, T=5, seed=D)
    with use_backend(tier):
        o, lse = flashtile.attention(q, k, v, is_causal=True, return_lse=True)
    o_ref, lse_ref = attention_truth(q.double(), k.double(), v.double(), True)
    tol = 2e-5 if DEVICE == "cpu" else 5e-3
    torch.testing.assert_close(o.double(), o_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), lse_ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("call", ["attention_reference", "attention_triton", "naive", "reference_forward", "kernel"])
def test_a_head_dim_over_256_is_refused_by_every_entry_point(call):
    q, k, v = qkv(D=264, T=3)
    fns = {
        "attention_reference": lambda: use_backend("reference"),
        "attention_triton": lambda: use_backend("triton"),
    }
    with pytest.raises(ValueError, match="head dim 264; flashtile supports head dims 1 to 256 on every tier"):
        if call in fns:
            with fns[call]():
                flashtile.attention(q, k, v)
        elif call == "naive":
            flashtile.naive_attention(q, k, v)
        elif call == "reference_forward":
            flashtile.flash_attention_forward(q, k, v)
        else:
            flash_attention(q, k, v)


def test_sparse_tensors_are_refused_by_name():
    q, k, v = (t.cpu() for t in qkv())
    with pytest.raises(TypeError, match="query must be a dense \\(strided\\) tensor, got layout torch.sparse_coo"):
        flashtile.attention(q.to_sparse(), k, v)


def test_meta_tensors_give_shapes_without_computing():
    q = torch.empty(2, 4, 9, 16, device="meta")
    k = torch.empty(2, 2, 11, 16, device="meta")
    o, lse = flashtile.attention(q, k, k, enable_gqa=True, return_lse=True)
    assert o.device.type == "meta" and o.shape == (2, 4, 9, 16) and lse.shape == (2, 4, 9)


def test_the_custom_op_refuses_an_unknown_backend():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="backend must be one of \\('triton', 'reference'\\), got 'cuda'"):
        attention_fwd(q, k, v, 0.25, "upper_left", -1, -1, None, "cuda")


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's bf16 limit exists on the CPU only")
def test_bf16_on_the_cpu_runs_on_the_reference_tier_or_is_refused_by_the_kernel():
    q, k, v = qkv(dtype=torch.bfloat16)
    o = flashtile.attention(q, k, v)  # dispatch: reference tier, correct
    expected, _ = attention_truth(q.double(), k.double(), v.double())
    torch.testing.assert_close(o.double(), expected, atol=2e-2, rtol=2e-2)
    with pytest.raises(TypeError, match="bfloat16 CPU tensor: the Triton interpreter computes bfloat16 wrongly"):
        flash_attention(q, k, v)


# --- kernel launchers: tile sizes and launch settings ---------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(num_warps=0), ValueError, "num_warps must be an int >= 1"),
        (dict(num_warps=3), ValueError, "num_warps must be a power of two"),
        (dict(num_stages=0), ValueError, "num_stages must be an int >= 1"),
        (dict(num_warps=4.0), TypeError, "num_warps must be an int"),
        (dict(block_q=np.int64(16)), None, None),  # a NumPy int is an int
        (dict(return_stats="yes"), TypeError, "return_stats must be a bool"),
    ],
)
def test_forward_launch_settings(kwargs, error, match):
    q, k, v = qkv()
    if error is None:
        o, _ = flash_attention(q, k, v, **kwargs)
        torch.testing.assert_close(o, flash_attention(q, k, v)[0])
        return
    with pytest.raises(error, match=match):
        flash_attention(q, k, v, **kwargs)


@pytest.mark.parametrize(
    "config,error,match",
    [
        ({"dkdv": (32, 32, 4, 1)}, ValueError, 'config must be a dict with exactly the keys "dkdv" and "dq"'),
        ({"dkdv": (32, 32, 4), "dq": (32, 32, 4, 1)}, ValueError, 'config\\["dkdv"\\] must be \\(block_q'),
        ({"dkdv": (32, 32, 0, 1), "dq": (32, 32, 4, 1)}, ValueError, "num_warps must be an int >= 1"),
        ({"dkdv": (32, 24, 4, 1), "dq": (32, 32, 4, 1)}, ValueError, 'config\\["dkdv"\\] block_k must be a power'),
        ([(32, 32, 4, 1)], ValueError, "config must be a dict"),
    ],
)
def test_backward_config_is_validated(config, error, match):
    q, k, v = qkv()
    o, lse = flash_attention(q, k, v)
    with pytest.raises(error, match=match):
        flash_attention_backward(q, k, v, o, lse, o, config=config)


def test_backward_refuses_stats_of_the_wrong_shape():
    q, k, v = qkv()
    o, lse, stats = flash_attention(q, k, v, return_stats=True)
    with pytest.raises(ValueError, match="stats must be \\(2, B, H, Tq\\)"):
        flash_attention_backward(q, k, v, o, lse, o, stats=stats[:, :, :1])


@pytest.mark.parametrize("block", [2.0, "16", True, 0, 24])
def test_softmax_block_is_checked(block):
    error = ValueError if block in (0, 24) and not isinstance(block, bool) else TypeError
    with pytest.raises(error, match="block must be"):
        softmax(torch.randn(3, 40, device=DEVICE), block)


def test_softmax_takes_a_numpy_int_block():
    x = torch.randn(3, 40, device=DEVICE)
    torch.testing.assert_close(softmax(x, np.int64(16)), torch.softmax(x, -1))


# --- exported helpers -----------------------------------------------------------------------------------


def test_online_softmax_stats_give_torch_logsumexp_on_non_finite_rows():
    x = torch.randn(5, 9, dtype=torch.float64)
    x[0, 3] = float("inf")
    x[1, 4] = float("nan")
    x[2] = float("-inf")
    x[3, 0] = float("-inf")
    m, l = online_softmax_stats(x, 4)
    lse = lse_from_stats(m, l)
    expected = torch.logsumexp(x, -1)
    assert torch.isposinf(lse[0]) and torch.isnan(lse[1]) and torch.isneginf(lse[2])
    torch.testing.assert_close(lse, expected, equal_nan=True)


def test_merge_and_update_refuse_mismatched_rows():
    m, l = torch.zeros(3), torch.ones(3)
    with pytest.raises(ValueError, match="m_b has shape \\(1,\\) but m_a has \\(3,\\)"):
        merge(m, l, torch.zeros(1), torch.ones(1))
    with pytest.raises(ValueError, match="x_block.shape\\[:-1\\] has shape \\(1,\\) but m has \\(3,\\)"):
        online_softmax_update(m, l, torch.randn(1, 4))
    with pytest.raises(ValueError, match="l has shape"):
        lse_from_stats(m, torch.ones(2))


def test_counting_helpers_refuse_an_invalid_alignment_and_bad_sizes():
    with pytest.raises(ValueError, match="alignment must be one of"):
        visible_pairs(4, 8, True, "lower-right")
    with pytest.raises(ValueError, match="alignment must be one of"):
        attention_flops(1, 1, 4, 8, 16, True, "bottom_right")
    with pytest.raises(TypeError, match="Tq must be an int"):
        visible_pairs(4.0, 8)
    with pytest.raises(ValueError, match="block_k must be a positive int"):
        last_key_tile(16, 64, 0, 0)

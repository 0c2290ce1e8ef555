"""flashtile.decode_attention: the tier it picks, what it returns, and every input it refuses."""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile._env import is_interpreting
from flashtile.api import pick_backend, use_backend
from flashtile.decode import H200_SM_COUNT, MIN_KEYS_PER_SPLIT, pick_num_splits
from tests._truth import assert_close_to_truth, decode_truth
from tests.decode._decode_cases import random_decode_inputs, to_pages


def _seqlens(*n):
    return torch.tensor(n, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_decode_attention_matches_truth_on_every_cpu_tier(dtype):
    lengths = [33, 0, 4]
    q, k, v = random_decode_inputs(3, 8, 2, 4, 33, 16, dtype, seed=1)
    o, lse = flashtile.decode_attention(q, k, v, _seqlens(*lengths), num_splits=3, return_lse=True)
    o_true, lse_true = decode_truth(q, k, v, lengths)
    tol = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    assert o.shape == q.shape and o.dtype == dtype
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close_to_truth(o, o_true, "o", rtol=tol, atol=tol)
    assert_close_to_truth(lse, lse_true, "lse", rtol=tol, atol=tol)


def test_decode_dispatches_like_flashtile_attention_use_backend_included():
    # decode_attention asks api.pick_backend: the same tier choice, and use_backend forces it too.
    q, k, v = random_decode_inputs(1, 4, 2, 1, 9, 16, seed=5)
    seqlens = _seqlens(9)
    assert pick_backend(q.double()) == "reference"
    assert pick_backend(q.bfloat16()) == "reference"  # the interpreter's bf16 is wrong
    assert pick_backend(q) == ("triton" if is_interpreting() or q.is_cuda else "reference")
    with use_backend("reference"):
        by_reference = flashtile.decode_attention(q, k, v, seqlens)
    torch.testing.assert_close(by_reference, flashtile.decode_attention(q, k, v, seqlens), atol=2e-5, rtol=2e-5)


def test_paged_call_through_the_public_function_with_padded_table():
    lengths = [21, 3]
    q, k, v = random_decode_inputs(2, 4, 4, 3, 21, 8, seed=2)
    k_pages, v_pages, table = to_pages(k, v, 4, lengths, pad=-1)  # -1 past each sequence's pages: never read
    o = flashtile.decode_attention(q, k_pages, v_pages, _seqlens(*lengths), block_table=table)
    assert_close_to_truth(o, decode_truth(q, k, v, lengths)[0], "o", rtol=2e-5, atol=2e-5)


def test_output_carries_no_gradient():
    q, k, v = (t.requires_grad_() for t in random_decode_inputs(1, 2, 2, 1, 8, 4, seed=0))
    assert not flashtile.decode_attention(q, k, v).requires_grad


def test_split_count_fills_the_sms_and_keeps_splits_long():
    assert pick_num_splits(H200_SM_COUNT, 1 << 17) == 1  # enough programs already
    assert pick_num_splits(8, 100) == 1  # too short to split
    s = pick_num_splits(8, 32768)  # B = 1, H_kv = 8: 8 programs for 132 SMs
    assert 8 * s % H200_SM_COUNT == 0 or 8 * s >= H200_SM_COUNT
    for programs, capacity in [(1, 4096), (8, 8192), (32, 131072), (64, 1024)]:
        s = pick_num_splits(programs, capacity)
        assert 1 <= s <= max(1, capacity // MIN_KEYS_PER_SPLIT)


BAD = [  # (what, kwargs overriding the good call, error type, message fragment)
    ("query not a tensor", dict(query=[1.0]), TypeError, "query must be a torch.Tensor"),
    ("query rank 3", dict(query=torch.zeros(2, 4, 8)), ValueError, "query must be a rank-4"),
    ("int query", dict(query=torch.zeros(2, 4, 1, 8, dtype=torch.int32)), TypeError, "query must have dtype"),
    ("cache dtype", dict(key_cache=torch.zeros(2, 2, 10, 8, dtype=torch.float16)), TypeError, "key_cache has dtype"),
    ("cache device", dict(key_cache=torch.zeros(2, 2, 10, 8, device="meta")), ValueError, "key_cache is on meta"),
    ("seqlens device", dict(cache_seqlens=torch.zeros(2, dtype=torch.int32, device="meta")), ValueError,
     "cache_seqlens is on meta"),
    ("value shape", dict(value_cache=torch.zeros(2, 2, 9, 8)), ValueError,
     r"value_cache must have the same shape as key_cache .* in every dim but the last"),
    ("17 new tokens", dict(query=torch.zeros(2, 4, 17, 8)), ValueError, "1 to 16"),
    ("head dim", dict(query=torch.zeros(2, 4, 1, 6)), ValueError, "head dim"),
    ("heads", dict(query=torch.zeros(2, 3, 1, 8)), ValueError, "multiple of the number of key/value heads"),
    ("batch", dict(query=torch.zeros(3, 4, 1, 8)), ValueError, "key_cache has batch size 2 but query has 3"),
    ("seqlens int64", dict(cache_seqlens=torch.tensor([3, 4])), TypeError, "cache_seqlens must have dtype"),
    ("seqlens length", dict(cache_seqlens=_seqlens(3)), ValueError, "cache_seqlens must have B = 2"),
    ("seqlens rank", dict(cache_seqlens=_seqlens(3, 4)[None]), ValueError, "cache_seqlens must be a rank-1"),
    ("seqlen negative", dict(cache_seqlens=_seqlens(3, -1)), ValueError, r"cache_seqlens\[1\] = -1"),
    ("seqlen above T_max", dict(cache_seqlens=_seqlens(11, 3)), ValueError, r"cache_seqlens\[0\] = 11"),
    ("seqlen below Tq", dict(query=torch.zeros(2, 4, 3, 8), cache_seqlens=_seqlens(2, 5)), ValueError,
     r"cache_seqlens\[0\] = 2.*\[3, 10\]"),
    ("cache shorter than Tq", dict(query=torch.zeros(2, 4, 12, 8), cache_seqlens=None), ValueError,
     "holds 10 keys but query has 12"),
    ("num_splits 0", dict(num_splits=0), ValueError, "num_splits must be an int >= 1"),
    ("num_splits float", dict(num_splits=2.0), TypeError, "num_splits must be an int"),
    ("num_splits huge", dict(num_splits=1000), ValueError, "num_splits must be at most 128"),
    ("scale inf", dict(scale=float("inf")), ValueError, "scale must be finite"),
    ("return_lse int", dict(return_lse=1), TypeError, "return_lse must be a bool"),
]  # fmt: skip


@pytest.mark.parametrize("what,override,error,match", BAD, ids=[b[0] for b in BAD])
def test_contiguous_call_refuses_bad_input(what, override, error, match):
    args = dict(query=torch.zeros(2, 4, 1, 8), key_cache=torch.zeros(2, 2, 10, 8), value_cache=torch.zeros(2, 2, 10, 8),
                cache_seqlens=_seqlens(3, 10))  # fmt: skip
    args.update(override)
    with pytest.raises(error, match=match):
        flashtile.decode_attention(**args)


PAGED_BAD = [
    ("table int64", dict(block_table=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "block_table must have dtype"),
    ("table rows", dict(block_table=torch.zeros(3, 3, dtype=torch.int32)), ValueError, r"\(B, max_pages\) = \(2"),
    ("table rank", dict(block_table=torch.zeros(2, dtype=torch.int32)), ValueError, "block_table must be a rank-2"),
    ("page out of pool", dict(block_table=torch.tensor([[0, 5, 0], [1, 2, 0]], dtype=torch.int32)), ValueError,
     r"block_table\[0, 1\] = 5 is outside the page pool \[0, 5\)"),
    ("negative page", dict(block_table=torch.tensor([[0, 1, 2], [-1, 0, 0]], dtype=torch.int32)), ValueError,
     r"block_table\[1, 0\] = -1"),
    ("above the table's pages", dict(cache_seqlens=_seqlens(13, 1)), ValueError, r"\[1, 12\].*max_pages"),
]  # fmt: skip


@pytest.mark.parametrize("what,override,error,match", PAGED_BAD, ids=[b[0] for b in PAGED_BAD])
def test_paged_call_refuses_bad_tables(what, override, error, match):
    # 5 pages of 4 keys; max_pages 3, so a sequence holds at most 12 keys. Sequence 1 has 1 key: one page read.
    args = dict(query=torch.zeros(2, 4, 1, 8), key_cache=torch.zeros(5, 2, 4, 8), value_cache=torch.zeros(5, 2, 4, 8),
                cache_seqlens=_seqlens(9, 1), block_table=torch.tensor([[0, 1, 2], [3, -1, -1]], dtype=torch.int32))
    args.update(override)
    with pytest.raises(error, match=match):
        flashtile.decode_attention(**args)


def test_meta_tensors_give_shapes_without_computing():
    q = torch.empty(2, 8, 3, 16, device="meta")
    k = torch.empty(2, 2, 40, 16, device="meta")
    o, lse = flashtile.decode_attention(q, k, k, torch.empty(2, dtype=torch.int32, device="meta"), return_lse=True)
    assert o.device.type == "meta" and o.shape == (2, 8, 3, 16) and lse.shape == (2, 8, 3)
    assert lse.dtype == torch.float32


def test_autocast_does_not_lower_the_precision_of_either_tier():
    lengths = [30, 5]
    q, k, v = random_decode_inputs(2, 4, 2, 2, 30, 16, torch.float64, seed=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = flashtile.decode_attention(q, k, v, _seqlens(*lengths), num_splits=2)
        o32 = flashtile.decode_attention(q.float(), k.float(), v.float(), _seqlens(*lengths), num_splits=2)
    o_true = decode_truth(q, k, v, lengths)[0]
    assert o.dtype == torch.float64 and o32.dtype == torch.float32
    assert_close_to_truth(o, o_true, "o", rtol=1e-12, atol=1e-12)
    assert_close_to_truth(o32, o_true, "o", rtol=2e-5, atol=2e-5)


def test_numpy_scalars_are_accepted_like_python_ones():
    import numpy as np

    q, k, v = random_decode_inputs(1, 2, 2, 1, 20, 8, seed=0)
    o, _ = flashtile.decode_attention(q, k, v, scale=np.float32(0.5), num_splits=np.int64(2),
                                      return_lse=np.bool_(True))
    o_ref = flashtile.decode_attention(q, k, v, scale=0.5, num_splits=2)
    assert torch.equal(o, o_ref)

"""The split-K decode kernels against the float64 truth, through Triton's interpreter on the CPU.

fp32 and fp16 only (the interpreter computes bf16 wrongly, Triton issue 11584: bf16 is in the GPU
file). Caches are a few tiles of 16 keys (``decode_config``'s interpreter tile), so that every
program kind appears: full tiles, a masked last tile, slices with no key, packed rows past g * Tq.
"""

from __future__ import annotations

import pytest
import torch

from flashtile._env import is_interpreting
from flashtile.kernels.decode import flash_decode
from tests._truth import assert_close_to_truth, decode_truth
from tests.decode._decode_cases import poison_past_lengths, random_decode_inputs, to_pages

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or is_interpreting()), reason="needs CUDA or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _check(q, k, v, lengths, dtype, scale=None, **kwargs):
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    o, lse = flash_decode(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), seqlens, scale=scale, **kwargs)
    o_true, lse_true = decode_truth(q, k, v, lengths, scale)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert_close_to_truth(o, o_true, "o", **TOL[dtype])
    assert_close_to_truth(lse, lse_true, "lse", **TOL[dtype])
    return o, lse


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_splits", [1, 3, 9])  # 9 > the 4 key tiles of the longest sequence
def test_decode_kernel_matches_truth_on_ragged_gqa_batches(group, num_splits):
    Tq, T_max = 2, 61
    lengths = [T_max, Tq, 16, 0]  # full, only the new tokens, exactly one tile, an empty slot
    q, k, v = random_decode_inputs(4, 2 * group, 2, Tq, T_max, 24, seed=group)
    k, v = poison_past_lengths(k, v, lengths)  # a read past a sequence's length would give NaN
    _check(q, k, v, lengths, torch.float32, num_splits=num_splits)


@pytest.mark.parametrize("Tq", [1, 5, 16])
def test_decode_kernel_aligns_new_tokens_lower_right_per_sequence(Tq):
    lengths = [40, Tq, 23]
    q, k, v = random_decode_inputs(3, 4, 1, Tq, 40, 16, seed=Tq)  # MQA: 4 heads x Tq rows in one program
    _check(q, k, v, lengths, torch.float32, num_splits=2)


def test_decode_kernel_packs_more_rows_than_one_block():
    # g * Tq = 8 * 16 = 128 packed rows: two row blocks of 64 per KV head.
    q, k, v = random_decode_inputs(1, 8, 1, 16, 33, 8, seed=1)
    _check(q, k, v, [33], torch.float32, num_splits=2)


@pytest.mark.parametrize("D", [1, 20, 64])
def test_decode_kernel_pads_odd_head_dims(D):
    q, k, v = random_decode_inputs(2, 2, 1, 1, 19, D, seed=D)
    _check(q, k, v, [19, 1], torch.float32, num_splits=2)


def test_decode_kernel_in_fp16_with_a_negative_scale():
    q, k, v = random_decode_inputs(2, 4, 2, 3, 50, 32, torch.float16, seed=5)
    _check(q, k, v, [50, 31], torch.float16, scale=-0.3, num_splits=4)


def test_decode_kernel_reads_strided_caches():
    q, k, v = random_decode_inputs(2, 4, 2, 1, 30, 16, seed=2)
    k_bthd = k.transpose(1, 2).contiguous().transpose(1, 2)  # a (B, T, H_kv, D) cache seen as (B, H_kv, T, D)
    v_bthd = v.transpose(1, 2).contiguous().transpose(1, 2)
    _check(q.transpose(2, 3).contiguous().transpose(2, 3), k_bthd, v_bthd, [30, 12], torch.float32, num_splits=3)


@pytest.fixture(scope="module")
def contiguous_decode():
    """One ragged batch, its contiguous-cache answer and its float64 truth, shared by every page size."""
    lengths = [45, 2, 19]
    q, k, v = random_decode_inputs(3, 8, 2, 2, 45, 16, seed=5)
    o, lse = flash_decode(q, k, v, torch.tensor(lengths, dtype=torch.int32), num_splits=3)
    return lengths, q, k, v, o, lse, decode_truth(q, k, v, lengths)[0]


@pytest.mark.parametrize("page_size", [1, 5, 16, 32])
def test_paged_cache_with_shuffled_pages_equals_the_contiguous_cache(contiguous_decode, page_size):
    lengths, q, k, v, o, lse, o_true = contiguous_decode
    k_pages, v_pages, table = to_pages(k, v, page_size, lengths, seed=page_size)  # NaN in every unused slot
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    o_paged, lse_paged = flash_decode(q, k_pages, v_pages, seqlens, num_splits=3, block_table=table)
    torch.testing.assert_close(o_paged, o, rtol=0, atol=0)  # the same tiles, the same arithmetic
    torch.testing.assert_close(lse_paged, lse, rtol=0, atol=0)
    assert_close_to_truth(o_paged, o_true, "o", **TOL[torch.float32])


def test_nan_in_one_sequence_stays_in_that_sequence():
    q, k, v = random_decode_inputs(3, 4, 2, 1, 40, 16, seed=9)
    v[1, 1, 7] = float("nan")  # a value every new token of sequence 1 sees, in KV head 1 (query heads 2, 3)
    o, lse = flash_decode(q, k, v, torch.tensor([40, 40, 40], dtype=torch.int32), num_splits=4)
    assert torch.isnan(o[1, 2:]).all()
    assert not torch.isnan(o[1, :2]).any() and not torch.isnan(o[[0, 2]]).any() and not torch.isnan(lse).any()


def test_poison_one_slot_past_the_length_is_never_read_and_one_inside_is():
    lengths = [29]
    q, k, v = random_decode_inputs(1, 2, 1, 1, 40, 16, seed=4)
    k_out, v_out = poison_past_lengths(k, v, lengths)
    o, _ = flash_decode(q, k_out, v_out, torch.tensor(lengths, dtype=torch.int32), num_splits=2)
    assert not torch.isnan(o).any()
    k_out[0, 0, lengths[0] - 1] = float("nan")  # control: the last key is visible, so its NaN must arrive
    o, _ = flash_decode(q, k_out, v_out, torch.tensor(lengths, dtype=torch.int32), num_splits=2)
    assert torch.isnan(o).all()


def test_default_split_count_runs_and_matches():
    q, k, v = random_decode_inputs(1, 4, 2, 1, 300, 16, seed=6)  # capacity 300 >= 256 keys: one split of 256
    _check(q, k, v, [300], torch.float32)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inside the interpreter warns on inf - inf
def test_infinite_scores_follow_the_package_rule_on_both_tiers():
    from flashtile.reference.decode import decode_attention_reference

    q, k, v = random_decode_inputs(2, 2, 1, 1, 40, 16, seed=1)
    q = q.abs()
    k[0, 0, 7] = 0.0
    k[0, 0, 7, 3] = float("inf")  # a +inf score in sequence 0: o NaN, lse +inf (torch.logsumexp's answer)
    k[1, 0, 9] = 0.0
    k[1, 0, 9, 3] = float("-inf")  # a -inf score in sequence 1: that key simply drops out
    lengths = [40, 40]
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    o_true, lse_true = decode_truth(q, k, v, lengths)
    assert torch.isposinf(lse_true[0]).all() and torch.isfinite(lse_true[1]).all()
    for o, lse in (flash_decode(q, k, v, seqlens, num_splits=3),
                   decode_attention_reference(q.double(), k.double(), v.double(), seqlens, num_splits=3)):
        assert_close_to_truth(o, o_true, "o", **TOL[torch.float32])
        assert_close_to_truth(lse, lse_true, "lse", **TOL[torch.float32])


def test_nan_value_behind_the_diagonal_follows_each_tiers_rule():
    """The contract (docs/part-b/attention-api.md, "Values a row does not see"): on the reference tier a
    value the row does not see never reaches it; on the Triton tier it may, where it shares a key tile with
    keys the row sees (here the two new tokens' keys sit in one tile)."""
    from flashtile.reference.decode import decode_attention_reference

    q, k, v = random_decode_inputs(1, 1, 1, 2, 20, 16, seed=1)
    v[0, 0, 19] = float("nan")  # the second new token's own value: hidden from the first new token
    seqlens = torch.tensor([20], dtype=torch.int32)
    o_true, _ = decode_truth(q, k, v, [20])
    assert torch.isnan(o_true).all()  # 0 * NaN in P V: the einsum truth multiplies the hidden value too
    hidden_zeroed = v.clone()
    hidden_zeroed[0, 0, 19] = 0.0  # the first token's truth: the hidden value left out
    o_first, _ = decode_truth(q, k, hidden_zeroed, [20])
    o_kernel, _ = flash_decode(q, k, v, seqlens, num_splits=2)
    o_ref, _ = decode_attention_reference(q.double(), k.double(), v.double(), seqlens, num_splits=2)
    assert torch.isnan(o_kernel).all()  # shares the tile: reaches both tokens
    assert torch.isnan(o_ref[..., 1, :]).all()  # the second token sees its own NaN value
    assert torch.isfinite(o_ref[..., 0, :]).all()  # the first does not see it, and it does not reach it
    torch.testing.assert_close(o_ref[..., 0, :], o_first[..., 0, :].to(o_ref.dtype), rtol=1e-12, atol=1e-12)

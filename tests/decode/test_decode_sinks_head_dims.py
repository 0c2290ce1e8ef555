"""decode_attention with attention sinks and a value head dim of its own (d_v != d_qk), on both tiers.

The truth is ``sink_decode_truth``: each row's softmax over its visible keys and one more column, the
sink, with a value of zero, in float64 from the definition. The Triton kernels run in the interpreter
(float32 and float16; bf16 is in the GPU file). The cases cover pairs of the options, not their grid:
contiguous and paged caches, GQA, one slice (the split kernel holds the sink) and several (the merge
does: the sink counted once), windows, soft-caps, empty sequences, and the head-dim pairs
(192, 128), (128, 64), (64, 128) and small odd ones.
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile._spec import output_strides
from flashtile.api import check_attention_call, use_backend
from flashtile.decode import decode_op
from flashtile.kernels.decode import make_attention_decode_plan
from tests._truth import assert_close_to_truth
from tests.decode._decode_cases import random_decode_inputs, sink_decode_truth, to_pages

TOL = {torch.float64: 1e-12, torch.float32: 3e-5, torch.float16: 3e-3}


def _seqlens(*n):
    return torch.tensor(n, dtype=torch.int32)


def _sinks(H, seed, dtype=torch.float32):
    """One sink per head, of the scores' size and larger (so that the sink holds much of each row's
    weight), the last head's -inf (no sink)."""
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(seed)) * 2 + 1
    sinks[-1] = float("-inf")
    return sinks.to(dtype)


# (name, B/H/H_kv/Tq, T_max, lengths, d_qk, d_v, page_size, num_splits, window, softcap)
CASES = [
    ("mla-192-128", (3, 4, 2, 3), 45, [45, 0, 3], 192, 128, None, 3, None, None),
    ("paged-128-64", (2, 8, 2, 2), 40, [40, 17], 128, 64, 8, 1, (5, 0), None),
    ("paged-64-128", (2, 2, 2, 1), 50, [0, 50], 64, 128, 5, None, None, 2.0),
    ("mqa-odd-9-5", (2, 4, 1, 4), 37, [37, 4], 9, 5, None, 4, (9, 0), 1.5),
    ("equal-dims-many-splits", (1, 2, 1, 2), 64, [64], 16, 16, 16, 7, None, None),
]


def _run(case, backend, dtype, sinks_dtype=torch.float32):
    name, (B, H, H_kv, Tq), T_max, lengths, d_qk, d_v, page, num_splits, window, softcap = case
    seed = sum(map(ord, name))
    q, k, v = random_decode_inputs(B, H, H_kv, Tq, T_max, d_qk, dtype, seed=seed, D_v=d_v)
    sinks = _sinks(H, seed, sinks_dtype)
    caches, table = (k, v), None
    if page is not None:
        *caches, table = to_pages(k, v, page, lengths, seed=seed)
    with use_backend(backend):
        o, lse = flashtile.decode_attention(q, *caches, _seqlens(*lengths), block_table=table, num_splits=num_splits,
                                            window=window, softcap=softcap, sinks=sinks, return_lse=True)  # fmt: skip
    o_true, lse_true = sink_decode_truth(q, k, v, lengths, window=window, softcap=softcap, sinks=sinks)
    assert o.shape == (B, H, Tq, d_v) and o.dtype == dtype
    assert_close_to_truth(o, o_true, "o", rtol=TOL[dtype], atol=TOL[dtype])
    assert_close_to_truth(lse, lse_true, "lse", rtol=TOL[dtype], atol=TOL[dtype])
    return o, lse, sinks, lengths


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_sinks_and_head_dims_match_the_float64_formula(case, backend):
    dtype = torch.float32 if backend == "triton" else torch.float64
    o, lse, sinks, lengths = _run(case, backend, dtype)
    for b, n in enumerate(lengths):
        if n == 0:  # a row that sees no key: o = 0, and lse is its head's sink (-inf for the last head)
            assert torch.equal(o[b], torch.zeros_like(o[b]))
            torch.testing.assert_close(lse[b], sinks.to(lse.dtype)[:, None].expand_as(lse[b]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_half_inputs_with_half_sinks(backend):
    # the sinks may be float32 or the inputs' dtype; the reference tier takes float16 on the CPU too
    _run(CASES[0], backend, torch.float16, sinks_dtype=torch.float16)
    _run(CASES[1], backend, torch.float16)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_sink_of_minus_inf_is_no_sink_bit_for_bit(backend, num_splits):
    q, k, v = random_decode_inputs(2, 4, 2, 2, 40, 24, seed=4, D_v=12)
    seqlens = _seqlens(40, 9)
    with use_backend(backend):
        plain = flashtile.decode_attention(q, k, v, seqlens, num_splits=num_splits, return_lse=True)
        none = flashtile.decode_attention(q, k, v, seqlens, num_splits=num_splits, return_lse=True,
                                          sinks=torch.full((4,), float("-inf")))  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(plain, none))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_the_sink_is_counted_once_whatever_the_split_count(backend):
    # a sink far above every score takes almost all of each row's weight: counted once per slice, the
    # lse would grow by log(num_splits) and o shrink by that factor
    q, k, v = random_decode_inputs(1, 2, 1, 1, 80, 8, seed=9, D_v=8)
    sinks = torch.tensor([4.0, 6.0])
    o_true, lse_true = sink_decode_truth(q, k, v, [80], sinks=sinks)
    with use_backend(backend):
        for num_splits in (1, 2, 5):
            o, lse = flashtile.decode_attention(q, k, v, num_splits=num_splits, sinks=sinks, return_lse=True)
            assert_close_to_truth(o, o_true, "o", rtol=3e-5, atol=3e-5)
            assert_close_to_truth(lse, lse_true, "lse", rtol=3e-5, atol=3e-5)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_sinks_through_strided_and_negative_views(backend):
    # the sinks are read through their strides, and a negative-bit view counts as its values
    q, k, v = random_decode_inputs(2, 4, 2, 1, 30, 16, seed=2, D_v=8)
    every_other = _sinks(8, 3)[::2]
    negated = torch._neg_view(-_sinks(4, 5))  # its values are _sinks(4, 5), the last -inf
    seqlens = _seqlens(30, 11)
    with use_backend(backend):
        for sinks in (every_other, negated):
            o = flashtile.decode_attention(q, k, v, seqlens, num_splits=2, sinks=sinks)
            o_true, _ = sink_decode_truth(q, k, v, [30, 11], sinks=sinks.clone().resolve_neg())
            assert_close_to_truth(o, o_true, "o", rtol=3e-5, atol=3e-5)


def _bad_calls():
    q, k, v = random_decode_inputs(1, 4, 2, 1, 8, 16, seed=0, D_v=8)
    good = torch.zeros(4)
    return q, k, v, good, [
        (dict(sinks=torch.zeros(5)), ValueError, r"sinks must have shape \(H,\) = \(4,\)"),
        (dict(sinks=torch.zeros(1, 4)), ValueError, "sinks"),
        (dict(sinks=torch.zeros(4, dtype=torch.float64)), TypeError, "sinks"),
        (dict(sinks=torch.zeros(4, dtype=torch.int32)), TypeError, "sinks"),
        (dict(sinks=[0.0] * 4), TypeError, "sinks"),
        (dict(sinks=torch.zeros(4, device="meta")), ValueError, "sinks is on meta"),
        (dict(sinks=torch.tensor([0.0, float("inf"), 0.0, 0.0])), ValueError, "sinks must be finite or -inf"),
        (dict(sinks=torch.tensor([0.0, 0.0, float("nan"), 0.0])), ValueError, "sinks must be finite or -inf"),
        (dict(sinks=torch.tensor([0.0, 40.0, 0.0, 0.0]), scale=1e-37), ValueError, "sinks must be at most 1.701e"),
        (dict(value_cache=v[:, :, :7]), ValueError, r"value_cache must have the same shape as key_cache "
         r"\(1, 2, 8, 16\) in every dim but the last .* value_cache has slots 7 \(dim 2\), key_cache 8"),
        (dict(value_cache=v[:, :1]), ValueError, r"value_cache has key/value heads 1 \(dim 1\), key_cache 2"),
        (dict(value_cache=torch.zeros(1, 2, 8, 257)), ValueError, "value_cache has head dim d_v = 257"),
        (dict(value_cache=torch.zeros(1, 2, 8, 0)), ValueError, "value_cache has head dim d_v = 0"),
        (dict(value_cache=v.double()), TypeError, "value_cache"),
    ]


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_bad_sinks_and_value_caches_are_refused_by_name_on_every_tier(backend):
    q, k, v, good, cases = _bad_calls()
    with use_backend(backend):
        for i, (change, error, match) in enumerate(cases):
            args = dict(value_cache=v, sinks=good, scale=None) | change
            with pytest.raises(error, match=match):
                flashtile.decode_attention(q, k, args["value_cache"], sinks=args["sinks"], scale=args["scale"])
            if i == 6:  # a bad value after a good call with the same layout: checked again
                flashtile.decode_attention(q, k, v, sinks=good)


def test_meta_inputs_give_a_d_v_wide_output():
    q, k, v = (t.to("meta") for t in random_decode_inputs(2, 4, 2, 3, 8, 16, seed=0, D_v=40))
    o, lse = flashtile.decode_attention(q, k, v, sinks=torch.zeros(4, device="meta"), return_lse=True)
    assert o.shape == (2, 4, 3, 40) and lse.shape == (2, 4, 3)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_sinks_and_head_dims_compile_with_fullgraph(backend):
    torch._dynamo.reset()
    q, k, v = random_decode_inputs(3, 4, 2, 2, 40, 24, seed=6, D_v=10)
    sinks = torch.nn.Parameter(_sinks(4, 6))  # a model's sinks: decoding asks the graph for no backward
    compiled = torch.compile(lambda q, k, v, n, s: flashtile.decode_attention(q, k, v, n, sinks=s, num_splits=3,
                                                                              return_lse=True), fullgraph=True)
    with use_backend(backend):
        for lengths in ([40, 0, 17], [2, 33, 5]):  # new values: nothing guards on them
            o, lse = compiled(q, k, v, _seqlens(*lengths), sinks)
            o_true, lse_true = sink_decode_truth(q, k, v, lengths, sinks=sinks.detach())
            assert not o.requires_grad
            assert_close_to_truth(o, o_true, "o", rtol=3e-5, atol=3e-5)
            assert_close_to_truth(lse, lse_true, "lse", rtol=3e-5, atol=3e-5)
        with pytest.raises(ValueError, match="sinks must be finite or -inf"):  # the eager check, when it runs
            compiled(q, k, v, _seqlens(40, 0, 17), torch.nn.Parameter(torch.tensor([0.0, float("nan"), 0.0, 0.0])))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_the_decode_op_passes_opcheck_with_sinks_and_head_dims(backend):
    q, k, v = random_decode_inputs(2, 4, 2, 2, 24, 8, seed=8, D_v=12)
    args = (_seqlens(24, 3), None, 0.3, 2, -1, 0, None, backend, _sinks(4, 8))
    result = torch.library.opcheck(decode_op, (q, k, v, *args))
    assert set(result.values()) == {"SUCCESS"}, result


def test_attention_decode_plans_take_sinks_and_a_value_head_dim():
    # what flashtile.attention's short calls run on the decode kernels: a full cache, lower-right causal, o
    # laid out as attention lays it out (q a (B, H, T, D) view of (B, T, H, D): o d_v wide in that order)
    q, k, v = random_decode_inputs(2, 4, 2, 3, 33, 20, seed=11, D_v=12)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    sinks = _sinks(4, 11)
    call = check_attention_call(q, k, v, is_causal=True, scale=None, enable_gqa=True, alignment="lower_right",
                                return_lse=True, window=(6, 0), softcap=None, sinks=sinks)  # fmt: skip
    plan = make_attention_decode_plan(q, k, v, sinks, spec=call.spec, store_lse=True)
    o, lse = plan.run(q, k, v, None, None, sinks)
    o_true, lse_true = sink_decode_truth(q, k, v, [33, 33], window=(6, 0), sinks=sinks)
    assert o.stride() == output_strides(q, 12)
    assert_close_to_truth(o, o_true, "o", rtol=3e-5, atol=3e-5)
    assert_close_to_truth(lse, lse_true, "lse", rtol=3e-5, atol=3e-5)
    with pytest.raises(ValueError, match="sinks must be passed exactly where"):
        plan.run(q, k, v)

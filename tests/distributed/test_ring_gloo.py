"""Ring attention for real: 2 and 3 gloo processes on this machine (loopback only), each run bounded
in time, float64 outputs and every gradient against a single-process float64 truth.

Each process group is started once per world size and runs every case, the strided views and the error
cases, since starting processes costs more than the cases themselves.
"""

import math
import time

import pytest
import torch
import torch.distributed as dist

from flashtile.distributed import (
    ring_attention,
    ring_attention_on_shards,
    shard_sequence,
    unshard_sequence,
)
from flashtile.distributed.local import RankFailed
from tests.distributed._ring_cases import (
    attention_truth,
    random_qkv,
    run_ring_from_the_tests,
    sink_attention_truth,
)

TIMEOUT_S = 60  # a hang fails the test after this long instead of holding up CI

# (name, B, H, H_kv, T, D, is_causal, scale)
CASES = [
    ("full", 2, 4, 4, 24, 8, False, None),
    ("causal", 2, 4, 4, 24, 8, True, None),
    ("gqa-full", 1, 6, 2, 36, 16, False, 0.3),
    ("gqa-causal", 1, 6, 2, 36, 16, True, 0.3),
    ("mqa-causal", 1, 4, 1, 12, 8, True, None),
]


# (name, B, H, H_kv, T, D, is_causal, scale, sinks): -inf is a head without a sink
SINK_CASES = [
    ("sinks-full", 2, 4, 2, 24, 8, False, None, (0.7, float("-inf"), -1.2, 2.5)),
    ("sinks-causal", 1, 3, 1, 36, 16, True, 0.3, (1.5, -0.4, float("-inf"))),
]


def group_worker(rank, world_size, cases, strided_inputs, sink_cases=()):
    """Worker: every case in order, then the strided views, then the error cases last (so that a broken
    error path cannot touch the cases before it); this rank's results by kind."""
    return {
        "cases": [ring_attention_on_shards(rank, world_size, *case) for case in cases],
        "sinks": [ring_attention_on_shards(rank, world_size, *case) for case in sink_cases],
        "strided": strided_shards(rank, world_size, *strided_inputs, True),
        "mismatched": mismatched_shards(rank, world_size),
        "disagreeing": disagreeing_ranks(rank, world_size),
    }


def inputs(case, world_size):
    name, B, H, H_kv, T, D, is_causal, scale, *sinks = case
    drawn = (*random_qkv(B, H, H_kv, T, D, seed=len(name) + world_size), is_causal, scale)
    return (*drawn, torch.tensor(sinks[0], dtype=torch.float64)) if sinks else drawn


# One worker takes every test of this file (make test runs pytest-xdist with --dist loadgroup): with the tests
# dealt out to both workers, each would start both process groups of the module fixture below.
pytestmark = pytest.mark.xdist_group("gloo-ring")


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def ring_results(request):
    """One process group per world size runs every scenario of this file that needs a healthy group."""
    world_size = request.param
    cases = [inputs(case, world_size) for case in CASES]
    strided_inputs = random_qkv(1, 4, 2, 4 * world_size, 8, seed=world_size)  # T: 2 chunks per rank
    sink_cases = [inputs(case, world_size) for case in SINK_CASES]
    per_rank = run_ring_from_the_tests(group_worker, world_size, cases, strided_inputs, sink_cases,
                                       timeout_s=TIMEOUT_S)
    return world_size, cases, strided_inputs, per_rank, sink_cases


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_ring_matches_float64_truth_output_and_every_gradient(ring_results, index):
    world_size, cases, _, per_rank, _ = ring_results
    q, k, v, do, is_causal, scale = cases[index]
    got = [unshard_sequence([r["cases"][index][i] for r in per_rank], is_causal) for i in range(4)]
    truth = attention_truth(q, k, v, do, is_causal, scale)
    for name, g, want in zip(("o", "dq", "dk", "dv"), got, truth):
        assert g.dtype == torch.float64 and g.shape == want.shape, name
        torch.testing.assert_close(g, want, rtol=0, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("index", range(len(SINK_CASES)), ids=[c[0] for c in SINK_CASES])
def test_ring_with_sinks_matches_float64_truth_and_the_ranks_shares_of_dsinks_add_up(ring_results, index):
    _, _, _, per_rank, sink_cases = ring_results
    q, k, v, do, is_causal, scale, sinks = sink_cases[index]
    got = [unshard_sequence([r["sinks"][index][i] for r in per_rank], is_causal) for i in range(4)]
    got.append(sum(r["sinks"][index][4] for r in per_rank))  # each rank: its query rows' share
    truth = sink_attention_truth(q, k, v, do, sinks, is_causal, scale)
    for name, g, want in zip(("o", "dq", "dk", "dv", "dsinks"), got, truth):
        assert g.dtype == torch.float64 and g.shape == want.shape, name
        torch.testing.assert_close(g, want, rtol=0, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def mismatched_shards(rank, world_size):
    """Worker: rank 1 holds a longer shard, or a different is_causal; every rank must raise, none hang."""
    errors = []
    for T_rank1, causal_rank1 in ((8, False), (4, True)):
        T = T_rank1 if rank == 1 else 4
        q = torch.randn(1, 2, T, 4, dtype=torch.float64)
        try:
            ring_attention(q, q, q, is_causal=causal_rank1 if rank == 1 else False)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    dist.barrier()  # every rank got here: nobody is stuck in a transfer
    return errors


def test_mismatched_shards_raise_value_error_on_every_rank(ring_results):
    per_rank = [r["mismatched"] for r in ring_results[3]]
    assert all(errors == per_rank[0] for errors in per_rank)  # one message, word for word, on every rank
    shape_error, causal_error = per_rank[0]
    assert "rank 0: query (1, 2, 4, 4)" in shape_error and "rank 1: query (1, 2, 8, 4)" in shape_error
    assert "equal shard" in shape_error
    assert "rank 0: query (1, 2, 4, 4), key (1, 2, 4, 4), is_causal=False" in causal_error
    assert "rank 1: query (1, 2, 4, 4), key (1, 2, 4, 4), is_causal=True" in causal_error


def disagreeing_ranks(rank, world_size):
    """Worker: rank 1 differs from rank 0 in the dtype only, then in the scale only, then in having sinks,
    then in the sinks' values; last, rank 0's sinks hold a NaN. Every rank must raise (before this check
    knew dtypes, the ranks aborted inside gloo: the transfers' byte counts differ; before it knew whether
    each rank's arguments passed its own checks, the others waited for a rank that had stopped)."""
    errors = []
    for case in ("dtype", "scale", "sinks", "sink values", "refused"):
        dtype = torch.float32 if case == "dtype" and rank == 1 else torch.float64
        scale = 0.25 if case == "scale" and rank == 1 else None  # the default is 1/sqrt(4) = 0.5
        sinks = torch.zeros(2, dtype=torch.float64) if case == "sinks" and rank == 1 else None
        if case == "sink values":
            sinks = torch.tensor([0.5, 1.0 if rank == 1 else -1.0], dtype=torch.float64)
        if case == "refused":
            sinks = torch.tensor([0.5, math.nan if rank == 0 else 1.0], dtype=torch.float64)
        q = torch.linspace(-1, 1, 32, dtype=dtype).view(1, 2, 4, 4)
        try:
            ring_attention(q, q, q, scale=scale, sinks=sinks)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    dist.barrier()  # every rank got here: nobody is stuck in a transfer
    return errors


def test_ranks_with_different_dtypes_or_scales_raise_the_same_value_error(ring_results):
    per_rank = [r["disagreeing"] for r in ring_results[3]]
    assert all(errors[:4] == per_rank[0][:4] for errors in per_rank)  # one message, word for word, everywhere
    dtype_error, scale_error, sinks_error, values_error, _ = per_rank[0]
    assert dtype_error is not None and "different dtype on different ranks" in dtype_error
    assert "rank 0: query (1, 2, 4, 4)" in dtype_error and "float64 on cpu" in dtype_error
    assert "rank 1: query (1, 2, 4, 4)" in dtype_error and "float32 on cpu" in dtype_error
    assert scale_error is not None and "different scale on different ranks" in scale_error
    assert "scale=0.5" in scale_error and "scale=0.25" in scale_error
    assert sinks_error is not None and "different sinks on different ranks" in sinks_error
    assert "rank 1: query (1, 2, 4, 4)" in sinks_error and "float64 on cpu, with sinks" in sinks_error
    assert "rank 0: query (1, 2, 4, 4), key (1, 2, 4, 4), is_causal=False, scale=0.5, float64 on cpu;" in sinks_error
    assert values_error is not None and "different sinks' values on different ranks" in values_error
    # a rank whose own checks refused its sinks raises its error; every other rank hears of it and stops too
    refused = [errors[4] for errors in per_rank]
    assert refused[0] is not None and "sinks must be finite or -inf" in refused[0]
    for error in refused[1:]:
        assert error is not None and "the arguments of rank 0 failed their checks" in error


def strided_shards(rank, world_size, q, k, v, do, is_causal):
    """Worker: this rank's shards as views a model hands over: query a (B, H, T, D) view of a (B, T, H, D)
    tensor, key a view with the negative bit set, value every other column of a wider tensor, do
    transposed too; returns (o, dq, dk, dv) like ``ring_attention_on_shards``."""
    q, k, v, do = (shard_sequence(x, world_size, rank, is_causal) for x in (q, k, v, do))
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    k = torch.complex(torch.zeros_like(k), -k).conj().imag  # reads as k; its memory holds -k
    assert k.is_neg()
    wide = torch.zeros(*v.shape[:-1], 2 * v.shape[-1], dtype=v.dtype)
    wide[..., ::2] = v
    v = wide[..., ::2]
    do = do.transpose(1, 2).contiguous().transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = ring_attention(q, k, v, is_causal=is_causal)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def assert_strided_results(per_rank, q, k, v, do):
    got = [unshard_sequence([r[i] for r in per_rank], True) for i in range(4)]
    for name, g, want in zip(("o", "dq", "dk", "dv"), got, attention_truth(q, k, v, do, True)):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def test_strided_and_negative_view_shards_are_read_as_their_values_at_world_size_1():
    # the control of the test below: a gloo group of one rank in this process (no process to start)
    q, k, v, do = random_qkv(1, 4, 2, 8, 8, seed=1)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        per_rank = [strided_shards(0, 1, q, k, v, do, True)]
    finally:
        dist.destroy_process_group()
    assert_strided_results(per_rank, q, k, v, do)


def test_strided_and_negative_view_shards_are_read_as_their_values_in_a_ring(ring_results):
    # before: world size 1 passed and world size 2 failed inside dist.isend ("Tensors must be contiguous")
    _, _, (q, k, v, do), per_rank, _ = ring_results
    assert_strided_results([r["strided"] for r in per_rank], q, k, v, do)


def sleeps(rank, world_size):
    time.sleep(600)


def test_a_rank_that_hangs_is_killed_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish"):
        run_ring_from_the_tests(sleeps, 2, timeout_s=3)
    assert time.monotonic() - start < 30


def raises(rank, world_size):
    raise ArithmeticError(f"planted on rank {rank}")


def test_a_rank_that_raises_reports_its_traceback():
    with pytest.raises(RankFailed, match="planted on rank 0"):
        run_ring_from_the_tests(raises, 1, timeout_s=TIMEOUT_S)  # one process: what is checked is the report

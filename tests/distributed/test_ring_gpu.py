"""Ring attention with NCCL on two GPUs of one host: bf16, against single-GPU flashtile.attention and
against a float64 truth. Needs 2 CUDA devices; run with ``pytest -m gpu tests/distributed``.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0): the launcher sets it in every rank.
"""

import pytest
import torch

import flashtile
from flashtile.distributed import ring_attention_on_shards, unshard_sequence
from tests.distributed._ring_cases import (
    attention_truth,
    random_qkv,
    run_ring_from_the_tests,
    sink_attention_truth,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

# (name, B, H, H_kv, T, D, is_causal)
CASES = [
    ("full-d64", 2, 8, 8, 2048, 64, False),
    ("causal-d64", 2, 8, 8, 2048, 64, True),
    ("gqa-causal-d128", 1, 8, 2, 4096, 128, True),
    ("gqa-full-d128-short", 1, 4, 1, 256, 128, False),
]


# (name, B, H, H_kv, T, D, is_causal, sinks): bf16 shards, float32 sinks (-inf: a head without one)
SINK_CASES = [
    ("sinks-causal-d64", 2, 8, 2, 2048, 64, True, (0.5, -1.0, 2.0, float("-inf"), 0.0, 3.0, -2.5, 1.0)),
    ("sinks-full-d128", 1, 4, 4, 1024, 128, False, (1.0, float("-inf"), -0.5, 4.0)),
]


def run_cases(rank, world_size, cases):
    return [ring_attention_on_shards(rank, world_size, *case) for case in cases]


def rel(a, b):
    """||a - b|| / ||b||, in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def ring_and_single():
    cases = []
    for name, B, H, H_kv, T, D, is_causal in CASES:
        q, k, v, do = (x.to(torch.bfloat16) for x in random_qkv(B, H, H_kv, T, D, seed=len(name), dtype=torch.float32))
        cases.append((q, k, v, do, is_causal))
    per_rank = run_ring_from_the_tests(run_cases, 2, cases, backend="nccl", timeout_s=240)
    out = []
    for index, (q, k, v, do, is_causal) in enumerate(cases):
        ring = [unshard_sequence([r[index][i] for r in per_rank], is_causal) for i in range(4)]
        leaves = [x.cuda().requires_grad_() for x in (q, k, v)]
        o = flashtile.attention(*leaves, is_causal=is_causal, enable_gqa=True)
        o.backward(do.cuda())
        single = [o.detach().cpu(), *(x.grad.cpu() for x in leaves)]
        truth = [t.cpu() for t in attention_truth(*(x.cuda() for x in (q, k, v, do)), is_causal)]
        out.append((ring, single, truth))
    return out


@pytest.fixture(scope="module")
def ring_with_sinks():
    cases = []
    for name, B, H, H_kv, T, D, is_causal, sinks in SINK_CASES:
        q, k, v, do = (x.to(torch.bfloat16) for x in random_qkv(B, H, H_kv, T, D, seed=len(name), dtype=torch.float32))
        cases.append((q, k, v, do, is_causal, None, torch.tensor(sinks, dtype=torch.float32)))
    per_rank = run_ring_from_the_tests(run_cases, 2, cases, backend="nccl", timeout_s=240)
    out = []
    for index, (q, k, v, do, is_causal, _, sinks) in enumerate(cases):
        ring = [unshard_sequence([r[index][i] for r in per_rank], is_causal) for i in range(4)]
        ring.append(sum(r[index][4] for r in per_rank))  # the ranks' shares of dsinks
        out.append((ring, sink_attention_truth(q, k, v, do, sinks, is_causal)))
    return out


@pytest.mark.parametrize("index", range(len(SINK_CASES)), ids=[c[0] for c in SINK_CASES])
def test_nccl_ring_bf16_with_sinks_matches_float64(ring_with_sinks, index):
    ring, truth = ring_with_sinks[index]
    for name, r, t in zip(("o", "dq", "dk", "dv", "dsinks"), ring, truth):
        assert r.dtype == (torch.float32 if name == "dsinks" else torch.bfloat16), name
        assert torch.isfinite(r).all(), name
        # bf16 operands, as in the test without sinks: within 1e-2 of the float64 truth
        assert rel(r, t) < 1e-2, (name, rel(r, t))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_nccl_ring_bf16_matches_single_gpu_flashtile_and_float64(ring_and_single, index):
    ring, single, truth = ring_and_single[index]
    for name, r, s, t in zip(("o", "dq", "dk", "dv"), ring, single, truth):
        assert r.dtype == torch.bfloat16 and r.shape == s.shape, name
        assert torch.isfinite(r).all(), name
        # bf16 operands: both land between 1e-3 and 1e-2 of the float64 truth; the ring's extra
        # roundings (one per partial o) may cost a little, never an order of magnitude.
        assert rel(r, t) < 1e-2, (name, rel(r, t), rel(s, t))
        assert rel(r, t) < 2 * rel(s, t) + 2e-3, (name, rel(r, t), rel(s, t))
        assert rel(r, s) < 1e-2, (name, rel(r, s))


def mismatched_cuda_shards(rank, world_size):
    """Worker on an NCCL group: rank 1 holds a longer bf16 shard. The check runs on a gloo group made
    with the NCCL group's ranks; both ranks must raise the same error, and a good call must still run."""
    from flashtile.distributed import ring_attention

    device = torch.device("cuda", rank)
    T = 256 if rank == 1 else 128
    q = torch.randn(1, 2, T, 64, device=device, dtype=torch.bfloat16)
    try:
        ring_attention(q, q, q)
        error = None
    except ValueError as e:
        error = str(e)
    good = torch.randn(1, 2, 128, 64, device=device, dtype=torch.bfloat16)
    o = ring_attention(good, good, good)  # the same host group, reused
    return error, bool(torch.isfinite(o).all())


def test_nccl_mismatched_shards_raise_value_error_on_every_rank():
    per_rank = run_ring_from_the_tests(mismatched_cuda_shards, 2, backend="nccl", timeout_s=120)
    assert per_rank[0] == per_rank[1]
    error, finite = per_rank[0]
    assert error is not None and "rank 0: query (1, 2, 128, 64)" in error and "rank 1: query (1, 2, 256, 64)" in error
    assert finite

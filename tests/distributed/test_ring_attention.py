"""Ring attention in one process: the in-place (o, lse) merge, the simulated ring, world size 1, input errors.

The merge itself (``reference.merge.merge_partials``) is tested in tests/reference/test_merge.py."""

import os

import pytest
import torch
import torch.distributed as dist

import flashtile
from flashtile.api import use_backend
from flashtile.distributed import merge_into, ring_attention, shard_sequence, simulate_ring, unshard_sequence
from flashtile.reference.merge import merge_partials
from tests.distributed._ring_cases import attention_truth, random_qkv


def test_the_in_place_merge_of_each_step_gives_the_reference_bits_in_its_rows_only():
    """merge_into on the CPU: the reference merge, written into a row slice of a larger running result."""
    generator = torch.Generator().manual_seed(3)
    o, o_part = (torch.randn(2, 3, 10, 8, dtype=torch.float32, generator=generator) for _ in range(2))
    lse, lse_part = (4 * torch.randn(2, 3, 10, dtype=torch.float32, generator=generator) for _ in range(2))
    rows = slice(4, 10)
    o_want, lse_want = merge_partials(o[..., rows, :], lse[..., rows], o_part[..., rows, :], lse_part[..., rows])
    untouched = o[..., :4, :].clone(), lse[..., :4].clone()
    merge_into(o[..., rows, :], lse[..., rows], o_part[..., rows, :], lse_part[..., rows])
    assert torch.equal(o[..., rows, :], o_want) and torch.equal(lse[..., rows], lse_want)
    assert torch.equal(o[..., :4, :], untouched[0]) and torch.equal(lse[..., :4], untouched[1])


def shards(x, world_size, is_causal):
    return [shard_sequence(x, world_size, r, is_causal) for r in range(world_size)]


@pytest.mark.parametrize("H, H_kv", [(4, 4), (4, 2), (3, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_simulated_ring_matches_float64_truth_with_every_gradient(world_size, is_causal, H, H_kv):
    q, k, v, do = random_qkv(2, H, H_kv, 2 * world_size * 5, 8, seed=world_size)
    o, dq, dk, dv = (unshard_sequence(x, is_causal) for x in
                     simulate_ring(*(shards(x, world_size, is_causal) for x in (q, k, v)), is_causal, None,
                                   shards(do, world_size, is_causal)))  # fmt: skip
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), attention_truth(q, k, v, do, is_causal)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def test_causal_plan_on_contiguous_shards_is_silently_wrong_which_is_why_layout_is_checked():
    """The zig-zag plan applied to contiguous shards computes some other mask: the numbers come out
    finite and wrong, so the layout cannot be left to chance."""
    q, k, v, do = random_qkv(1, 2, 2, 16, 8, seed=5)
    contiguous = [shards(x, 2, is_causal=False) for x in (q, k, v)]
    o = unshard_sequence(simulate_ring(*contiguous, True), is_causal=False)
    assert torch.isfinite(o).all()
    assert not torch.allclose(o, attention_truth(q, k, v, do, True)[0], atol=1e-3)


@pytest.fixture
def one_rank_group():
    """A gloo process group of world size 1 inside this test process, torn down afterwards."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_world_size_1_equals_flashtile_attention(one_rank_group, is_causal):
    q, k, v, do = random_qkv(1, 4, 2, 12, 8, seed=6)
    results = []
    for fn in (
        lambda q, k, v: ring_attention(q, k, v, is_causal=is_causal),
        lambda q, k, v: flashtile.attention(q, k, v, is_causal=is_causal, enable_gqa=True),
    ):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with use_backend("reference"):
            o = fn(*leaves)
            o.backward(do)
        results.append([o.detach(), *(x.grad for x in leaves)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


def test_no_process_group_is_a_value_error_that_says_how_to_make_one():
    assert not dist.is_initialized()
    q, k, v, _ = random_qkv(1, 2, 2, 8, 4, seed=7)
    with pytest.raises(ValueError, match="init_process_group"):
        ring_attention(q, k, v)


def test_a_layout_that_does_not_match_is_causal_is_a_value_error():
    q, k, v, _ = random_qkv(1, 2, 2, 8, 4, seed=8)
    with pytest.raises(ValueError, match="does not match is_causal=True"):
        ring_attention(q, k, v, is_causal=True, layout="contiguous")
    with pytest.raises(ValueError, match="does not match is_causal=False"):
        ring_attention(q, k, v, is_causal=False, layout="zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_attention(q, k, v, layout="striped")


def test_bad_shards_are_caught_before_any_communication():
    q, k, v, _ = random_qkv(1, 2, 2, 6, 4, seed=9)
    with pytest.raises(ValueError, match="even"):
        ring_attention(q[..., :5, :], k[..., :5, :], v[..., :5, :], is_causal=True)
    with pytest.raises(ValueError, match="self-attention"):
        ring_attention(q[..., :4, :], k, v)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        ring_attention(q, k, v, is_causal=1)
    with pytest.raises(TypeError, match="query must be a torch.Tensor"):
        ring_attention(q.tolist(), k, v)


def test_group_of_the_wrong_type_is_a_type_error(one_rank_group):
    q, k, v, _ = random_qkv(1, 2, 2, 6, 4, seed=10)
    with pytest.raises(TypeError, match="ProcessGroup"):
        ring_attention(q, k, v, group="world")


def test_backward_with_each_steps_own_lse_is_wrong_which_is_why_the_forward_saves_the_merged_one():
    """The ring backward passes the final (o, lse) to every step. A step's own partial lse would make
    exp(S - lse) a softmax over the visiting keys only, and the shares would not add up."""
    from flashtile.distributed.ring import local_backward, local_forward

    q, k, v, do = random_qkv(1, 2, 2, 8, 4, seed=11)
    halves = (slice(0, 4), slice(4, 8))
    truth_dq = attention_truth(q, k, v, do, False)[1]
    o, lse = local_forward(q, k, v, False, 0.5)
    right = sum(local_backward(q, k[..., s, :], v[..., s, :], o, lse, do, False, 0.5)[0] for s in halves)
    wrong = 0
    for s in halves:
        o_part, lse_part = local_forward(q, k[..., s, :], v[..., s, :], False, 0.5)
        wrong = wrong + local_backward(q, k[..., s, :], v[..., s, :], o_part, lse_part, do, False, 0.5)[0]
    torch.testing.assert_close(right, truth_dq, rtol=0, atol=1e-12)
    assert not torch.allclose(wrong, truth_dq, atol=1e-3)


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or the Triton interpreter (the root conftest turns it on without CUDA)",
)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_kernel_path_of_the_steps_matches_float64_truth(monkeypatch, is_causal):
    """The steps' CUDA branch (flashtile's Triton kernels, fp32 lse hand-off, strided row slices),
    run through the Triton interpreter on a machine without a GPU."""
    from flashtile.distributed import ring

    monkeypatch.setattr(ring, "uses_kernels", lambda q: q.dtype != torch.float64)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, do = (x.to(device) for x in random_qkv(1, 4, 2, 64, 16, seed=12, dtype=torch.float32))
    o, dq, dk, dv = (unshard_sequence(x, is_causal) for x in
                     simulate_ring(*(shards(x, 2, is_causal) for x in (q, k, v)), is_causal, None,
                                   shards(do, 2, is_causal)))  # fmt: skip
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), attention_truth(q, k, v, do, is_causal)):
        assert got.dtype == torch.float32, name
        torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-3, msg=lambda m, name=name: f"{name}: {m}")

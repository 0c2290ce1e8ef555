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
from tests.distributed._ring_cases import attention_truth, random_qkv, sink_attention_truth


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


SINKS = {4: [0.9, float("-inf"), -1.5, 3.0], 3: [0.9, float("-inf"), 3.0]}  # H -> one per head; -inf: none


@pytest.mark.parametrize("H, H_kv", [(4, 4), (3, 1)], ids=["mha", "mqa"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_simulated_ring_with_sinks_counts_each_sink_once_with_every_gradient(world_size, is_causal, H, H_kv):
    q, k, v, do = random_qkv(2, H, H_kv, 2 * world_size * 4, 8, seed=20 + world_size)
    sinks = torch.tensor(SINKS[H], dtype=torch.float64)
    o, dq, dk, dv, shares = simulate_ring(*(shards(x, world_size, is_causal) for x in (q, k, v)), is_causal, None,
                                          shards(do, world_size, is_causal), sinks=sinks)
    got = [unshard_sequence(x, is_causal) for x in (o, dq, dk, dv)] + [sum(shares)]
    for name, g, want in zip(("o", "dq", "dk", "dv", "dsinks"), got, sink_attention_truth(q, k, v, do, sinks,
                                                                                           is_causal)):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
    assert shares[0][1] == 0  # the head whose sink is -inf has none: no gradient


def test_a_sink_of_minus_inf_on_every_head_is_the_ring_without_sinks():
    q, k, v, do = random_qkv(1, 2, 2, 16, 8, seed=25)
    cut = [shards(x, 2, True) for x in (q, k, v, do)]
    without = simulate_ring(*cut[:3], True, None, cut[3])
    with_none = simulate_ring(*cut[:3], True, None, cut[3], sinks=torch.full((2,), float("-inf"), dtype=torch.float64))
    for a, b in zip(without, with_none[:4]):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert all(torch.equal(share, torch.zeros(2, dtype=torch.float64)) for share in with_none[4])


def test_a_sink_merged_into_every_steps_partial_is_counted_w_times_which_is_why_it_joins_after_the_merge():
    """Each step's partial is exact over its keys; giving every partial the sink (as a kernel that starts
    each call from m = sink, l = 1 would) counts it once per step, a sink of sink + log W. The control: the
    sink merged once gives the truth."""
    from flashtile.distributed.ring import fold_sinks, local_forward

    q, k, v, do = random_qkv(1, 2, 2, 12, 8, seed=26)
    sinks = torch.tensor([1.0, -0.5], dtype=torch.float64)
    thirds = (slice(0, 4), slice(4, 8), slice(8, 12))
    parts = [local_forward(q, k[..., s, :], v[..., s, :], False, 8**-0.5) for s in thirds]
    once, every = parts[0], fold_sinks(*parts[0], sinks)
    for part in parts[1:]:
        once = merge_partials(*once, *part)
        every = merge_partials(*every, *fold_sinks(*part, sinks))
    once = fold_sinks(*once, sinks)
    truth = sink_attention_truth(q, k, v, do, sinks, False)[0]
    torch.testing.assert_close(once[0], truth, rtol=0, atol=1e-12)
    assert not torch.allclose(every[0], truth, atol=1e-3)
    thrice = sink_attention_truth(q, k, v, do, sinks + torch.log(torch.tensor(3.0, dtype=torch.float64)), False)[0]
    torch.testing.assert_close(every[0], thrice, rtol=0, atol=1e-12)


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


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_world_size_1_with_sinks_equals_flashtile_attention(one_rank_group, is_causal):
    q, k, v, do = random_qkv(1, 4, 2, 12, 8, seed=27)
    sinks = torch.tensor([0.5, float("-inf"), 2.0, -1.0], dtype=torch.float64)
    results = []
    for fn in (
        lambda q, k, v, s: ring_attention(q, k, v, is_causal=is_causal, sinks=s),
        lambda q, k, v, s: flashtile.attention(q, k, v, is_causal=is_causal, enable_gqa=True, sinks=s),
    ):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
        with use_backend("reference"):
            o = fn(*leaves)
            o.backward(do)
        results.append([o.detach(), *(x.grad for x in leaves)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


def test_bad_sinks_are_caught_before_any_communication():
    q, k, v, _ = random_qkv(1, 2, 2, 8, 4, seed=28)
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(2,\)"):
        ring_attention(q, k, v, sinks=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="sinks must have dtype"):
        ring_attention(q, k, v, sinks=torch.zeros(2, dtype=torch.float16))
    with pytest.raises(TypeError, match="sinks must be a torch.Tensor"):
        ring_attention(q, k, v, sinks=[0.0, 0.0])
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="sinks must be finite or -inf"):
            ring_attention(q, k, v, sinks=torch.tensor([0.0, bad], dtype=torch.float64))
    # the control: good sinks get as far as the process group
    with pytest.raises(ValueError, match="init_process_group"):
        ring_attention(q, k, v, sinks=torch.tensor([0.0, float("-inf")], dtype=torch.float64))


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
    right = sum(local_backward(q, k[..., s, :], v[..., s, :], o, lse, do, causal=False, scale=0.5)[0] for s in halves)
    wrong = 0
    for s in halves:
        o_part, lse_part = local_forward(q, k[..., s, :], v[..., s, :], False, 0.5)
        wrong = wrong + local_backward(q, k[..., s, :], v[..., s, :], o_part, lse_part, do, causal=False,
                                     scale=0.5)[0]
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


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or the Triton interpreter (the root conftest turns it on without CUDA)",
)
def test_kernel_path_of_the_steps_with_sinks_matches_float64_truth(monkeypatch):
    """The same CUDA branch with float32 sinks: the kernels attend keys only, the sinks join after the merge,
    and the kernels' backward takes the lse that holds them."""
    from flashtile.distributed import ring

    monkeypatch.setattr(ring, "uses_kernels", lambda q: q.dtype != torch.float64)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, do = (x.to(device) for x in random_qkv(1, 4, 2, 64, 16, seed=29, dtype=torch.float32))
    sinks = torch.tensor([0.5, float("-inf"), 2.0, -1.0], device=device)
    o, dq, dk, dv, shares = simulate_ring(*(shards(x, 2, True) for x in (q, k, v)), True, None, shards(do, 2, True),
                                          sinks=sinks)
    got = [unshard_sequence(x, True) for x in (o, dq, dk, dv)] + [sum(shares)]
    for name, g, want in zip(("o", "dq", "dk", "dv", "dsinks"), got, sink_attention_truth(q, k, v, do, sinks, True)):
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g.double().cpu(), want, rtol=1e-3, atol=1e-3,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_the_simulated_ring_checks_its_shards_and_sinks_as_ring_attention_does():
    q, k, v, _ = random_qkv(1, 2, 2, 8, 4, seed=29)
    qs, ks, vs = (shards(x, 2, False) for x in (q, k, v))
    with pytest.raises(ValueError, match="sinks must be finite or -inf"):
        simulate_ring(qs, ks, vs, False, sinks=torch.tensor([0.0, float("nan")], dtype=torch.float64))
    with pytest.raises(TypeError, match="sinks must be a torch.Tensor"):
        simulate_ring(qs, ks, vs, False, sinks=[0.0, 0.0])
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(2,\)"):
        simulate_ring(qs, ks, vs, False, sinks=torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="one shape and dtype"):
        simulate_ring([qs[0], qs[1][..., :2, :]], [ks[0], ks[1][..., :2, :]], [vs[0], vs[1][..., :2, :]], False)
    with pytest.raises(ValueError, match="lists of one shard per rank, of one length"):
        simulate_ring(qs, ks[:1], vs, False)
    with pytest.raises(ValueError, match="self-attention"):
        simulate_ring([qs[0]], [ks[0][..., :2, :]], [vs[0][..., :2, :]], False)
    # the control: the same shards with good sinks run
    assert len(simulate_ring(qs, ks, vs, False, sinks=torch.zeros(2, dtype=torch.float64))) == 2

"""The (o, lse) merge (``reference.merge.merge_partials``): the results over two disjoint key sets give the
result over their union, against softmax and logsumexp of the whole score row in float64."""

import torch

from flashtile.reference.merge import merge_partials


def qkv(B, H, T, D, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, dtype=torch.float64, generator=generator) for _ in range(3)]


def partial_attention(q, k, v, scale):
    """(o, lse) of q over the keys k, v only, from the definition, in float64."""
    s = scale * q @ k.transpose(-1, -2)
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def test_merging_the_results_of_two_key_halves_gives_the_whole_in_either_order():
    q, k, v = qkv(2, 3, 20, 8, seed=0)
    scale = 0.4
    whole = partial_attention(q, k, v, scale)
    a = partial_attention(q, k[..., :7, :], v[..., :7, :], scale)
    b = partial_attention(q, k[..., 7:, :], v[..., 7:, :], scale)
    for first, second in ((a, b), (b, a)):
        o, lse = merge_partials(*first, *second)
        torch.testing.assert_close(o, whole[0], rtol=0, atol=1e-14)
        torch.testing.assert_close(lse, whole[1], rtol=0, atol=1e-14)


def test_a_part_that_saw_no_key_counts_for_nothing_and_makes_no_nan():
    o_b, lse_b = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    empty_o, empty_lse = torch.zeros(4, 5, dtype=torch.float64), torch.full((4,), float("-inf"), dtype=torch.float64)
    o, lse = merge_partials(empty_o, empty_lse, o_b, lse_b)
    assert torch.equal(o, o_b) and torch.equal(lse, lse_b)
    o, lse = merge_partials(empty_o, empty_lse, empty_o, empty_lse)
    assert torch.equal(o, empty_o) and torch.isneginf(lse).all()


def test_merging_without_the_rescale_is_wrong_so_the_test_above_can_fail():
    """Control for the merge test: averaging the halves (no weights from lse) misses the answer."""
    q, k, v = qkv(1, 2, 12, 8, seed=1)
    whole = partial_attention(q, k, v, 0.35)
    a = partial_attention(q, k[..., :5, :], v[..., :5, :], 0.35)
    b = partial_attention(q, k[..., 5:, :], v[..., 5:, :], 0.35)
    assert not torch.allclose((a[0] + b[0]) / 2, whole[0], atol=1e-3)
    assert torch.allclose(merge_partials(*a, *b)[0], whole[0], atol=1e-14)


def test_the_merge_is_computed_in_the_dtype_of_lse_a_whatever_the_outputs_dtype():
    """The ring merges bf16 or fp32 outputs with fp32 lse: the result comes back in lse's dtype, and equals
    the merge of the same values cast up front."""
    generator = torch.Generator().manual_seed(2)
    o_a, o_b = (torch.randn(3, 6, 8, generator=generator).to(torch.bfloat16) for _ in range(2))
    lse_a, lse_b = (torch.randn(3, 6, generator=generator) for _ in range(2))
    o, lse = merge_partials(o_a, lse_a, o_b, lse_b)
    assert o.dtype == lse.dtype == torch.float32
    o_cast, lse_cast = merge_partials(o_a.float(), lse_a, o_b.float(), lse_b)
    assert torch.equal(o, o_cast) and torch.equal(lse, lse_cast)

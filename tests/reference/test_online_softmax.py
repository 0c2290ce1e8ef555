import math

import pytest
import torch

from flashtile.reference.online_softmax import (
    lse_from_stats,
    merge,
    online_softmax_stats,
)


@pytest.mark.parametrize("block", [1, 3, 7, 16, 64, 1000])
def test_lse_matches_torch_logsumexp_for_any_block(rand, block):
    x = rand(5, 37, scale=4.0)
    m, l = online_softmax_stats(x, block)
    torch.testing.assert_close(lse_from_stats(m, l), torch.logsumexp(x, -1), rtol=0, atol=1e-12)
    torch.testing.assert_close(m, x.amax(-1), rtol=0, atol=0)


def test_rescale_survives_a_max_that_jumps_from_minus_40_to_1000():
    # First block's max is -40; the second block's is 1000. Without the rescale, the first block's
    # sum would be carried at the wrong max; with a naive exp(x) the second block would overflow.
    x = torch.tensor([[-40.0, -41.0, -45.0, 1000.0, 999.0, -3.0]], dtype=torch.float64)
    m, l = online_softmax_stats(x, block=3)
    assert m.item() == 1000.0
    expected = 1000.0 + math.log(1 + math.exp(-1) + math.exp(-1003) + sum(math.exp(v - 1000) for v in (-40, -41, -45)))
    assert math.isclose(lse_from_stats(m, l).item(), expected, rel_tol=0, abs_tol=1e-12)
    assert torch.isfinite(l).all()
    # float32 too: exp(1000) overflows float32 long before, the streamed form does not.
    m32, l32 = online_softmax_stats(x.float(), block=3)
    assert torch.isfinite(l32).all() and math.isclose(lse_from_stats(m32, l32).item(), expected, rel_tol=1e-6)


def test_all_minus_inf_row_gives_m_minus_inf_l_zero_and_no_nan():
    x = torch.full((2, 9), float("-inf"), dtype=torch.float64)
    x[1, 4] = 0.5
    m, l = online_softmax_stats(x, block=4)
    assert m[0].item() == float("-inf") and l[0].item() == 0.0
    assert not torch.isnan(m).any() and not torch.isnan(l).any()
    lse = lse_from_stats(m, l)
    assert lse[0].item() == float("-inf") and lse[1].item() == 0.5


@pytest.mark.parametrize("split", [1, 5, 20, 36])
def test_merge_of_two_halves_equals_the_whole_row(rand, split):
    x = rand(4, 37, scale=3.0)
    x[1, :split] = float("-inf")  # one half of one row is empty: merging with (-inf, 0) must be a no-op
    whole = online_softmax_stats(x, 8)
    a = online_softmax_stats(x[:, :split], 4)
    b = online_softmax_stats(x[:, split:], 4)
    m, l = merge(*a, *b)
    torch.testing.assert_close(m, whole[0], rtol=0, atol=0)
    torch.testing.assert_close(l, whole[1], rtol=1e-13, atol=0)


def test_merge_is_commutative_and_associative(rand):
    parts = [online_softmax_stats(rand(3, n, scale=5.0), 4) for n in (5, 9, 2)]
    left = merge(*merge(*parts[0], *parts[1]), *parts[2])
    right = merge(*parts[0], *merge(*parts[1], *parts[2]))
    swapped = merge(*parts[2], *merge(*parts[1], *parts[0]))
    for other in (right, swapped):
        torch.testing.assert_close(lse_from_stats(*left), lse_from_stats(*other), rtol=0, atol=1e-12)


def test_the_stats_give_torch_softmax_in_a_second_pass(rand):
    x = rand(6, 50, scale=10.0)
    m, l = online_softmax_stats(x, 16)
    p = torch.exp(x - m[..., None]) / l[..., None]  # the second pass, written out here
    torch.testing.assert_close(p, torch.softmax(x, -1), rtol=0, atol=1e-14)

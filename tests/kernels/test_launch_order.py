"""The causal launch order: ``_common.program_tile`` renumbers programs, never changes what they compute.

The numbering is checked against a plain-Python list of the launch order (the grid's first axis
fastest); the kernels are checked to give the same bits with the heaviest tiles first or not, and the
gradients against the float64 formula.
"""

import pytest
import torch
import triton
import triton.language as tl

from _truth import attention_truth
from flashtile.kernels._common import HEAVIEST_FIRST_KV_BYTES, heaviest_first, program_tile
from flashtile.kernels.backward import flash_attention_backward
from flashtile.kernels.forward import flash_attention

from ._helpers import DEVICE, FORWARD_TOL, randn


@triton.jit
def _record_tiles(OUT, HEAVY_TILE_LAST: tl.constexpr, HEAVIEST_FIRST: tl.constexpr):
    tile, plane, b = program_tile(HEAVY_TILE_LAST, HEAVIEST_FIRST)
    rank = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    tl.store(OUT + 3 * rank, tile)
    tl.store(OUT + 3 * rank + 1, plane)
    tl.store(OUT + 3 * rank + 2, b)


def _launch_order(grid, heavy_tile_last, heaviest_first_):
    out = torch.full((grid[0] * grid[1] * grid[2], 3), -1, dtype=torch.int32, device=DEVICE)
    _record_tiles[grid](out, HEAVY_TILE_LAST=heavy_tile_last, HEAVIEST_FIRST=heaviest_first_)
    return [tuple(row) for row in out.cpu().tolist()]  # (tile, plane, b) of each program, in launch order


@pytest.mark.parametrize("grid", [(5, 3, 2), (1, 4, 3), (7, 1, 1), (4, 6, 1)])
@pytest.mark.parametrize("heavy_tile_last", [False, True])
def test_heaviest_first_starts_every_heads_heaviest_tile_before_any_second_heaviest(grid, heavy_tile_last):
    n_tiles, planes, batch = grid
    every = {(t, p, b) for t in range(n_tiles) for p in range(planes) for b in range(batch)}
    order = _launch_order(grid, heavy_tile_last, True)
    assert len(order) == len(every) and set(order) == every  # each (tile, plane, b) exactly once
    weight = [n_tiles - 1 - t if heavy_tile_last else t for t, _, _ in order]  # 0 = the heaviest tile
    assert weight == sorted(weight)
    per_tile = planes * batch  # within one tile index: planes fastest, then batch
    assert [(p, b) for _, p, b in order[:per_tile]] == [(p, b) for b in range(batch) for p in range(planes)]


@pytest.mark.parametrize("heavy_tile_last", [False, True])
def test_without_heaviest_first_only_the_tile_axis_may_flip(heavy_tile_last):
    grid = (5, 3, 2)
    expected = [(4 - t if heavy_tile_last else t, p, b) for b in range(2) for p in range(3) for t in range(5)]
    assert _launch_order(grid, heavy_tile_last, False) == expected


def test_heaviest_first_is_picked_where_k_and_v_fit_and_only_under_causal():
    small = torch.empty(2, 4, 2048, 64, dtype=torch.bfloat16, device="meta")  # 2 MiB each
    large = torch.empty(8, 16, 2048, 64, dtype=torch.bfloat16, device="meta")  # 32 MiB each
    assert 2 * small.numel() * 2 <= HEAVIEST_FIRST_KV_BYTES < 2 * large.numel() * 2
    assert heaviest_first(None, True, small, small)
    assert not heaviest_first(None, True, large, large)
    assert not heaviest_first(None, False, small, small)
    assert heaviest_first(True, True, large, large) and not heaviest_first(False, True, small, small)
    assert not heaviest_first(True, False, small, small)  # no causal mask: every tile has the same work
    with pytest.raises(TypeError, match="heaviest_first"):
        heaviest_first(1, True, small, small)


@pytest.mark.parametrize("shape", [(2, 4, 2, 77, 77, 24), (1, 3, 1, 50, 90, 16), (2, 2, 2, 96, 64, 32)])
def test_heaviest_first_gives_the_same_bits_and_the_float64_gradients(shape):
    B, H, H_kv, Tq, Tk, D = shape
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(sum(shape))
    q, do = (randn(B, H, Tq, D, dtype=dtype, generator=gen) for _ in range(2))
    k, v = (randn(B, H_kv, Tk, D, dtype=dtype, generator=gen) for _ in range(2))
    config = {"dkdv": (16, 16, 4, 1), "dq": (16, 16, 4, 1)}  # many tiles per head, so the order matters
    results = []
    for first in (False, True):
        o, lse, stats = flash_attention(q, k, v, True, block_q=16, block_k=16, return_stats=True,
                                        heaviest_first=first)  # fmt: skip
        grads = flash_attention_backward(q, k, v, o, lse, do, True, stats=stats, config=config, heaviest_first=first)
        results.append((o, lse, *grads))
    for before, after in zip(*results):
        assert torch.equal(before, after)
    q64, k64, v64 = (x.detach().double().cpu().requires_grad_() for x in (q, k, v))
    o64, _ = attention_truth(q64, k64, v64, causal=True)
    torch.testing.assert_close(results[1][0].double().cpu(), o64.detach(), **FORWARD_TOL[dtype])
    truth = torch.autograd.grad(o64, (q64, k64, v64), do.double().cpu())
    for got, want in zip(results[1][2:], truth):
        torch.testing.assert_close(got.double().cpu(), want, atol=2e-2 if dtype == torch.float16 else 1e-4,
                                   rtol=2e-2 if dtype == torch.float16 else 1e-4)  # fmt: skip

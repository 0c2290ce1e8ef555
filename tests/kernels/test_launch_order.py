"""The launch orders: ``_jit.program_tile`` renumbers programs under causal, ``_host.document_order`` orders
packed documents; neither changes what the programs compute.

The numbering is checked against a plain-Python list of the launch order (the grid's first axis
fastest); the kernels are checked to give the same bits with the heaviest tiles first or not, and the
gradients against the float64 formula.
"""

import pytest
import torch
import triton
import triton.language as tl

from flashtile import _plans
from flashtile._env import H200_SM_COUNT
from flashtile.kernels import backward, forward
from flashtile.kernels._host import (
    HEAVIEST_FIRST_BYTES,
    HEAVIEST_FIRST_WAVES,
    document_order,
    heaviest_first_chunk,
    resident_programs,
)
from flashtile.kernels._jit import program_tile
from flashtile.kernels.backward import flash_attention_backward, flash_attention_varlen_backward
from flashtile.kernels.forward import flash_attention, flash_attention_varlen
from tests._truth import attention_truth

from ._helpers import DEVICE, FORWARD_TOL, randn


@triton.jit
def _record_tiles(OUT, chunk, HEAVY_TILE_LAST: tl.constexpr, HEAVIEST_FIRST: tl.constexpr):
    tile, plane, b = program_tile(chunk, HEAVY_TILE_LAST, HEAVIEST_FIRST)
    rank = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    tl.store(OUT + 3 * rank, tile)
    tl.store(OUT + 3 * rank + 1, plane)
    tl.store(OUT + 3 * rank + 2, b)


def _launch_order(grid, heavy_tile_last, chunk):
    """(tile, plane, b) of every program, in launch order; chunk 0: the plain order."""
    out = torch.full((grid[0] * grid[1] * grid[2], 3), -1, dtype=torch.int32, device=DEVICE)
    _record_tiles[grid](out, max(chunk, 1), HEAVY_TILE_LAST=heavy_tile_last, HEAVIEST_FIRST=chunk > 0)
    return [tuple(row) for row in out.cpu().tolist()]


def _expected_order(grid, heavy_tile_last, chunk):
    """The order written out by hand: (plane, b) pairs (plane fastest) cut into chunks; in each chunk the
    heaviest tile of every pair, then the next heaviest, and so on."""
    n_tiles, planes, batch = grid
    pairs = [(p, b) for b in range(batch) for p in range(planes)]
    heaviest = list(range(n_tiles))[::-1] if heavy_tile_last else list(range(n_tiles))  # heaviest first
    order = []
    for start in range(0, len(pairs), chunk):
        order += [(t, p, b) for t in heaviest for p, b in pairs[start:start + chunk]]
    return order


@pytest.mark.parametrize("grid", [(5, 3, 2), (1, 4, 3), (7, 1, 1), (4, 6, 1)])
@pytest.mark.parametrize("heavy_tile_last", [False, True])
@pytest.mark.parametrize("chunk", [1, 2, 4, 100])
def test_heaviest_first_starts_every_heads_heaviest_tile_first_within_each_chunk(grid, heavy_tile_last, chunk):
    order = _launch_order(grid, heavy_tile_last, chunk)
    assert order == _expected_order(grid, heavy_tile_last, chunk)
    assert len(set(order)) == len(order)  # each (tile, plane, b) exactly once


@pytest.mark.parametrize("heavy_tile_last", [False, True])
def test_without_heaviest_first_only_the_tile_axis_may_flip(heavy_tile_last):
    grid = (5, 3, 2)
    expected = [(4 - t if heavy_tile_last else t, p, b) for b in range(2) for p in range(3) for t in range(5)]
    assert _launch_order(grid, heavy_tile_last, 0) == expected


def test_chunks_hold_what_fits_in_the_budget_in_whole_groups_only_under_causal_and_on_short_grids():
    budget, cpu, few = HEAVIEST_FIRST_BYTES, torch.device("cpu"), 1000  # the CPU tier assumes the H200's SMs

    def chunk(causal=True, plane_bytes=budget // 8, pairs=100, programs=few, resident=1, share=1):
        return heaviest_first_chunk(causal, plane_bytes, pairs, programs, resident, cpu, share)

    assert chunk() == 8
    assert chunk(pairs=5) == 5  # never more than the grid has
    assert chunk(plane_bytes=budget // 10, share=4) == 8  # whole GQA groups
    assert chunk(plane_bytes=2 * budget, share=4) == 4  # at least one group
    assert chunk(causal=False) == 0  # no causal mask: every tile has the same work
    waves = HEAVIEST_FIRST_WAVES * H200_SM_COUNT  # programs in that many waves of one program per SM
    assert chunk(programs=waves) == 8 and chunk(programs=waves + 1) == 0  # a long grid: the plain order
    assert chunk(programs=2 * waves, resident=2) == 8  # two programs per SM: twice the programs per wave


def test_resident_programs_follow_the_register_file():
    assert resident_programs(8, 128) == 2  # 8 warps x 32 threads x 128 registers = half of 65,536
    assert resident_programs(8, None) == 1  # no cap: up to 255 registers a thread
    assert resident_programs(4, None) == 2
    assert resident_programs(32, 255) == 1  # never fewer than one


# Three or more 16-row tiles per head, the last one ragged, so the heaviest-first order differs from the plain
# one in every launch; two batches and GQA groups of 2 (shapes 1 and 3), Tq < Tk and Tq > Tk.
@pytest.mark.parametrize("shape", [(2, 4, 2, 45, 45, 24), (1, 3, 1, 50, 90, 16), (2, 2, 2, 64, 40, 32)])
def test_heaviest_first_gives_the_same_bits_and_the_float64_gradients(shape, monkeypatch):
    B, H, H_kv, Tq, Tk, D = shape
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(sum(shape))
    q, do = (randn(B, H, Tq, D, dtype=dtype, generator=gen) for _ in range(2))
    k, v = (randn(B, H_kv, Tk, D, dtype=dtype, generator=gen) for _ in range(2))
    config = {"dkdv": (16, 16, 4, 1), "dq": (16, 16, 4, 1)}  # many tiles per head, so the order matters
    results = []
    for first in (False, True):
        chunks = []  # what the launchers got: the heuristic's chunk, or 0 (the plain order) when not first

        def chunk(*args, first=first, chunks=chunks, **kwargs):
            chunks.append(heaviest_first_chunk(*args, **kwargs) if first else 0)
            return chunks[-1]

        with monkeypatch.context() as patch:
            patch.setattr(_plans, "_plans", {})  # fresh plans, made with the chunk above
            patch.setattr(forward, "heaviest_first_chunk", chunk)
            patch.setattr(backward, "heaviest_first_chunk", chunk)
            o, lse, stats = flash_attention(q, k, v, causal=True, block_q=16, block_k=16, return_stats=True)
            grads = flash_attention_backward(q, k, v, o, lse, do, causal=True, stats=stats, config=config)
        assert len(chunks) == 3 and (all(chunks) if first else not any(chunks)), chunks  # forward, dK/dV, dQ
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


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("lengths_q, lengths_k", [((5, 40, 17, 40), (5, 40, 17, 40)), ((3, 0, 8, 4), (9, 6, 2, 6)),
                                                  ((7,), (7,)), ((), ())])  # fmt: skip
def test_document_order_puts_the_most_pairs_first_ties_in_packing_order(lengths_q, lengths_k):
    want = sorted(range(len(lengths_q)), key=lambda d: -lengths_q[d] * lengths_k[d])  # sorted() is stable
    order = document_order(_cu(lengths_q), _cu(lengths_k))
    assert order.dtype == torch.int32 and order.device == _cu(()).device and order.tolist() == want


def test_document_order_follows_a_write_to_either_cu_seqlens():
    cu_q, cu_k = _cu((4, 9, 6)), _cu((4, 9, 6))
    assert document_order(cu_q, cu_k).tolist() == [1, 2, 0]
    cu_k[1:] = torch.tensor([12, 14, 16], dtype=torch.int32)  # key lengths 12, 2, 2: now document 0 has most pairs
    assert document_order(cu_q, cu_k).tolist() == [0, 1, 2]
    cu_q[1:] = torch.tensor([1, 2, 19], dtype=torch.int32)  # query lengths 1, 1, 17
    assert document_order(cu_q, cu_k).tolist() == [2, 0, 1]
    assert document_order(cu_q, _cu((20, 1, 1))).tolist() == [0, 2, 1]  # another key tensor: worked out again


def test_the_document_order_changes_no_bit_of_the_varlen_kernels(monkeypatch):
    """The same packed call with the documents launched in packing order and most pairs first (which differ
    here): every output and gradient bit for bit."""
    lengths = (5, 40, 17, 33)
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(7)
    q, k, v, do = (randn(sum(lengths), 2, 16, dtype=dtype, generator=gen) for _ in range(4))
    cu = _cu(lengths)
    assert document_order(cu, cu).tolist() == [1, 3, 2, 0]
    results = []
    for packing_order in (True, False):
        with monkeypatch.context() as patch:
            if packing_order:
                plain = lambda cu_q, cu_k: torch.arange(cu_q.shape[0] - 1, dtype=torch.int32, device=cu_q.device)
                patch.setattr(forward, "document_order", plain)
                patch.setattr(backward, "document_order", plain)
            o, lse, stats = flash_attention_varlen(q, k, v, cu, cu, 40, 40, causal=True, block_q=16, block_k=16)
            grads = flash_attention_varlen_backward(q, k, v, o, lse, do, cu, cu, 40, 40, causal=True, block_q=16,
                                                    block_k=16, stats=stats)  # fmt: skip
        results.append((o, lse, stats, *grads))
    for before, after in zip(*results):
        assert torch.equal(before, after)

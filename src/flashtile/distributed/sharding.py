"""Cutting a sequence into per-rank shards, and gluing the shards back.

A sequence of T tokens (dim 2 of a (B, H, T, D) tensor) is cut into equal chunks, and each rank of a
ring of ``world_size`` ranks holds some of them:

* ``"contiguous"`` (for ``is_causal=False``): W chunks, rank r holds chunk r.
* ``"zigzag"`` (for ``is_causal=True``): 2W chunks, rank r holds chunks r and 2W - 1 - r, in that
  order. Under a causal mask a late chunk has more keys to look at than an early one; pairing the
  r-th earliest chunk with the r-th latest gives every rank the same amount of work (the ring
  attention chapter counts it).

Non-causal attention does not care where a token sits, so the contiguous layout is already balanced
there. ``ring_attention`` assumes the layout that ``shard_sequence`` uses for the same ``is_causal``.
"""

from __future__ import annotations

import torch

from .._checks import check_causal, check_tensor

LAYOUTS = ("contiguous", "zigzag")


def layout_for(is_causal: bool) -> str:
    """The layout ``shard_sequence`` uses: zig-zag for causal attention, contiguous otherwise."""
    return "zigzag" if check_causal(is_causal, "is_causal") else "contiguous"


def _check_world(world_size, rank=None) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size):
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")


# --8<-- [start:chunks]
def rank_chunks(world_size: int, rank: int, is_causal: bool = False) -> tuple[int, ...]:
    """Indices of the chunks rank ``rank`` holds, in the order it stores them."""
    _check_world(world_size, rank)
    if layout_for(is_causal) == "zigzag":
        # the r-th earliest and the r-th latest chunk
        return (rank, 2 * world_size - 1 - rank)
    return (rank,)


def n_chunks(world_size: int, is_causal: bool = False) -> int:
    """How many equal chunks the sequence is cut into: 2W for zig-zag, W for
    contiguous."""
    return 2 * world_size if layout_for(is_causal) == "zigzag" else world_size
# --8<-- [end:chunks]


def _chunk_len(T: int, world_size: int, is_causal: bool, what: str) -> int:
    n = n_chunks(world_size, is_causal)
    if T % n != 0:
        raise ValueError(
            f"{what} has T = {T} tokens, which the {layout_for(is_causal)} layout cannot split into {n} equal "
            f"chunks ({'2 * world_size' if n == 2 * world_size else 'world_size'} = {n}); pad T to a multiple of {n}"
        )
    return T // n


def shard_positions(T: int, world_size: int, rank: int, is_causal: bool = False) -> torch.Tensor:
    """The global positions (0 .. T-1) of the tokens rank ``rank`` holds, in its storage order."""
    c = _chunk_len(T, world_size, is_causal, "the sequence")
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in rank_chunks(world_size, rank, is_causal)])


def shard_sequence(x: torch.Tensor, world_size: int, rank: int, is_causal: bool = False) -> torch.Tensor:
    """This rank's shard of x (B, H, T, D) along T: (B, H, T / W, D), contiguous.

    Raises ValueError when T is not a multiple of W (contiguous) or 2W (zig-zag).
    """
    check_tensor("x", x, rank=4)
    _check_world(world_size, rank)
    c = _chunk_len(x.shape[2], world_size, is_causal, "x")
    return torch.cat([x[:, :, i * c : (i + 1) * c] for i in rank_chunks(world_size, rank, is_causal)], dim=2)


def unshard_sequence(shards, is_causal: bool = False) -> torch.Tensor:
    """Inverse of ``shard_sequence``: the list of every rank's shard, in rank order, back to (B, H, T, D)."""
    if isinstance(shards, torch.Tensor) or not isinstance(shards, (list, tuple)) or not shards:
        raise TypeError("shards must be a non-empty list of tensors, one per rank, in rank order")
    for r, s in enumerate(shards):
        check_tensor(f"shards[{r}]", s, rank=4)
        if s.shape != shards[0].shape:
            raise ValueError(f"shards[{r}] has shape {tuple(s.shape)} but shards[0] has {tuple(shards[0].shape)}")
    world_size = len(shards)
    per_rank = len(rank_chunks(world_size, 0, is_causal))
    T_local = shards[0].shape[2]
    if T_local % per_rank != 0:
        raise ValueError(f"each shard has {T_local} tokens, but a zig-zag shard holds 2 equal chunks; T must be even")
    c = T_local // per_rank
    chunks = [None] * n_chunks(world_size, is_causal)
    for r, s in enumerate(shards):
        for slot, i in enumerate(rank_chunks(world_size, r, is_causal)):
            chunks[i] = s[:, :, slot * c : (slot + 1) * c]
    return torch.cat(chunks, dim=2)

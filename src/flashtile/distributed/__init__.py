"""flashtile.distributed: attention over a sequence sharded across the ranks of a torch.distributed group.

* ``shard_sequence`` / ``unshard_sequence``: cut a (B, H, T, D) tensor along T into per-rank shards
  (zig-zag for causal attention, contiguous otherwise) and glue them back.
* ``ring_attention``: forward and backward on this rank's shards, with the key/value shards passed
  around the ring by ``torch.distributed.batch_isend_irecv``; attention sinks (``sinks=``) join each
  row once, after the last merge.
* ``merge_into``: the (o, lse) merge every ring step uses, in place (``reference.merge.merge_partials``,
  or the Triton kernel of ``kernels.merge`` on CUDA).
* ``simulate_ring``: the same steps for W ranks in one process, for reading and for claims.
* ``run_local_ring``: run a function on W local processes joined by gloo over loopback (or NCCL,
  one GPU each), with a time limit; the tests and the chapter's claim use it.
"""

from .local import ring_attention_on_shards, run_local_ring
from .ring import merge_into, ring_attention, simulate_ring, step_plan
from .sharding import layout_for, n_chunks, rank_chunks, shard_positions, shard_sequence, unshard_sequence

__all__ = [
    "layout_for",
    "merge_into",
    "n_chunks",
    "rank_chunks",
    "ring_attention",
    "ring_attention_on_shards",
    "run_local_ring",
    "shard_positions",
    "shard_sequence",
    "simulate_ring",
    "step_plan",
    "unshard_sequence",
]

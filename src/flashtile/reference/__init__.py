"""Part A: plain PyTorch, exact in float64, one concept per module.

naive           standard attention through the full T x T matrices (the ground truth)
online_softmax  streaming (m, l) statistics and merging two (m, l) states
merge           merging two partial results (o, lse) over disjoint keys (decode, ring)
forward         the tiled FlashAttention forward with its (m, l, acc) state
causal          causal alignments and the full / diagonal / skip tile classification
masks           sliding windows and packed documents: the band of kept diagonals, by tile
varlen          attention within each packed document, on (total_tokens, H, D) tensors
backward        the tiled backward with D = rowsum(dO * O) and recomputed P
sinks           attention sinks: the online softmax's start state, its gradient through D, the merge
head_dims       unequal head dims: q, k of width d_qk, v, o of width d_v; the FLOPs of each
autograd        a torch.autograd.Function that saves only q, k, v, o and lse (and the sinks)
io_model        HBM traffic of standard attention against FlashAttention (Theorem 2)
footprint       measuring memory: the largest temporary, and what autograd saves
"""

from .autograd import FlashAttentionFunction, reference_attention
from .backward import backward_delta, flash_attention_backward
from .causal import (
    TileKind,
    causal_mask,
    classify_tile,
    count_visited_tiles,
    diagonal_offset,
    last_key_tile,
    tile_map,
)
from .footprint import largest_tensor, saved_tensor_shapes
from .forward import flash_attention_forward
from .head_dims import head_dim_flops
from .io_model import (
    Traffic,
    flash_attention_traffic,
    paper_tile_sizes,
    sram_footprint,
    standard_attention_traffic,
    theorem2_bound,
)
from .masks import (
    Band,
    classify_band_tile,
    count_visited_document_tiles,
    count_visited_window_tiles,
    document_mask,
    document_visible_pairs,
    first_key_tile,
    window_band,
    window_mask,
    window_tile_map,
    window_visible_pairs,
)
from .merge import merge_partials
from .naive import attention_flops, naive_attention, naive_hbm_bytes, score_matrix_bytes, visible_pairs
from .online_softmax import lse_from_stats, merge, online_softmax_stats, online_softmax_update
from .sinks import merge_sink, sink_gradient, sink_start_state
from .varlen import varlen_attention_backward, varlen_attention_forward

__all__ = [
    "Band",
    "FlashAttentionFunction",
    "TileKind",
    "Traffic",
    "attention_flops",
    "backward_delta",
    "causal_mask",
    "classify_band_tile",
    "classify_tile",
    "count_visited_document_tiles",
    "count_visited_tiles",
    "count_visited_window_tiles",
    "diagonal_offset",
    "document_mask",
    "document_visible_pairs",
    "first_key_tile",
    "flash_attention_backward",
    "flash_attention_forward",
    "flash_attention_traffic",
    "head_dim_flops",
    "largest_tensor",
    "last_key_tile",
    "lse_from_stats",
    "merge",
    "merge_partials",
    "merge_sink",
    "naive_attention",
    "naive_hbm_bytes",
    "online_softmax_stats",
    "online_softmax_update",
    "paper_tile_sizes",
    "reference_attention",
    "saved_tensor_shapes",
    "score_matrix_bytes",
    "sink_gradient",
    "sink_start_state",
    "sram_footprint",
    "standard_attention_traffic",
    "theorem2_bound",
    "tile_map",
    "varlen_attention_backward",
    "varlen_attention_forward",
    "visible_pairs",
    "window_band",
    "window_mask",
    "window_tile_map",
    "window_visible_pairs",
]

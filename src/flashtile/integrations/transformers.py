"""flashtile as an attention implementation of Hugging Face transformers (5.x).

    from flashtile.integrations.transformers import register
    name = register()                                   # "ftile"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    model.set_attn_implementation(name)                 # or switch a model you already have

What it supports:

* causal language models (Llama, Mistral, Qwen2, Gemma-2, ... : any model whose attention layers call
  ``ALL_ATTENTION_FUNCTIONS``): training (reverse-mode autograd), evaluation, and generation with a KV
  cache (dynamic or static), the new tokens aligned lower-right to the cache; one new token without
  gradients, whose row sees one run of keys shared by the batch, runs ``flashtile.decode_attention``;
* grouped-query attention without repeating K/V (``enable_gqa=True``); inputs as transformers passes
  them, (B, H, T, D) views of (B, T, H, D) projections;
* sliding windows (the layer's ``sliding_window`` W: Mistral, Qwen2 with ``use_sliding_window``, Gemma-2's
  alternating layers) as ``window=(W - 1, 0)``: W keys, the query's own included, as transformers' mask;
* logit soft-capping (the layer's ``softcap``, Gemma-2's ``attn_logit_softcapping``) as ``softcap=``, and
  the layer's ``scaling`` as τ (Gemma-2's ``query_pre_attn_scalar``);
* attention sinks (gpt-oss's ``s_aux``: one learnable logit per query head, in the units of the scaled
  score, as its eager attention appends it to the scores) as ``sinks=``, the layer's own tensor, so its
  gradient reaches the parameter; on every path (dense, packed and decode calls), with gpt-oss's
  alternating sliding-window and full layers;
* a value head dim of its own (DeepSeek-V3's multi-head latent attention: 192 for q·k, 128 for v):
  value goes in with its own D_v, unpadded, and o comes back with D_v, on every path;
* padded batches (left or right padding) and packed rows (``position_ids`` that restart, as
  ``DataCollatorWithFlattening`` makes them, or its ``cu_seq_lens_q`` / ``cu_seq_lens_k``): the real
  tokens are gathered into one ``flashtile.attention_varlen`` call, one document per run of real tokens,
  and scattered back; padding rows come out as zeros.

What it refuses, with an error that names the limitation (never a silently ignored mask): a mask that is
not "causal on runs of real tokens, with the layer's window" (block or prefix masks, additive biases,
per-head masks, right padding during generation), a mask or a binding window on a non-causal layer,
attention dropout, sinks that are not one per query head (per-token sinks) and position biases.

Two traps this module handles for its users:

* transformers treats every attention-implementation name that contains "flash" as a request for a
  FlashAttention kernel package, and one with "/" or ":" as a Hub kernel repository, and fails to load
  it: ``register`` refuses such names;
* a custom attention function receives ``attention_mask=None`` for a padded batch unless a mask function
  is registered under the same name (``AttentionMaskInterface``): ``register`` registers one.

Measured status: the CPU tests in tests/integrations compare logits, every parameter gradient and greedy
generation with transformers' eager attention on tiny Llama, Qwen2 (with and without windows), Mistral,
Gemma-2, gpt-oss (sinks, alternating windows) and DeepSeek-V3 (q·k 24 dims, v 16) models, padded and
packed. A masked or packed batch reads its layout on the host once per
forward (the first layer; the others reuse it), so it is not ``torch.compile`` fullgraph-clean (a graph
break; the numbers stay right); an unpadded, unpacked batch whose layers get no mask is a single call
without host reads. transformers gives a sliding-window layer a mask once the keys reach its window
(gpt-oss, Mistral, Qwen2 with windows), and a static cache's decode step always one: those read it too.
Under torch.compile, packed rows need ``cu_seq_lens_q`` (``document_starts``).

Rows of padding tokens come out as 0 (a row that sees no key), where eager attention gives them some
average of the keys: the real tokens' outputs are eager's, but a loss that reads a padding row's output
(a label on a padding position, or, with left padding, the first real token predicted from the last
padding row) differs from eager's. Mask such labels with -100, as transformers' collators do for padding.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..api import attention
from ..decode import decode_attention
from ..varlen import attention_varlen

DEFAULT_NAME = "ftile"


# --8<-- [start:register]
def check_name(name) -> str:
    """A name transformers will take as a plain registered implementation, or a
    ValueError naming ``name``.

    transformers reads any attention implementation whose name contains "flash" as a
    request for a FlashAttention kernel package, and one with "/" or ":" as a kernel
    repository on the Hub ("org/name" or "org/name:function"): either way it goes
    looking for a package and fails to load it instead of calling the registered
    function. "eager" and names with "|" are reserved.
    """
    if (
        not isinstance(name, str)
        or not name
        or "flash" in name.lower()
        or name == "eager"
        or "|" in name
    ):
        raise ValueError(
            f"cannot register flashtile as name={name!r}: transformers reads any "
            "attention implementation whose name contains 'flash' as a request for a "
            "FlashAttention kernel package and fails to load it; 'eager' and names "
            f"with '|' are reserved too. Use another name, e.g. {DEFAULT_NAME!r}"
        )
    if "/" in name or ":" in name:
        raise ValueError(
            f"cannot register flashtile as name={name!r}: transformers reads a name "
            "with '/' or ':' as a kernel repository on the Hub ('org/name' or "
            "'org/name:function') and tries to download it; use a name without '/' and "
            f"':', e.g. {DEFAULT_NAME!r}"
        )
    return name


def register(name: str = DEFAULT_NAME) -> str:
    """Register flashtile with transformers under ``name``; return the name. Idempotent.

    Registers two things under the same name: the attention function
    (``AttentionInterface``) and a mask function (``AttentionMaskInterface``), without
    which the model would pass ``attention_mask=None`` for a padded batch. Raises
    ValueError for a name containing "flash" (transformers would look for a
    FlashAttention kernel package), with '/' or ':' (a Hub kernel repository,
    "org/name:function"), or a name already taken by another implementation.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as exc:
        raise ImportError(
            "flashtile.integrations.transformers needs transformers: pip install "
            "transformers"
        ) from exc
    check_name(name)
    for interface, function in (
        (AttentionInterface, flashtile_attention_forward),
        (AttentionMaskInterface, sdpa_mask),
    ):
        taken = interface._global_mapping.get(name)
        if taken is not None and taken is not function:
            raise ValueError(
                f"{name!r} is already registered in transformers' {interface.__name__} "
                f"as {taken!r}"
            )
    AttentionInterface.register(name, flashtile_attention_forward)
    # sdpa's mask: None when the batch is plain causal (no padding), else a (B, 1, Tq,
    # Tk) bool mask
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
# --8<-- [end:register]


# --8<-- [start:attention_forward]
def flashtile_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, H, Tq, D), a view of the (B, Tq, H, D) projection
    key: torch.Tensor,  # (B, H_kv, Tk, D): the whole cache so far, the new tokens last
    value: torch.Tensor,  # (B, H_kv, Tk, D_v): D_v may differ from D (MLA)
    # None, or (B, 1, Tq, Tk): True (or 0.0) where a key may be seen
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    # sliding_window, softcap, s_aux, position_ids, ... as the model passes them
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function transformers calls in every attention layer; returns (o (B, Tq, H,
    D_v), None)."""
    refuse_unsupported(dropout, kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    Tq, Tk = query.shape[2], key.shape[2]
    layer = dict(
        scale=scaling, window=layer_window(kwargs.get("sliding_window"), causal, Tk),
        softcap=kwargs.get("softcap"), enable_gqa=query.shape[1] != key.shape[1],
        sinks=layer_sinks(kwargs, query),
    )  # fmt: skip
    # packed rows: (B, Tq) True where a document starts
    documents = document_starts(query, key, kwargs)
    if documents is not None and not causal:
        raise ValueError(
            "flashtile supports packed rows on causal layers only; use "
            "attn_implementation='sdpa'"
        )
    # padding, packing, a window, or a cache's offset
    if attention_mask is not None or documents is not None:
        plan = segment_plan(
            attention_mask, documents, query, key, layer["window"], causal
        )
        return run_segments(query, key, value, plan, **layer), None
    if Tq == 1 and decode_fits(query):
        o = decode_attention(
            query,
            key,
            value,
            scale=scaling,
            window=layer["window"],
            softcap=layer["softcap"],
            sinks=layer["sinks"],
        )
    # sdpa's mask function skips the mask only for Tq == 1, Tq == Tk, or an empty cache
    # (rows 0 ... Tq-1)
    else:
        causal = causal and Tq > 1
        # an empty static cache: slots Tq ... Tk-1 hold no token yet
        if causal and Tk > Tq:
            key, value = key[:, :, :Tq], value[:, :, :Tq]
        o = attention(
            query, key, value, is_causal=causal, alignment="lower_right", **layer
        )
    # (B, Tq, H, D_v), as the model's reshape expects. flashtile.attention lays o out
    # like the model's query view (a transposed (B, T, H, D) projection), so after it
    # this is contiguous already: no copy
    return o.transpose(1, 2).contiguous(), None
# --8<-- [end:attention_forward]


def refuse_unsupported(dropout: float, kwargs: dict) -> None:
    """Raise for what flashtile cannot compute, rather than compute something else."""
    if dropout:
        raise ValueError(
            f"flashtile has no attention dropout, but this layer asks for dropout={dropout} (the config's "
            "attention_dropout, in training mode): set attention_dropout=0.0 or use attn_implementation='sdpa'"
        )
    if kwargs.get("position_bias") is not None:
        raise ValueError("flashtile does not support 'position_bias' in attention; use attn_implementation='sdpa'")
    if kwargs.get("output_attentions"):
        raise ValueError(
            "flashtile computes no attention weights (it never forms the probabilities P), so "
            "output_attentions=True cannot be answered: use attn_implementation='eager' for them"
        )


# --8<-- [start:layer_sinks]
def layer_sinks(kwargs: dict, query: torch.Tensor) -> torch.Tensor | None:
    """The layer's attention sinks, (H,) float32 or query's dtype, or None.

    gpt-oss passes its learnable sinks as ``s_aux`` (the module's (H,) parameter):
    transformers' eager attention appends them as one more column of the scaled
    scores, joins them to the softmax and drops their column, the units flashtile's
    ``sinks`` take. The tensor goes through as it is (no copy), so its gradient
    reaches the parameter.
    """
    given = [name for name in ("s_aux", "sinks") if kwargs.get(name) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError("the layer passes both s_aux and sinks; pass one")
    sinks, H = kwargs[given[0]], query.shape[1]
    if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (H,):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else sinks
        raise ValueError(
            f"flashtile takes one attention sink per query head: {given[0]} of shape "
            f"({H},), got {shape!r} (per-token sinks are not supported); use "
            "attn_implementation='eager'"
        )
    if sinks.dtype not in (torch.float32, query.dtype):
        sinks = sinks.float()
    return sinks
# --8<-- [end:layer_sinks]


# --8<-- [start:layer_window]
def layer_window(sliding_window, causal: bool, Tk: int) -> tuple[int, int] | None:
    """flashtile's window for transformers' ``sliding_window`` W: (W - 1, 0), or None
    where it cannot bind.

    transformers' sliding mask keeps key j for query position p when p - W < j <= p
    (``masking_utils.
    sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``, and causal): W keys,
    the query's own included, so W - 1 to the left. A query at key position p < W sees
    every earlier key anyway, and the largest p is Tk - 1: with Tk <= W the window
    changes nothing, and the call runs without one.
    """
    if sliding_window is None:
        return None
    if (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, numbers.Integral)
        or sliding_window < 1
    ):
        raise ValueError(
            "sliding_window must be a positive int (keys in the window, the query's "
            f"own included), got {sliding_window!r}"
        )
    if Tk <= sliding_window:
        return None
    # a bidirectional window (|i - j| <= W in transformers) on a non-causal layer
    if not causal:
        raise ValueError(
            "flashtile supports sliding windows on causal layers only: this non-causal "
            f"layer has a window of {sliding_window} keys and {Tk} keys to attend to; "
            "use attn_implementation='sdpa'"
        )
    return sliding_window - 1, 0
# --8<-- [end:layer_window]


def decode_fits(query) -> bool:
    """One new token can take ``decode_attention`` (window, soft-cap, sinks and D_v included) when no gradient
    is wanted."""
    return not (torch.is_grad_enabled() and query.requires_grad)


def document_starts(query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
    """(B, Tq) bool, True at the first token of each packed document, or None when the rows are not packed.

    Packed rows (``DataCollatorWithFlattening``) come as ``position_ids`` that restart, or as
    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (with ``return_flash_attn_kwargs=True``). A document starts
    where a position is not the previous one plus 1, as in transformers' own ``find_packed_sequence_indices``.
    transformers' eager and SDPA masks honour restarting positions only without a cache (``use_cache=False``);
    flashtile honours them always, as transformers' FlashAttention path does. Read once per forward (the
    model hands every layer the same tensor): one host read, skipped for one token and after a cache
    (Tk != Tq). Under ``torch.compile`` ``cu_seq_lens_q`` is read too (a graph break: packing must not be
    dropped), but restarting ``position_ids`` alone are not: every batch carries position_ids, and reading
    them would break every compiled forward's graph; pass ``cu_seq_lens_q`` with packed rows there.
    """
    B, _, Tq, _ = query.shape
    if Tq == 1 or key.shape[2] != Tq:
        return None
    compiling = torch.compiler.is_compiling()
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None:
        if not isinstance(cu_q, torch.Tensor):
            raise TypeError(f"cu_seq_lens_q must be a 1-D integer tensor, got {type(cu_q).__name__}")
        if compiling:  # no attribute kept on a traced tensor
            return starts_from_cu_seqlens(cu_q, cu_k, B, Tq)
        return remembered(cu_q, "_flashtile_starts", lambda: starts_from_cu_seqlens(cu_q, cu_k, B, Tq))
    if compiling:
        return None
    positions = kwargs.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.shape[-1] != Tq:
        return None
    def expanded():  # one (B, Tq) tensor for every layer: segment_plan keeps its plan on it
        starts = starts_from_positions(positions)
        return None if starts is None else starts.expand(B, Tq)

    return remembered(positions, f"_flashtile_starts_{B}", expanded)


def starts_from_positions(positions: torch.Tensor) -> torch.Tensor | None:
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return starts if bool(starts[:, 1:].any()) else None


def starts_from_cu_seqlens(cu_q, cu_k, B: int, Tq: int) -> torch.Tensor:
    bounds = [int(x) for x in cu_q.tolist()]
    if cu_k is not None and [int(x) for x in cu_k.tolist()] != bounds:
        raise ValueError("flashtile takes packed self-attention only: cu_seq_lens_k must equal cu_seq_lens_q, got "
                         f"{cu_k.tolist()} and {bounds}")  # fmt: skip
    if B != 1 or len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != Tq or bounds != sorted(bounds):
        raise ValueError(
            f"cu_seq_lens_q must run from 0 to the row's {Tq} tokens, non-decreasing, over one packed row (batch "
            f"size 1), got {bounds} for batch size {B}"
        )
    starts = torch.zeros(1, Tq, dtype=torch.bool, device=cu_q.device)
    starts[0, [s for s in bounds[:-1] if s < Tq]] = True
    return starts


def remembered(tensor: torch.Tensor, attribute: str, compute):
    """``compute()``, kept on ``tensor`` itself: every layer of one forward gets the same mask and position
    tensors, so the host reads happen in the first layer only. Computed again if the tensor was written in
    place since (its version counter moved)."""
    cached = getattr(tensor, attribute, None)
    if cached is None or cached[0] != tensor._version:
        cached = (tensor._version, compute())
        setattr(tensor, attribute, cached)
    return cached[1]


def allowed_keys(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """(B, Tq, Tk) bool, True where a key may be seen, from transformers' (B, 1, Tq, Tk) bool or 0/-inf mask."""
    B, _, Tq, _ = query.shape
    Tk = key.shape[2]
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2:] != (Tq, Tk) or mask.shape[0] not in (1, B):
        raise ValueError(
            f"flashtile takes a (B, 1, Tq, Tk) = ({B}, 1, {Tq}, {Tk}) padding mask, got shape {tuple(mask.shape)} "
            "(per-head and other shapes are not supported); use attn_implementation='sdpa'"
        )
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(
            f"attention_mask must be a bool or floating-point (B, 1, Tq, Tk) mask (True or 0.0 where a key may be "
            f"seen), got dtype {str(mask.dtype).replace('torch.', '')}: an integer mask is ambiguous (1 = keep, or "
            "an additive 0 / large negative?); convert it with mask.bool() or pass transformers' own mask"
        )
    if mask.dtype == torch.bool:
        allowed = mask[:, 0]
    else:  # additive: 0 where seen, a huge negative number (or -inf) where not; anything else is a bias
        allowed = mask[:, 0] == 0
        blocked = mask[:, 0] <= torch.finfo(mask.dtype).min / 2
        if not bool((allowed | blocked).all()):
            raise ValueError("flashtile cannot add a bias to the scores (this float mask is not 0/-inf); use 'sdpa'")
    return allowed.expand(B, Tq, Tk)


class Segments(NamedTuple):
    """Runs of consecutive real queries of one row, each against one run of keys, in row-major order.

    Segment s holds query rows q0 ... q1 - 1 of batch row b and keys k0 ... k1 - 1 of the same row, the
    last query at the last key (lower-right). The indices are into the (B * Tq) and (B * Tk) flattened
    tokens; cu_seqlens_* are int32 [0, n_1, n_1 + n_2, ...], as ``attention_varlen`` takes them.
    """

    q_index: torch.Tensor  # (total_q,) int64
    k_index: torch.Tensor  # (total_k,) int64
    cu_seqlens_q: torch.Tensor  # (segments + 1,) int32
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    whole: tuple[int, int] | None  # (k0, k1) when every row is one segment of all Tq queries on keys k0 ... k1-1


# --8<-- [start:segment_plan]
def segment_plan(mask, documents, query, key, window, causal: bool) -> Segments:
    """The segments a mask (and packed documents) describe, or a ValueError for any
    other mask.

    Query row i sits at key position p = i + off. It is real when it may see its own key
    p. Two neighbouring real rows are in one segment when the second may see the first's
    key (and no document starts there); a segment's keys start at the first key its
    first row may see. The mask is then rebuilt from the segments, causal and windowed,
    and must equal the model's on every real row: padding rows come out as zeros. Every
    layer of one forward gets the same mask (or document starts) tensor, so the plan is
    worked out in the first layer and kept on that tensor: its host reads, and those of
    the varlen call's cu_seqlens, happen once per forward and window, not once per
    layer.
    """
    if mask is not None and not causal:
        raise ValueError(
            "flashtile supports masks on causal layers only; use "
            "attn_implementation='sdpa'"
        )
    find = lambda: find_segments(mask, documents, query, key, window)  # noqa: E731
    if torch.compiler.is_compiling() or (mask is not None and documents is not None):
        # no attributes on traced tensors; a mask with documents: two tensors, nowhere
        # to keep it
        return find()
    return remembered(
        documents if mask is None else mask, f"_flashtile_plan_{window}", find
    )


def find_segments(mask, documents, query, key, window) -> Segments:
    B, _, Tq, _ = query.shape
    Tk = key.shape[2]
    # packed rows without a mask: every token real, off = 0 (document_starts needs Tq ==
    # Tk)
    if mask is None:
        real = torch.ones(B, Tq, dtype=torch.bool, device=query.device)
        starts, k0, off = (
            documents.clone(),
            torch.arange(Tq, device=query.device).expand(B, Tq),
            0,
        )
    # the mask's reading is kept on it even where the plan cannot be (a mask with
    # documents)
    else:
        found = lambda: mask_segments(mask, query, key, window)  # noqa: E731
        compiling = torch.compiler.is_compiling()  # no attributes on traced tensors
        real, starts, k0, off = (
            found()
            if compiling
            else remembered(mask, f"_flashtile_segments_{window}", found)
        )
        # documents the mask does not know of (a cache was in use)
        if documents is not None and off == 0:
            documents = documents & real
            starts = starts | documents
            # a document starts at itself
            k0 = torch.where(documents, torch.arange(Tq, device=query.device), k0)
    return segments(real, starts, k0, off, Tq, Tk)
# --8<-- [end:segment_plan]


def mask_segments(mask, query, key, window):
    """(real, starts, k0, off) for the first offset whose rebuilt mask equals ``mask`` on the real rows."""
    B, _, Tq, _ = query.shape
    Tk = key.shape[2]
    allowed = allowed_keys(mask, query, key)  # (B, Tq, Tk)
    i = torch.arange(Tq, device=allowed.device)
    j = torch.arange(Tk, device=allowed.device)
    seen = allowed.to(torch.uint8)
    lo = seen.argmax(dim=-1)  # (B, Tq): the first key each row may see
    # the offset: Tk - Tq after a dynamic cache (and with none); a static cache has empty slots after the
    # last token, whose last row then sees key off + Tq - 1 last. A wrong offset can pass the rebuild by
    # calling every row padding (a static cache's last slot is empty: "a padding row"), so of the offsets
    # that pass, the one with the most real rows wins
    offsets = (0,)
    if Tk > Tq:
        last_seen = Tk - 1 - seen[:, -1].flip(-1).argmax(dim=-1)  # (B,): the last row's last key
        offsets = (int(last_seen.max()) - (Tq - 1), Tk - Tq, 0)
    best = None
    for off in dict.fromkeys(offsets):
        if not 0 <= off <= Tk - Tq:
            continue
        p = i + off  # (Tq,): each row's own key position
        real = allowed[:, i, p]  # (B, Tq): the row may see its own key
        after = torch.zeros_like(real)  # the row continues the previous row's segment
        after[:, 1:] = real[:, 1:] & real[:, :-1] & allowed[:, i[1:], p[1:] - 1]
        starts = real & ~after
        k0 = torch.where(starts, lo, 0)
        first = torch.where(starts, i, -1).cummax(dim=1).values.clamp_min(0)  # each row's segment start
        k0_row = k0.gather(1, first)
        rebuilt = real[..., None] & (j >= k0_row[..., None]) & (j <= p[:, None])
        if window is not None:
            rebuilt &= j >= p[:, None] - window[0]
        if torch.equal(allowed & real[..., None], rebuilt):
            count = int(real.sum())
            if best is None or count > best[0]:
                best = count, (real, starts, k0, off)
    if best is not None:
        return best[1]
    raise ValueError(
        "flashtile has no attn_mask: it runs masks that are causal on runs of real tokens (left or right padding, "
        "packed documents), with the layer's sliding window if it has one. This mask is something else (a block, "
        "prefix or custom mask, or right padding during generation: pad on the left to generate); use "
        "attn_implementation='sdpa' for it"
    )


def segments(real, starts, k0, off: int, Tq: int, Tk: int) -> Segments:
    """The varlen layout of the segments that begin at ``starts`` (B, Tq) and run over consecutive real rows."""
    B = real.shape[0]
    device = real.device
    goes_on = torch.zeros_like(real)  # the next row continues this row's segment
    goes_on[:, :-1] = real[:, 1:] & ~starts[:, 1:]
    first, last = starts.nonzero(), (real & ~goes_on).nonzero()  # (segments, 2) each, both row-major
    b, q0, q1 = first[:, 0], first[:, 1], last[:, 1] + 1
    k0 = k0[b, q0]
    k1 = q1 + off  # the last query sits at the last key
    nq, nk = q1 - q0, k1 - k0
    cu_q = F.pad(nq.cumsum(0), (1, 0)).to(torch.int32)
    cu_k = F.pad(nk.cumsum(0), (1, 0)).to(torch.int32)
    sizes = torch.stack([cu_q[-1], cu_k[-1], F.pad(nq, (0, 1)).max(), F.pad(nk, (0, 1)).max()])  # 0 if none
    total_q, total_k, max_q, max_k = (int(x) for x in sizes.tolist())  # the one host read of the layout
    q_index = torch.arange(total_q, device=device) + torch.repeat_interleave(b * Tq + q0 - cu_q[:-1], nq,
                                                                             output_size=total_q)  # fmt: skip
    k_index = torch.arange(total_k, device=device) + torch.repeat_interleave(b * Tk + k0 - cu_k[:-1], nk,
                                                                             output_size=total_k)  # fmt: skip
    whole = None
    if len(b) == B and total_q == B * Tq:  # every row is one segment of all its queries
        k_bounds = torch.stack([k0.min(), k0.max()]).tolist()
        if k_bounds[0] == k_bounds[1]:
            whole = (k_bounds[0], Tq + off)
    return Segments(q_index, k_index, cu_q, cu_k, max_q, max_k, whole)


# --8<-- [start:run_segments]
def run_segments(
    query, key, value, plan: Segments, scale, window, softcap, enable_gqa, sinks
) -> torch.Tensor:
    """(B, Tq, H, D_v): the segments' real rows in one call, zeros in the padding rows.

    Every row one segment on the same keys (a cache, a window without padding): one
    ``attention`` call on those keys, aligned lower-right. Otherwise the real tokens are
    gathered into packed (total, H, D) tensors, run as one ``attention_varlen`` call
    (each segment a document, aligned lower-right) and scattered back. A padding row
    is zeros, as under eager attention with sinks (the sink takes all of its weight).
    """
    B, H, Tq, D = query.shape
    H_kv, Tk, D_v = key.shape[1], key.shape[2], value.shape[-1]
    if plan.whole is not None:
        k0, k1 = plan.whole
        key, value = key[:, :, k0:k1], value[:, :, k0:k1]
        if Tq == 1 and decode_fits(query):
            o = decode_attention(
                query, key, value, scale=scale, window=window, softcap=softcap,
                sinks=sinks,
            )  # fmt: skip
            return o.transpose(1, 2).contiguous()
        o = attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=enable_gqa,
            alignment="lower_right", window=window, softcap=softcap, sinks=sinks,
        )  # fmt: skip
        return o.transpose(1, 2).contiguous()
    # (B, T, H, D) views, flattened to tokens: free for the model's projections, one
    # copy for a cache
    # (total_q, H, D)
    q = query.transpose(1, 2).reshape(B * Tq, H, D).index_select(0, plan.q_index)
    # (total_k, H_kv, D) and (total_k, H_kv, D_v)
    k = key.transpose(1, 2).reshape(B * Tk, H_kv, D).index_select(0, plan.k_index)
    v = value.transpose(1, 2).reshape(B * Tk, H_kv, D_v).index_select(0, plan.k_index)
    o = query.new_zeros(B * Tq, H, D_v)
    if len(plan.q_index):
        packed = attention_varlen(
            q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q,
            plan.max_seqlen_k, is_causal=True, scale=scale, window=window,
            softcap=softcap, alignment="lower_right", sinks=sinks,
        )  # fmt: skip
        o = o.index_copy(0, plan.q_index, packed)
    return o.view(B, Tq, H, D_v)
# --8<-- [end:run_segments]

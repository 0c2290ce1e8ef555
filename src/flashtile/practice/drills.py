"""The practice battery's later steps: the autograd.Function wiring, and drills on the variants interviews
ask about (GQA, a sliding window, split-KV decode and its merge, the paged-KV gather, packed varlen, an
attention sink and its gradient).

Like ``battery``, this module imports nothing else from flashtile: each truth is the definition in float64
(``truth.attention_truth`` under the variant's own visibility), and each symptom rule compares a wrong
answer with the output a known mistake gives.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .battery import (
    HINT_ALIGNMENT,
    HINT_NEG_INF,
    AttentionInputs,
    Case,
    Hint,
    PracticeFailure,
    Shape,
    attention_symptom,
    backward_symptom,
    call_with_grads,
    check_dtype,
    compare,
    matches,
    nan_symptom,
    randn,
    with_symptom,
)
from .truth import (
    attention_grads_truth,
    attention_truth,
    backward_equations,
    sink_attention_truth,
    sink_gradient_truth,
    visible,
)

# ---------------------------------------------------------------------------------------------------
# Step 8: the autograd.Function wiring (the reader's forward and backward, saved lse, causal passed on)
# ---------------------------------------------------------------------------------------------------
HINT_NO_GRAD = Hint(
    "no_grad", "o carries no gradient (no grad_fn): the output does not come out of your Function's apply; look "
    "at reference_attention", "o, lse = FlashAttentionFunction.apply(q, k, v, causal, scale, ...); return o")
HINT_WIRING = Hint(
    "wiring", "your gradients are the right equations with another mask, scale or alignment than the forward's: "
    "what the forward was given does not reach the backward; look at what ctx keeps",
    "in forward: ctx.save_for_backward(q, k, v, o, lse); ctx.causal, ctx.scale, ctx.alignment = causal, scale, "
    "alignment; in backward: flash_attention_backward(q, k, v, o, lse, do, ctx.causal, ctx.scale, ...)")
HINT_SAVED = Hint(
    "saved", "autograd saved more than q, k, v, o and lse for the backward: autograd is recording your forward's "
    "tiles (or you saved P); look at what the forward keeps",
    "compute o, lse inside Function.forward (no graph is recorded there) and save_for_backward(q, k, v, o, lse)")


def _autograd_case(s: Shape, memory: bool = False, seed: int = 0):
    def run(impl):
        q, k, v = (randn(s.B, s.H, T, s.D, seed=seed + i) for i, T in enumerate((s.Tq, s.Tk, s.Tk)))
        do = randn(s.B, s.H, s.Tq, s.D, seed=seed + 3)
        o_ref, lse_ref, *grads = attention_grads_truth(q, k, v, do, s.causal, s.scale, s.alignment)
        kwargs = dict(causal=s.causal, scale=s.scale, block_q=s.block_q, block_k=s.block_k, alignment=s.alignment)
        out, got, saved, largest = call_with_grads(impl, "reference_attention", (q, k, v), kwargs, [0, 1, 2], do)
        o = out[0] if isinstance(out, tuple | list) else out
        a = AttentionInputs(q, k, v, s.causal, s.scale, s.alignment, s.block_k, 1e-10, torch.float64, s.block_q)
        with_symptom(lambda: compare("o", o, o_ref, 1e-10), lambda: attention_symptom(a, o, lse_ref))
        if got is None:
            raise PracticeFailure("o carries no gradient (o.grad_fn is None)", HINT_NO_GRAD, "o has no grad_fn")

        def same(scale, alignment, causal=s.causal, mask=None):
            alt = backward_equations(q, k, v, o_ref, lse_ref, do, causal, scale, alignment, mask)
            return all(matches(g, r, 1e-9) for g, r in zip(got, alt))

        def symptom():
            hint = backward_symptom(s, (q, k, v, o_ref, lse_ref, do), got, grads, same)
            if hint is not None and {"mask_backward", "alignment", "scale"} & set(hint.name.split("+")):
                return HINT_WIRING  # the backward itself passed its step: what it is given is wrong
            return hint

        with_symptom(lambda: [compare(n, g, r, 1e-10) for n, g, r in zip(("dq", "dk", "dv"), got, grads)], symptom)
        if memory:
            need = sum(t.numel() * t.element_size() for t in (q, k, v, o_ref, lse_ref))
            if saved > 1.5 * need or largest >= s.Tq * s.Tk:
                raise PracticeFailure(
                    f"autograd saved {saved / 2**10:.0f} KiB for the backward (the largest tensor {largest} elements); "
                    f"q, k, v, o and lse are {need / 2**10:.0f} KiB, and one head's P is {s.Tq * s.Tk} elements",
                    HINT_SAVED)
    return run


def autograd_cases() -> list[Case]:
    tiled = Shape(1, 1, 128, 128, 8, 16, 16, True, "lower_right", 0.5)
    return [
        Case(f"{Shape(1, 2, 20, 37, 8, 16, 8, scale=0.3)} (no mask: o and its gradients)",
             _autograd_case(Shape(1, 2, 20, 37, 8, 16, 8, scale=0.3))),
        Case(f"{Shape(2, 1, 20, 37, 8, 8, 16, True, 'lower_right')} (causal: the mask reaches the backward)",
             _autograd_case(Shape(2, 1, 20, 37, 8, 8, 16, True, "lower_right"))),
        Case(f"{Shape(1, 1, 40, 13, 8, 16, 16, True, 'lower_right', 0.7)} (27 rows see no key: zero gradients)",
             _autograd_case(Shape(1, 1, 40, 13, 8, 16, 16, True, "lower_right", 0.7))),
        Case(f"{tiled} (saved for the backward: q, k, v, o and lse, 33 KiB; P would be 128 KiB)",
             _autograd_case(tiled, memory=True)),
    ]


# ---------------------------------------------------------------------------------------------------
# Drill: grouped-query attention (H query heads share H_kv key/value heads)
# ---------------------------------------------------------------------------------------------------
HINT_GQA_MAP = Hint(
    "gqa_head_map", "your output is attention with query head h reading key/value head h % H_kv (interleaved); "
    "the heads of a group are consecutive: look at the key/value head index",
    "query head h reads key/value head h // (H // H_kv), as SDPA's enable_gqa and repeat_interleave do")


def _gqa_case(B, H, H_kv, Tq, Tk, D, causal=False, alignment="upper_left", seed=0):
    def run(impl):
        q = randn(B, H, Tq, D, seed=seed)
        k, v = randn(B, H_kv, Tk, D, seed=seed + 1), randn(B, H_kv, Tk, D, seed=seed + 2)
        out = impl.flash_attention_forward(q, k, v, causal=causal, block_q=16, block_k=16, alignment=alignment)
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise PracticeFailure(f"expected (o, lse), got {type(out).__name__}")
        o, lse = out
        grouped = AttentionInputs(q, k.repeat_interleave(H // H_kv, 1), v.repeat_interleave(H // H_kv, 1), causal,
                                  None, alignment, 16, 1e-10, torch.float64, 16)
        o_ref, lse_ref = grouped.truth()

        def symptom():
            interleaved = attention_truth(q, k.repeat(1, H // H_kv, 1, 1), v.repeat(1, H // H_kv, 1, 1), causal,
                                          None, alignment)
            if matches(o, interleaved[0], 1e-10) and matches(lse, interleaved[1], 1e-10):
                return HINT_GQA_MAP
            return attention_symptom(grouped, o, lse)

        with_symptom(lambda: (compare("o", o, o_ref, 1e-10), compare("lse", lse, lse_ref, 1e-10)), symptom)
    return run


def gqa_cases() -> list[Case]:
    return [
        Case("B=1 H=4 H_kv=2 Tq=20 Tk=37 D=8 (groups of 2 query heads)", _gqa_case(1, 4, 2, 20, 37, 8)),
        Case("B=2 H=6 H_kv=1 Tq=16 Tk=40 D=8, causal lower_right (MQA: one key/value head)",
             _gqa_case(2, 6, 1, 16, 40, 8, True, "lower_right")),
        Case("B=1 H=8 H_kv=4 Tq=33 Tk=33 D=8, causal (groups of 2, ragged tiles)", _gqa_case(1, 8, 4, 33, 33, 8, True)),
    ]


# ---------------------------------------------------------------------------------------------------
# Drill: a sliding window, query i sees keys offset + i - left .. offset + i + right (-1: unbounded)
# ---------------------------------------------------------------------------------------------------
HINT_WINDOW_EDGE = Hint(
    "window_edge", "your output is attention with a window one key narrower (an edge key dropped): look at the "
    "comparisons of the window's bounds", "visible iff offset + i - left <= j <= offset + i + right: both inclusive")
HINT_WINDOW_OFFSET = Hint(
    "window_offset", "your output is the window placed on the other diagonal (without the alignment's offset): "
    "look at where the window is centred", "the window is around j = i + offset, offset = 0 upper_left, Tk - Tq "
    "lower_right")
HINT_WINDOW_TILES = Hint(
    "window_tiles", "NaN appears when the key tiles outside every row's window hold NaN, and your output is right "
    "without it: those tiles are loaded; look at the loop's first and last key tile",
    "first tile: (q_start + offset - left) // block_k; last: the causal or window right edge of the tile's last row")


def window_visible(Tq, Tk, window, causal, alignment, edge=0, offset_used=True):
    """Boolean (Tq, Tk) of the window (left, right), -1 unbounded; causal caps right at 0. edge=1 narrows
    the left bound by one (a mistake); offset_used=False centres it on j = i (a mistake)."""
    left, right = window
    offset = (0 if alignment == "upper_left" else Tk - Tq) if offset_used else 0
    d = torch.arange(Tk)[None, :] - torch.arange(Tq)[:, None] - offset  # j - i - offset
    keep = torch.ones(Tq, Tk, dtype=torch.bool)
    if left >= 0:
        keep &= d >= -left + edge
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if right >= 0:
        keep &= d <= right
    return keep


def _window_case(Tq, Tk, window, causal=False, alignment="upper_left", poison=False, seed=0):
    def run(impl):
        q, k, v = randn(1, 2, Tq, 8, seed=seed), randn(1, 2, Tk, 8, seed=seed + 1), randn(1, 2, Tk, 8, seed=seed + 2)
        mask = window_visible(Tq, Tk, window, causal, alignment)
        o_ref, lse_ref = attention_truth(q, k, v, mask=mask)
        k_in, v_in = k.clone(), v.clone()
        if poison:  # NaN in the keys no row sees, whole tiles of 16 at the left
            seen_cols = mask.any(0).nonzero().flatten()
            first = int(seen_cols.min()) // 16 * 16
            k_in[..., :first, :] = float("nan")
            v_in[..., :first, :] = float("nan")

        def call(kk, vv):
            return impl.flash_attention_forward(q, kk, vv, causal=causal, block_q=16, block_k=16, alignment=alignment,
                                                window=window)
        out = call(k_in, v_in)
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise PracticeFailure(f"expected (o, lse), got {type(out).__name__}")
        o, lse = out

        def symptom():
            o_got, lse_got = o, lse
            if poison and torch.isnan(o).any():  # the same call without the NaN: is reading them the only bug?
                o_got, lse_got = call(k, v)
                if matches(o_got, o_ref, 1e-10) and matches(lse_got, lse_ref, 1e-10):
                    return HINT_WINDOW_TILES
            for hint, alt in [(HINT_WINDOW_EDGE, window_visible(Tq, Tk, window, causal, alignment, edge=1)),
                              (HINT_WINDOW_OFFSET, window_visible(Tq, Tk, window, causal, alignment,
                                                                  offset_used=False))]:
                o_alt, lse_alt = attention_truth(q, k, v, mask=alt)
                if not torch.equal(alt, mask) and matches(o_got, o_alt, 1e-10) and matches(lse_got, lse_alt, 1e-10):
                    return hint
            nan_rows = torch.isnan(o_got).any(-1) | torch.isnan(lse_got)  # NaN only where a row sees no key
            if nan_rows.any() and not (nan_rows & ~torch.isneginf(lse_ref)).any():
                return HINT_NEG_INF
            return None

        with_symptom(lambda: (compare("o", o, o_ref, 1e-10), compare("lse", lse, lse_ref, 1e-10)), symptom)
    return run


def window_cases() -> list[Case]:
    return [
        Case("Tq=Tk=48, window (8, 8), no mask (a band around the diagonal)", _window_case(48, 48, (8, 8))),
        Case("Tq=20 Tk=60, window (10, -1), causal lower_right (the last 11 keys of each row)",
             _window_case(20, 60, (10, -1), True, "lower_right")),
        Case("Tq=Tk=64, window (5, 0), causal (each row sees itself and the 5 keys before it)",
             _window_case(64, 64, (5, 0), True)),
        Case("Tq=16 Tk=80, window (7, 0), causal lower_right (key tiles 0-2 are outside every window: NaN there)",
             _window_case(16, 80, (7, 0), True, "lower_right", poison=True)),
    ]


# ---------------------------------------------------------------------------------------------------
# Drills: split-KV decode with the merge of partials, and the paged-KV gather
# ---------------------------------------------------------------------------------------------------
HINT_SPLIT_MERGE = Hint(
    "split_merge", "right with one split and wrong with several: the merge of the splits' partials is where it "
    "differs; look at how (o_s, lse_s) are combined",
    "lse = logsumexp_s(lse_s); o = sum_s exp(lse_s - lse) o_s (a split that saw no key: lse_s = -inf, weight 0)")
HINT_CACHE_LENGTHS = Hint(
    "cache_lengths", "your output is attention over the whole cache, past each sequence's length: look at where "
    "cache_seqlens bounds the keys", "sequence b sees keys 0 .. cache_seqlens[b] - 1 only")
HINT_DECODE_ALIGNMENT = Hint(
    "decode_alignment", "your output is the new tokens aligned upper-left: the Tq new tokens are the last Tq "
    "positions of the sequence; look at the causal offset", "new token t sees key j iff j <= t + length - Tq")
HINT_BLOCK_TABLE = Hint(
    "block_table", "your keys are page j of the pool instead of page table_row[j]: look at the page index",
    "key t of the sequence is pages[table_row[t // page_size], :, t % page_size]")


def decode_truth(query, keys, values, lengths, alignment="lower_right"):
    """(o, lse) per sequence b over its first lengths[b] keys, the new tokens last (lower-right causal)."""
    H = query.shape[1]
    o = torch.zeros(query.shape, dtype=torch.float64)
    lse = torch.zeros(query.shape[:-1], dtype=torch.float64)
    for b, n in enumerate(lengths):
        k, v = (t[b:b + 1, :, :n].repeat_interleave(H // t.shape[1], 1) for t in (keys, values))
        o[b:b + 1], lse[b:b + 1] = attention_truth(query[b:b + 1], k, v, True, None, alignment)
    return o, lse


def _decode_case(B, H, H_kv, Tq, capacity, lengths, num_splits, page_size=None, seed=0):
    def run(impl):
        query = randn(B, H, Tq, 8, seed=seed)
        keys, values = randn(B, H_kv, capacity, 8, seed=seed + 1), randn(B, H_kv, capacity, 8, seed=seed + 2)
        cache_seqlens = torch.tensor(lengths, dtype=torch.int32)
        kwargs = dict(cache_seqlens=cache_seqlens, num_splits=num_splits)
        if page_size is None:
            key_cache, value_cache = keys, values
        else:  # the same keys in a shuffled pool of pages, unused pages NaN
            per = capacity // page_size
            order = torch.randperm(B * per + 2, generator=torch.Generator().manual_seed(seed))
            key_cache = torch.full((B * per + 2, H_kv, page_size, 8), float("nan"), dtype=torch.float64)
            value_cache = key_cache.clone()
            table = order[:B * per].view(B, per).to(torch.int32)
            for b in range(B):
                for j in range(per):
                    key_cache[table[b, j]] = keys[b, :, j * page_size:(j + 1) * page_size]
                    value_cache[table[b, j]] = values[b, :, j * page_size:(j + 1) * page_size]
            kwargs["block_table"] = table
        o_ref, lse_ref = decode_truth(query, keys, values, lengths)
        out = impl.decode_attention_reference(query, key_cache, value_cache, **kwargs)
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise PracticeFailure(f"expected (o, lse), got {type(out).__name__}")
        o, lse = out

        def symptom():
            whole = decode_truth(query, keys, values, [capacity] * B)
            if matches(o, whole[0], 1e-10) and any(n < capacity for n in lengths):
                return HINT_CACHE_LENGTHS
            upper = decode_truth(query, keys, values, lengths, "upper_left")
            if matches(o, upper[0], 1e-10):
                return HINT_DECODE_ALIGNMENT
            if num_splits > 1:
                one = impl.decode_attention_reference(query, key_cache, value_cache, **dict(kwargs, num_splits=1))
                if matches(one[0], o_ref, 1e-10) and matches(one[1], lse_ref, 1e-10):
                    return HINT_SPLIT_MERGE
            return nan_symptom(o, lse)

        with_symptom(lambda: (compare("o", o, o_ref, 1e-10), compare("lse", lse, lse_ref, 1e-10)), symptom)
    return run


def decode_cases() -> list[Case]:
    return [
        Case("B=2 H=4 H_kv=2 Tq=1, cache lengths 37 and 64 of 64, 1 split", _decode_case(2, 4, 2, 1, 64, [37, 64], 1)),
        Case("B=2 H=4 H_kv=2 Tq=1, cache lengths 37 and 64 of 64, 3 splits (the merge)",
             _decode_case(2, 4, 2, 1, 64, [37, 64], 3)),
        Case("B=1 H=2 H_kv=1 Tq=3, cache length 50 of 64, 4 splits (3 new tokens: lower-right)",
             _decode_case(1, 2, 1, 3, 64, [50], 4)),
        Case("B=2 H=2 H_kv=2 Tq=1, cache lengths 5 and 64 of 64, 4 splits (splits with no key in sequence 0)",
             _decode_case(2, 2, 2, 1, 64, [5, 64], 4)),
        Case("B=2 H=4 H_kv=2 Tq=1, a paged cache of 16-key pages, lengths 37 and 64, 2 splits",
             _decode_case(2, 4, 2, 1, 64, [37, 64], 2, page_size=16)),
    ]


def _gather_case(H_kv, page_size, length, pool_pages, seed=0):
    def run(impl):
        keys = randn(H_kv, length, 8, seed=seed)
        used = -(-length // page_size)
        table = torch.randperm(pool_pages, generator=torch.Generator().manual_seed(seed))[:used + 1].to(torch.int32)
        pages = torch.full((pool_pages, H_kv, page_size, 8), float("nan"), dtype=torch.float64)
        for j in range(used):
            chunk = keys[:, j * page_size:(j + 1) * page_size]
            pages[table[j], :, :chunk.shape[1]] = chunk
        got = impl.gather_pages(pages, table, length)

        def symptom():
            if not (isinstance(got, torch.Tensor) and got.shape == keys.shape):
                return None
            direct = pages[:used].transpose(0, 1).flatten(1, 2)[:, :length]  # page j, not table_row[j]
            return HINT_BLOCK_TABLE if matches(got, direct, 0.0) else None

        with_symptom(lambda: compare("gather_pages(pages, table_row, length)", got, keys, 0.0), symptom)
    return run


def paged_cases() -> list[Case]:
    return [
        Case("H_kv=2, pages of 4 keys, length 10 (a partly filled last page), a shuffled table",
             _gather_case(2, 4, 10, 8)),
        Case("H_kv=1, pages of 16 keys, length 64 (whole pages), a shuffled table", _gather_case(1, 16, 64, 9, 1)),
        Case("H_kv=3, pages of 1 key, length 5", _gather_case(3, 1, 5, 12, 2)),
    ]


# ---------------------------------------------------------------------------------------------------
# Drill: packed variable-length documents (cu_seqlens)
# ---------------------------------------------------------------------------------------------------
HINT_DOCUMENTS = Hint(
    "documents", "your output is attention across the whole packed batch: a query sees other documents' keys; "
    "look at where cu_seqlens bounds each document",
    "document d: queries cu_seqlens_q[d] .. cu_seqlens_q[d+1] - 1 see keys cu_seqlens_k[d] .. cu_seqlens_k[d+1] - 1")


def varlen_truth(q, k, v, cu_q, cu_k, causal, alignment):
    H = q.shape[1]
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((H, q.shape[0]), float("-inf"), dtype=torch.float64)
    for d in range(len(cu_q) - 1):
        (qs, qe), (ks, ke) = (int(cu_q[d]), int(cu_q[d + 1])), (int(cu_k[d]), int(cu_k[d + 1]))
        if qe == qs:
            continue
        as_batch = lambda t, a, b: t[a:b].transpose(0, 1)[None]  # noqa: E731
        if ke == ks:  # queries that see no key: o = 0, lse = -inf
            continue
        o_d, lse_d = attention_truth(as_batch(q, qs, qe), as_batch(k, ks, ke), as_batch(v, ks, ke), causal, None,
                                     alignment)
        o[qs:qe] = o_d[0].transpose(0, 1)
        lse[:, qs:qe] = lse_d[0]
    return o, lse


def _varlen_case(lengths_q, lengths_k, causal=False, alignment="upper_left", seed=0):
    def run(impl):
        cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
        q = randn(int(cu_q[-1]), 2, 8, seed=seed)
        k, v = randn(int(cu_k[-1]), 2, 8, seed=seed + 1), randn(int(cu_k[-1]), 2, 8, seed=seed + 2)
        out = impl.varlen_attention_forward(q, k, v, cu_q, cu_k, causal=causal, alignment=alignment)
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise PracticeFailure(f"expected (o, lse), got {type(out).__name__}")
        o, lse = out
        o_ref, lse_ref = varlen_truth(q, k, v, cu_q, cu_k, causal, alignment)

        def symptom():
            one = varlen_truth(q, k, v, cu_q[[0, -1]], cu_k[[0, -1]], causal, alignment)
            if matches(o, one[0], 1e-10):
                return HINT_DOCUMENTS
            if causal:
                other = "upper_left" if alignment == "lower_right" else "lower_right"
                if matches(o, varlen_truth(q, k, v, cu_q, cu_k, causal, other)[0], 1e-10):
                    return HINT_ALIGNMENT
            empty = torch.isneginf(lse_ref)
            nan = isinstance(o, torch.Tensor) and torch.isnan(o).any(-1).T
            if nan is not False and nan.any() and not (nan & ~empty).any():
                return HINT_NEG_INF
            return None

        check_dtype("lse", lse, torch.float64)
        with_symptom(lambda: (compare("o", o, o_ref, 1e-10), compare("lse", lse, lse_ref, 1e-10)), symptom)
    return run


def varlen_cases() -> list[Case]:
    return [
        Case("3 documents of 5, 17 and 9 tokens, no mask", _varlen_case([5, 17, 9], [5, 17, 9])),
        Case("3 documents, queries 4, 10, 2 and keys 9, 10, 20, causal lower_right",
             _varlen_case([4, 10, 2], [9, 10, 20], True, "lower_right")),
        Case("4 documents, one with no keys (its 3 queries: o = 0, lse = -inf), causal lower_right",
             _varlen_case([6, 3, 8, 1], [6, 0, 11, 4], True, "lower_right")),
    ]


# ---------------------------------------------------------------------------------------------------
# Drills: an attention sink (the online softmax's start state), then its gradient through D
# ---------------------------------------------------------------------------------------------------
SINK_START = "before the first key tile: m = sink, l = e^(sink - sink) = 1, acc = 0 (a sink of -inf: m = -inf, l = 0)"
HINT_SINK_START = Hint(
    "sink_start", "your output is attention without the sink: the rows never count it in l; look at the state "
    "each row starts from (an l that starts at 0 leaves the sink out)", SINK_START)
HINT_SINK_VALUE = Hint(
    "sink_value", "lse is right, and o is off by the sink's share e^(sink - lse) times one vector per head: the "
    "sink carries a value; look at what acc starts from", "the sink's value is zero: " + SINK_START)
HINT_SINK_PER_TILE = Hint(
    "sink_per_tile", "your output is attention with the sink counted once per key tile (as if its logit were "
    "sink + log(number of tiles)): the sink joins a row once; look at where it enters l",
    "the sink is the state before the first tile, never a column of each tile's scores: " + SINK_START)
HINT_SINK_PER_TILE_OR_EMPTY = replace(
    HINT_SINK_PER_TILE, nudge="right on every row that sees a key, and o = 0, lse = -inf on the rows that see none: "
    "they lost their sink, as they would if it joined once per key tile they visit (they visit none), or if the "
    "epilogue or a skipped query tile wrote them as rows without one; look at where the sink enters l and at what "
    "a row with no key ends as")
HINT_SINK_SCALE = Hint(
    "sink_scale", "your output is attention with the sink multiplied (or divided) by τ: the sink is a logit in the "
    "units of the scaled scores; look where the sink meets the scale",
    "s = τ q kᵀ for the keys only; the sink joins as it is: m = sink, not τ · sink")
HINT_SINK_HEAD = Hint(
    "sink_head", "your output gives query head h another head's sink (key/value head h // (H / H_kv)'s, or "
    "h % H_kv's): there is one sink per query head; look at how sinks is indexed",
    "the rows of query head h start from m = sinks[h]; only their keys and values come from key/value head "
    "h // (H // H_kv)")
HINT_SINK_EMPTY = Hint(
    "sink_empty_row", "right on every row that sees a key, and o = 0, lse = -inf on rows that see none: such a "
    "row still has its sink; look at what the epilogue writes for a row with no key, and at any query tile your "
    "loop skips because none of its rows sees a key (its rows must still be written from the sink)",
    "a row that sees no key ends as it started: o = acc / l = 0 / 1 = 0 and lse = m + log l = sink (-inf, o = 0, "
    "without a sink)")
HINT_SINK_LSE = Hint(
    "sink_lse", "o is right, but lse is the log of the keys' normaliser alone: lse is the log of the whole "
    "normaliser, e^sink included (the backward divides by it); look at what the epilogue adds to m",
    "lse = m + log l, with l counting the sink from the start state: log(e^sink + sum_j e^(S_ij))")
HINT_SINK_NEG_INF = replace(
    HINT_NEG_INF, nudge="NaN only on rows that see no key or whose head has no sink (sink = -inf, so m starts at "
    "-inf): exp(-inf - (-inf)) is NaN; look at every exp(a - m) where m can still be -inf",
    formula="subtract 0 where m = -inf (then alpha = p = 0); a sink of -inf starts the row from m = -inf, l = 0")


def tiles_visited(Tq, Tk, causal, alignment, block_q, block_k, skip=True) -> torch.Tensor:
    """(Tq,) float64: how many key tiles the query tile of each row visits, the causal ones skipped
    (``skip``) or every one."""
    every = -(-Tk // block_k)
    offset = 0 if alignment == "upper_left" else Tk - Tq
    n = torch.full((Tq,), float(every), dtype=torch.float64)
    if causal and skip:
        for q0 in range(0, Tq, block_q):
            last = min(Tk - 1, min(q0 + block_q, Tq) - 1 + offset)
            n[q0:q0 + block_q] = last // block_k + 1 if last >= 0 else 0
    return n


def sink_symptom(q, k, v, sinks, causal, scale, alignment, block_q, block_k, o, lse) -> Hint | None:
    """The hint a wrong (o, lse) of the sink drill points at: each known mistake is the truth with another
    sink (none, τ times it, one per key tile, another head's) or another output on the sink's share."""
    def truth(sink=sinks, keys=k, values=v):
        return sink_attention_truth(q, keys, values, sink, causal, scale, alignment)

    o_ref, lse_ref = truth()
    if not (isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor) and o.shape == o_ref.shape
            and lse.shape == lse_ref.shape):
        return None
    o64, lse64 = o.detach().double().cpu(), lse.detach().double().cpu()
    B, H, Tq = lse_ref.shape
    no_key = ~visible(Tq, k.shape[2], causal, alignment).any(-1)  # (Tq,)
    nan = torch.isnan(o64).any(-1) | torch.isnan(lse64)
    if nan.any():
        explained = no_key[None, None, :] | torch.isneginf(sinks)[None, :, None]
        return HINT_SINK_NEG_INF if not (nan & ~explained).any() else None

    def same(alt):
        return matches(o64, alt[0], 1e-10) and matches(lse64, alt[1], 1e-10)

    tau = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = H // k.shape[1]
    per_row = sinks[None, :, None].expand(B, H, Tq)
    others = [(HINT_SINK_START, torch.full_like(sinks, float("-inf"))),
              (HINT_SINK_SCALE, tau * sinks), (HINT_SINK_SCALE, sinks / tau)]
    for skip in (True, False):
        n = tiles_visited(Tq, k.shape[2], causal, alignment, block_q, block_k, skip)
        # with at most one key tile a row, "once per tile" differs from the truth only on the rows that
        # visit none, as a row written without its sink does: the hint names both
        once_per_tile = HINT_SINK_PER_TILE if n.max() > 1 else HINT_SINK_PER_TILE_OR_EMPTY
        others += [(once_per_tile, per_row + torch.log(n)), (HINT_SINK_PER_TILE, per_row + torch.log(n + 1))]
    if group > 1:
        heads = torch.arange(H)
        others += [(HINT_SINK_HEAD, sinks[heads // group]), (HINT_SINK_HEAD, sinks[heads % k.shape[1]])]
    for hint, sink in others:
        if same(truth(sink)):
            return hint
    if group > 1 and same(truth(keys=k.repeat(1, group, 1, 1), values=v.repeat(1, group, 1, 1))):
        return HINT_GQA_MAP
    if same((o_ref, truth(torch.full_like(sinks, float("-inf")))[1])):  # o right, lse without the sink
        return HINT_SINK_LSE
    if matches(lse64, lse_ref, 1e-10):  # o = o_ref + w c: the sink's weight w times one vector c per head
        w = torch.where(torch.isneginf(lse_ref), 0.0, torch.exp(per_row - lse_ref))
        top = w.argmax(-1, keepdim=True)  # (B, H, 1): the row where the sink weighs most
        c = (o64 - o_ref).gather(2, top[..., None].expand(B, H, 1, o_ref.shape[-1]))
        c = c / torch.where(w.gather(2, top) == 0, 1.0, w.gather(2, top))[..., None]
        if matches(o64, o_ref + w[..., None] * c, 1e-10):
            return HINT_SINK_VALUE
    if no_key.any():  # some or all of the rows that see no key written as if they had no sink
        lost = no_key[None, None, :] & torch.isneginf(lse64) & ~torch.isneginf(lse_ref)
        if lost.any() and same((torch.where(lost[..., None], 0.0, o_ref), torch.where(lost, float("-inf"),
                                                                                       lse_ref))):  # fmt: skip
            return HINT_SINK_EMPTY
    return None


def _sink_case(B, H, H_kv, Tq, Tk, sinks, causal=False, alignment="upper_left", scale=None, block_k=16, seed=0):
    def run(impl):
        q = randn(B, H, Tq, 8, seed=seed)
        k, v = randn(B, H_kv, Tk, 8, seed=seed + 1), randn(B, H_kv, Tk, 8, seed=seed + 2)
        # None: no sink at all, which must be step 3's forward (the truth: a sink of -inf on every head)
        sink = torch.tensor(float("-inf") if sinks is None else sinks, dtype=torch.float64).expand(H)
        out = impl.flash_attention_forward(q, k, v, causal=causal, scale=scale, block_q=16, block_k=block_k,
                                           alignment=alignment, sinks=None if sinks is None else sink.clone())
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise PracticeFailure(f"expected (o, lse), got {type(out).__name__}")
        o, lse = out
        o_ref, lse_ref = sink_attention_truth(q, k, v, sink, causal, scale, alignment)
        with_symptom(lambda: (compare("o", o, o_ref, 1e-10), compare("lse", lse, lse_ref, 1e-10)),
                     lambda: sink_symptom(q, k, v, sink, causal, scale, alignment, 16, block_k, o, lse))
    return run


def sink_cases() -> list[Case]:
    inf = float("-inf")
    return [
        Case("B=1 H=2 Tq=20 Tk=37 D=8, sinks (0.5, -1), τ = 0.3, no mask (3 key tiles)",
             _sink_case(1, 2, 2, 20, 37, (0.5, -1.0), scale=0.3)),
        Case("B=2 H=2 Tq=40 Tk=13 D=8, sinks (1.5, -inf), causal lower_right (27 rows see no key: o = 0, lse = "
             "the sink, -inf without one)", _sink_case(2, 2, 2, 40, 13, (1.5, inf), True, "lower_right", seed=1)),
        Case("B=1 H=4 H_kv=2 Tq=16 Tk=40 D=8, sinks (-0.5, 2, 0.25, 1), causal lower_right (GQA: a sink per query "
             "head)", _sink_case(1, 4, 2, 16, 40, (-0.5, 2.0, 0.25, 1.0), True, "lower_right", seed=2)),
        Case("B=1 H=2 Tq=Tk=33 D=8, sinks (3, -2), causal, key tiles of 8 (a sink above most scores)",
             _sink_case(1, 2, 2, 33, 33, (3.0, -2.0), True, block_k=8, seed=3)),
        Case("B=1 H=2 Tq=9 Tk=21 D=8, sinks=None (no sink: the forward of step 3)",
             _sink_case(1, 2, 2, 9, 21, None, seed=5)),
    ]


DSINK_FORMULA = "dsink_h = -Σ_b Σ_i e^(sink_h - lse_bhi) D_bhi: the sink's value is 0, so its dP = 0 and its dS = " \
    "P_sink (0 - D)"
HINT_DSINK_SIGN = Hint(
    "dsink_sign", "dsink is the truth times -1: look at the sign of the sink's column of dS = P (dP - D), where "
    "the sink's dP is dO · 0 = 0", DSINK_FORMULA)
HINT_DSINK_WEIGHT = Hint(
    "dsink_weight", "dsink is a sum of D with another weight than the sink's probability e^(sink - lse) in each "
    "row (none, or e^(lse - sink)): look at the factor of D", DSINK_FORMULA)
HINT_DSINK_BATCH = Hint(
    "dsink_batch", "dsink is the sum over one batch element only, or divided by B: every row of every batch "
    "element shares the head's sink; look at which dimensions are summed", DSINK_FORMULA)
HINT_DSINK_NEG_INF = replace(
    HINT_NEG_INF, nudge="NaN in dsink, and some rows have lse = -inf (they see no key and their head has no sink): "
    "e^(sink - lse) there is exp(-inf - (-inf)); look at the weight", formula="where lse = -inf the weight is 0 "
    "(and D is 0 too, since o = 0): " + DSINK_FORMULA)


def dsink_symptom(sinks, lse, delta, got) -> Hint | None:
    """The hint a wrong dsink points at; the alternatives are written from lse and D (the symptom's
    hypotheses), never the truth, which comes from autograd."""
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(sinks.shape):
        return None
    got = got.detach().double().cpu()
    if torch.isnan(got).any():  # explained only where the NaN heads are those with rows of lse = -inf
        explained = torch.isneginf(lse).any(dim=(0, 2))
        return HINT_DSINK_NEG_INF if not (torch.isnan(got) & ~explained).any() else None
    seen = ~torch.isneginf(lse)
    diff = torch.where(seen, sinks[None, :, None] - torch.where(seen, lse, 0.0), float("-inf"))
    terms = torch.exp(diff) * delta
    right = -terms.sum((0, 2))
    others = [(HINT_DSINK_SIGN, -right), (HINT_DSINK_WEIGHT, -delta.sum((0, 2))),
              (HINT_DSINK_WEIGHT, -(torch.where(seen, torch.exp(-diff), 0.0) * delta).sum((0, 2)))]
    if lse.shape[0] > 1:
        others += [(HINT_DSINK_BATCH, right / lse.shape[0]), (HINT_DSINK_BATCH, -terms[0].sum(-1))]
    return next((hint for hint, alt in others if matches(got, alt, 1e-10)), None)


def _sink_gradient_case(B, H, Tq, Tk, sinks, causal=False, alignment="upper_left", seed=0):
    def run(impl):
        q, k, v = randn(B, H, Tq, 8, seed=seed), randn(B, H, Tk, 8, seed=seed + 1), randn(B, H, Tk, 8, seed=seed + 2)
        do, sink = randn(B, H, Tq, 8, seed=seed + 3), torch.tensor(sinks, dtype=torch.float64)
        o, lse, dsinks = sink_gradient_truth(q, k, v, sink, do, causal, None, alignment)
        delta = (do * o).sum(-1)  # D = rowsum(dO * O), (B, H, Tq)
        got = impl.sink_gradient(sink.clone(), lse.clone(), delta.clone())
        with_symptom(lambda: compare("sink_gradient(sinks, lse, delta)", got, dsinks, 1e-10),
                     lambda: dsink_symptom(sink, lse, delta, got))
    return run


def sink_gradient_cases() -> list[Case]:
    return [
        Case("B=2 H=3 Tq=Tk=12, sinks (0.5, -1, 2), no mask (a head's dsink sums the rows of both batch elements)",
             _sink_gradient_case(2, 3, 12, 12, (0.5, -1.0, 2.0))),
        Case("B=1 H=2 Tq=20 Tk=9, sinks (1, -inf), causal lower_right (11 rows see no key: lse = -inf in the head "
             "without a sink)", _sink_gradient_case(1, 2, 20, 9, (1.0, float("-inf")), True, "lower_right", 1)),
        Case("B=3 H=2 Tq=7 Tk=30, sinks (4, -3), causal lower_right (a sink above most scores, one far below)",
             _sink_gradient_case(3, 2, 7, 30, (4.0, -3.0), True, "lower_right", 2)),
    ]

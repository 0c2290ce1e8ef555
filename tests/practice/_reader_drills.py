"""A reader's autograd wiring and variant drills, plain PyTorch, with switches for their planted bugs.

* autograd ``causal_to_backward=False`` / ``scale_to_backward=False``: the backward gets causal=False
  or scale=None whatever the forward had; ``no_function=True``: autograd records the tiled forward itself
  (right gradients, every tile saved); ``detached=True``: o returned detached (no gradient).
* gqa ``interleaved=True``: query head h reads key/value head h % H_kv.
* window ``edge=True``: the left bound exclusive; ``no_offset=True``: the window centred on j = i;
  ``skip_tiles=False``: every key tile visited (hidden ones masked).
* paged ``ignore_table=True``: page j read instead of table_row[j].
* decode ``merge="mean"``: the partials averaged; ``lengths=False``: the whole capacity attended;
  ``lower_right=False``: new tokens aligned upper-left.
* varlen ``documents=False``: the packed batch attended as one sequence.
* sink ``l_start=0.0``: l starts at 0; ``acc_like_l=True``: acc starts at l (the sink's value 1);
  ``per_tile=True``: the sink a column of every key tile's scores; ``sink_scaled=True``: the sink times τ;
  ``sink_of_kv_head=True``: query head h given sinks[h // (H // H_kv)]; ``interleaved=True``: key/value
  head h % H_kv; ``empty_rows_no_sink=True``: a row that sees no key written as o = 0, lse = -inf;
  ``guard_neg_inf=False``: exp(m - m_new) unguarded.
* sink_gradient ``sign=1``: the sign flipped; ``weighted=False``: D summed without e^(sink - lse);
  ``batch="mean"`` / ``"first"``: a mean over the batch, or batch 0 only; ``guard_neg_inf=False``:
  e^(sink - lse) unguarded where both are -inf.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from . import _reader_forward


def make_autograd(causal_to_backward=True, scale_to_backward=True, no_function=False, detached=False):
    forward = _reader_forward.make().flash_attention_forward
    backward = _reader_forward.make_backward().flash_attention_backward

    class FlashAttentionFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, scale, block_q, block_k, alignment):
            o, lse = forward(q, k, v, causal, scale, block_q, block_k, alignment)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.settings = (causal and causal_to_backward, scale if scale_to_backward else None, block_q, block_k,
                            alignment)
            return o, lse

        @staticmethod
        def backward(ctx, do, dlse):
            q, k, v, o, lse = ctx.saved_tensors
            causal, scale, block_q, block_k, alignment = ctx.settings
            dq, dk, dv = backward(q, k, v, o, lse, do, causal, scale, block_q, block_k, alignment)
            return dq, dk, dv, None, None, None, None, None

    def reference_attention(q, k, v, causal=False, scale=None, block_q=16, block_k=16, alignment="upper_left"):
        if no_function:  # BUG: autograd through the tiles
            return forward(q, k, v, causal, scale, block_q, block_k, alignment)[0]
        o, _ = FlashAttentionFunction.apply(q, k, v, causal, scale, block_q, block_k, alignment)
        return o.detach() if detached else o  # BUG when detached

    return SimpleNamespace(reference_attention=reference_attention)


def make_gqa(interleaved=False):
    forward = _reader_forward.make().flash_attention_forward

    def flash_attention_forward(q, k, v, causal=False, scale=None, block_q=16, block_k=16, alignment="upper_left"):
        group = q.shape[1] // k.shape[1]
        if interleaved:  # BUG: head h reads h % H_kv
            k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        else:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return forward(q, k, v, causal, scale, block_q, block_k, alignment)

    return SimpleNamespace(flash_attention_forward=flash_attention_forward)


def make_window(edge=False, no_offset=False, skip_tiles=True):
    def flash_attention_forward(q, k, v, causal=False, scale=None, block_q=16, block_k=16, alignment="upper_left",
                                *, window=None):
        Tq, Tk = q.shape[-2], k.shape[-2]
        tau = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
        offset = 0 if alignment == "upper_left" or no_offset else Tk - Tq  # BUG when no_offset
        left, right = window or (-1, -1)
        right = min(right, 0) if causal and right >= 0 else (0 if causal else right)
        lo = -Tk - Tq if left < 0 else offset - left + (1 if edge else 0)  # BUG when edge
        hi = Tk + Tq if right < 0 else offset + right
        o, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
        for q0 in range(0, Tq, block_q):
            q1 = min(q0 + block_q, Tq)
            first, last = max(0, (q0 + lo) // block_k), min(Tk - 1, q1 - 1 + hi) // block_k
            tiles = range(first, last + 1) if skip_tiles else range(0, -(-Tk // block_k))
            m = torch.full((*q.shape[:-2], q1 - q0), float("-inf"), dtype=q.dtype)
            l, acc = torch.zeros_like(m), torch.zeros((*q.shape[:-2], q1 - q0, q.shape[-1]), dtype=q.dtype)
            for t in tiles:
                k0, k1 = t * block_k, min(t * block_k + block_k, Tk)
                d = torch.arange(k0, k1)[None, :] - torch.arange(q0, q1)[:, None]
                keep = (d >= lo) & (d <= hi)
                s = (tau * q[..., q0:q1, :] @ k[..., k0:k1, :].transpose(-1, -2)).masked_fill(~keep, float("-inf"))
                m_new = torch.maximum(m, s.amax(-1))
                m_sub = torch.where(torch.isneginf(m_new), 0.0, m_new)
                alpha, p = torch.exp(m - m_sub), torch.exp(s - m_sub[..., None])
                l = alpha * l + p.sum(-1)
                acc = alpha[..., None] * acc + p @ v[..., k0:k1, :]
                m = m_new
            empty = l == 0
            o[..., q0:q1, :] = acc / torch.where(empty, 1.0, l)[..., None]
            lse[..., q0:q1] = torch.where(empty, float("-inf"), m + torch.log(torch.where(empty, 1.0, l)))
        return o, lse

    return SimpleNamespace(flash_attention_forward=flash_attention_forward)


def make_decode(merge="weights", lengths=True, lower_right=True, ignore_table=False):
    def gather_pages(pages, table_row, length):
        page_size = pages.shape[2]
        used = -(-length // page_size)
        index = torch.arange(used) if ignore_table else table_row[:used].long()  # BUG when ignore_table
        return pages[index].transpose(0, 1).flatten(1, 2)[:, :length]

    def decode_attention_reference(query, key_cache, value_cache, cache_seqlens=None, *, scale=None,
                                   num_splits=None, block_table=None):
        B, H, Tq, D = query.shape
        tau = 1 / math.sqrt(D) if scale is None else scale
        capacity = key_cache.shape[2] * (block_table.shape[1] if block_table is not None else 1)
        splits = num_splits or 1
        o, lse = torch.zeros_like(query), torch.zeros(query.shape[:-1], dtype=query.dtype)
        for b in range(B):
            n = int(cache_seqlens[b]) if cache_seqlens is not None and lengths else capacity  # BUG when not lengths
            if block_table is None:
                k, v = key_cache[b, :, :n], value_cache[b, :, :n]
            else:
                k, v = gather_pages(key_cache, block_table[b], n), gather_pages(value_cache, block_table[b], n)
            k, v = k.repeat_interleave(H // k.shape[0], 0), v.repeat_interleave(H // v.shape[0], 0)
            per = -(-n // splits)
            o_b, lse_b, parts = torch.zeros(H, Tq, D, dtype=query.dtype), torch.full((H, Tq), float("-inf"),
                                                                                      dtype=query.dtype), []
            for s0 in range(0, splits * per, per):
                s1 = min(s0 + per, n)
                j = torch.arange(s0, max(s1, s0))[None, :]
                position = torch.arange(Tq)[:, None] + (n - Tq if lower_right else 0)  # BUG when not lower_right
                sc = (tau * query[b] @ k[:, s0:s1].transpose(-1, -2)).masked_fill(~(j <= position), float("-inf"))
                lse_s = torch.logsumexp(sc, -1) if sc.shape[-1] else torch.full((H, Tq), float("-inf"))
                safe = torch.where(torch.isneginf(lse_s), 0.0, lse_s)
                o_s = torch.exp(sc - safe[..., None]) @ v[:, s0:s1] if sc.shape[-1] else torch.zeros(H, Tq, D)
                parts.append((o_s, lse_s))
                new = torch.logaddexp(lse_b, lse_s)
                base = torch.where(torch.isneginf(new), 0.0, new)  # two empty states: subtract 0
                o_b = torch.exp(lse_b - base)[..., None] * o_b + torch.exp(lse_s - base)[..., None] * o_s
                lse_b = new
            if merge == "mean":  # BUG: the partials averaged
                o_b = sum(p for p, _ in parts) / len(parts)
            o[b], lse[b] = o_b, lse_b
        return o, lse

    return SimpleNamespace(gather_pages=gather_pages, decode_attention_reference=decode_attention_reference)


def make_varlen(documents=True):
    forward = _reader_forward.make().flash_attention_forward

    def varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None, block_q=16,
                                 block_k=16, alignment="upper_left"):
        cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        if not documents:  # BUG: one sequence
            cu_q, cu_k = [0, cu_q[-1]], [0, cu_k[-1]]
        o = torch.zeros_like(q)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=q.dtype)
        for (qs, qe), (ks, ke) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
            if qe == qs or ke == ks:
                continue
            o_d, lse_d = forward(q[qs:qe].transpose(0, 1)[None], k[ks:ke].transpose(0, 1)[None],
                                 v[ks:ke].transpose(0, 1)[None], causal, scale, block_q, block_k, alignment)
            o[qs:qe], lse[:, qs:qe] = o_d[0].transpose(0, 1), lse_d[0]
        return o, lse

    return SimpleNamespace(varlen_attention_forward=varlen_attention_forward)


def make_sinks(l_start=1.0, acc_like_l=False, per_tile=False, sink_scaled=False, sink_of_kv_head=False,
               interleaved=False, empty_rows_no_sink=False, guard_neg_inf=True):
    def flash_attention_forward(q, k, v, causal=False, scale=None, block_q=16, block_k=16, alignment="upper_left",
                                *, sinks=None):
        B, H, Tq, D = q.shape
        H_kv, Tk = k.shape[1], k.shape[2]
        group = H // H_kv
        tau = 1 / math.sqrt(D) if scale is None else scale
        if interleaved:  # BUG: head h reads h % H_kv
            k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        else:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        sink = torch.full((H,), float("-inf"), dtype=q.dtype) if sinks is None else sinks.to(q.dtype)
        if sink_of_kv_head:  # BUG: the key/value head's sink
            sink = sink[:H_kv].repeat_interleave(group)
        if sink_scaled:  # BUG: the sink before the scale
            sink = tau * sink
        offset = 0 if alignment == "upper_left" else Tk - Tq
        o, lse = torch.zeros_like(q), torch.empty(B, H, Tq, dtype=q.dtype)
        for q0 in range(0, Tq, block_q):
            q1 = min(q0 + block_q, Tq)
            start = sink[None, :, None].expand(B, H, q1 - q0)
            if per_tile:  # BUG: the empty state here, the sink in every tile below
                m, l = torch.full_like(start, float("-inf")), torch.zeros_like(start)
            else:
                m, l = start.clone(), torch.where(torch.isneginf(start), 0.0, l_start)  # l_start = 0: BUG
            acc = l[..., None].expand(B, H, q1 - q0, D).clone() if acc_like_l else torch.zeros(B, H, q1 - q0, D,
                                                                                              dtype=q.dtype)
            last = Tk - 1 if not causal else min(Tk - 1, q1 - 1 + offset)  # causal: later tiles skipped
            for k0 in range(0, last + 1, block_k):
                k1 = min(k0 + block_k, Tk)
                s = tau * q[..., q0:q1, :] @ k[..., k0:k1, :].transpose(-1, -2)
                if causal:
                    hidden = torch.arange(k0, k1)[None, :] > torch.arange(q0, q1)[:, None] + offset
                    s = s.masked_fill(hidden, float("-inf"))
                if per_tile:
                    s = torch.cat([s, start[..., None]], -1)
                m_new = torch.maximum(m, s.amax(-1))
                m_sub = torch.where(torch.isneginf(m_new), 0.0, m_new) if guard_neg_inf else m_new
                alpha, p = torch.exp(m - m_sub), torch.exp(s - m_sub[..., None])
                l = alpha * l + p.sum(-1)
                acc = alpha[..., None] * acc + p[..., :k1 - k0] @ v[..., k0:k1, :]
                m = m_new
            empty = l == 0
            o[..., q0:q1, :] = acc / torch.where(empty, 1.0, l)[..., None]
            lse[..., q0:q1] = torch.where(empty, float("-inf"), m + torch.log(torch.where(empty, 1.0, l)))
            if empty_rows_no_sink and causal:  # BUG: a row with no key written as if it had no sink
                no_key = torch.arange(q0, q1) + offset < 0
                o[..., q0:q1, :][..., no_key, :] = 0.0
                lse[..., q0:q1][..., no_key] = float("-inf")
        return o, lse

    return SimpleNamespace(flash_attention_forward=flash_attention_forward)


def make_sink_gradient(sign=-1, weighted=True, batch="sum", guard_neg_inf=True):
    def sink_gradient(sinks, lse, delta):
        diff = sinks[None, :, None] - lse
        if guard_neg_inf:
            diff = torch.where(torch.isneginf(lse), float("-inf"), diff)
        terms = (torch.exp(diff) if weighted else 1.0) * delta  # BUG when not weighted
        if batch == "mean":  # BUG: a mean over the batch
            return sign * terms.sum(-1).mean(0)
        if batch == "first":  # BUG: batch 0 only
            return sign * terms[0].sum(-1)
        return sign * terms.sum((0, 2))  # sign = 1: BUG

    return SimpleNamespace(sink_gradient=sink_gradient)

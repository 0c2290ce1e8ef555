"""Sinks table: a learnable sink per head, against the same call without one, FlexAttention plus the lse
renormalisation, and eager attention; forward and backward, same run.

``python -m flashtile.bench sinks`` writes ``bench/results/sinks.json`` (``--out`` elsewhere; ``--cases``
to pick some of ``CASES``, ``--rounds`` rounds). The shapes are gpt-oss's attention: H = 64 query heads
on H_kv = 8 key/value heads, D = 64, bf16, the ``bthd`` layout a model's projections give, causal, at
B·T = 16,384 tokens, and its sliding layers' window of 128 keys (``window:127,0``). The sinks are bf16,
one per query head, as the model keeps them.

Providers:

- ``flashtile`` without sinks (rows ``sinks: false``): the same call, the cost a sink is measured against;
- ``flashtile`` with sinks (``sinks: true``): ``flashtile.attention(..., sinks=)``, the sink as each
  row's start state;
- ``flex`` without sinks (``sinks: false``): compiled ``flex_attention`` over the same band, no sink, so
  that a table can tell what Flex's rescale costs from how the two kernels compare without a sink;
- ``flex`` with sinks (``sinks: true``): what users write today, since a sink is no ``score_mod``: compiled
  ``flex_attention`` with ``return_lse=True`` and the block mask of the same band, then
  o · e^lse / (e^lse + e^sink) = o · sigmoid(lse - sink); the whole function (attention and rescale) is
  one ``torch.compile``, Flex's best case;
- ``naive`` (``sinks: true``): eager attention as a model writes it: the scores, the sink appended as one
  more column, a float32 softmax, the column dropped, then P·V.

Every forward is checked against a float32 truth (the same appended column, one block of rows at a time);
every provider's gradients (q, k, v and the sinks) are compared with those of flashtile's call of the same
function (plain Flex with plain flashtile). FLOPs count only the pairs
the band keeps (``reference.masks.window_attention_flops``), x2.5 for a backward; a sink adds none.
"""

from __future__ import annotations

import math

import torch

from ..reference.masks import window_attention_flops
from .common import RESULTS
from .providers import make_inputs
from .rounds import Contender, main_for, outcome_rows, run_rounds
from .shapes import describe, shape

HEADS, KV_HEADS, HEAD_DIM = 64, 8, 64  # gpt-oss's attention
CASES = {  # name -> (B, T, window): 16,384 tokens in each
    "1k": (16, 1024, None),
    "4k": (4, 4096, None),
    "16k": (1, 16384, None),
    "4k-window": (4, 4096, (127, 0)),  # the sliding layers: 128 keys, the query's own included
}
ROUNDS = 3
METHOD = (
    "triton.testing.do_bench median (warmup 50 ms, rep 200 ms) per round, median of the rounds, providers "
    "taking turns each round; forward under no_grad, backward alone (o.backward(do, retain_graph=True)); "
    "TFLOP/s = 4*B*H*D*(pairs the band keeps) (x2.5 backward) / time; each forward checked against a float32 "
    "truth with the sink as one more column, gradients (q, k, v, sinks) compared with flashtile's"
)


def visible(Tq: int, Tk: int, start: int, stop: int, window, device) -> torch.Tensor:
    """(stop - start, Tk) bool: key j for query i when j <= i and, with a window (L, 0), i - j <= L."""
    i = torch.arange(start, stop, device=device)[:, None]
    j = torch.arange(Tk, device=device)[None, :]
    keep = j <= i
    if window is not None:
        keep &= i - j <= window[0]
    return keep


def sink_truth(q, k, v, sinks, window, rows: int = 512) -> torch.Tensor:
    """softmax([S, sink]) without its last column, times V, in float32 (B, H, T, D_v): the sink as one more
    column of every row, a block of query rows at a time; TF32 off."""
    B, H, Tq, D = q.shape
    group = H // k.shape[1]
    out = torch.empty(B, H, Tq, v.shape[-1], dtype=torch.float32, device=q.device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for b in range(B):
            kb = k[b].float().repeat_interleave(group, dim=0)
            vb = v[b].float().repeat_interleave(group, dim=0)
            for start in range(0, Tq, rows):
                stop = min(Tq, start + rows)
                s = q[b, :, start:stop].float() @ kb.transpose(1, 2) / math.sqrt(D)
                s = s.masked_fill(~visible(Tq, k.shape[2], start, stop, window, q.device), float("-inf"))
                column = sinks.float()[:, None, None].expand(H, stop - start, 1)
                p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1]
                out[b, :, start:stop] = p @ vb
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return out


def flex_with_sinks(T: int, window, device, rescale: bool = True):
    """Compiled (q, k, v, sinks) -> o: flex_attention's o and lse over the band, then each row rescaled by
    e^lse / (e^lse + e^sink) = sigmoid(lse - sink), all in one torch.compile; ``rescale=False``: compiled
    (q, k, v) -> o, flex_attention alone over the band (no sink)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    L = T if window is None else window[0]
    band = create_block_mask(lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx <= L), None, None,
                             T, T, device=device)  # fmt: skip

    def attend(q, k, v, sinks):
        o, lse = flex_attention(q, k, v, block_mask=band, enable_gqa=True, return_lse=True)
        keep = torch.sigmoid(lse - sinks.float()[None, :, None])
        return o * keep.unsqueeze(-1).to(o.dtype)

    def plain(q, k, v):
        return flex_attention(q, k, v, block_mask=band, enable_gqa=True)

    torch._dynamo.reset()  # one fresh compile per case
    return torch.compile(attend if rescale else plain, dynamic=False)


def eager_with_sinks(window):
    """(q, k, v, sinks) -> o as eager model code computes it: the (B, H, T, T) scores, the sink appended
    as a last column, a float32 softmax, the column dropped, P·V."""

    def attend(q, k, v, sinks):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
        T = q.shape[2]
        s = s.masked_fill(~visible(T, T, 0, T, window, q.device), float("-inf"))
        column = sinks.to(s.dtype)[None, :, None, None].expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
        return p.to(v.dtype) @ v

    return attend


def contenders(q, k, v, sinks, window) -> dict:
    """The five providers of one case, each with the truth its forward is checked against."""
    from ..api import attention

    T, qkv = q.shape[2], ("q", "k", "v")
    with_sinks = (q, k, v, sinks)
    truth = sink_truth(q, k, v, sinks, window)
    no_sink = sink_truth(q, k, v, torch.full_like(sinks, float("-inf")), window)
    return {
        "flashtile": Contender(lambda q, k, v: attention(q, k, v, is_causal=True, window=window, enable_gqa=True),
                               (q, k, v), qkv, dict(provider="flashtile", sinks=False), no_sink),  # fmt: skip
        "flashtile+sinks": Contender(
            lambda q, k, v, s: attention(q, k, v, is_causal=True, window=window, enable_gqa=True, sinks=s),
            with_sinks, (*qkv, "sinks"), dict(provider="flashtile", sinks=True), truth),  # fmt: skip
        "flex": Contender(flex_with_sinks(T, window, q.device, rescale=False), (q, k, v), qkv,
                          dict(provider="flex", sinks=False), no_sink),  # fmt: skip
        "flex+rescale": Contender(flex_with_sinks(T, window, q.device), with_sinks, (*qkv, "sinks"),
                                  dict(provider="flex", sinks=True), truth),  # fmt: skip
        "naive": Contender(eager_with_sinks(window), with_sinks, (*qkv, "sinks"), dict(provider="naive", sinks=True),
                           truth),
    }


def measure_case(name: str, rounds: int = ROUNDS, device="cuda") -> list[dict]:
    B, T, window = CASES[name]
    s = shape(B, HEADS, T, HEAD_DIM, True, H_kv=KV_HEADS, layout="bthd")
    q, k, v = make_inputs(s, device)
    sinks = (torch.randn(HEADS, generator=torch.Generator().manual_seed(1)) + 1.0).to(q.device, q.dtype)
    do = torch.randn_like(q)
    mask = "causal" if window is None else f"window:{window[0]},{window[1]}"
    flops = window_attention_flops(B, HEADS, T, T, HEAD_DIM, window or (-1, 0), True)
    cs = contenders(q, k, v, sinks, window)
    outcomes = run_rounds(cs, do, "bf16", rounds=rounds, label=f"{name} {describe(s)}")
    # each against flashtile's call of the same function: with the sinks, or plain Flex against plain flashtile
    compared = {"flex+rescale": "flashtile+sinks", "naive": "flashtile+sinks", "flex": "flashtile"}
    return outcome_rows(outcomes, cs, {**s, "mask": mask, "case": name}, flops, compared=compared)


def main(argv=None) -> None:
    main_for("sinks", __doc__, CASES, measure_case, RESULTS / "sinks.json", ROUNDS, METHOD, argv)


if __name__ == "__main__":
    main()

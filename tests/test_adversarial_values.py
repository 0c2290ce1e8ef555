"""Values a row does not see, scores near the scale's limit, FP8 at large scores: each tier against float64.

The rules (docs/part-b/attention-api.md, "Values a row does not see"):

* every tier: a hidden key's K never matters (its score becomes -inf); tiles wholly outside a row's query
  tile's mask, cache entries before the first new token's window or at and past ``cache_seqlens``, keys
  past Tk and head dims past D are never read;
* reference tier: a hidden key's V never reaches a row either (o_i is the formula's sum over the keys
  row i sees, exactly);
* Triton tier: a hidden V may reach row i as 0 · NaN when the kernel computes the tile (i's query tile,
  j's key tile), that is when some row of i's query tile sees some key of j's key tile.

Each "never read" test has a control: the same NaN one element further in does arrive.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashtile
from flashtile.api import use_backend
from flashtile.kernels.forward import forward_config
from tests._truth import attention_truth, decode_truth, definition_mask, masked_truth

NAN = float("nan")


def qkv(Tq, Tk, H=1, D=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, H, Tq, D, generator=gen), torch.randn(1, H, Tk, D, generator=gen),
            torch.randn(1, H, Tk, D, generator=gen))


def nan_rows(o):
    """The rows (of the first batch and head) that hold a NaN."""
    return torch.isnan(o[0, 0]).any(-1).nonzero().flatten().tolist()


def interpreter_tiles():
    config = forward_config(16, torch.float32, interpreted=True)
    return config["block_q"], config["block_k"]


# --- the reference tier: a hidden key or value never reaches a row ------------------------------------

MASKS = [  # (Tq, Tk, kwargs, window for definition_mask, causal, alignment, poisoned key)
    (40, 40, dict(is_causal=True), None, True, "upper_left", 30),
    (40, 40, dict(is_causal=True, window=(7, 0)), (7, 0), True, "upper_left", 10),
    (20, 70, dict(is_causal=True, alignment="lower_right"), None, True, "lower_right", 60),
    (70, 70, dict(window=(3, 3)), (3, 3), False, "upper_left", 66),
]


@pytest.mark.parametrize("Tq, Tk, kwargs, window, causal, alignment, j", MASKS)
@pytest.mark.parametrize("where", ["value", "key"])
def test_reference_tier_a_hidden_key_or_value_never_reaches_a_row(Tq, Tk, kwargs, window, causal, alignment, j,
                                                                  where):
    q, k, v = qkv(Tq, Tk)
    keep = definition_mask(Tq, Tk, window, causal, alignment)
    clean, _ = masked_truth(q.double(), k.double(), v.double(), keep)
    (v if where == "value" else k)[0, 0, j, 3] = NAN
    with use_backend("reference"):
        o = flashtile.attention(q, k, v, **kwargs)
    sees = keep[:, j].nonzero().flatten().tolist()
    assert sees and len(sees) < Tq  # some rows see key j, some do not
    assert nan_rows(o) == sees  # exactly the rows that see it: on this tier the tile does not matter
    others = ~keep[:, j]
    assert torch.allclose(o[0, 0, others].double(), clean[0, 0, others], atol=1e-5)


def test_reference_tier_varlen_a_hidden_value_never_reaches_a_row():
    lengths = [40, 30]
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(70, 2, 16, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 40, 70], dtype=torch.int32)
    v[25, 1, 5] = NAN  # document 0's key 25, head 1: seen by its rows 25..39 only
    with use_backend("reference"):
        o = flashtile.attention_varlen(q, k, v, cu, cu, 40, 40, is_causal=True)
    assert torch.isnan(o[:, 1]).any(-1).nonzero().flatten().tolist() == list(range(25, 40))
    assert not torch.isnan(o[:, 0]).any()
    q0, k0, v0 = (t[: lengths[0]].transpose(0, 1)[None].double() for t in (q, k, v))
    clean, _ = attention_truth(q0, k0, torch.nan_to_num(v0), causal=True)
    assert torch.allclose(o[:25, 1].double(), clean[0, 1, :25], atol=1e-5)


def test_reference_tier_decode_a_hidden_new_tokens_value_never_reaches_an_earlier_token():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 4, 16, generator=gen)
    k, v = (torch.randn(1, 2, 50, 16, generator=gen) for _ in range(2))
    clean, _ = decode_truth(q, k, v, [50])
    v[0, :, 49, 0] = NAN  # the last new token's own key: tokens 0..2 do not see it
    with use_backend("reference"):
        o = flashtile.decode_attention(q, k, v)
    assert torch.isnan(o[0, :, 3]).any(-1).all() and not torch.isnan(o[0, :, :3]).any()
    assert torch.allclose(o[0, :, :3].double(), clean[0, :, :3], atol=1e-5)


# --- the Triton tier: the tile rule, and what is never read ---------------------------------------------


def test_triton_tier_a_key_tile_no_row_of_the_query_tile_sees_is_never_read():
    block_q, block_k = interpreter_tiles()
    T = 3 * block_q + 4
    q, k, v = qkv(T, T, seed=6)
    clean, _ = attention_truth(q.double(), k.double(), v.double(), causal=True)
    j = block_k + 8  # in key tile 1: query tile 0 (rows 0 .. block_q - 1) never computes it
    v[0, 0, j, 2] = NAN
    with use_backend("triton"):
        o = flashtile.attention(q, k, v, is_causal=True)
    assert nan_rows(o) == list(range(block_q, T))  # query tile 1 shares the tile (rows block_q .. j - 1 too)
    assert torch.allclose(o[0, 0, :block_q].double(), clean[0, 0, :block_q], atol=1e-5)
    # the control: one key earlier, in key tile 0, and query tile 0 computes it: rows that do not see key
    # block_k - 1 get 0 · NaN through the tile's P·V product
    v[0, 0, j, 2] = 1.0
    v[0, 0, block_k - 1, 2] = NAN
    with use_backend("triton"):
        o = flashtile.attention(q, k, v, is_causal=True)
    assert nan_rows(o) == list(range(T))


def test_triton_tier_window_tiles_before_the_band_are_never_read():
    block_q, block_k = interpreter_tiles()
    T, left = 4 * block_q, 7
    q, k, v = qkv(T, T, seed=7)
    keep = definition_mask(T, T, (left, 0), True, "upper_left")
    clean, _ = masked_truth(q.double(), k.double(), v.double(), keep)
    tile = 2 * block_q  # query tile 2: its first row sees keys tile - left .. tile, in key tile 1
    v[0, 0, tile - left - 1, 0] = NAN  # hidden from every row of query tile 2, in a key tile it computes
    v[0, 0, block_k - 1, 0] = NAN  # key tile 0: query tile 2 never reads it
    with use_backend("triton"):
        o = flashtile.attention(q, k, v, is_causal=True, window=(left, 0))
    rows = list(range(tile, T))
    assert not set(nan_rows(o)) & set(range(3 * block_q, T))  # query tile 3 reads neither key tile
    assert tile in nan_rows(o)  # the control: row `tile` does not see key tile - left - 1, yet shares its tile
    assert torch.allclose(o[0, 0, 3 * block_q:].double(), clean[0, 0, 3 * block_q:], atol=1e-5)
    assert rows  # query tiles 2 and 3 exist


def test_triton_tier_varlen_no_tile_spans_two_documents():
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(70, 1, 16, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 40, 70], dtype=torch.int32)
    v[45, 0, 1] = NAN  # document 1's key 5
    with use_backend("triton"):
        o = flashtile.attention_varlen(q, k, v, cu, cu, 40, 40, is_causal=True)
    assert not torch.isnan(o[:40]).any()  # document 0 never reads document 1's keys
    clean, _ = attention_truth(*(t[:40].transpose(0, 1)[None].double() for t in (q, k, v)), causal=True)
    assert torch.allclose(o[:40, 0].double(), clean[0, 0], atol=1e-5)
    assert torch.isnan(o[45:70]).any(-1).all()  # the control: the rows that see it


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_padding_past_tk_and_past_the_head_dim_is_never_read(backend):
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 1, 37, 12, generator=gen)
    k_big, v_big = (torch.full((1, 1, 40, 16), NAN) for _ in range(2))
    k_big[..., :37, :12] = torch.randn(1, 1, 37, 12, generator=gen)
    v_big[..., :37, :12] = torch.randn(1, 1, 37, 12, generator=gen)
    k, v = k_big[..., :37, :12], v_big[..., :37, :12]  # views: NaN past Tk = 37 and past D = 12
    truth, _ = attention_truth(q.double(), k.double(), v.double())
    with use_backend(backend):
        o = flashtile.attention(q, k, v)
        assert torch.allclose(o.double(), truth, atol=1e-5)
        # the control: one key more is one NaN key more, which every row sees
        assert torch.isnan(flashtile.attention(q, k_big[..., :38, :12], v_big[..., :38, :12])).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("Tq", [1, 3])
def test_decode_never_reads_the_cache_before_the_window_or_past_the_lengths(backend, Tq):
    gen = torch.Generator().manual_seed(10)
    q = torch.randn(2, 2, Tq, 16, generator=gen)
    k, v = (torch.randn(2, 2, 200, 16, generator=gen) for _ in range(2))
    lengths = torch.tensor([200, 150], dtype=torch.int32)
    left = 10
    keep = [definition_mask(Tq, n, (left, 0), True, "lower_right") for n in (200, 150)]
    truth = [masked_truth(q[b : b + 1].double(), k[b : b + 1, :, :n].double(), v[b : b + 1, :, :n].double(),
                          keep[b])[0] for b, n in enumerate((200, 150))]  # fmt: skip
    first = [n - Tq - left for n in (200, 150)]  # the first key new token 0 sees
    poisoned_k, poisoned_v = k.clone(), v.clone()
    for b, n in enumerate((200, 150)):
        poisoned_k[b, :, : first[b]] = NAN  # every key before the window
        poisoned_v[b, :, : first[b]] = NAN
        poisoned_k[b, :, n:] = NAN  # and every slot past the sequence's length
        poisoned_v[b, :, n:] = NAN
    with use_backend(backend):
        o = flashtile.decode_attention(q, poisoned_k, poisoned_v, lengths, window=(left, 0))
    for b in range(2):
        assert torch.allclose(o[b : b + 1].double(), truth[b], atol=1e-5), b
    # the control: the first key the window keeps, poisoned, reaches new token 0
    poisoned_v[0, :, first[0], 0] = NAN
    with use_backend(backend):
        o = flashtile.decode_attention(q, poisoned_k, poisoned_v, lengths, window=(left, 0))
    assert torch.isnan(o[0, :, 0]).any(-1).all() and not torch.isnan(o[1]).any()


# --- the scale near its limit (float32): both tiers agree with float64 ---------------------------------


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("Tq", [5, 40])  # 5: the Triton tier's short-query path (the decode kernel)
def test_a_scale_near_the_limit_agrees_with_float64(backend, Tq):
    tau = 2e38  # |τ| log2 e = 2.9e38, under float32's largest 3.4e38: accepted
    D = 16
    q, k = torch.zeros(1, 1, Tq, D), torch.zeros(1, 1, Tq, D)
    q[..., 0] = 1.0
    k[0, 0, :, 0] = 1.295 - 0.01 * torch.arange(Tq)  # the largest score 2.59e38; lse too, in float32's range
    v = torch.randn(1, 1, Tq, D, generator=torch.Generator().manual_seed(11))
    o64, lse64 = attention_truth(q.double(), k.double(), v.double(), scale=tau)
    with use_backend(backend):
        o, lse = flashtile.attention(q, k, v, scale=tau, return_lse=True)
    assert torch.isfinite(lse).all() and torch.isfinite(o).all()
    assert torch.allclose(lse.double(), lse64, rtol=1e-6, atol=0)
    assert torch.allclose(o.double(), o64, atol=1e-6)
    # random inputs: scores of 1e39 pass float32, so lse rounds to +inf, as float64's value rounded to float32
    # does; o stays finite and right
    q, k, v = qkv(Tq, Tq, seed=12)
    o64, lse64 = attention_truth(q.double(), k.double(), v.double(), scale=tau)
    with use_backend(backend):
        o, lse = flashtile.attention(q, k, v, scale=tau, return_lse=True)
    assert torch.equal(lse, lse64.float())
    assert torch.allclose(o.double(), o64, atol=1e-6)


# --- FP8 at large scores: where nothing rounds, the kernel is exact at any size -------------------------


@pytest.mark.parametrize("tau", [1e3, 1e5, 1e7, 1e30])
def test_fp8_kernel_is_exact_where_nothing_rounds_at_any_score_size(tau):
    from flashtile.kernels.fp8_forward import fp8_forward

    B, H, T, D = 1, 2, 40, 16
    q, k = torch.zeros(B, H, T, D), torch.zeros(B, H, T, D)
    for i in range(T):  # query i matches key i alone among the keys it sees: P is exactly 0 or 1
        q[:, :, i, i % D] = 1.0
        k[:, :, i, i % D] = 1.0
    v = torch.randint(-2, 3, (B, H, T, D), generator=torch.Generator().manual_seed(13)).float()
    ones = [torch.ones(B, H, T) for _ in range(3)]
    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
    o, lse = fp8_forward(q8, k8, v8, *ones, True, tau, out_dtype=torch.float32)
    o64, lse64 = attention_truth(q.double(), k.double(), v.double(), causal=True, scale=tau)
    assert (o.double() - o64).abs().max() < 1e-6  # was 1.31 at 1e7, 0.097 at 1e6, 0.015 at 1e5
    assert torch.allclose(lse.double(), lse64, rtol=1e-6, atol=0)


def test_fp8_rerun_limit_is_where_the_fast_steps_error_stays_below_4e_5():
    from flashtile.kernels.fp8_forward import FP8_SHIFT_LIMIT

    limit = FP8_SHIFT_LIMIT.value if hasattr(FP8_SHIFT_LIMIT, "value") else FP8_SHIFT_LIMIT
    ulp = math.ulp(float(limit))
    assert ulp * math.log(2) / 2 < 4e-5  # o's relative error from the rounded shift below the limit

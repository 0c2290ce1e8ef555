"""Split-K decoding on the GPU at serving shapes, bf16 and fp16, against SDPA's own error.

The bar (as for the forward kernel): the largest error of o against the float64 truth on the same
rounded inputs is at most twice SDPA's, SDPA running in the same dtype on the same inputs.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from flashtile import decode_attention
from flashtile.kernels.decode import flash_decode
from tests._truth import attention_truth
from tests.decode._decode_cases import to_pages

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.bfloat16, torch.float16]
# name: (B, H, H_kv, Tq, T_max, lengths or None for full, page_size or None)
VARIANTS = {
    "mha-8k": (1, 32, 32, 1, 8192, None, None),
    "gqa4-32k": (1, 32, 8, 1, 32768, None, None),
    "gqa4-128k": (1, 32, 8, 1, 131072, None, None),
    "gqa8-ragged-16k": (4, 32, 4, 1, 16384, [16384, 1, 5000, 12345], None),
    "tq4-ragged": (3, 16, 2, 4, 4096, [4096, 4, 3001], None),
    "paged-16": (4, 32, 4, 1, 16384, [16384, 1, 5000, 12345], 16),
    "paged-256-tq3": (3, 16, 2, 3, 8192, [8192, 3, 777], 256),
}


def _sdpa_sequence(q, k, v):
    """SDPA for one sequence's new tokens q (1, H, Tq, D) against its keys (1, H_kv, n, D), lower-right:
    prepend n - Tq dummy queries so that is_causal's upper-left diagonal lands lower-right, then drop them."""
    Tq, n = q.shape[2], k.shape[2]
    if Tq == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    q = torch.cat([torch.zeros_like(q[:, :, :1]).expand(-1, -1, n - Tq, -1), q], dim=2)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[:, :, n - Tq :]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_error_is_at_most_twice_sdpa_error(variant, dtype):
    B, H, H_kv, Tq, T_max, lengths, page_size = VARIANTS[variant]
    lengths = lengths or [T_max] * B
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(variant.encode()))
    q = torch.randn(B, H, Tq, 128, generator=gen, device="cuda").to(dtype)
    k, v = (torch.randn(B, H_kv, T_max, 128, generator=gen, device="cuda").to(dtype) for _ in range(2))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    if page_size is None:
        o, lse = decode_attention(q, k, v, seqlens, return_lse=True)
    else:
        k_pages, v_pages, table = (t.cuda() for t in to_pages(k.cpu(), v.cpu(), page_size, lengths))
        o, lse = decode_attention(q, k_pages, v_pages, seqlens, block_table=table, return_lse=True)
    assert o.dtype == dtype and not torch.isnan(o).any()
    for b, n in enumerate(lengths):
        kb, vb = k[b : b + 1, :, :n], v[b : b + 1, :, :n]
        o_ref, lse_ref = attention_truth(q[b : b + 1].double(), kb.double(), vb.double(), True, None, "lower_right")
        ours = (o[b : b + 1].double() - o_ref).abs().max().item()
        theirs = (_sdpa_sequence(q[b : b + 1], kb, vb).double() - o_ref).abs().max().item()
        assert ours <= 2 * theirs, f"sequence {b}: max |o - ref| = {ours:.3e}, SDPA's = {theirs:.3e}"
        torch.testing.assert_close(lse[b : b + 1].double(), lse_ref, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 33, 128])
def test_every_split_count_gives_the_same_answer_up_to_rounding(num_splits):
    gen = torch.Generator(device="cuda").manual_seed(num_splits)
    q = torch.randn(2, 32, 1, 128, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(2, 8, 20000, 128, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([20000, 999], dtype=torch.int32, device="cuda")
    o, lse = flash_decode(q, k, v, seqlens, num_splits=num_splits)
    o_one, lse_one = flash_decode(q, k, v, seqlens, num_splits=1)
    torch.testing.assert_close(o.float(), o_one.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, lse_one, atol=1e-4, rtol=1e-5)


def test_decode_uses_64_bit_offsets_in_a_large_paged_pool():
    # 9,000 pages of 8 heads x 256 keys x 128 dims = 2.4e9 elements: page offsets pass 2**31.
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = torch.zeros(9000, 8, 256, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, 8, 1024, 128, generator=gen, device="cuda").to(torch.bfloat16)
    table = torch.tensor([[8999, 8998, 4500, 3]], dtype=torch.int32, device="cuda")
    for j in range(4):
        pool[table[0, j]] = k[0, :, j * 256 : (j + 1) * 256]
    q = torch.randn(1, 32, 1, 128, generator=gen, device="cuda").to(torch.bfloat16)
    o = decode_attention(q, pool, pool, block_table=table)
    o_ref, _ = attention_truth(q.double(), k.double(), k.double())
    torch.testing.assert_close(o.double(), o_ref, atol=2e-2, rtol=2e-2)


# --- windows, soft-caps and attention's Tq <= 16 route (issues 35 and 36) --------------------------------

WINDOWED = {  # name: (B, H, H_kv, Tq, T_max, lengths, page_size, window, softcap)
    "mistral-4k-window": (2, 32, 8, 1, 16384, [16384, 3000], None, (4095, 0), None),
    "gemma2-cap-window": (2, 16, 8, 4, 8192, [8192, 4100], 16, (4095, 0), 50.0),
    "cap-only-32k": (1, 32, 8, 1, 32768, [32768], None, None, 30.0),
}


@pytest.mark.parametrize("variant", list(WINDOWED))
def test_windowed_decode_in_bf16_is_within_twice_the_rounding_of_its_inputs(variant):
    """bf16 (the interpreter's bf16 is wrong, so only here): o against the float64 formula on the same rounded
    inputs, within the bar of the plain decode tests' SDPA error at these lengths (2e-2 absolute is what a
    bf16 output alone costs at |o| ~ 1)."""
    from tests._truth import definition_mask, masked_truth

    B, H, H_kv, Tq, T_max, lengths, page_size, window, softcap = WINDOWED[variant]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(variant.encode()))
    q = torch.randn(B, H, Tq, 128, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(B, H_kv, T_max, 128, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    if page_size is None:
        o, lse = decode_attention(q, k, v, seqlens, window=window, softcap=softcap, return_lse=True)
    else:
        k_pages, v_pages, table = (t.cuda() for t in to_pages(k.cpu(), v.cpu(), page_size, lengths))
        o, lse = decode_attention(q, k_pages, v_pages, seqlens, block_table=table, window=window, softcap=softcap,
                                  return_lse=True)  # fmt: skip
    for b, n in enumerate(lengths):
        keep = definition_mask(Tq, n, window, True, "lower_right")
        o_ref, lse_ref = masked_truth(q[b : b + 1].double().cpu(), k[b : b + 1, :, :n].double().cpu(),
                                      v[b : b + 1, :, :n].double().cpu(), keep, None, softcap)  # fmt: skip
        torch.testing.assert_close(o[b : b + 1].double().cpu(), o_ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse[b : b + 1].double().cpu(), lse_ref, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("Tq,causal,alignment", [(1, False, "upper_left"), (4, True, "lower_right"),
                                                 (16, True, "upper_left")])  # fmt: skip
def test_attention_routes_short_calls_to_the_decode_kernels_on_the_gpu(Tq, causal, alignment):
    import flashtile
    from tests._truth import definition_mask, masked_truth

    gen = torch.Generator(device="cuda").manual_seed(Tq)
    q = torch.randn(2, 32, Tq, 128, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(2, 8, 8192, 128, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        o = flashtile.attention(q, k, v, is_causal=causal, alignment=alignment, enable_gqa=True)
        if causal and alignment == "lower_right" or Tq == 1:  # the decode contract: bit for bit
            assert torch.equal(o, decode_attention(q, k, v))
        compiled = torch.compile(lambda q, k, v: flashtile.attention(q, k, v, is_causal=causal, alignment=alignment,
                                                                     enable_gqa=True), fullgraph=True)(q, k, v)
    assert torch.equal(compiled, o)
    keep = definition_mask(Tq, 8192, None, causal, alignment)
    o_ref, _ = masked_truth(q.double().cpu(), k.double().cpu(), v.double().cpu(), keep)
    torch.testing.assert_close(o.double().cpu(), o_ref, atol=2e-2, rtol=2e-2)


# --- attention sinks and a value head dim of its own ------------------------------------------------------------

SINKS_AND_HEAD_DIMS = {  # name: (B, H, H_kv, Tq, T_max, lengths, page_size, window, softcap, d_qk, d_v, num_splits)
    "gpt-oss-window-paged": (2, 64, 8, 1, 8192, [8192, 3000], 16, (127, 0), None, 64, 64, None),
    "mla-192-128-ragged": (2, 16, 2, 4, 8192, [8192, 4100], None, None, None, 192, 128, None),
    "128-64-one-slice-cap": (3, 16, 2, 3, 4096, [4096, 3, 0], 256, None, 30.0, 128, 64, 1),
    "64-128-many-slices": (1, 8, 1, 1, 32768, [32768], None, None, None, 64, 128, None),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("variant", list(SINKS_AND_HEAD_DIMS))
def test_decode_with_sinks_and_unequal_head_dims_matches_the_float64_formula(variant, dtype):
    """Sinks (one head's -inf) and d_v != d_qk at serving lengths: o against the float64 formula on the same
    rounded inputs within what a 16-bit output costs at |o| ~ 1 (2e-2, as the windowed tests), lse within
    1e-3; the sink counted once whether one slice or the merge holds it."""
    from tests.decode._decode_cases import sink_decode_truth

    B, H, H_kv, Tq, T_max, lengths, page_size, window, softcap, d_qk, d_v, num_splits = SINKS_AND_HEAD_DIMS[variant]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(variant.encode()))
    q = torch.randn(B, H, Tq, d_qk, generator=gen, device="cuda").to(dtype)
    k = torch.randn(B, H_kv, T_max, d_qk, generator=gen, device="cuda").to(dtype)
    v = torch.randn(B, H_kv, T_max, d_v, generator=gen, device="cuda").to(dtype)
    sinks = torch.randn(H, generator=gen, device="cuda") * 2 + 1
    sinks[0] = float("-inf")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    options = dict(window=window, softcap=softcap, num_splits=num_splits, sinks=sinks, return_lse=True)
    if page_size is None:
        o, lse = decode_attention(q, k, v, seqlens, **options)
    else:
        k_pages, v_pages, table = (t.cuda() for t in to_pages(k.cpu(), v.cpu(), page_size, lengths))
        o, lse = decode_attention(q, k_pages, v_pages, seqlens, block_table=table, **options)
    assert o.shape == (B, H, Tq, d_v) and o.dtype == dtype
    o_ref, lse_ref = sink_decode_truth(q, k, v, lengths, window=window, softcap=softcap, sinks=sinks.cpu())
    torch.testing.assert_close(o.double().cpu(), o_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double().cpu(), lse_ref, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
def test_kept_decode_launches_find_their_kernel_by_device_and_views_off_16_bytes_get_their_own(num_splits,
                                                                                               with_sinks):
    """A decode plan is kept under the layouts of every tensor it is given (16-byte alignment included), so
    its launches find the compiled kernel by the device alone: after the first call, every kept launch of
    ``decode_attention``, ``flash_decode`` and ``attention``'s decode route holds one kernel, under the
    device. Repeated calls give the first answer bit for bit; q, k and v 2 bytes off a 16-byte boundary get
    plans and kernels of their own and the float64 formula's answer (a kernel compiled for aligned
    addresses would read them wrong or fault)."""
    from flashtile import _plans, attention
    from flashtile.kernels.decode import DecodePlan
    from tests.decode._decode_cases import sink_decode_truth

    B, H, H_kv, T, D = 1, 8, 2, 512, 64
    gen = torch.Generator(device="cuda").manual_seed(11 + num_splits + 2 * with_sinks)
    q = torch.randn(B, H, 1, D, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(B, H_kv, T, D, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    sinks = torch.randn(H, generator=gen, device="cuda") if with_sinks else None
    seqlens = torch.tensor([T - 7], dtype=torch.int32, device="cuda")
    calls = {
        "decode_attention": lambda q, k, v: decode_attention(q, k, v, seqlens, num_splits=num_splits, sinks=sinks),
        "flash_decode": lambda q, k, v: flash_decode(q, k, v, seqlens, num_splits=num_splits, sinks=sinks)[0],
        "attention": lambda q, k, v: attention(q, k, v, enable_gqa=True, sinks=sinks),
    }
    truth = {name: sink_decode_truth(q, k, v, [T if name == "attention" else T - 7], sinks=sinks)[0]
             for name in calls}  # fmt: skip
    _plans._plans.clear()
    for name, call in calls.items():
        first = call(q, k, v)
        torch.testing.assert_close(first.double().cpu(), truth[name], atol=2e-2, rtol=2e-2)
        for _ in range(3):
            assert torch.equal(call(q, k, v), first), name
    plans = [p for p in _plans._plans.values() if isinstance(p, DecodePlan)]
    plans += [p.plans.kernels for p in _plans._plans.values() if hasattr(p, "plans")
              and getattr(p.plans, "kernels", None) is not None]  # fmt: skip
    plans += [p.plans.decode for p in _plans._plans.values() if hasattr(p, "plans")
              and getattr(p.plans, "decode", None) is not None]  # fmt: skip
    assert len(plans) == 3
    launches = [launch for plan in plans for launch in (plan.split, plan.merge) if launch is not None]
    # a split kernel per plan, and a merge where the plan splits the keys (attention's route picks its own count)
    assert len(launches) >= (3 if num_splits == 1 else 5)
    assert all(list(launch._compiled) == [torch.cuda.current_device()] for launch in launches)
    storage = torch.randn(3 * k.numel() + 8, generator=gen, device="cuda").to(torch.bfloat16)
    k_off, v_off = (storage[1 + i * k.numel() : 1 + (i + 1) * k.numel()].view(k.shape) for i in range(2))
    q_off = storage[1 + 2 * k.numel() : 1 + 2 * k.numel() + q.numel()].view(q.shape)
    assert all(x.data_ptr() % 16 for x in (q_off, k_off, v_off))
    for name, call in calls.items():
        length = T if name == "attention" else T - 7
        o_true = sink_decode_truth(q_off, k_off, v_off, [length], sinks=sinks)[0]
        for _ in range(2):
            torch.testing.assert_close(call(q_off, k_off, v_off).double().cpu(), o_true, atol=2e-2, rtol=2e-2)

"""The forward kernel on the GPU at realistic shapes, bf16 and fp16, against SDPA's own error.

The bar: the kernel's largest error against float64 naive attention (run on the same rounded
inputs) is at most twice SDPA's largest error, SDPA running in the same dtype on the same inputs.
"""

import zlib

import pytest
import torch

from flashtile.kernels.forward import flash_attention
from flashtile.reference.naive import expand_kv_heads
from tests._grids import covering
from tests._truth import attention_truth

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIMS = [64, 128, 256]

# name: (B, H, H_kv, Tq, Tk, causal, alignment, layout). SDPA's is_causal is upper-left; lower-right
# goes to SDPA as an explicit boolean mask.
VARIANTS = {
    "full-8k": (1, 2, 2, 8192, 8192, False, "upper_left", "bhtd"),
    "causal-upper-left-8k": (1, 2, 2, 8192, 8192, True, "upper_left", "bhtd"),
    "causal-lower-right-chunk": (2, 4, 4, 1000, 3000, True, "lower_right", "bhtd"),
    "ragged-causal": (2, 4, 4, 1037, 1037, True, "upper_left", "bhtd"),
    "ragged-Tq-ne-Tk": (2, 4, 4, 777, 1500, False, "upper_left", "bhtd"),
    "gqa-4": (2, 8, 2, 2048, 2048, True, "upper_left", "bhtd"),
    "mqa": (1, 8, 1, 1024, 1500, True, "lower_right", "bhtd"),
    "strided-bthd": (2, 4, 4, 2000, 2000, True, "upper_left", "bthd"),
}


def _make(B, H, T, D, dtype, layout, gen):
    x = torch.randn(B, T, H, D, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    return x.transpose(1, 2) if layout == "bthd" else x.transpose(1, 2).contiguous()


def _sdpa(q, k, v, causal, alignment):
    """SDPA on the same inputs, through its fused kernels (no explicit mask, which would send it to a
    slower backend with a different error). Lower-right with Tq <= Tk is upper-left for the last Tq
    rows of Tk queries, and rows are independent, so prepend Tk - Tq dummy queries and drop them."""
    k, v = expand_kv_heads(k, q.shape[1]), expand_kv_heads(v, q.shape[1])
    pad = k.shape[2] - q.shape[2] if causal and alignment == "lower_right" else 0
    assert pad >= 0, "the SDPA baseline covers lower-right with Tq <= Tk only"
    if pad:
        q = torch.cat([torch.zeros_like(q[:, :, :1]).expand(-1, -1, pad, -1), q], dim=2)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)[:, :, pad:]


# Every pair of (variant, dtype, head dim, load path) in 24 runs instead of all 96, each of which compiles
# its own kernel (tests/_grids.py; make gpu-test-long runs all 96).
@pytest.mark.parametrize(
    "variant,dtype,D,tma",
    covering(variant=list(VARIANTS), dtype={"bf16": torch.bfloat16, "fp16": torch.float16}, D=HEAD_DIMS,
             load={"tma": True, "pointers": False}),
)  # fmt: skip
def test_forward_error_is_at_most_twice_sdpa_error(variant, dtype, D, tma):
    B, H, H_kv, Tq, Tk, causal, alignment, layout = VARIANTS[variant]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{variant}-{D}".encode()))
    q = _make(B, H, Tq, D, dtype, layout, gen)
    k, v = _make(B, H_kv, Tk, D, dtype, layout, gen), _make(B, H_kv, Tk, D, dtype, layout, gen)

    o, lse = flash_attention(q, k, v, causal=causal, alignment=alignment, tma=tma)
    o_ref, lse_ref = attention_truth(q.double(), k.double(), v.double(), causal=causal, alignment=alignment)
    o_sdpa = _sdpa(q, k, v, causal, alignment)

    ours = (o.double() - o_ref).abs().max().item()
    theirs = (o_sdpa.double() - o_ref).abs().max().item()
    assert o.dtype == dtype and not torch.isnan(o).any()
    assert ours <= 2 * theirs, f"max |o - ref| = {ours:.3e}, SDPA's = {theirs:.3e}"
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", HEAD_DIMS)
def test_forward_has_no_nan_on_fully_masked_rows(dtype, D):
    Tq, Tk = 3000, 1000  # lower-right: rows 0 .. 1999 see no key at all
    gen = torch.Generator(device="cuda").manual_seed(D)
    q = torch.randn(2, 4, Tq, D, generator=gen, device="cuda").to(dtype)
    k, v = (torch.randn(2, 2, Tk, D, generator=gen, device="cuda").to(dtype) for _ in range(2))
    o, lse = flash_attention(q, k, v, causal=True, alignment="lower_right")
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.equal(o[:, :, : Tq - Tk], torch.zeros_like(o[:, :, : Tq - Tk]))
    assert torch.isneginf(lse[:, :, : Tq - Tk]).all() and torch.isfinite(lse[:, :, Tq - Tk :]).all()
    o_ref, _ = attention_truth(q.double(), k.double(), v.double(), causal=True, alignment="lower_right")
    torch.testing.assert_close(o.double(), o_ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("D", [80, 96])
def test_forward_pads_head_dims_that_are_not_powers_of_two(D):
    gen = torch.Generator(device="cuda").manual_seed(D)
    q, k, v = (torch.randn(2, 4, 1500, D, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
    o, _ = flash_attention(q, k, v, causal=True)
    o_ref, _ = attention_truth(q.double(), k.double(), v.double(), causal=True)
    theirs = (_sdpa(q, k, v, True, "upper_left").double() - o_ref).abs().max().item()
    assert (o.double() - o_ref).abs().max().item() <= 2 * theirs


@pytest.mark.parametrize("D", [64, 128, 256])
def test_forward_fp32_inputs_are_multiplied_in_fp32_not_tf32(D):
    # tl.dot on fp32 would run in tf32 (10-bit mantissa, errors ~1e-3) unless told "ieee": the kernels ask
    # for full fp32, so the error is fp32's own, far below what tf32 would give.
    gen = torch.Generator(device="cuda").manual_seed(D)
    q, k, v = (torch.randn(2, 4, 1000, D, generator=gen, device="cuda") for _ in range(3))
    o, lse = flash_attention(q, k, v, causal=True)
    o_ref, lse_ref = attention_truth(q.double(), k.double(), v.double(), causal=True)
    torch.testing.assert_close(o.double(), o_ref, atol=5e-5, rtol=5e-5)
    torch.testing.assert_close(lse.double(), lse_ref, atol=5e-5, rtol=5e-5)


def test_forward_uses_64_bit_offsets_past_2_to_the_31_elements():
    # q's batch 2 starts 2**31 + 2 elements into its buffer; int32 offsets would wrap negative.
    B, H, T, D = 3, 1, 256, 64
    batch_stride = 2**30 + 1
    buffer = torch.empty(batch_stride * (B - 1) + H * T * D, dtype=torch.bfloat16, device="cuda")
    q = buffer.as_strided((B, H, T, D), (batch_stride, T * D, D, 1))
    gen = torch.Generator(device="cuda").manual_seed(7)
    q.copy_(torch.randn(B, H, T, D, generator=gen, device="cuda"))
    k, v = (torch.randn(B, H, T, D, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    o, _ = flash_attention(q, k, v, causal=True)
    o_dense, _ = flash_attention(q.contiguous(), k, v, causal=True)
    del buffer, q
    assert torch.equal(o, o_dense)


def test_forward_uses_64_bit_offsets_along_the_head_dim_too():
    # A head dim that is the outermost axis of its buffer: d * stride_d passes 2**31 at d = 63.
    T, D = 128, 64
    head_dim_stride = 2**25 + 2**20
    assert (D - 1) * head_dim_stride > 2**31
    buffer = torch.empty(head_dim_stride * (D - 1) + T, dtype=torch.bfloat16, device="cuda")
    q = buffer.as_strided((1, 1, T, D), (T, T, 1, head_dim_stride))
    gen = torch.Generator(device="cuda").manual_seed(8)
    q.copy_(torch.randn(1, 1, T, D, generator=gen, device="cuda"))
    k, v = (torch.randn(1, 1, T, D, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    o, _ = flash_attention(q, k, v, causal=True)
    o_dense, _ = flash_attention(q.contiguous(), k, v, causal=True)
    del buffer, q
    assert torch.equal(o, o_dense)

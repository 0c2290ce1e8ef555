"""A standing adversarial battery: the inputs a hostile user tries, on every tier where two exist.

Each case is either computed right (against the float64 truth of tests/_truth.py, never against flashtile)
or refused with a ValueError / TypeError that names the argument. What the battery holds:

* views of ``decode_attention``'s integer arguments: ``cache_seqlens`` strided, a column of a table,
  expanded (stride 0), with a raw neighbour beyond the view that must never be read; ``block_table``
  transposed, strided and expanded;
* the negative bit of a view (``z.conj().imag``) on every float argument of ``attention`` (and its
  upstream gradient) and of ``decode_attention``; complex (conjugate) tensors are refused by name;
* a second derivative, through ``reference_attention`` and ``flashtile.attention``: an error, never zeros;
* the transformers integration's names and masks; the ring's cross-rank check is in
  tests/distributed/test_ring_gloo.py (gloo processes);
* issue #49: ``attention_varlen``'s cu_seqlens views, window sides past the longest document and max_seqlen
  bounds far past it; an undefined gradient of o (gradcheck's defaults, a Function returning None) on every
  autograd path; scale and softcap traced symbolically under ``torch.compile(dynamic=True)``; numbers too
  large for a float; window sides past int64; float64 under ``use_backend("triton")``; ``decode_attention``
  under ``fullgraph=True``; the practice checker's ``--time-limit inf``. Where a planted bug is cheap to
  plant (the kernels given the view itself, an unclamped side), a control test plants it and sees the check fail.

The Triton tier runs in the interpreter on the CPU: shapes are tiny and the cases chosen pairwise.
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile.api import use_backend
from flashtile.reference.autograd import reference_attention
from tests._truth import attention_truth, decode_truth, definition_mask, masked_truth, truth_with_grads
from tests._varlen_truth import varlen_truth, varlen_truth_grads

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TIERS = ["reference", "triton"]
TOL = 2e-5 if DEVICE == "cpu" else 5e-3


def normal(*shape, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype)


def neg_view(x: torch.Tensor) -> torch.Tensor:
    """A view whose values are x's but whose memory holds -x: the imaginary part of a conjugate.

    ``torch.complex(0, -x).conj().imag`` reads as x, is a strided view (every other float of the complex
    storage) and has ``is_neg()`` set: code that reads the raw memory sees -x."""
    if x.dtype in (torch.bfloat16, torch.float16):  # no complex bf16 (and complex32 is experimental): torch's own
        # helper sets the same bit
        view = torch._neg_view(-x)
    else:
        view = torch.complex(torch.zeros_like(x), -x).conj().imag
    assert view.is_neg() and torch.equal(view, x)
    return view



def decode_inputs(B=3, H=2, H_kv=1, Tq=2, T_max=40, D=8, seed=0):
    return (normal(B, H, Tq, D, seed=seed), normal(B, H_kv, T_max, D, seed=seed + 1),
            normal(B, H_kv, T_max, D, seed=seed + 2))  # fmt: skip


def int32(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


# --- decode_attention: views of cache_seqlens --------------------------------------------------------------


def seqlens_views():
    """(name, cache_seqlens view, the lengths it holds); each view's raw memory holds other numbers."""
    strided = int32(40, 7, 2, 39, 17)[::2]  # [40, 2, 17]; raw [40, 7, 2]
    table = torch.tensor([[17, 40, 1], [3, 999, 999], [40, 2, 5]], dtype=torch.int32, device=DEVICE)
    column = table[:, 0]  # [17, 3, 40]; raw [17, 40, 1]
    expanded = int32(17).expand(3)  # one int32 of memory, stride 0
    neighbour = int32(0, 999, 9, 999, 33, 999)[::2]  # [0, 9, 33]; a raw read past b = 0 finds 999
    offset = int32(999, 999, 12, 31, 4)[2:]  # a storage offset: [12, 31, 4]
    return [
        ("strided", strided, [40, 2, 17]),
        ("column", column, [17, 3, 40]),
        ("expanded", expanded, [17, 17, 17]),
        ("neighbour-999", neighbour, [0, 9, 33]),
        ("offset", offset, [12, 31, 4]),
    ]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("case", range(5), ids=[c[0] for c in seqlens_views()])
def test_decode_reads_cache_seqlens_through_its_view(tier, case):
    _, seqlens, lengths = seqlens_views()[case]
    assert seqlens.tolist() == lengths
    q, k, v = decode_inputs(seed=case)
    with use_backend(tier):
        o, lse = flashtile.decode_attention(q, k, v, seqlens, num_splits=2, return_lse=True)
    o_true, lse_true = decode_truth(q, k, v, lengths)
    torch.testing.assert_close(o.double().cpu(), o_true, atol=TOL, rtol=TOL)
    torch.testing.assert_close(lse.double().cpu(), lse_true, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("tier", TIERS)
def test_decode_reads_a_paged_cache_through_views_of_both_tables(tier):
    # 4 pages of 8 keys per sequence (at most 32 keys), 12 pages, shuffled. The table is handed over
    # transposed (column-major), and the lengths as a strided view whose raw neighbours exceed the pool.
    B, H_kv, P, page = 3, 1, 4, 8
    q, k, v = decode_inputs(B=B, H_kv=H_kv, T_max=P * page, seed=7)
    order = torch.randperm(B * P, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    k_pages = torch.empty(B * P, H_kv, page, 8, device=DEVICE)
    v_pages = torch.empty_like(k_pages)
    for b in range(B):
        for j in range(P):
            k_pages[order[b * P + j]] = k[b, :, j * page : (j + 1) * page]
            v_pages[order[b * P + j]] = v[b, :, j * page : (j + 1) * page]
    table = order.view(B, P).to(torch.int32).t().contiguous().t()  # strides (1, B)
    lengths = [32, 9, 20]
    seqlens = int32(32, 999, 9, 999, 20)[::2]
    with use_backend(tier):
        o = flashtile.decode_attention(q, k_pages, v_pages, seqlens, block_table=table, num_splits=2)
    torch.testing.assert_close(o.double().cpu(), decode_truth(q, k, v, lengths)[0], atol=TOL, rtol=TOL)
    # an expanded table (every sequence reads the same pages, stride 0 between rows) is a valid table too
    shared = table[:1].expand(B, P)
    with use_backend(tier):
        o = flashtile.decode_attention(q, k_pages, v_pages, seqlens, block_table=shared, num_splits=2)
    k_shared = k[:1].expand(B, -1, -1, -1)
    v_shared = v[:1].expand(B, -1, -1, -1)
    torch.testing.assert_close(o.double().cpu(), decode_truth(q, k_shared, v_shared, lengths)[0], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize(
    "what,override,error,match",
    [
        ("int64 lengths", dict(cache_seqlens=torch.tensor([3, 4, 5])), TypeError, "cache_seqlens must have dtype"),
        ("float lengths", dict(cache_seqlens=torch.tensor([3.0, 4.0, 5.0])), TypeError,
         "cache_seqlens must have dtype"),
        ("a 999 in the view", dict(cache_seqlens=torch.tensor([3, 999, 5], dtype=torch.int32)), ValueError,
         r"cache_seqlens\[1\] = 999"),
        ("int64 table", dict(block_table=torch.zeros(3, 1, dtype=torch.int64)), TypeError,
         "block_table must have dtype"),
        ("complex query", dict(query=torch.zeros(3, 2, 2, 8, dtype=torch.complex64)), TypeError,
         "query must have dtype"),
        ("float64 cache for float32 query", dict(key_cache=torch.zeros(3, 1, 40, 8, dtype=torch.float64)),
         TypeError, "key_cache has dtype"),
    ],
)  # fmt: skip
def test_decode_refuses_wrong_dtypes_by_name_on_every_tier(tier, what, override, error, match):
    q, k, v = decode_inputs()
    args = dict(query=q, key_cache=k, value_cache=v, cache_seqlens=int32(3, 4, 5))
    args.update({name: t.to(DEVICE) for name, t in override.items()})
    with use_backend(tier), pytest.raises(error, match=match):
        flashtile.decode_attention(**args)


# --- the negative bit of a view, and complex tensors --------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_attention_reads_a_negative_view_as_its_values(tier, which):
    q, k, v = normal(1, 2, 9, 8, seed=1), normal(1, 2, 11, 8, seed=2), normal(1, 2, 11, 8, seed=3)
    args = dict(q=q, k=k, v=v)
    args[which] = neg_view(args[which])
    with use_backend(tier):
        o, lse = flashtile.attention(args["q"], args["k"], args["v"], is_causal=True, return_lse=True,
                                     alignment="lower_right")  # fmt: skip
    o_true, lse_true = attention_truth(q.double(), k.double(), v.double(), True, None, "lower_right")
    torch.testing.assert_close(o.double(), o_true, atol=TOL, rtol=TOL)
    torch.testing.assert_close(lse.double(), lse_true, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("which", ["q", "do"])
def test_attention_gradients_read_negative_views_as_their_values(tier, which):
    q, k, v = normal(1, 2, 7, 8, seed=4), normal(1, 2, 7, 8, seed=5), normal(1, 2, 7, 8, seed=6)
    do = normal(1, 2, 7, 8, seed=7)
    leaf = (neg_view(q) if which == "q" else q.clone()).requires_grad_()
    k, v = k.clone().requires_grad_(), v.clone().requires_grad_()
    with use_backend(tier):
        o = flashtile.attention(leaf, k, v, is_causal=True)
    o.backward(neg_view(do) if which == "do" else do)
    _, _, (dq, dk, dv) = truth_with_grads(q, k, v, do, causal=True)
    for name, got, want in (("dq", leaf.grad, dq), ("dk", k.grad, dk), ("dv", v.grad, dv)):
        torch.testing.assert_close(got.double(), want, atol=TOL, rtol=TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("which", ["query", "key_cache", "value_cache"])
def test_decode_reads_a_negative_view_as_its_values(tier, which):
    q, k, v = decode_inputs(seed=11)
    args = dict(query=q, key_cache=k, value_cache=v)
    args[which] = neg_view(args[which])
    lengths = [40, 5, 23]
    with use_backend(tier):
        o = flashtile.decode_attention(**args, cache_seqlens=int32(*lengths), num_splits=2)
    torch.testing.assert_close(o.double().cpu(), decode_truth(q, k, v, lengths)[0], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("tier", TIERS)
def test_complex_and_conjugate_tensors_are_refused_by_name(tier):
    q, k, v = normal(1, 2, 5, 8, seed=0), normal(1, 2, 5, 8, seed=1), normal(1, 2, 5, 8, seed=2)
    z = torch.complex(q, k)
    with use_backend(tier):
        for bad in (z, z.conj()):
            with pytest.raises(TypeError, match="query must have dtype"):
                flashtile.attention(bad, k, v)
            with pytest.raises(TypeError, match="value must have dtype"):
                flashtile.attention(q, k, bad)


# --- a second derivative: an error, never zeros ---------------------------------------------------------------


def _penalty_grad(attend, q, k, v, do):
    """d/dq of |dL/dq|^2 for L = <o, do> with a constant do: a gradient penalty, a double backward."""
    o = attend(q, k, v)
    (dq,) = torch.autograd.grad(o, q, do, create_graph=True)
    return torch.autograd.grad((dq * dq).sum(), q)


def test_reference_attention_refuses_a_double_backward_with_a_constant_gradient():
    q, k, v = (normal(1, 1, 4, 3, seed=s, dtype=torch.float64).requires_grad_() for s in range(3))
    do = normal(1, 1, 4, 3, seed=3, dtype=torch.float64)  # a constant: the case that used to give zeros
    with pytest.raises(RuntimeError, match="double backward"):
        _penalty_grad(lambda q, k, v: reference_attention(q, k, v, causal=True), q, k, v, do)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.gradgradcheck(lambda q, k, v: reference_attention(q, k, v), (q, k, v))


def test_reference_attention_still_takes_one_backward_with_create_graph():
    # create_graph=True alone is not a second derivative: the first one is right and nothing raises
    q, k, v = (normal(1, 1, 5, 4, seed=s, dtype=torch.float64).requires_grad_() for s in range(3))
    do = normal(1, 1, 5, 4, seed=9, dtype=torch.float64)
    dq, dk, dv = torch.autograd.grad(reference_attention(q, k, v, causal=True), (q, k, v), do, create_graph=True)
    for got, want in zip((dq, dk, dv), truth_with_grads(q, k, v, do, causal=True)[2]):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("tier,dtype", [("reference", torch.float32), ("reference", torch.float64),
                                        ("triton", torch.float32)])  # float64 runs the reference tier only
def test_attention_refuses_a_double_backward_on_every_tier(tier, dtype):
    q, k, v = (normal(1, 1, 4, 8, seed=s, dtype=dtype).requires_grad_() for s in range(3))
    do = normal(1, 1, 4, 8, seed=3, dtype=dtype)
    with use_backend(tier), pytest.raises(RuntimeError, match="double backward"):
        _penalty_grad(lambda q, k, v: flashtile.attention(q, k, v, is_causal=True), q, k, v, do)


# --- the transformers integration ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["org/name", "org/name:fn", "kernels-community:ftile", "a/b", ":x"])
def test_register_refuses_hub_style_names(bad):
    pytest.importorskip("transformers")
    from flashtile.integrations.transformers import register

    with pytest.raises(ValueError, match="name"):
        register(bad)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.int8])
def test_an_integer_attention_mask_is_refused_by_name(dtype):
    pytest.importorskip("transformers")
    from flashtile.integrations.transformers import flashtile_attention_forward

    q = normal(2, 2, 3, 8, seed=0).transpose(1, 2).transpose(1, 2)
    k = v = normal(2, 2, 3, 8, seed=1)
    mask = torch.ones(2, 1, 3, 3, dtype=dtype, device=DEVICE).tril()
    module = torch.nn.Module()
    module.is_causal = True
    with pytest.raises(TypeError, match="attention_mask must be a bool or floating-point"):
        flashtile_attention_forward(module, q, k, v, mask)


# --- on the GPU: 16-bit dtypes (the interpreter's bf16 is wrong) and real memory past a view ---------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_views_on_the_gpu_in_16_bit(dtype):
    tol = 3e-2 if dtype == torch.bfloat16 else 5e-3  # before the fixes the errors were of order 1
    # decode: lengths expanded from one int32 (stride 0) and strided over raw neighbours of 10**6, which a
    # read without the stride would take as a length and follow far past the cache
    q, k, v = (x.to(dtype) for x in decode_inputs(B=3, H=4, H_kv=2, Tq=1, T_max=300, D=64, seed=21))
    for seqlens, lengths in ((int32(257).expand(3), [257] * 3), (int32(300, 10**6, 1, 10**6, 77)[::2], [300, 1, 77])):
        o = flashtile.decode_attention(neg_view(q), k, neg_view(v), seqlens, num_splits=3)
        torch.cuda.synchronize()
        torch.testing.assert_close(o.double().cpu(), decode_truth(q, k, v, lengths)[0], atol=tol, rtol=tol)
    # attention: a negative query and a negative upstream gradient
    q, k, v, do = (normal(2, 4, 70, 64, seed=s, dtype=dtype) for s in range(4))
    leaf = neg_view(q).requires_grad_()
    flashtile.attention(leaf, k, v, is_causal=True).backward(neg_view(do))
    o_true, _, (dq, _, _) = truth_with_grads(q, k, v, do, causal=True)
    torch.testing.assert_close(leaf.grad.double(), dq, atol=4 * tol, rtol=4 * tol)
    o = flashtile.attention(neg_view(q), k, v, is_causal=True)
    torch.testing.assert_close(o.double(), o_true, atol=tol, rtol=tol)


# --- below the public entry points: a negative view is refused by name on every tier -----------------------


def same_layout_pair(x: torch.Tensor):
    """(plain, negative): two views of one layout (every other float of a complex tensor), holding x's values;
    only the second has the negative bit."""
    plain = torch.complex(torch.zeros_like(x), x).imag
    negative = neg_view(x)
    assert plain.stride() == negative.stride() and not plain.is_neg()
    return plain, negative


def launcher_calls():
    """(name, the argument made negative, call(arg)): the tier functions under the public entry points."""
    from flashtile.kernels.backward import flash_attention_backward as kernel_backward
    from flashtile.kernels.decode import flash_decode
    from flashtile.kernels.forward import flash_attention
    from flashtile.reference.backward import flash_attention_backward as reference_backward
    from flashtile.reference.decode import decode_attention_reference
    from flashtile.reference.forward import flash_attention_forward

    q, k, v = normal(1, 2, 6, 8, seed=30), normal(1, 2, 6, 8, seed=31), normal(1, 2, 6, 8, seed=32)
    o, lse = flash_attention_forward(q, k, v, True)
    kq, kk, kv, _ = decode_inputs(seed=33) + (None,)
    lengths = int32(40, 3, 17)
    return [
        ("kernel forward, q", "q", lambda x: flash_attention(x, k, v, causal=True), q),
        ("reference forward, v", "v", lambda x: flash_attention_forward(q, k, x, True), v),
        ("kernel backward, do", "do", lambda x: kernel_backward(q, k, v, o, lse, x, causal=True), o),
        ("reference backward, do", "do", lambda x: reference_backward(q, k, v, o, lse, x, True), o),
        ("reference backward, lse", "lse", lambda x: reference_backward(q, k, v, o, x, o, True), lse),
        ("kernel decode, key_cache", "key_cache", lambda x: flash_decode(kq, x, kv, lengths), kk),
        ("reference decode, query", "query", lambda x: decode_attention_reference(x, kk, kv, lengths), kq),
    ]


@pytest.mark.parametrize("case", range(7), ids=[c[0] for c in launcher_calls()])
def test_tier_functions_refuse_a_negative_view_by_name_even_after_its_layout_ran(case):
    _, arg, call, x = launcher_calls()[case]
    plain, negative = same_layout_pair(x)
    call(plain)  # the layout's plan is now kept: the refusal must not depend on a first call
    with pytest.raises(ValueError, match=f"{arg} is a view with the negative bit set"):
        call(negative)


# --- issue #49: index views, window sides and max_seqlen of packed documents -------------------------------


def packed(total_q, total_k, H=2, H_kv=1, D=8, seed=0, dtype=torch.float32):
    return (normal(total_q, H, D, seed=seed, dtype=dtype), normal(total_k, H_kv, D, seed=seed + 1, dtype=dtype),
            normal(total_k, H_kv, D, seed=seed + 2, dtype=dtype))  # fmt: skip


def varlen_against_truth(tier, q, k, v, cu_q, cu_k, max_q, max_k, lengths_q, lengths_k, truth_window=None,
                         **kwargs):  # fmt: skip
    """o, lse and the three gradients of attention_varlen on ``tier`` against the float64 truth of the
    documents ``lengths_q`` / ``lengths_k`` (the values the index tensors hold, as lists)."""
    do = normal(*q.shape, seed=99)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with use_backend(tier):
        o, lse = flashtile.attention_varlen(*leaves, cu_q, cu_k, max_q, max_k, return_lse=True, **kwargs)
    o.backward(do)
    causal, alignment = kwargs.get("is_causal", False), kwargs.get("alignment", "upper_left")
    o_true, lse_true = varlen_truth(q, k, v, lengths_q, lengths_k, truth_window, causal, alignment)
    grads = varlen_truth_grads(q, k, v, do, lengths_q, lengths_k, truth_window, causal, alignment)
    torch.testing.assert_close(o.double().cpu(), o_true.cpu(), atol=TOL, rtol=TOL)
    torch.testing.assert_close(lse.double().cpu(), lse_true.cpu(), atol=TOL, rtol=TOL)
    for name, leaf, want in zip(("dq", "dk", "dv"), leaves, grads):
        torch.testing.assert_close(leaf.grad.double().cpu(), want.cpu(), atol=TOL, rtol=TOL,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip


def cu_seqlens_views():
    """(name, cu_seqlens_q view, its values, cu_seqlens_k view, its values); each view's raw memory differs."""
    table = torch.tensor([[0, 0], [5, 7], [12, 14]], dtype=torch.int32, device=DEVICE)
    return [
        ("strided", int32(0, 99, 5, 99, 12, 99)[::2], [0, 5, 12], int32(0, 99, 7, 99, 14, 99)[::2], [0, 7, 14]),
        ("column", table[:, 0], [0, 5, 12], table[:, 1], [0, 7, 14]),
        ("offset", int32(99, 0, 4, 12)[1:], [0, 4, 12], int32(99, 99, 0, 9, 14)[2:], [0, 9, 14]),
        ("reversed-copy", int32(12, 99, 5, 99, 0).flip(0)[::2], [0, 5, 12], int32(0, 7, 14), [0, 7, 14]),
    ]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("case", range(4), ids=[c[0] for c in cu_seqlens_views()])
def test_varlen_reads_cu_seqlens_through_its_view(tier, case):
    _, cu_q, values_q, cu_k, values_k = cu_seqlens_views()[case]
    assert cu_q.tolist() == values_q and cu_k.tolist() == values_k
    q, k, v = packed(12, 14, seed=case)
    varlen_against_truth(tier, q, k, v, cu_q, cu_k, 8, 9, values_q, values_k, is_causal=True,
                         alignment="lower_right")  # fmt: skip


def test_varlen_view_control_a_kernel_reading_raw_memory_fails(monkeypatch):
    # the planted bug: the kernels given the strided view itself, which they read as if contiguous
    import flashtile._dispatch.varlen

    monkeypatch.setattr(flashtile._dispatch.varlen, "index_memory", lambda x: x)
    _, cu_q, values_q, cu_k, values_k = cu_seqlens_views()[0]
    q, k, v = packed(12, 14, seed=0)
    with pytest.raises(AssertionError):
        varlen_against_truth("triton", q, k, v, cu_q, cu_k, 8, 9, values_q, values_k, is_causal=True,
                             alignment="lower_right")  # fmt: skip


HUGE_WINDOWS = [(0, 2**31 - 1), (2**31 - 1, 0), (2**40, 3), (2, 2**64), (2**64, 2**70)]


def truth_side(side: int) -> int:
    """A side that long keeps every key of these tiny documents: the same mask with a side the truth's int64
    index grids can add."""
    return min(side, 10**6)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("window", HUGE_WINDOWS, ids=str)
def test_varlen_window_sides_past_the_longest_document_keep_every_key(tier, window):
    # Tq != Tk in each document, lower-right: the band's offset + right overflowed int32 in the kernel
    cu_q, cu_k = int32(0, 4, 10), int32(0, 6, 14)
    q, k, v = packed(10, 14, seed=5)
    varlen_against_truth(tier, q, k, v, cu_q, cu_k, 6, 8, [0, 4, 10], [0, 6, 14],
                         truth_window=tuple(map(truth_side, window)), window=window,
                         alignment="lower_right")  # fmt: skip


def test_varlen_window_control_an_unclamped_side_fails(monkeypatch):
    import flashtile._dispatch.varlen

    monkeypatch.setattr(flashtile.varlen, "clamp_band", lambda mask, longest: mask)
    q, k, v = packed(10, 14, seed=5)
    with pytest.raises(AssertionError):
        varlen_against_truth("triton", q, k, v, int32(0, 4, 10), int32(0, 6, 14), 6, 8, [0, 4, 10], [0, 6, 14],
                             truth_window=(0, 10**6), window=(0, 2**31 - 1), alignment="lower_right")  # fmt: skip


@pytest.mark.parametrize("tier", TIERS)
def test_varlen_max_seqlen_bounds_the_documents_but_never_sizes_the_work(tier, monkeypatch):
    # 12 tokens with max_seqlen 2**40: the answer, at once (the grid was sized by max_seqlen: it never returned);
    # the kernels see the longest document's counts whatever bound is passed
    import flashtile.kernels.forward as forward

    seen = []
    launcher = forward.varlen_forward_with_spec
    monkeypatch.setattr(forward, "varlen_forward_with_spec",
                        lambda *args, **kwargs: seen.append(kwargs["max_seqlen_q"]) or launcher(*args, **kwargs))
    cu_q, cu_k = int32(0, 5, 12), int32(0, 9, 14)
    q, k, v = packed(12, 14, seed=8)
    varlen_against_truth(tier, q, k, v, cu_q, cu_k, 2**40, 100000, [0, 5, 12], [0, 9, 14], is_causal=True)
    assert seen == ([7] if tier == "triton" else [])  # the control: the launcher saw the true longest
    with use_backend(tier):
        for max_q, max_k, name in ((6, 9, "max_seqlen_q"), (7, 8, "max_seqlen_k")):
            with pytest.raises(ValueError, match=f"{name} must be at least the longest document's length"):
                flashtile.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)
        with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
            flashtile.attention_varlen(q, k, v, cu_q, cu_k, 7.0, 9)


# --- issue #49: an undefined gradient of o means zero ---------------------------------------------------------


class DropFirstGradient(torch.autograd.Function):
    """(x, y) -> (x, y), whose backward returns None for x (keep=False) or x's gradient (keep=True): what a
    downstream Function that ignores one input hands upstream."""

    @staticmethod
    def forward(ctx, x, y, keep):
        ctx.keep = keep
        return x.clone(), y.clone()

    @staticmethod
    def backward(ctx, gx, gy):
        return (gx if ctx.keep else None), gy, None


def attend_three_ways(entry, q, k, v, return_lse):
    cu = int32(0, 3, 7)
    if entry == "attention":
        out = flashtile.attention(q, k, v, is_causal=True, return_lse=return_lse)
    elif entry == "varlen":
        q, k, v = (x[0].transpose(0, 1) for x in (q, k, v))  # (1, H, 7, D) -> (7, H, D)
        out = flashtile.attention_varlen(q, k, v, cu, cu, 4, 4, is_causal=True, return_lse=return_lse)
    else:  # the custom op itself, as torch.compile runs it
        from flashtile.api import attention_fwd, pick_backend

        out = attention_fwd(q, k, v, 0.5, "upper_left", -1, 0, None, pick_backend(q))[:2]
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("entry", ["attention", "varlen", "op"])
@pytest.mark.parametrize("return_lse", [False, True])
def test_an_undefined_gradient_of_o_gives_zero_gradients(tier, entry, return_lse):
    q, k, v = (normal(1, 2, 7, 8, seed=s).requires_grad_() for s in range(3))
    w = normal(3, seed=4).requires_grad_()
    for keep in (False, True):  # keep=True is the control: the same graph with o's gradient defined
        for x in (q, k, v, w):
            x.grad = None
        with use_backend(tier):
            o = attend_three_ways(entry, q, k, v, return_lse)
        o2, w2 = DropFirstGradient.apply(o, w, keep)
        ((o2 * o2).sum() + w2.sum()).backward()
        assert torch.equal(w.grad, torch.ones(3, device=DEVICE))
        for name, x in (("q", q), ("k", k), ("v", v)):
            if keep:
                assert x.grad is not None and x.grad.abs().max() > 0, name
            else:
                assert x.grad is None or not x.grad.any(), f"{name}: {x.grad}"


@pytest.mark.parametrize("tier", TIERS)
def test_gradcheck_with_its_defaults_passes(tier):
    # gradcheck's undefined-gradient check hands the backward an undefined dO (float64: the reference tier on both)
    q = normal(1, 1, 3, 4, seed=0, dtype=torch.float64).requires_grad_()
    cu = int32(0, 1, 3)
    with use_backend(tier):
        assert torch.autograd.gradcheck(lambda q: flashtile.attention(q, q, q), (q,))
        assert torch.autograd.gradcheck(lambda q: flashtile.attention(q, q, q, return_lse=True)[0], (q,))
        packed_q = q.detach()[0].transpose(0, 1).clone().requires_grad_()  # (3, 1, 4)
        assert torch.autograd.gradcheck(lambda x: flashtile.attention_varlen(x, x, x, cu, cu, 2, 2), (packed_q,))


# --- issue #49: scale and softcap under torch.compile(dynamic=True), and numbers no float can hold --------------


@pytest.mark.parametrize("value", [0.0, -0.0, 1.5, -1e308, 5e-324, float("inf"), float("-inf"), float("nan")])
def test_the_traceable_finiteness_test_agrees_with_math_isfinite(value):
    import math

    from flashtile._checks import is_finite

    assert is_finite(value) is math.isfinite(value)


class ScaledAttention(torch.nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale  # a float attribute: dynamo traces it symbolically under dynamic=True

    def forward(self, q, options):
        return flashtile.attention(q, q, q, is_causal=True, scale=self.scale, softcap=options["softcap"])


@pytest.mark.parametrize("tier", TIERS)
def test_scale_and_softcap_trace_under_compile_with_dynamic_shapes(tier):
    torch._dynamo.reset()
    q = normal(1, 2, 20, 8, seed=2)
    model = ScaledAttention(0.3)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    with use_backend(tier):
        for scale, cap in ((0.3, 5.0), (0.7, 2.5)):  # a second call with new values: no stale constant
            model.scale = scale
            o = compiled(q, {"softcap": cap})
            keep = definition_mask(20, 20, None, True, "upper_left")
            o_true, _ = masked_truth(q.double(), q.double(), q.double(), keep, scale, cap)
            torch.testing.assert_close(o.double(), o_true, atol=TOL, rtol=TOL)
        # eagerly, the same errors as before
        with pytest.raises(ValueError, match="scale must be finite, got nan"):
            flashtile.attention(q, q, q, scale=float("nan"))
        with pytest.raises(ValueError, match="softcap must be a positive finite number"):
            flashtile.attention(q, q, q, softcap=float("inf"))


def too_large_for_a_float_calls():
    from fractions import Fraction

    q, k, v = normal(1, 2, 3, 8, seed=0), normal(1, 2, 3, 8, seed=1), normal(1, 2, 3, 8, seed=2)
    cu = int32(0, 3)
    dq, dk = decode_inputs()[:2]
    calls = []
    for name in ("scale", "softcap"):
        for big in (10**400, -(10**400), Fraction(10**400, 3)):
            kw = {name: big}
            calls += [(name, lambda kw=kw: flashtile.attention(q, k, v, **kw)),
                      (name, lambda kw=kw: flashtile.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                                                      v[0].transpose(0, 1), cu, cu, 3, 3, **kw)),
                      (name, lambda kw=kw: flashtile.decode_attention(dq, dk, dk, **kw))]  # fmt: skip
    return calls


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("case", range(18))
def test_numbers_too_large_for_a_float_are_refused_by_name(tier, case):
    name, call = too_large_for_a_float_calls()[case]
    message = f"^{name} must be finite, got (an int|a number) too large for a float"
    with use_backend(tier), pytest.raises(ValueError, match=message):
        call()


# --- issue #49: window sides past int64 --------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("window", [(0, 2**64), (2**64, 2**63), (2**63 - 1, 1)], ids=str)
def test_window_sides_past_int64_keep_every_key_on_every_entry_point(tier, window):
    from flashtile._checks import MAX_WINDOW_SIDE, check_window

    assert check_window(window) == tuple(min(s, MAX_WINDOW_SIDE) for s in window)
    truth_window = tuple(map(truth_side, window))
    q, k, v = normal(1, 2, 5, 8, seed=1), normal(1, 2, 9, 8, seed=2), normal(1, 2, 9, 8, seed=3)
    keep = definition_mask(5, 9, truth_window, False, "lower_right")
    o_true, lse_true = masked_truth(q.double(), k.double(), v.double(), keep)
    with use_backend(tier):
        o, lse = flashtile.attention(q, k, v, window=window, alignment="lower_right", return_lse=True)
        meta = flashtile.attention(q.to("meta"), k.to("meta"), v.to("meta"), window=window)  # the custom op
        varlen_o = flashtile.attention_varlen(*(x[0].transpose(0, 1) for x in (q, k, v)), int32(0, 5), int32(0, 9),
                                              5, 9, window=window, alignment="lower_right")  # fmt: skip
        dq, dk = decode_inputs(seed=4)[:2]
        # decode's new tokens are causal and a short left side would cut keys: its window is the longest side twice
        decode_o = flashtile.decode_attention(dq, dk, dk, window=(max(window), max(window)))
    assert meta.shape == q.shape and meta.is_meta
    torch.testing.assert_close(o.double(), o_true, atol=TOL, rtol=TOL)
    torch.testing.assert_close(lse.double(), lse_true, atol=TOL, rtol=TOL)
    torch.testing.assert_close(varlen_o.transpose(0, 1)[None].double(), o_true, atol=TOL, rtol=TOL)
    torch.testing.assert_close(decode_o.double().cpu(), decode_truth(dq, dk, dk, [40] * 3)[0], atol=TOL, rtol=TOL)


# --- issue #49: float64 under use_backend("triton") ----------------------------------------------------------


def test_float64_takes_the_reference_tier_even_under_use_backend_triton():
    from flashtile.api import pick_backend

    q, k, v = (normal(1, 2, 6, 8, seed=s, dtype=torch.float64) for s in range(3))
    do = normal(1, 2, 6, 8, seed=3, dtype=torch.float64)
    leaf = q.clone().requires_grad_()
    with use_backend("triton"):
        assert pick_backend(q) == "reference" and pick_backend(q.float()) == "triton"  # the control: fp32 still
        o = flashtile.attention(leaf, k, v, is_causal=True)
        varlen_o = flashtile.attention_varlen(*(x[0].transpose(0, 1) for x in (q, k, v)), int32(0, 6), int32(0, 6),
                                              6, 6, is_causal=True)  # fmt: skip
        dq, dk = decode_inputs(seed=5)[:2]
        decode_o = flashtile.decode_attention(dq.double(), dk.double(), dk.double(), int32(40, 2, 9))
    o.backward(do)
    o_true, _, (dq_true, _, _) = truth_with_grads(q, k, v, do, causal=True)
    torch.testing.assert_close(o, o_true, atol=1e-12, rtol=1e-12)  # float64 digits: float64 arithmetic
    torch.testing.assert_close(leaf.grad, dq_true, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(varlen_o.transpose(0, 1)[None], o_true, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(decode_o.cpu(), decode_truth(dq, dk, dk, [40, 2, 9])[0], atol=1e-12, rtol=1e-12)


# --- issue #49: decode_attention under torch.compile(fullgraph=True) ------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
def test_decode_attention_compiles_with_fullgraph_and_checks_lengths_when_it_runs(tier):
    torch._dynamo.reset()
    q, k, v = decode_inputs(seed=6)
    # dynamic=True: the scale, a float argument, is traced symbolically too (issue #49's C2 for decode)
    compiled = torch.compile(lambda q, k, v, n, s: flashtile.decode_attention(q, k, v, n, scale=s, return_lse=True),
                             fullgraph=True, dynamic=True)  # fmt: skip
    with use_backend(tier):
        for lengths, scale in (([40, 2, 17], 0.3), ([0, 33, 5], -0.7)):  # new values: nothing guards on them
            o, lse = compiled(q, k, v, int32(*lengths), scale)
            o_true, lse_true = decode_truth(q, k, v, lengths, scale)
            torch.testing.assert_close(o.double().cpu(), o_true, atol=TOL, rtol=TOL)
            torch.testing.assert_close(lse.double().cpu(), lse_true, atol=TOL, rtol=TOL)
        with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 41"):  # the eager check, at run time
            compiled(q, k, v, int32(40, 41, 3), 0.3)


@pytest.mark.parametrize("tier", TIERS)
def test_the_decode_op_passes_opcheck(tier):
    # the node decode_attention becomes under torch.compile: schema, fake implementation and real run agree
    from flashtile.decode import decode_op

    q, k, v = decode_inputs(seed=8)
    for args in ((int32(40, 2, 17), None, 0.3, None, -1, -1, None), (None, None, 0.5, 2, 3, 0, 4.0)):
        result = torch.library.opcheck(decode_op, (q, k, v, *args, tier))
        assert set(result.values()) == {"SUCCESS"}, result


# --- issue #49: the practice checker's --time-limit ------------------------------------------------------------


@pytest.mark.parametrize("limit", [float("inf"), 1e300])
def test_a_time_limit_past_the_platforms_longest_wait_is_that_wait(limit):
    import queue
    import threading
    from types import SimpleNamespace

    from flashtile.practice.cli import Worker

    events = queue.Queue()
    later = threading.Timer(0.05, events.put, ({"event": "ok"},))  # the wait must begin before the event
    later.start()
    assert Worker.next(SimpleNamespace(events=events), limit) == {"event": "ok"}
    later.join()
    with pytest.raises(TimeoutError):  # the control: an ordinary limit still times out
        Worker.next(SimpleNamespace(events=events), 0.01)


def test_the_checker_runs_with_time_limit_inf_and_refuses_nan_by_name(capsys):
    from flashtile.practice.cli import main

    assert main(["check", "--package", "--step", "online_softmax", "--fast", "--time-limit", "inf"]) == 0
    assert "1 of 1 steps pass" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["check", "--package", "--time-limit", "nan"])
    assert "--time-limit must be a positive number of seconds (inf for no limit), got nan" in capsys.readouterr().err

"""A value head dim of its own (d_v != d_qk) through ``flashtile.attention`` and ``flashtile.attention_varlen``:
both tiers, forward and backward, against the dense float64 softmax (``tests/reference/_sink_truth.py``, which
imports nothing of flashtile), with GQA, masks, soft-capping and sinks; the errors; strided views; the kept
call, the custom ops and torch.compile. The Triton tier runs in the interpreter on the CPU, in float32 and
float16 (its bfloat16 is wrong there); the ``gpu`` cases run bfloat16 at 192/128 and 128/64 on the GPU."""

import math

import pytest
import torch

import flashtile
import flashtile._dispatch.dense as dense
from flashtile.api import attention, attention_bwd, attention_fwd, use_backend
from tests._grids import covering
from tests.reference._sink_truth import dense_attention

DIMS = {"192/128": (192, 128), "128/64": (128, 64), "64/128": (64, 128), "40/24": (40, 24), "16/1": (16, 1)}
TIERS = {  # (backend, dtype): float64 always runs on the reference tier
    "reference-f64": ("reference", torch.float64),
    "reference-f32": ("reference", torch.float32),
    "triton-f32": ("triton", torch.float32),
    "triton-f16": ("triton", torch.float16),
}
MASKS = {  # name: (flashtile's keywords, the truth's)
    "none": (dict(), dict()),
    "causal-lower-right": (dict(is_causal=True, alignment="lower_right"), dict(causal=True, alignment="lower_right")),
    "window": (dict(window=(3, 1)), dict(window=(3, 1))),
    "causal-window": (dict(is_causal=True, window=(2, -1)), dict(causal=True, window=(2, -1))),
}
ATOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 4e-3}


def make_inputs(shape, d_qk, d_v, dtype=torch.float64, seed=0):
    """q (B, H, Tq, d_qk), k (B, H_kv, Tk, d_qk), v (B, H_kv, Tk, d_v), sinks (H,) and do (B, H, Tq, d_v)."""
    B, H, H_kv, Tq, Tk = shape
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype) for s in
                   ((B, H, Tq, d_qk), (B, H_kv, Tk, d_qk), (B, H_kv, Tk, d_v), (B, H, Tq, d_v)))  # fmt: skip
    sinks = (2 * torch.randn(H, generator=gen, dtype=torch.float64)).to(dtype)
    return q, k, v, sinks, do


def truth(q, k, v, sinks, do, **mask):
    """The dense formula's o, lse and float64 autograd gradients of q, k, v (and the sinks, where given)."""
    tensors = (q, k, v) if sinks is None else (q, k, v, sinks)
    leaves = [t.detach().double().requires_grad_() for t in tensors]
    o, lse = dense_attention(*leaves[:3], sinks=leaves[3] if sinks is not None else None, **mask)
    return o.detach(), lse.detach(), torch.autograd.grad(o, leaves, do.double())


def ours(q, k, v, sinks, do, backend, **kwargs):
    tensors = (q, k, v) if sinks is None else (q, k, v, sinks)
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    with use_backend(backend):
        o, lse = attention(*leaves[:3], sinks=leaves[3] if sinks is not None else None, return_lse=True,
                           enable_gqa=True, **kwargs)  # fmt: skip
    return o.detach(), lse, torch.autograd.grad(o, leaves, do)


def assert_matches(got, expected, dtype):
    o, lse, grads = got
    o_ref, lse_ref, grads_ref = expected
    atol = ATOL[dtype]
    assert o.shape == o_ref.shape and o.dtype == dtype
    torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=atol)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=0, atol=min(atol, 1e-4))
    for name, g, g_ref in zip(("dq", "dk", "dv", "dsinks"), grads, grads_ref):
        assert g.shape == g_ref.shape, name
        torch.testing.assert_close(g.double(), g_ref, rtol=0, atol=atol * 10 * max(1.0, g_ref.abs().max().item()),
                                   msg=name)  # fmt: skip


@pytest.mark.parametrize(
    "backend, dtype, d_qk, d_v, kwargs, truth_mask, H, H_kv, softcap, with_sinks",
    covering(tier=TIERS, dims=DIMS, mask=MASKS, groups={"mha": (4, 4), "gqa": (4, 2)},
             softcap={"nocap": None, "cap": 1.5}, sinks={"nosinks": False, "sinks": True}),
)  # fmt: skip
def test_unequal_head_dims_match_the_dense_softmax_forward_and_backward(backend, dtype, d_qk, d_v, kwargs, truth_mask,
                                                                        H, H_kv, softcap, with_sinks):  # fmt: skip
    # Tk = 13 is no multiple of a key tile; d_v = 24 and 1 are padded to 32 and 16 in the kernels
    q, k, v, sinks, do = make_inputs((1, H, H_kv, 19, 13), d_qk, d_v, dtype, seed=d_qk + d_v + H_kv)
    sinks = sinks if with_sinks else None
    got = ours(q, k, v, sinks, do, backend, softcap=softcap, **kwargs)
    assert_matches(got, truth(q, k, v, sinks, do, softcap=softcap, **truth_mask), dtype)


def test_the_truth_sees_the_value_head_dim_so_the_test_above_can_fail():
    """A control: the truth's o changes with the columns of v past its first d_v, and its default scale is
    1/sqrt(d_qk), not 1/sqrt(d_v)."""
    q, k, v, _, do = make_inputs((1, 2, 2, 6, 7), 40, 24, seed=1)
    o, _, _ = truth(q, k, v, None, do)
    o_narrow, _, _ = truth(q, k, v[..., :8], None, do[..., :8])
    torch.testing.assert_close(o[..., :8], o_narrow, rtol=0, atol=1e-12)  # each column of o is its own
    assert (o - truth(q, k, v, None, do, scale=1 / math.sqrt(24))[0]).abs().max() > 1e-3


@pytest.mark.parametrize("backend, dtype", [("reference", torch.float64), ("triton", torch.float32)])
def test_the_default_scale_is_one_over_the_root_of_the_query_head_dim(backend, dtype):
    q, k, v, _, _ = make_inputs((1, 2, 1, 18, 9), 48, 16, dtype, seed=2)
    with use_backend(backend):
        default = attention(q, k, v, enable_gqa=True)
        assert torch.equal(default, attention(q, k, v, enable_gqa=True, scale=1 / math.sqrt(48)))
        assert not torch.allclose(default, attention(q, k, v, enable_gqa=True, scale=1 / math.sqrt(16)))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_unequal_head_dims_equal_the_padded_call_with_the_padding_dropped(backend):
    """v padded with zero columns to d_qk gives o padded with zero columns, and the same dq, dk, and dv on the
    real columns: what callers did before a kernel took d_v != d_qk."""
    q, k, v, _, do = make_inputs((1, 4, 2, 20, 11), 32, 8, torch.float32, seed=3)
    v_pad, do_pad = torch.nn.functional.pad(v, (0, 24)), torch.nn.functional.pad(do, (0, 24))
    o, _, grads = ours(q, k, v, None, do, backend, is_causal=True)
    o_pad, _, grads_pad = ours(q, k, v_pad, None, do_pad, backend, is_causal=True)
    torch.testing.assert_close(o, o_pad[..., :8], rtol=0, atol=2e-6)
    assert torch.equal(o_pad[..., 8:], torch.zeros_like(o_pad[..., 8:]))
    for g, g_pad in zip(grads[:2], grads_pad[:2]):
        torch.testing.assert_close(g, g_pad, rtol=0, atol=2e-6)
    torch.testing.assert_close(grads[2], grads_pad[2][..., :8], rtol=0, atol=2e-6)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_strided_views_of_value_and_query_are_read_through_their_strides_and_o_takes_querys_layout(backend):
    """value as a (B, T, H, d_v) projection seen as (B, H, T, d_v), and as the first d_v columns of a wider
    tensor (a row stride past d_v); query as a (B, T, H, d_qk) view, whose o is a (B, T, H, d_v) view too."""
    q, k, v, _, do = make_inputs((2, 4, 2, 17, 12), 40, 24, torch.float32, seed=4)
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)
    v_view = v.transpose(1, 2).contiguous().transpose(1, 2)
    v_slice = torch.cat([v, torch.full_like(v[..., :5], math.nan)], dim=-1)[..., :24]  # NaN past d_v, never read
    expected = truth(q, k, v, None, do, causal=True)
    for query, value in ((q_view, v_view), (q, v_slice)):
        assert not value.is_contiguous()
        got = ours(query, k, value, None, do, backend, is_causal=True)
        assert_matches(got, expected, torch.float32)
    with use_backend(backend):
        o = attention(q_view, k, v_view, is_causal=True, enable_gqa=True)
    assert o.transpose(1, 2).is_contiguous()  # laid out as (B, T, H, d_v), like query


BAD = [  # (id, change of (query, key, value), error, message): the same on every tier
    ("d_v too wide", lambda q, k, v: (q, k, torch.zeros(*k.shape[:-1], 257)), ValueError,
     r"value has head dim d_v = 257; flashtile supports value head dims 1 to 256"),
    ("d_v zero", lambda q, k, v: (q, k, v[..., :0]), ValueError, r"value has head dim d_v = 0"),
    ("value shorter", lambda q, k, v: (q, k, v[:, :, :3]), ValueError,
     r"value must have the same shape as key \(1, 2, 5, 8\) in every dim but the last .* value has length 3 "
     r"\(dim 2\), key 5"),
    ("value other heads", lambda q, k, v: (q, k, torch.cat([v, v], dim=1)), ValueError,
     r"value has key/value heads 4 \(dim 1\), key 2"),
    ("value other batch", lambda q, k, v: (q, k, torch.cat([v, v])), ValueError,
     r"value has batch size 2 \(dim 0\), key 1"),
    ("value float64", lambda q, k, v: (q, k, v.double()), TypeError, r"value has dtype torch.float64 but query"),
    ("value rank 3", lambda q, k, v: (q, k, v[0]), ValueError, r"value must be a rank-4 tensor"),
    ("key head dim", lambda q, k, v: (q, k[..., :4], v), ValueError, r"key has head dim 4 but query has 8"),
]  # fmt: skip


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("name, change, error, message", BAD, ids=[b[0] for b in BAD])
def test_bad_value_shapes_get_the_same_error_on_every_tier(backend, name, change, error, message):
    q, k, v, _, _ = make_inputs((1, 4, 2, 6, 5), 8, 3, torch.float32, seed=5)
    with use_backend(backend), pytest.raises(error, match=message):
        attention(*change(q, k, v), enable_gqa=True)


def test_a_short_call_with_unequal_head_dims_runs_on_the_decode_kernels_from_its_kept_plan(monkeypatch):
    """A short call (Tq <= 16, no gradient) takes the decode kernels with d_v != d_qk, sinks or not: its
    decode plan is made once and kept with the call, whose second call (new sink values) reuses it; o is
    d_v wide in q's layout, and the answers are the float64 formula's."""
    import flashtile.kernels.decode as decode

    made = []
    real_plan = decode.make_attention_decode_plan
    monkeypatch.setattr(decode, "make_attention_decode_plan", lambda *a, **kw: made.append(1) or real_plan(*a, **kw))
    checks = []
    real = dense.check_attention_call
    monkeypatch.setattr("flashtile.api.check_attention_call", lambda *a, **kw: checks.append(1) or real(*a, **kw))
    q, k, v, sinks, do = make_inputs((1, 4, 1, 3, 21), 64, 32, torch.float32, seed=6)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a model's (B, H, T, D) view of (B, T, H, D)
    for s in (None, sinks):
        for shift in (0.0, -1.0):  # the second call: the kept call and its decode plan
            call_sinks = None if s is None else s + shift
            with use_backend("triton"):
                o, lse = attention(q, k, v, is_causal=True, alignment="lower_right", enable_gqa=True,
                                   sinks=call_sinks, return_lse=True)  # fmt: skip
            o_ref, lse_ref, _ = truth(q, k, v, call_sinks, do, causal=True, alignment="lower_right")
            torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=2e-6)
            torch.testing.assert_close(lse.double(), lse_ref, rtol=0, atol=2e-6)
            assert o.shape == (1, 4, 3, 32) and o.stride() == (4 * 3 * 32, 32, 4 * 32, 1)
    assert len(checks) == 2 and len(made) == 2  # one checked call and one decode plan each, with sinks or not


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_torch_compile_fullgraph_with_unequal_head_dims_matches_eager_with_its_gradients(backend):
    q, k, v, sinks, do = make_inputs((1, 4, 2, 18, 9), 24, 40, torch.float32, seed=7)
    torch._dynamo.reset()  # the tier is read at trace time: no graph traced under the other tier

    def call(q, k, v, s):
        return attention(q, k, v, is_causal=True, enable_gqa=True, window=(4, -1), sinks=s, return_lse=True)

    with use_backend(backend):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
        o, lse = torch.compile(call, fullgraph=True, backend="aot_eager")(*leaves)
        grads = torch.autograd.grad(o, leaves, do)
        eager_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
        o_eager, lse_eager = call(*eager_leaves)
        grads_eager = torch.autograd.grad(o_eager, eager_leaves, do)
    assert o.shape == (1, 4, 18, 40)
    assert torch.equal(o, o_eager) and torch.equal(lse, lse_eager)
    for g, g_eager in zip(grads, grads_eager):
        assert torch.equal(g, g_eager)
    assert_matches((o.detach(), lse, grads), truth(q, k, v, sinks, do, causal=True, window=(4, -1)), torch.float32)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_the_ops_with_unequal_head_dims_pass_torch_library_opcheck(backend):
    q, k, v, sinks, do = make_inputs((1, 2, 1, 7, 9), 16, 4, torch.float32, seed=8)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # o follows query's layout: the fake must say the same
    args = (q, k, v, 0.3, "lower_right", -1, 0, None, backend, sinks)
    torch.library.opcheck(attention_fwd, args)
    o, lse, stats = attention_fwd(*args)
    assert o.shape == (1, 2, 7, 4) and o.transpose(1, 2).is_contiguous()
    torch.library.opcheck(attention_bwd, (do, q, k, v, o, lse, stats, *args[3:]))
    dq, dk, dv, dsinks = attention_bwd(do, q, k, v, o, lse, stats, *args[3:])
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


# --- packed documents --------------------------------------------------------------------------------------

DOCUMENTS = {  # (lengths of queries, lengths of keys)
    "three": ((5, 17, 9), (5, 17, 9)),
    "keyless": ((6, 4, 10), (6, 0, 10)),  # a document with queries but no keys
    "ragged": ((3, 11), (9, 5)),  # Tq != Tk in each document
}
VARLEN_MASKS = {
    "none": (dict(), dict()),
    "causal-lower-right": (dict(is_causal=True, alignment="lower_right"), dict(causal=True, alignment="lower_right")),
    "window-cap": (dict(window=(4, 2), softcap=2.0), dict(window=(4, 2), softcap=2.0)),
}


def packed(lengths_q, lengths_k, H, H_kv, d_qk, d_v, dtype, seed):
    """Packed q (total_q, H, d_qk), k (total_k, H_kv, d_qk), v (total_k, H_kv, d_v), do, sinks, cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q, k, v, do = (torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype) for s in
                   ((total_q, H, d_qk), (total_k, H_kv, d_qk), (total_k, H_kv, d_v), (total_q, H, d_v)))  # fmt: skip
    sinks = (2 * torch.randn(H, generator=gen, dtype=torch.float64)).to(dtype)

    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    return q, k, v, do, sinks, cu(lengths_q), cu(lengths_k)


def packed_truth(q, k, v, do, sinks, lengths_q, lengths_k, **mask):
    """Each document through the dense formula on its own; o, lse (H, total_q) and the gradients, float64."""
    tensors = (q, k, v) if sinks is None else (q, k, v, sinks)
    leaves = [t.detach().double().requires_grad_() for t in tensors]
    s = leaves[3] if sinks is not None else None
    os, lses, starts_q, starts_k = [], [], [0], [0]
    for n_q, n_k in zip(lengths_q, lengths_k):
        q_d = leaves[0][starts_q[-1] : starts_q[-1] + n_q].transpose(0, 1)[None]
        k_d = leaves[1][starts_k[-1] : starts_k[-1] + n_k].transpose(0, 1)[None]
        v_d = leaves[2][starts_k[-1] : starts_k[-1] + n_k].transpose(0, 1)[None]
        o_d, lse_d = dense_attention(q_d, k_d, v_d, sinks=s, **mask)
        os.append(o_d[0].transpose(0, 1))
        lses.append(lse_d[0])
        starts_q.append(starts_q[-1] + n_q)
        starts_k.append(starts_k[-1] + n_k)
    o, lse = torch.cat(os), torch.cat(lses, dim=1)
    return o.detach(), lse.detach(), torch.autograd.grad(o, leaves, do.double(), allow_unused=True)


@pytest.mark.parametrize(
    "backend, dtype, d_qk, d_v, lengths_q, lengths_k, kwargs, truth_mask, with_sinks",
    covering(tier={k: TIERS[k] for k in ("reference-f64", "triton-f32")},
             dims={k: DIMS[k] for k in ("128/64", "64/128", "40/24", "16/1")}, documents=DOCUMENTS,
             mask=VARLEN_MASKS, sinks={"nosinks": False, "sinks": True}),
)  # fmt: skip
def test_attention_varlen_with_unequal_head_dims_matches_each_document_forward_and_backward(
        backend, dtype, d_qk, d_v, lengths_q, lengths_k, kwargs, truth_mask, with_sinks):  # fmt: skip
    q, k, v, do, sinks, cu_q, cu_k = packed(lengths_q, lengths_k, 4, 2, d_qk, d_v, dtype, seed=d_qk + d_v)
    sinks = sinks if with_sinks else None
    tensors = (q, k, v) if sinks is None else (q, k, v, sinks)
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    with use_backend(backend):
        o, lse = flashtile.attention_varlen(*leaves[:3], cu_q, cu_k, max(lengths_q), max(lengths_k), return_lse=True,
                                            sinks=leaves[3] if sinks is not None else None, **kwargs)  # fmt: skip
    grads = torch.autograd.grad(o, leaves, do)
    o_ref, lse_ref, grads_ref = packed_truth(q, k, v, do, sinks, lengths_q, lengths_k, **truth_mask)
    assert o.shape == (q.shape[0], 4, d_v) and o.is_contiguous()
    atol = ATOL[dtype]
    torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=atol)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=0, atol=atol)
    for name, g, g_ref in zip(("dq", "dk", "dv", "dsinks"), grads, grads_ref):
        g_ref = torch.zeros_like(g, dtype=torch.float64) if g_ref is None else g_ref  # keys no query sees
        torch.testing.assert_close(g.double(), g_ref, rtol=0, atol=atol * 10 * max(1.0, g_ref.abs().max().item()),
                                   msg=name)  # fmt: skip


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_attention_varlen_refuses_a_value_that_disagrees_with_key_by_name(backend):
    q, k, v, _, _, cu_q, cu_k = packed((4, 5), (4, 5), 2, 1, 8, 3, torch.float32, seed=9)
    cases = [
        (v[:-1], r"value must have the same shape as key \(9, 1, 8\) in every dim but the last .* value has "
                 r"tokens 8 \(dim 0\), key 9"),
        (torch.cat([v, v], dim=1), r"value has key/value heads 2 \(dim 1\), key 1"),
        (torch.zeros(9, 1, 300), r"value has head dim d_v = 300; flashtile supports value head dims 1 to 256"),
    ]  # fmt: skip
    for value, message in cases:
        with use_backend(backend), pytest.raises(ValueError, match=message):
            flashtile.attention_varlen(q, k, value, cu_q, cu_k, 5, 5)


# --- bfloat16 on the GPU -----------------------------------------------------------------------------------

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_CASES = {  # (d_qk, d_v), (B, H, H_kv, Tq, Tk), flashtile's keywords, the truth's
    "192/128-causal-gqa": ((192, 128), (2, 8, 2, 700, 700), dict(is_causal=True), dict(causal=True)),
    "192/128-sinks-window": ((192, 128), (1, 4, 4, 1100, 1100), dict(window=(255, 0)), dict(window=(255, 0))),
    "128/64-causal-sinks": ((128, 64), (2, 8, 8, 1300, 1300), dict(is_causal=True), dict(causal=True)),
    "128/64-lower-right": ((128, 64), (1, 4, 1, 300, 900), dict(is_causal=True, alignment="lower_right"),
                           dict(causal=True, alignment="lower_right")),
}  # fmt: skip


def assert_within_bf16(got, expected, name):
    """bf16 inputs, float32 accumulation: within a few bf16 units of the largest float64 entry."""
    scale = max(1.0, expected.abs().max().item())
    error = (got.double() - expected).abs().max().item()
    assert error <= 2e-2 * scale, f"{name}: max error {error:.3e} against a largest entry of {scale:.3e}"


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("case", list(GPU_CASES), ids=list(GPU_CASES))
def test_unequal_head_dims_bf16_on_the_gpu_forward_and_backward(case):
    (d_qk, d_v), shape, kwargs, truth_mask = GPU_CASES[case]
    q, k, v, sinks, do = (t.cuda().bfloat16() for t in make_inputs(shape, d_qk, d_v, torch.float32, seed=10))
    sinks = sinks.float() if "sinks" in case else None
    got = ours(q, k, v, sinks, do, "triton", **kwargs)
    o_ref, lse_ref, grads_ref = truth(q.cpu(), k.cpu(), v.cpu(), None if sinks is None else sinks.cpu(), do.cpu(),
                                      **truth_mask)  # fmt: skip
    assert got[0].dtype == torch.bfloat16 and got[0].shape == o_ref.shape
    assert_within_bf16(got[0].cpu(), o_ref, "o")
    torch.testing.assert_close(got[1].double().cpu(), lse_ref, rtol=0, atol=1e-2)
    for name, g, g_ref in zip(("dq", "dk", "dv", "dsinks"), got[2], grads_ref):
        assert_within_bf16(g.cpu(), g_ref, name)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("d_qk, d_v", [(192, 128), (128, 64)])
def test_attention_varlen_with_unequal_head_dims_and_sinks_bf16_on_the_gpu(d_qk, d_v):
    lengths = (300, 1000, 0, 77)
    q, k, v, do, sinks, cu_q, cu_k = packed(lengths, lengths, 8, 2, d_qk, d_v, torch.float32, seed=11)
    q, k, v, do = (t.cuda().bfloat16() for t in (q, k, v, do))
    sinks, cu_q, cu_k = sinks.cuda(), cu_q.cuda(), cu_k.cuda()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    o, lse = flashtile.attention_varlen(*leaves[:3], cu_q, cu_k, 1000, 1000, is_causal=True, return_lse=True,
                                        sinks=leaves[3])  # fmt: skip
    grads = torch.autograd.grad(o, leaves, do)
    o_ref, lse_ref, grads_ref = packed_truth(*(t.cpu() for t in (q, k, v, do, sinks)), lengths, lengths, causal=True)
    assert_within_bf16(o.cpu(), o_ref, "o")
    torch.testing.assert_close(lse.double().cpu(), lse_ref, rtol=0, atol=1e-2)
    for name, g, g_ref in zip(("dq", "dk", "dv", "dsinks"), grads, grads_ref):
        assert_within_bf16(g.cpu(), g_ref, name)


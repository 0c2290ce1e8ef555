"""Attention sinks through ``flashtile.attention_varlen``: both tiers against each document's dense float64
softmax with one extra column (``tests/reference/_sink_truth.py``, through ``packed_truth``), the edge cases,
the errors, the custom ops under opcheck and torch.compile, and bfloat16 cases on the GPU. The Triton tier runs
in the interpreter on the CPU, in float32 and float16."""

import math

import pytest
import torch

import flashtile
from flashtile.api import use_backend
from flashtile.varlen import attention_varlen_bwd, attention_varlen_fwd
from tests._grids import covering
from tests.test_head_dims_api import packed, packed_truth

TIERS = {  # (backend, dtype): float64 always runs on the reference tier
    "reference-f64": ("reference", torch.float64),
    "reference-f32": ("reference", torch.float32),
    "triton-f32": ("triton", torch.float32),
    "triton-f16": ("triton", torch.float16),
}
DOCUMENTS = {  # (lengths of queries, lengths of keys)
    "three": ((5, 17, 9), (5, 17, 9)),
    "keyless": ((6, 4, 10), (6, 0, 10)),  # a document with queries but no keys: its rows see the sink only
    "empty": ((7, 0, 12), (7, 0, 12)),
    "queryless": ((0, 8, 3), (4, 8, 3)),  # keys no query sees
    "ragged": ((3, 11), (9, 5)),  # Tq != Tk in each document
}
MASKS = {  # name: (flashtile's keywords, the truth's)
    "none": (dict(), dict()),
    "causal": (dict(is_causal=True), dict(causal=True)),
    "causal-lower-right": (dict(is_causal=True, alignment="lower_right"), dict(causal=True, alignment="lower_right")),
    "window": (dict(window=(4, 2)), dict(window=(4, 2))),
}
ATOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 4e-3}


def ours(q, k, v, sinks, do, cu_q, cu_k, lengths, backend, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    with use_backend(backend):
        o, lse = flashtile.attention_varlen(*leaves[:3], cu_q, cu_k, max(lengths[0]), max(lengths[1]),
                                            sinks=leaves[3], return_lse=True, **kwargs)  # fmt: skip
    return o.detach(), lse, torch.autograd.grad(o, leaves, do)


def assert_matches(got, expected, dtype):
    (o, lse, grads), (o_ref, lse_ref, grads_ref) = got, expected
    atol = ATOL[dtype]
    assert o.dtype == dtype and grads[3].dtype == dtype
    torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=atol)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=0, atol=min(atol, 1e-4))
    for name, g, g_ref in zip(("dq", "dk", "dv", "dsinks"), grads, grads_ref):
        g_ref = torch.zeros_like(g, dtype=torch.float64) if g_ref is None else g_ref  # keys no query sees
        torch.testing.assert_close(g.double(), g_ref, rtol=0, atol=atol * 10 * max(1.0, g_ref.abs().max().item()),
                                   msg=name)  # fmt: skip


@pytest.mark.parametrize(
    "backend, dtype, lengths_q, lengths_k, kwargs, truth_mask, H, H_kv, softcap, scale",
    covering(tier=TIERS, documents=DOCUMENTS, mask=MASKS, groups={"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)},
             softcap={"nocap": None, "cap": 1.5}, scale={"default": None, "negative": -0.6}),
)  # fmt: skip
def test_varlen_sinks_match_each_documents_dense_softmax_with_a_sink_column(backend, dtype, lengths_q, lengths_k,
                                                                           kwargs, truth_mask, H, H_kv, softcap,
                                                                           scale):  # fmt: skip
    q, k, v, do, sinks, cu_q, cu_k = packed(lengths_q, lengths_k, H, H_kv, 16, 16, dtype, seed=H + H_kv)
    got = ours(q, k, v, sinks, do, cu_q, cu_k, (lengths_q, lengths_k), backend, softcap=softcap, scale=scale,
               **kwargs)  # fmt: skip
    expected = packed_truth(q, k, v, do, sinks, lengths_q, lengths_k, softcap=softcap, scale=scale, **truth_mask)
    assert_matches(got, expected, dtype)


def test_the_sink_changes_the_packed_truth_so_the_test_above_can_fail():
    lengths = ((5, 9), (5, 9))
    q, k, v, do, sinks, _, _ = packed(*lengths, 2, 2, 8, 8, torch.float64, seed=1)
    with_sink = packed_truth(q, k, v, do, sinks, *lengths)
    without = packed_truth(q, k, v, do, torch.full_like(sinks, -math.inf), *lengths)
    for a, b in zip((*with_sink[:2], *with_sink[2][:3]), (*without[:2], *without[2][:3])):
        assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_rows_of_a_document_without_keys_get_o_zero_lse_the_sink_and_no_gradient(backend):
    lengths = ((6, 4, 10), (6, 0, 10))
    q, k, v, do, sinks, cu_q, cu_k = packed(*lengths, 2, 1, 8, 8, torch.float32, seed=2)
    o, lse, grads = ours(q, k, v, sinks, do, cu_q, cu_k, lengths, backend)
    blind = slice(6, 10)  # the second document's queries
    assert torch.equal(o[blind], torch.zeros_like(o[blind]))
    torch.testing.assert_close(lse[:, blind], sinks[:, None].expand(2, 4), rtol=1e-6, atol=0)
    assert torch.equal(grads[0][blind], torch.zeros_like(grads[0][blind]))
    only_blind = torch.zeros_like(do)
    only_blind[blind] = do[blind]  # the gradient from the blind rows alone: D = 0 there, so dsinks = 0
    assert torch.equal(ours(q, k, v, sinks, only_blind, cu_q, cu_k, lengths, backend)[2][3], torch.zeros_like(sinks))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_varlen_sink_of_minus_inf_is_no_sink_bit_for_bit(backend, dtype):
    lengths = ((5, 12), (7, 12))
    q, k, v, do, sinks, cu_q, cu_k = packed(*lengths, 4, 2, 8, 8, dtype, seed=3)
    sinks = torch.full_like(sinks, -math.inf)
    o, lse, grads = ours(q, k, v, sinks, do, cu_q, cu_k, lengths, backend, is_causal=True, softcap=2.0)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with use_backend(backend):
        o_none, lse_none = flashtile.attention_varlen(*leaves, cu_q, cu_k, 12, 12, is_causal=True, softcap=2.0,
                                                      return_lse=True)  # fmt: skip
    assert torch.equal(o, o_none) and torch.equal(lse, lse_none)
    for g, g_none in zip(grads, torch.autograd.grad(o_none, leaves, do)):
        assert torch.equal(g, g_none)
    assert torch.equal(grads[3], torch.zeros_like(sinks))


def test_varlen_sinks_gradient_passes_gradcheck():
    lengths = ((3, 4), (4, 2))
    q, k, v, _, sinks, cu_q, cu_k = packed(*lengths, 2, 1, 4, 3, torch.float64, seed=4)

    def call(q, k, v, s):
        return flashtile.attention_varlen(q, k, v, cu_q, cu_k, 4, 4, is_causal=True, alignment="lower_right",
                                          softcap=1.5, sinks=s)  # fmt: skip

    assert torch.autograd.gradcheck(call, [t.requires_grad_() for t in (q, k, v, sinks)])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_varlen_sinks_alone_requiring_a_gradient_get_one(backend):
    lengths = ((6, 5), (6, 5))
    q, k, v, do, sinks, cu_q, cu_k = packed(*lengths, 2, 2, 8, 8, torch.float32, seed=5)
    sinks.requires_grad_()
    with use_backend(backend):
        o = flashtile.attention_varlen(q, k, v, cu_q, cu_k, 6, 6, sinks=sinks)
    (dsinks,) = torch.autograd.grad(o, sinks, do)
    torch.testing.assert_close(dsinks.double(), packed_truth(q, k, v, do, sinks, *lengths)[2][3], rtol=0, atol=2e-5)


@pytest.mark.parametrize("sinks_dtype", [torch.float16, torch.float32])
def test_float16_packed_inputs_take_float16_or_float32_sinks_on_the_triton_tier(sinks_dtype):
    lengths = ((17, 9), (17, 9))
    q, k, v, do, sinks, cu_q, cu_k = packed(*lengths, 2, 1, 16, 16, torch.float16, seed=6)
    sinks = sinks.to(sinks_dtype)
    o, lse, grads = ours(q, k, v, sinks, do, cu_q, cu_k, lengths, "triton", is_causal=True)
    o_ref, lse_ref, grads_ref = packed_truth(q, k, v, do, sinks, *lengths, causal=True)
    assert o.dtype == torch.float16 and grads[3].dtype == sinks_dtype
    torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=2e-3)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(grads[3].double(), grads_ref[3], rtol=1e-2, atol=1e-2)


BAD_SINKS = [  # (id, sinks for float32 inputs with H = 2, error, message)
    ("list", [0.0, 1.0], TypeError, r"sinks must be a torch.Tensor, got list"),
    ("rank-2", torch.zeros(1, 2), ValueError, r"sinks must be a rank-1 tensor"),
    ("per-kv-head", torch.zeros(1), ValueError, r"sinks must have shape \(H,\) = \(2,\)"),
    ("int", torch.zeros(2, dtype=torch.int64), TypeError, r"sinks must have dtype in \(float32\)"),
    ("float64", torch.zeros(2, dtype=torch.float64), TypeError, r"sinks must have dtype in \(float32\)"),
    ("nan", torch.tensor([math.nan, 0.0]), ValueError, r"sinks must be finite or -inf"),
    ("plus-inf", torch.tensor([0.0, math.inf]), ValueError, r"sinks must be finite or -inf"),
    ("meta", torch.zeros(2, device="meta"), ValueError, r"sinks is on meta but q is on cpu"),
    # past the float32 start state: sink / |scale| (scale 8^-0.5) beyond float32's range
    ("past-float32", torch.tensor([7e37, 0.0]), ValueError, r"sinks must be at most 6\.015e\+37 in magnitude"),
]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("name, sinks, error, message", BAD_SINKS, ids=[c[0] for c in BAD_SINKS])
def test_bad_varlen_sinks_get_the_same_error_on_every_tier(backend, name, sinks, error, message):
    q, k, v, _, _, cu_q, cu_k = packed((4, 3), (4, 3), 2, 1, 8, 8, torch.float32, seed=7)
    with use_backend(backend), pytest.raises(error, match=message):
        flashtile.attention_varlen(q, k, v, cu_q, cu_k, 4, 4, sinks=sinks)


def test_a_negative_view_of_varlen_sinks_is_read_as_its_values():
    lengths = ((5, 3), (5, 3))
    q, k, v, do, sinks, cu_q, cu_k = packed(*lengths, 2, 2, 4, 4, torch.float64, seed=8)
    view = torch.complex(torch.zeros_like(sinks), -sinks).conj().imag  # holds -(-sinks) in a negative view
    assert view.is_neg()
    o = flashtile.attention_varlen(q, k, v, cu_q, cu_k, 5, 5, sinks=view)
    torch.testing.assert_close(o, packed_truth(q, k, v, do, sinks, *lengths)[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_the_varlen_ops_with_sinks_pass_opcheck_and_torch_compile_fullgraph(backend):
    """The ops take the sinks last (``Tensor? sinks``); their fake implementations and autograd registration
    pass opcheck, and a function of the forward op compiles in one graph (the entry point reads cu_seqlens on
    the host first, a graph break by design) with the eager op's o, lse and gradients."""
    lengths = ((5, 0, 9), (5, 3, 9))
    q, k, v, do, sinks, cu_q, cu_k = packed(*lengths, 2, 1, 8, 4, torch.float32, seed=9)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    args = (*leaves[:3], cu_q, cu_k, 9, 9, 0.25, "upper_left", 4, 0, None, backend, leaves[3])  # causal, (4, -1)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    result = torch.library.opcheck(torch.ops.flashtile.attention_varlen_fwd.default, args, test_utils=checks)
    assert set(result.values()) == {"SUCCESS"}, result
    o, lse, stats = attention_varlen_fwd(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    bwd_args = (do, q, k, v, o, lse, stats, *args[3:-1], sinks)
    torch.library.opcheck(torch.ops.flashtile.attention_varlen_bwd.default, bwd_args, test_utils=checks)
    assert attention_varlen_bwd(*bwd_args)[3].shape == (2,)
    assert attention_varlen_bwd(*bwd_args[:-1])[3].numel() == 0  # no sinks: an empty dsinks

    def call(q, k, v, s):
        return attention_varlen_fwd(q, k, v, cu_q, cu_k, 9, 9, 0.25, "upper_left", 4, 0, None, backend, s)[:2]

    torch._dynamo.reset()
    o_compiled, lse_compiled = torch.compile(call, fullgraph=True, backend="aot_eager")(*leaves)
    grads = torch.autograd.grad(o_compiled, leaves, do)
    eager_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    o_eager, lse_eager = call(*eager_leaves)
    assert torch.equal(o_compiled, o_eager) and torch.equal(lse_compiled, lse_eager)
    for g, g_eager in zip(grads, torch.autograd.grad(o_eager, eager_leaves, do)):
        assert torch.equal(g, g_eager)
    expected = packed_truth(q, k, v, do, sinks, *lengths, causal=True, window=(4, -1), scale=0.25)
    assert_matches((o_compiled.detach(), lse_compiled, grads), expected, torch.float32)


# --- bfloat16 on the GPU -----------------------------------------------------------------------------------

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_CASES = {  # lengths (queries = keys), H, H_kv, D, flashtile's keywords, the truth's
    "gpt-oss-window": ((700, 1300, 0, 45), 8, 2, 64, dict(is_causal=True, window=(127, 0)),
                       dict(causal=True, window=(127, 0))),
    "full-causal": ((1024, 333, 2048), 8, 1, 64, dict(is_causal=True), dict(causal=True)),
    "d128-cap": ((900, 900), 4, 4, 128, dict(softcap=30.0), dict(softcap=30.0)),
}  # fmt: skip


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("case", list(GPU_CASES), ids=list(GPU_CASES))
def test_varlen_sinks_bf16_on_the_gpu_forward_and_backward(case):
    lengths, H, H_kv, D, kwargs, truth_mask = GPU_CASES[case]
    q, k, v, do, sinks, cu_q, cu_k = packed(lengths, lengths, H, H_kv, D, D, torch.float32, seed=10)
    q, k, v, do = (t.cuda().bfloat16() for t in (q, k, v, do))
    sinks, cu_q, cu_k = sinks.cuda(), cu_q.cuda(), cu_k.cuda()
    o, lse, grads = ours(q, k, v, sinks, do, cu_q, cu_k, (lengths, lengths), "triton", **kwargs)
    o_ref, lse_ref, grads_ref = packed_truth(*(t.cpu() for t in (q, k, v, do, sinks)), lengths, lengths,
                                             **truth_mask)  # fmt: skip
    assert o.dtype == torch.bfloat16 and grads[3].dtype == torch.float32
    for name, got, expected in (("o", o, o_ref), *zip(("dq", "dk", "dv", "dsinks"), grads, grads_ref)):
        scale = max(1.0, expected.abs().max().item())  # bf16 inputs, float32 accumulation: a few bf16 units
        error = (got.double().cpu() - expected).abs().max().item()
        assert error <= 2e-2 * scale, f"{name}: max error {error:.3e} against a largest entry of {scale:.3e}"
    torch.testing.assert_close(lse.double().cpu(), lse_ref, rtol=0, atol=1e-2)

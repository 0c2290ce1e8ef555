"""flashtile.attention_varlen: the contract (errors by name), and each CPU tier against dense float64
attention through the packed documents' block-diagonal mask (``_varlen_truth``)."""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile.api import use_backend
from tests._truth import assert_close_to_truth
from tests._varlen_truth import varlen_truth, varlen_truth_grads

TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=2e-5, rtol=2e-5),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}  # fmt: skip
BACKENDS = ["reference"]  # the Triton tier (interpreter) is exercised in tests/kernels/test_varlen_kernels.py


def packed(lengths_q, lengths_k, H=2, H_kv=2, D=16, dtype=torch.float32, seed=0):
    """Random packed q, k, v and their int32 cu_seqlens for documents of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = torch.randn(total_q, H, D, generator=g).to(dtype)
    k = torch.randn(total_k, H_kv, D, generator=g).to(dtype)
    v = torch.randn(total_k, H_kv, D, generator=g).to(dtype)
    cu = lambda lengths: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    return q, k, v, cu(lengths_q), cu(lengths_k)


CASES = [  # (lengths_q, lengths_k, H, H_kv, mask kwargs)
    ((5, 17, 9), (5, 17, 9), 2, 2, dict(is_causal=True)),
    ((5, 17, 9), (5, 17, 9), 4, 2, dict()),  # GQA
    ((7, 0, 12), (7, 0, 12), 2, 1, dict(is_causal=True)),  # an empty document
    ((6, 4, 10), (6, 0, 10), 2, 2, dict()),  # a document with queries but no keys
    ((0, 8, 3), (4, 8, 3), 2, 2, dict(is_causal=True)),  # keys without queries
    ((3, 11), (9, 5), 2, 2, dict(is_causal=True, alignment="lower_right")),  # Tq != Tk in each document
    ((20, 13), (20, 13), 2, 2, dict(window=(4, 2))),
    ((20, 13), (20, 13), 2, 2, dict(window=(5, -1), is_causal=True, softcap=3.0)),
]


def truth_kwargs(mask):
    return dict(window=mask.get("window"), causal=mask.get("is_causal", False),
                alignment=mask.get("alignment", "upper_left"), softcap=mask.get("softcap"))  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case, dtype", [(c, torch.float64) for c in range(len(CASES))] + [(c, torch.float32) for c in (0, 3, 5, 7)]
)
def test_attention_varlen_matches_dense_masked_float64(case, dtype, backend):
    lq, lk, H, H_kv, mask = CASES[case]
    q, k, v, cu_q, cu_k = packed(lq, lk, H, H_kv, dtype=dtype, seed=case)
    with use_backend(backend):
        o, lse = flashtile.attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), return_lse=True, **mask)
    o_ref, lse_ref = varlen_truth(q, k, v, cu_q, cu_k, **truth_kwargs(mask))
    assert o.shape == q.shape and o.dtype == dtype
    assert lse.shape == (H, q.shape[0]) and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close_to_truth(o.double(), o_ref, "o", **TOL[dtype])
    assert_close_to_truth(lse.double(), lse_ref, "lse", **TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case, dtype", [(1, torch.float64), (0, torch.float32), (3, torch.float32),
                                         (4, torch.float32), (5, torch.float32), (7, torch.float32)])  # fmt: skip
def test_attention_varlen_gradients_match_float64(case, dtype, backend):
    lq, lk, H, H_kv, mask = CASES[case]
    q, k, v, cu_q, cu_k = packed(lq, lk, H, H_kv, dtype=dtype, seed=10 + case)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(case)).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with use_backend(backend):
        o = flashtile.attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), **mask)
    grads = torch.autograd.grad(o, leaves, do)
    truth = varlen_truth_grads(q, k, v, do, cu_q, cu_k, **truth_kwargs(mask))
    for name, g, t in zip(("dq", "dk", "dv"), grads, truth):
        assert g.shape == t.shape and g.dtype == dtype
        assert_close_to_truth(g.double(), t, name, **TOL[dtype])


def test_attention_varlen_blind_rows_and_keyless_keys_get_zero():
    """A document with queries but no keys: o = 0, lse = -inf, zero dq; one with keys but no queries: zero dk, dv."""
    q, k, v, cu_q, cu_k = packed((4, 3, 0), (4, 0, 5))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with use_backend("reference"):
        o, lse = flashtile.attention_varlen(*leaves, cu_q, cu_k, 4, 5, is_causal=True, return_lse=True)
    assert torch.equal(o[4:7], torch.zeros_like(o[4:7]))
    assert torch.isneginf(lse[:, 4:7]).all()
    dq, dk, dv = torch.autograd.grad(o, leaves, torch.ones_like(o))
    assert torch.equal(dq[4:7], torch.zeros_like(dq[4:7]))
    assert torch.equal(dk[4:], torch.zeros_like(dk[4:])) and torch.equal(dv[4:], torch.zeros_like(dv[4:]))


def test_attention_varlen_bf16_cpu_runs_on_the_reference_tier():
    """bf16 CPU tensors take the reference tier whatever TRITON_INTERPRET says (the interpreter's bf16 is wrong)."""
    q, k, v, cu_q, cu_k = packed((5, 9), (5, 9), dtype=torch.bfloat16)
    o = flashtile.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, is_causal=True)
    o_ref, _ = varlen_truth(q, k, v, cu_q, cu_k, causal=True)
    assert_close_to_truth(o.double(), o_ref, "o", atol=2e-2, rtol=2e-2)


ERRORS = [  # (what to change, exception, words the message must hold)
    (dict(cu_seqlens_q=lambda cu: cu.long()), TypeError, "cu_seqlens_q"),
    (dict(cu_seqlens_k=lambda cu: cu.float()), TypeError, "cu_seqlens_k"),
    (dict(cu_seqlens_q=lambda cu: cu[None]), ValueError, "cu_seqlens_q"),
    (dict(cu_seqlens_q=lambda cu: torch.tensor([1, 5, 14], dtype=torch.int32)), ValueError, "cu_seqlens_q[0]"),
    (dict(cu_seqlens_k=lambda cu: torch.tensor([0, 9, 5, 14], dtype=torch.int32)), ValueError, "non-decreasing"),
    (dict(cu_seqlens_q=lambda cu: torch.tensor([0, 5, 13], dtype=torch.int32)), ValueError, "cu_seqlens_q[-1]"),
    (dict(cu_seqlens_k=lambda cu: torch.tensor([0, 14], dtype=torch.int32)), ValueError, "documents"),
    (dict(max_seqlen_q=lambda m: 8), ValueError, "max_seqlen_q"),
    (dict(max_seqlen_k=lambda m: 8.0), TypeError, "max_seqlen_k"),
    (dict(max_seqlen_q=lambda m: True), TypeError, "max_seqlen_q"),
    (dict(query=lambda x: x[None]), ValueError, "query"),
    (dict(query=lambda x: torch.cat([x, x[:, :1]], 1)), ValueError, "multiple of"),
    (dict(value=lambda x: x.half()), (TypeError, ValueError), "value"),
    (dict(is_causal=lambda c: 1), TypeError, "is_causal"),
    (dict(return_lse=lambda c: "yes"), TypeError, "return_lse"),
    (dict(window=lambda w: (3,)), TypeError, "window"),
    (dict(softcap=lambda s: -1.0), ValueError, "softcap"),
    (dict(alignment=lambda a: "centre"), ValueError, "alignment"),
]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("change", range(len(ERRORS)))
def test_attention_varlen_refuses_bad_input_by_name(change, backend):
    """Every tier refuses the same inputs with the same error (the checks run before the dispatch)."""
    q, k, v, cu_q, cu_k = packed((5, 9), (5, 9), H=2, H_kv=2)
    args = dict(query=q, key=k, value=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=9, max_seqlen_k=9,
                is_causal=False, return_lse=False, window=None, softcap=None, alignment="upper_left")  # fmt: skip
    edit, error, words = ERRORS[change]
    for name, f in edit.items():
        args[name] = f(args[name])
    with use_backend(backend), pytest.raises(error) as info:
        flashtile.attention_varlen(**args)
    assert words in str(info.value)


def test_attention_varlen_lse_carries_no_gradient_and_o_is_contiguous():
    q, k, v, cu_q, cu_k = packed((5, 9), (5, 9))
    q = q.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()  # a (total, H, D) view of (H, total, D)
    with use_backend("reference"):
        o, lse = flashtile.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, return_lse=True)
    assert o.is_contiguous() and not lse.requires_grad and o.requires_grad


def test_attention_varlen_double_backward_is_refused():
    q, k, v, cu_q, cu_k = packed((5, 9), (5, 9), dtype=torch.float64)
    q.requires_grad_()
    with use_backend("reference"):
        o = flashtile.attention_varlen(q, k, v, cu_q, cu_k, 9, 9)
    (g,) = torch.autograd.grad(o.sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        g.sum().backward()


def test_attention_varlen_ops_pass_torch_library_opcheck():
    """The custom ops' schemas, fake implementations (what torch.compile traces with) and autograd registration."""
    q, k, v, cu_q, cu_k = packed((5, 0, 9), (5, 3, 9), H=2, H_kv=1)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    args = (*leaves, cu_q, cu_k, 9, 9, 0.25, "upper_left", 4, 0, None, "reference")  # causal, window (4, -1)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    result = torch.library.opcheck(torch.ops.flashtile.attention_varlen_fwd.default, args, test_utils=checks)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_meta_tokens_are_refused_by_name_because_their_lengths_are_read_on_the_host(backend):
    q, k, v = (torch.empty(7, 2, 8, device="meta") for _ in range(3))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device="meta")
    with use_backend(backend), pytest.raises(ValueError, match="cu_seqlens_q is a meta tensor, which holds no"):
        flashtile.attention_varlen(q, k, v, cu, cu, 4, 4)

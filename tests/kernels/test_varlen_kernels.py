"""Packed documents in the Triton kernels (``flash_attention_varlen``, ``flash_attention_varlen_backward``):
each document against dense float64 attention through its own mask (``_varlen_truth``), memory outside a
document poisoned with NaN, and the programs' document mapping. On the CPU through the interpreter
(float32 and float16, small tiles); the ``gpu`` cases run bf16 at the H200's tile sizes."""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile.api import use_backend
from flashtile.bench.masks import document_lengths
from flashtile.kernels.backward import flash_attention_varlen_backward
from flashtile.kernels.forward import flash_attention_varlen
from tests._truth import assert_close_to_truth
from tests._varlen_truth import varlen_truth, varlen_truth_by_document, varlen_truth_grads

from ._helpers import DEVICE, FORWARD_TOL, LSE_TOL

GRAD_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}


def packed(lengths_q, lengths_k, H=2, H_kv=2, D=16, dtype=torch.float32, seed=0, device=DEVICE):
    """Random packed q, k, v (made on the CPU, then moved) and their int32 cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q, k, v = (torch.randn(n, h, D, generator=g) for n, h in ((total_q, H), (total_k, H_kv), (total_k, H_kv)))
    cu = lambda lengths: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    move = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731
    return move(q), move(k), move(v), cu(lengths_q).to(device), cu(lengths_k).to(device)


def mask_kwargs(mask):
    """The launcher's keywords for the truth's."""
    return dict(causal=mask.get("causal", False), window=mask.get("window"), softcap=mask.get("softcap"),
                alignment=mask.get("alignment", "upper_left"))  # fmt: skip


# Pairwise over: document lengths against the 16-row tiles (shorter than a tile, a multiple, ragged), mask
# (none, causal, window, causal + window, lower_right with Tq != Tk), softcap, GQA, head dim (power of 2 or
# not), dtype. Each pair of values appears in some case.
FORWARD_CASES = [  # (lengths_q, lengths_k, H, H_kv, D, dtype, mask)
    ((5, 40, 17), (5, 40, 17), 2, 2, 16, torch.float32, dict(causal=True)),
    ((32, 9, 48), (32, 9, 48), 4, 2, 24, torch.float16, dict()),
    ((3, 33), (20, 9), 2, 1, 16, torch.float32, dict(causal=True, alignment="lower_right")),
    ((30, 20, 1), (30, 20, 1), 2, 2, 16, torch.float16, dict(window=(5, 3), softcap=2.0)),
    ((6, 4, 10), (6, 0, 10), 4, 1, 24, torch.float32, dict(window=(7, -1), causal=True)),
    ((0, 35, 3), (4, 35, 3), 2, 2, 16, torch.float16, dict(causal=True, softcap=4.0)),
]


@pytest.mark.parametrize("case", range(len(FORWARD_CASES)))
def test_varlen_forward_matches_float64_per_document(case):
    lq, lk, H, H_kv, D, dtype, mask = FORWARD_CASES[case]
    q, k, v, cu_q, cu_k = packed(lq, lk, H, H_kv, D, dtype, seed=case)
    o, lse, stats = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), block_q=16, block_k=16,
                                           **mask_kwargs(mask))  # fmt: skip
    o_ref, lse_ref = varlen_truth(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), **mask_kwargs(mask))
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == (H, q.shape[0]) and stats.shape == (2, *lse.shape)
    assert_close_to_truth(o.double().cpu(), o_ref, "o", **FORWARD_TOL[dtype])
    assert_close_to_truth(lse.double().cpu(), lse_ref, "lse", **LSE_TOL[dtype])


def test_varlen_forward_reads_nothing_outside_a_document():
    """Keys of a document without queries (padding between documents) and queries of a document without
    keys hold NaN: no NaN may reach another document's rows, and the blind rows give o = 0, lse = -inf.
    The control: one NaN key inside the middle document reaches exactly that document's rows."""
    lq, lk = (17, 0, 9, 6, 21), (17, 13, 9, 0, 21)  # document 1: keys only; document 3: queries only
    q, k, v, cu_q, cu_k = packed(lq, lk, H=2, H_kv=1, seed=7)
    k[17:30], v[17:30], q[26:32] = float("nan"), float("nan"), float("nan")
    o, lse, _ = flash_attention_varlen(q, k, v, cu_q, cu_k, 21, 21, block_q=16, block_k=16, causal=True)
    # the truth one document at a time: the dense packed formula would multiply the NaN values by P = 0
    o_ref, _ = varlen_truth_by_document(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), causal=True)
    assert torch.isfinite(o).all()
    assert torch.equal(o[26:32].cpu(), torch.zeros(6, 2, 16)) and torch.isneginf(lse[:, 26:32]).all()
    assert_close_to_truth(o.double().cpu(), o_ref, "o", **FORWARD_TOL[torch.float32])
    k[35] = float("nan")  # the control: key 5 of document 2 (tokens 30 .. 38), seen causally by its rows 5 ..
    o, _, _ = flash_attention_varlen(q, k, v, cu_q, cu_k, 21, 21, block_q=16, block_k=16, causal=True)
    nan_rows = torch.isnan(o).any(dim=(1, 2)).cpu()
    assert nan_rows.nonzero().flatten().tolist() == list(range(17 + 5, 17 + 9))


def test_varlen_kernels_stay_inside_the_packed_tensors_whatever_cu_seqlens_holds():
    """Values the host check never saw (``checked=True``, as after a write behind torch's back): the kernels
    clamp each document to the tokens that exist, so the last document, told to run to token 1000 and to
    start its keys before 0, runs on tokens 9 .. 23 of each tensor, the rest of a NaN-poisoned buffer is never
    read, and the gradients of the tokens that exist come back finite. The control: the same call with the
    true bounds gives the same numbers."""
    lengths = (9, 15)
    q, k, v, cu_q, cu_k = packed(lengths, lengths, seed=11)
    padded = [torch.full((40, *x.shape[1:]), float("nan")) for x in (q, k, v)]
    for buffer, x in zip(padded, (q, k, v)):
        buffer[8:32] = x  # the packed tensors are views into the middle of poisoned storage
    q_view, k_view, v_view = (buffer[8:32] for buffer in padded)
    wild_q = torch.tensor([0, 9, 1000], dtype=torch.int32)
    wild_k = torch.tensor([0, -7, 1000], dtype=torch.int32)  # the clamps give document 0 no keys: blind rows
    o, lse, stats = flash_attention_varlen(q_view, k_view, v_view, wild_q, wild_k, 1000, 1000, block_q=16,
                                           block_k=16, causal=True, checked=True)  # fmt: skip
    true_k = torch.tensor([0, 0, 24], dtype=torch.int32)
    o_true, lse_true, _ = flash_attention_varlen(q, k, v, wild_q.clamp(max=24), true_k, 15, 24, block_q=16,
                                                 block_k=16, causal=True)  # fmt: skip
    assert torch.isfinite(o).all() and torch.equal(o, o_true) and torch.equal(lse, lse_true)
    assert torch.isneginf(lse[:, :9]).all()
    do = torch.randn_like(q)
    grads = flash_attention_varlen_backward(q_view, k_view, v_view, o, lse, do, wild_q, wild_k, 1000, 1000,
                                            causal=True, block_q=16, block_k=16, stats=stats, checked=True)  # fmt: skip
    assert all(torch.isfinite(g).all() for g in grads)


def test_varlen_forward_takes_any_strides():
    """A (total, H, D) view of (H, total, D) storage, and a head dim stored with stride 2."""
    q, k, v, cu_q, cu_k = packed((12, 20), (12, 20), seed=3)
    q_view = q.transpose(0, 1).contiguous().transpose(0, 1)
    k_view = torch.stack([k, k], dim=-1)[..., 0]  # stride 2 along D
    o, lse, _ = flash_attention_varlen(q_view, k_view, v, cu_q, cu_k, 20, 20, block_q=16, block_k=16, causal=True)
    o_ref, _ = varlen_truth(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), causal=True)
    assert_close_to_truth(o.double().cpu(), o_ref, "o", **FORWARD_TOL[torch.float32])


@pytest.mark.parametrize(
    "bad, error, words",
    [
        (dict(max_seqlen_q=16), ValueError, "max_seqlen_q"),
        (dict(cu_seqlens_k=torch.tensor([0, 10, 32], dtype=torch.int64)), TypeError, "cu_seqlens_k"),
        (dict(q=torch.zeros(32, 2, 16, dtype=torch.float64)), TypeError, "q"),
    ],
)
def test_varlen_launcher_refuses_bad_input_by_name(bad, error, words):
    q, k, v, cu_q, cu_k = packed((12, 20), (12, 20))
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=20, max_seqlen_k=20)
    args.update({name: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for name, x in bad.items()})
    with pytest.raises(error, match=words):
        flash_attention_varlen(**args)


BACKWARD_CASES = [  # (lengths_q, lengths_k, H, H_kv, D, dtype, mask): pairwise as above, fewer (each costs more)
    ((5, 20, 17), (5, 20, 17), 2, 1, 16, torch.float32, dict(causal=True)),
    ((3, 21, 0), (12, 9, 6), 2, 1, 24, torch.float16, dict(causal=True, alignment="lower_right", softcap=3.0)),
    ((18, 4, 10), (18, 0, 10), 2, 2, 16, torch.float32, dict(window=(4, 2))),
]


@pytest.mark.parametrize("case", range(len(BACKWARD_CASES)))
def test_varlen_backward_matches_float64_per_document(case):
    """dq, dk, dv against torch.autograd through the dense float64 formula; zero for the queries of a document
    without keys and the keys of a document without queries (cases 1 and 2)."""
    lq, lk, H, H_kv, D, dtype, mask = BACKWARD_CASES[case]
    q, k, v, cu_q, cu_k = packed(lq, lk, H, H_kv, D, dtype, seed=20 + case)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(case)).to(device=DEVICE, dtype=dtype)
    o, lse, stats = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), block_q=16, block_k=16,
                                           **mask_kwargs(mask))  # fmt: skip
    grads = flash_attention_varlen_backward(q, k, v, o, lse, do, cu_q, cu_k, max(lq), max(lk), block_q=16,
                                            block_k=16, stats=stats, **mask_kwargs(mask))  # fmt: skip
    truth = varlen_truth_grads(*(x.cpu() for x in (q, k, v, do, cu_q, cu_k)), **mask_kwargs(mask))
    for name, g, t, x in zip(("dq", "dk", "dv"), grads, truth, (q, k, v)):
        assert g.shape == x.shape and g.dtype == dtype
        assert_close_to_truth(g.double().cpu(), t, name, **GRAD_TOL[dtype])


def test_attention_varlen_runs_the_kernels_under_the_interpreter():
    """flashtile.attention_varlen on the Triton tier (forward and backward through autograd) against the float64
    formula, with the tier's own default tiles; its lse is the kernel's."""
    lq = (9, 40, 23)
    q, k, v, cu_q, cu_k = packed(lq, lq, 2, 1, 16, torch.float32, seed=5)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with use_backend("triton"):
        o, lse = flashtile.attention_varlen(*leaves, cu_q, cu_k, 40, 40, is_causal=True, window=(11, -1),
                                            return_lse=True)  # fmt: skip
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = torch.autograd.grad(o, leaves, do)
    cpu = [x.detach().cpu() for x in (q, k, v, do, cu_q, cu_k)]
    o_ref, lse_ref = varlen_truth(*cpu[:3], *cpu[4:], window=(11, -1), causal=True)
    assert_close_to_truth(o.detach().double().cpu(), o_ref, "o", **FORWARD_TOL[torch.float32])
    assert_close_to_truth(lse.double().cpu(), lse_ref, "lse", **LSE_TOL[torch.float32])
    truth = varlen_truth_grads(*cpu, window=(11, -1), causal=True)
    for name, g, t in zip(("dq", "dk", "dv"), grads, truth):
        assert_close_to_truth(g.double().cpu(), t, name, **GRAD_TOL[torch.float32])


# --- on the H200: bf16 at the package's own tile sizes --------------------------------------------------------


GPU_CASES = [  # (lengths, H, H_kv, D, mask): the first two are the masks benchmark's packed case
    (document_lengths(), 16, 16, 128, dict(causal=True)),
    (document_lengths(), 16, 16, 128, dict()),
    (document_lengths(seed=1), 8, 2, 64, dict(causal=True, window=(1023, 0))),
    ((1000, 1, 3000, 77, 129), 4, 4, 128, dict(causal=True, softcap=30.0)),
]


gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def each_gpu_case(test):
    """``test(case)`` once for every entry of ``GPU_CASES``, marked gpu and skipped without a CUDA device."""
    return pytest.mark.gpu(gpu_only(pytest.mark.parametrize("case", range(len(GPU_CASES)))(test)))


def gpu_case(case: int):
    """(lengths, mask, q, k, v, cu_q, cu_k): ``GPU_CASES[case]`` as packed bf16 tensors, seeded by ``case``."""
    lengths, H, H_kv, D, mask = GPU_CASES[case]
    return lengths, mask, *packed(lengths, lengths, H, H_kv, D, torch.bfloat16, seed=case)


@each_gpu_case
def test_varlen_forward_bf16_on_gpu(case):
    lengths, mask, q, k, v, cu_q, cu_k = gpu_case(case)
    o, lse, _ = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lengths), max(lengths), **mask_kwargs(mask))
    o_ref, lse_ref = varlen_truth_by_document(q, k, v, cu_q, cu_k, **mask_kwargs(mask))
    assert_close_to_truth(o.double(), o_ref, "o", **FORWARD_TOL[torch.bfloat16])
    assert_close_to_truth(lse.double(), lse_ref, "lse", **LSE_TOL[torch.bfloat16])


@each_gpu_case
def test_varlen_backward_bf16_on_gpu_is_right_and_deterministic(case):
    lengths, mask, q, k, v, cu_q, cu_k = gpu_case(case)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(case)).to(device=DEVICE, dtype=q.dtype)
    args = (cu_q, cu_k, max(lengths), max(lengths))
    o, lse, stats = flash_attention_varlen(q, k, v, *args, **mask_kwargs(mask))
    grads = flash_attention_varlen_backward(q, k, v, o, lse, do, *args, stats=stats, **mask_kwargs(mask))
    again = flash_attention_varlen_backward(q, k, v, o, lse, do, *args, stats=stats, **mask_kwargs(mask))
    assert all(torch.equal(a, b) for a, b in zip(grads, again)), "the varlen backward is not bitwise reproducible"
    truth = varlen_truth_by_document(q, k, v, cu_q, cu_k, do=do, **mask_kwargs(mask))[2:]
    # The bar, as for the dense backward (test_backward_gpu): at most twice the error of PyTorch's SDPA in bf16 on
    # the same documents, one at a time; SDPA has no soft-cap, so a capped case is held to 2 % of its largest value.
    peer = None if mask.get("softcap") else sdpa_gradients_by_document(q, k, v, do, lengths, mask)
    for n, (name, g, t) in enumerate(zip(("dq", "dk", "dv"), grads, truth)):
        assert torch.isfinite(g).all(), f"{name} has NaN or inf"
        err = (g.double() - t).abs().max().item()
        bar = 0.02 * t.abs().max().item() if peer is None else 2 * (peer[n].double() - t).abs().max().item() + 1e-6
        assert err <= bar, f"{name}: error {err:.3g} over the bar {bar:.3g}"


def sdpa_gradients_by_document(q, k, v, do, lengths, mask):
    """(dq, dk, dv) of torch's scaled_dot_product_attention in q's dtype, one document at a time through the
    document's boolean mask (K and V expanded for GQA, their gradients summed back over each group)."""
    from torch.nn.functional import scaled_dot_product_attention

    from tests._truth import definition_mask

    group = q.shape[1] // k.shape[1]
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        start += n
        keep = definition_mask(n, n, mask.get("window"), mask.get("causal", False), "upper_left").to(q.device)
        qd = q[part].transpose(0, 1)[None].detach().requires_grad_()
        kd, vd = (x[part].transpose(0, 1)[None].detach().requires_grad_() for x in (k, v))
        o = scaled_dot_product_attention(qd, kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1),
                                         attn_mask=keep)  # fmt: skip
        for packed_grad, g in zip(grads, torch.autograd.grad(o, (qd, kd, vd), do[part].transpose(0, 1)[None])):
            packed_grad[part] = g[0].transpose(0, 1)
    return grads


@pytest.mark.gpu
@gpu_only
def test_attention_varlen_on_gpu_matches_the_reference_tier():
    """The same call on both tiers: the Triton tier within bf16's tolerance of the reference tier's float32."""
    lengths = document_lengths(n=4, total=4096, low=256, high=2048, seed=2)
    q, k, v, cu_q, cu_k = packed(lengths, lengths, 8, 2, 128, torch.bfloat16, seed=9)
    outs = {}
    for backend in ("triton", "reference"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with use_backend(backend):
            o = flashtile.attention_varlen(*leaves, cu_q, cu_k, max(lengths), max(lengths), is_causal=True)
        outs[backend] = (o.detach(), *torch.autograd.grad(o, leaves, torch.ones_like(o)))
    for name, a, b in zip(("o", "dq", "dk", "dv"), outs["triton"], outs["reference"]):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.gpu
@gpu_only
def test_attention_varlen_reads_cu_seqlens_again_after_an_in_place_change():
    """The checks keep a device cu_seqlens' values while the tensor is unchanged (``_checks.host_values``): an
    in-place write bumps its version, and the next call reads and checks the new values."""
    q, k, v, cu_q, cu_k = packed((12, 20), (12, 20), dtype=torch.bfloat16)
    flashtile.attention_varlen(q, k, v, cu_q, cu_k, 20, 20)
    flashtile.attention_varlen(q, k, v, cu_q, cu_k, 20, 20)  # the kept values
    cu_q[1] = 40  # now decreasing
    with pytest.raises(ValueError, match="non-decreasing"):
        flashtile.attention_varlen(q, k, v, cu_q, cu_k, 20, 20)

"""One semantics on every tier: NaN and inf, huge logits, autograd modes, autocast, dispatch.

Each test runs ``flashtile.attention`` on the PyTorch reference tier and on the Triton tier (the
interpreter on a CPU, the kernels on a GPU) and holds both to the independent float64 truth of
tests/_truth.py. The written-down rule (docs: "flashtile.attention"):

* a row that sees a NaN, or a +-inf score whose softmax is undefined, comes out NaN (lse NaN, or +inf
  when a score is +inf, as torch.logsumexp gives); every other row is unaffected;
* a row that sees no key gives o = 0 and lse = -inf;
* gradients: every entry the float64 truth makes NaN because a row saw a NaN may be NaN; the entries of
  the rows and keys that saw it are NaN; every other entry is finite and correct.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

import flashtile
from flashtile.api import pick_backend, use_backend
from tests._truth import assert_close_to_truth, assert_same_nonfinite, truth_with_grads

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TIERS = ["reference", "triton"]
F32 = torch.float32
TOL = dict(atol=5e-5, rtol=5e-5) if DEVICE == "cuda" else dict(atol=2e-5, rtol=2e-5)  # fp32 dots in fp32


def qkv_do(B=1, H=2, H_kv=2, Tq=37, Tk=37, D=16, seed=0, dtype=F32):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE, dtype)
    return make(B, H, Tq, D), make(B, H_kv, Tk, D), make(B, H_kv, Tk, D), make(B, H, Tq, D)


def run(tier, q, k, v, do, causal=False, alignment="upper_left", scale=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with use_backend(tier):
        o, lse = flashtile.attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=True, alignment=alignment, return_lse=True
        )
    o.backward(do)
    return o.detach(), lse, (q.grad, k.grad, v.grad)


# --- NaN and inf ------------------------------------------------------------------------------------

POISONS = {
    "nan_in_query_row": lambda q, k, v: q[0, 1, 5].fill_(float("nan")),
    "nan_in_one_key": lambda q, k, v: k[0, 0, 30, 3].fill_(float("nan")),
    "posinf_in_one_key": lambda q, k, v: k[0, 1, 20, 0].fill_(float("inf")),
    "neginf_in_one_key": lambda q, k, v: k[0, 1, 3, 7].fill_(float("-inf")),
    "nan_in_the_first_value": lambda q, k, v: v[0, 0, 0, 2].fill_(float("nan")),  # seen by every row
    "posinf_query_entry": lambda q, k, v: q[0, 0, 33, 1].fill_(float("inf")),
}


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("causal,alignment", [(False, "upper_left"), (True, "upper_left"), (True, "lower_right")])
@pytest.mark.parametrize("poison", sorted(POISONS))
def test_nan_and_inf_reach_exactly_the_rows_that_see_them(tier, causal, alignment, poison):
    q, k, v, do = qkv_do(Tq=37, Tk=45, seed=hash(poison) % 1000)
    POISONS[poison](q, k, v)
    o, lse, grads = run(tier, q, k, v, do, causal, alignment)
    o_ref, lse_ref, grads_ref = truth_with_grads(q, k, v, do, causal, None, alignment)
    assert not torch.isfinite(o_ref).all(), "the poison must reach some row, or this test shows nothing"
    assert_close_to_truth(o, o_ref, "o", **TOL)
    assert_close_to_truth(lse, lse_ref, "lse", **TOL)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        # The dense float64 gradient spreads a NaN further (0 * NaN in every full-size product) than tiles
        # that are never visited do: ours may be finite where it is NaN, never NaN where it is finite.
        g, g_ref = g.double().cpu(), g_ref.cpu()
        assert not (torch.isnan(g) & torch.isfinite(g_ref)).any(), f"{name}: NaN where the truth is finite"
        finite = torch.isfinite(g_ref)
        torch.testing.assert_close(g[finite], g_ref[finite], **TOL, msg=lambda m, name=name: f"{name}: {m}")
    # ... and the rows that produced a NaN output carry it into their own dq.
    bad_rows = torch.isnan(o).any(-1).cpu()
    assert torch.isnan(grads[0].cpu()[bad_rows]).any(-1).all()


@pytest.mark.parametrize("tier", TIERS)
def test_rows_that_see_no_key_are_zero_with_lse_minus_inf_and_zero_gradients(tier):
    q, k, v, do = qkv_do(Tq=40, Tk=13, seed=3)  # lower-right with Tq > Tk: the first 27 rows see nothing
    o, lse, (dq, _, _) = run(tier, q, k, v, do, True, "lower_right")
    assert torch.equal(o[:, :, :27].cpu(), torch.zeros(1, 2, 27, 16))
    assert torch.isneginf(lse[:, :, :27]).all() and torch.isfinite(lse[:, :, 27:]).all()
    assert torch.equal(dq[:, :, :27].cpu(), torch.zeros(1, 2, 27, 16))


@pytest.mark.parametrize("tier", TIERS)
def test_a_first_tile_of_minus_inf_scores_weighs_nothing(tier):
    # Keys 0..63 hold -inf in component 0 and every query has a positive component 0: their scores are
    # -inf, unmasked, in the first (FULL) tiles. The float64 formula gives them weight 0, nothing NaN.
    q, k, v, do = qkv_do(Tq=40, Tk=100, seed=14)
    q[..., 0] = q[..., 0].abs() + 0.5
    k[:, :, :64, 0] = float("-inf")
    o, lse, grads = run(tier, q, k, v, do, False)
    o_ref, lse_ref, grads_ref = truth_with_grads(q, k, v, do, False)
    assert torch.isfinite(o_ref).all()
    assert_close_to_truth(o, o_ref, "o", **TOL)
    assert_close_to_truth(lse, lse_ref, "lse", **TOL)
    assert_close_to_truth(grads[2], grads_ref[2], "dv", **TOL)


@pytest.mark.parametrize("tier", TIERS)
def test_the_tiers_agree_on_every_non_finite_entry(tier):
    q, k, v, do = qkv_do(seed=4)
    q[0, 0, 2, 0], k[0, 1, 9, 4] = float("nan"), float("inf")
    o, lse, _ = run(tier, q, k, v, do, True)
    o_other, lse_other, _ = run(TIERS[1 - TIERS.index(tier)], q, k, v, do, True)
    assert_same_nonfinite(o, o_other, "o")
    assert_same_nonfinite(lse, lse_other, "lse")


# --- large logits: the forward-to-backward hand-off -------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("logit", [1e1, 4e3, 4e5, 4e6, 4e7, 1e12, 1e30])
def test_backward_on_the_forwards_own_statistics_is_exact_at_any_logit_magnitude(tier, logit):
    # Scores of size |logit| (about sqrt(D) * a^2 for entries of size a), where the truth is finite.
    q, k, v, do = qkv_do(Tq=37, Tk=37, seed=5)
    a = math.sqrt(logit / math.sqrt(q.shape[-1]))
    q, k = q * a, k * a
    o, lse, (dq, dk, dv) = run(tier, q, k, v, do, True)
    o_ref, lse_ref, (dq_ref, dk_ref, dv_ref) = truth_with_grads(q, k, v, do, True)
    # o and dv are sums of P-weighted values: relative to |v| and |dO| they must be as exact as at logit 1.
    rel = 1e-3 if logit <= 1e1 else 2e-5  # at |logit| ~ 10, fp32 rounding of S itself moves P by ~1e-6
    torch.testing.assert_close(o.double().cpu(), o_ref.cpu(), atol=rel * v.abs().max().item(), rtol=0)
    torch.testing.assert_close(dv.double().cpu(), dv_ref.cpu(), atol=rel * do.abs().max().item() * 37, rtol=0)
    assert torch.isfinite(lse).all()
    # lse carries the fp32 rounding of the dot products themselves (relative ~1e-6 with cancellation).
    torch.testing.assert_close(lse.double().cpu(), lse_ref.cpu(), rtol=1e-5, atol=1e-5)
    # dQ = τ dS K and dK = τ dS^T Q are sums of products of size τ |dO| |V| |K| (or |Q|): their rounding
    # error is judged against that size, which is how plain fp32 autograd fares too.
    tau = 1 / math.sqrt(q.shape[-1])
    size = tau * do.abs().max().item() * v.abs().max().item()
    torch.testing.assert_close(dq.double().cpu(), dq_ref.cpu(), atol=1e-5 * size * k.abs().max().item(), rtol=0)
    torch.testing.assert_close(dk.double().cpu(), dk_ref.cpu(), atol=1e-5 * size * q.abs().max().item(), rtol=0)


@pytest.mark.parametrize("scale", [0.0, -0.3, -1e-40, 7.5])
@pytest.mark.parametrize("tier", TIERS)
def test_zero_negative_tiny_and_large_scales(tier, scale):
    q, k, v, do = qkv_do(seed=6)
    o, lse, grads = run(tier, q, k, v, do, True, scale=scale)
    o_ref, lse_ref, grads_ref = truth_with_grads(q, k, v, do, True, scale)
    # Scores of size |τ| q·k carry fp32 rounding proportional to |τ|: so does the tolerance.
    tol = {name: value * max(1.0, abs(scale)) for name, value in TOL.items()}
    assert_close_to_truth(o, o_ref, "o", **tol)
    assert_close_to_truth(lse, lse_ref, "lse", **tol)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close_to_truth(g, g_ref, name, **tol)


# --- autograd modes -----------------------------------------------------------------------------------


def test_forward_mode_ad_is_refused_with_a_clear_error():
    q, k, v, _ = qkv_do(Tq=8, Tk=8, seed=7)
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.ones_like(q))
        with pytest.raises(NotImplementedError, match="does not support forward-mode AD"):
            flashtile.attention(dual, k, v)


@pytest.mark.parametrize("transform", ["jvp", "grad", "vmap"])
def test_torch_func_transforms_are_refused_with_a_clear_error(transform):
    q, k, v, _ = qkv_do(Tq=8, Tk=8, seed=8)
    f = lambda a: flashtile.attention(a, k, v).sum()
    with pytest.raises(NotImplementedError, match="does not support torch.func transforms"):
        if transform == "jvp":
            torch.func.jvp(lambda a: flashtile.attention(a, k, v), (q,), (torch.ones_like(q),))
        elif transform == "grad":
            torch.func.grad(f)(q)
        else:
            torch.func.vmap(lambda a: flashtile.attention(a, k, v))(q[None])


@pytest.mark.parametrize(
    "entry,error,match",
    [
        ("reference", NotImplementedError, "double backward .* is not supported"),
        ("triton", NotImplementedError, "double backward .* is not supported"),
        ("reference_attention", NotImplementedError, "double backward .* is not supported"),
    ],
)
def test_double_backward_raises_instead_of_a_wrong_answer(entry, error, match):
    dtype = torch.float64 if entry == "reference_attention" else F32
    q, k, v, _ = qkv_do(Tq=8, Tk=8, seed=9, dtype=dtype)
    q.requires_grad_()
    if entry == "reference_attention":
        o = flashtile.reference_attention(q, k, v)
    else:
        with use_backend(entry):
            o = flashtile.attention(q, k, v)
    (g,) = torch.autograd.grad(o.square().sum(), q, create_graph=True)
    with pytest.raises(error, match=match):
        g.sum().backward()


def test_reference_attention_under_torch_func_is_right_or_refused():
    q, k, v, _ = qkv_do(Tq=8, Tk=8, seed=13, dtype=torch.float64)
    loss = lambda a: flashtile.reference_attention(a, k, v, True).square().sum()
    leaf = q.clone().requires_grad_()
    loss(leaf).backward()
    torch.testing.assert_close(torch.func.grad(loss)(q), leaf.grad)  # the same gradient as autograd
    with pytest.raises(NotImplementedError, match="jvp"):
        torch.func.jvp(lambda a: flashtile.reference_attention(a, k, v), (q,), (torch.ones_like(q),))
    with pytest.raises(RuntimeError, match="vmap"):
        torch.func.vmap(lambda a: flashtile.reference_attention(a, k, v))(q[None].expand(2, -1, -1, -1, -1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_reference_tier_backpropagates_its_own_16_bit_forward(dtype):
    q, k, v, do = (t.cpu().to(dtype) for t in qkv_do(seed=11))
    q.requires_grad_()
    o = flashtile.reference_attention(q, k, v, True)
    o.backward(do)
    _, _, (dq_ref, _, _) = truth_with_grads(q, k, v, do, True)
    assert q.grad.dtype == dtype
    torch.testing.assert_close(q.grad.double(), dq_ref, atol=3e-2, rtol=3e-2)


# --- autocast and dispatch ----------------------------------------------------------------------------


@pytest.mark.parametrize("tier", [*TIERS, None])
def test_autocast_casts_like_sdpa(tier):
    q, k, v, _ = qkv_do(seed=12)
    low = torch.get_autocast_dtype(DEVICE)  # bf16 on the CPU, fp16 on CUDA
    if tier == "triton" and DEVICE == "cpu":  # forced onto the interpreter, bf16 is refused by name
        with torch.autocast(DEVICE), use_backend(tier), pytest.raises(TypeError, match="Triton issue 11584"):
            flashtile.attention(q, k, v)
        return
    with torch.autocast(DEVICE), use_backend(tier or pick_backend(q.to(low))):
        ours = flashtile.attention(q, k, v, is_causal=True)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert ours.dtype == sdpa.dtype == low
    o_ref = truth_with_grads(q.to(low), k.to(low), v.to(low), torch.zeros_like(q), True)[0]
    err, sdpa_err = (ours.double() - o_ref).abs().max(), (sdpa.double() - o_ref).abs().max()
    assert err <= 2 * sdpa_err + 1e-3, (err, sdpa_err)


def test_use_backend_is_local_to_the_thread_that_set_it():
    q = torch.ones(1, 1, 1, 16, device=DEVICE)
    seen = {}
    inside, release = threading.Event(), threading.Event()

    def other_thread():
        inside.wait()
        seen["other"] = pick_backend(q)
        release.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with use_backend("reference"):
        seen["mine"] = pick_backend(q)
        inside.set()
        release.wait(timeout=30)
    thread.join(timeout=30)
    assert seen == {"mine": "reference", "other": "triton"}


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("On", True), ("0", False),
                                            ("false", False), ("", False), ("2", False)])
def test_triton_interpret_is_read_exactly_as_triton_reads_it(monkeypatch, value, expected):
    triton = pytest.importorskip("triton")
    from flashtile._env import is_interpreting

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert is_interpreting() is expected
    if hasattr(triton, "knobs"):
        assert triton.knobs.runtime.interpret is expected

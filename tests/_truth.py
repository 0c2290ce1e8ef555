"""The float64 truth every attention test compares against, written without importing flashtile.

softmax(τ Q Kᵀ) V with einsum and torch.softmax, in float64, straight from the definition: a test's
expected value must not come from the code under test. Conventions (the package's documented ones):

* causal: query i sees key j iff j <= i + offset, offset 0 ("upper_left") or Tk - Tq ("lower_right");
* a row that sees no key has o = 0 and lse = -inf (and zero gradients);
* NaN and inf follow IEEE float64 arithmetic through the formula: a row that sees a NaN is NaN.
"""

from __future__ import annotations

import math

import torch


def visible_pairs_mask(Tq: int, Tk: int, causal: bool, alignment: str, device=None) -> torch.Tensor:
    """Boolean (Tq, Tk): True where query i sees key j."""
    if not causal:
        return torch.ones(Tq, Tk, dtype=torch.bool, device=device)
    offset = 0 if alignment == "upper_left" else Tk - Tq
    i = torch.arange(Tq, device=device)[:, None]
    j = torch.arange(Tk, device=device)[None, :]
    return j <= i + offset


def attention_truth(q, k, v, causal=False, scale=None, alignment="upper_left"):
    """(o, lse) in float64 from float64 tensors; differentiable through torch autograd.

    q: (B, H, Tq, D); k, v: (B, H_kv, Tk, D) with H a multiple of H_kv (query head h reads kv head
    h // (H // H_kv)).
    """
    assert q.dtype == k.dtype == v.dtype == torch.float64
    tau = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = tau * torch.einsum("bhid,bhjd->bhij", q, k)
    visible = visible_pairs_mask(q.shape[2], k.shape[2], causal, alignment, q.device)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)[..., None]  # rows that see no key (a NaN or +inf lse is not empty)
    p = torch.where(empty, 0.0, torch.softmax(torch.where(empty, 0.0, s), dim=-1))
    o = torch.einsum("bhij,bhjd->bhid", p, v)
    return o, lse


def decode_truth(q, k, v, lengths, scale=None):
    """(o, lse) float64, on the CPU: each sequence b's Tq new tokens (q is (B, H, Tq, D)) against the first
    ``lengths[b]`` keys of the caches k, v (B, H_kv, T_max, D), lower-right aligned; a sequence with no key
    gets o = 0 and lse = -inf."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float64)
    for b, n in enumerate(lengths):
        if n:
            o_b, lse_b = attention_truth(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], True, scale,
                                         "lower_right")  # fmt: skip
            o[b], lse[b] = o_b[0], lse_b[0]
    return o, lse


def truth_with_grads(q, k, v, do, causal=False, scale=None, alignment="upper_left"):
    """o, lse and (dq, dk, dv) in float64, for the given (possibly low-precision) inputs and upstream dO."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, lse = attention_truth(q64, k64, v64, causal, scale, alignment)
    grads = torch.autograd.grad(o, (q64, k64, v64), do.detach().double())
    return o.detach(), lse.detach(), grads


def assert_same_nonfinite(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """actual is NaN exactly where expected is NaN, and +-inf exactly where expected is +-inf."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    for what, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        mismatch = test(actual) != test(expected)
        if mismatch.any():
            where = mismatch.nonzero()[0].tolist()
            raise AssertionError(
                f"{name}: {what} pattern differs from the float64 truth at {int(mismatch.sum())} entries, first at "
                f"{where}: got {actual[tuple(where)].item()}, expected {expected[tuple(where)].item()}"
            )


def assert_close_to_truth(actual, expected, name, **tol) -> None:
    """Same non-finite pattern, and the finite entries within tolerance."""
    assert_same_nonfinite(actual, expected, name)
    finite = torch.isfinite(expected.detach().cpu())
    torch.testing.assert_close(
        actual.detach().double().cpu()[finite], expected.detach().double().cpu()[finite], **tol,
        msg=lambda m: f"{name}: {m}",
    )


# --- sliding windows and soft-capping (flashtile.reference.masks), from the definitions -------------


def definition_mask(Tq, Tk, window, causal, alignment):
    """(Tq, Tk) bool: query i keeps key j iff i + offset - left <= j <= i + offset + right, each side only
    where it is not -1 (unbounded); causal caps the right side at 0. Every (i, j) is tested, as broadcast
    index grids, so that the GPU tests' thousands of rows cost no Python loop."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    offset = 0 if alignment == "upper_left" else Tk - Tq
    i, j = torch.arange(Tq)[:, None], torch.arange(Tk)[None, :]
    keep = torch.ones(Tq, Tk, dtype=torch.bool)
    if left != -1:
        keep &= j >= i + offset - left
    if right != -1:
        keep &= j <= i + offset + right
    return keep


def masked_truth(q, k, v, keep, scale=None, softcap=None):
    """(o, lse) in float64 of attention through a (Tq, Tk) boolean mask; differentiable by autograd.
    q: (B, H, Tq, D); k, v: (B, H_kv, Tk, D). A row that keeps no key gets o = 0, lse = -inf."""
    tau = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = tau * torch.einsum("bhid,bhjd->bhij", q, k)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)[..., None]
    p = torch.where(empty, 0.0, torch.softmax(torch.where(empty, 0.0, s), dim=-1))
    return torch.einsum("bhij,bhjd->bhid", p, v), lse


def truth_gradients(q, k, v, do, keep, scale=None, softcap=None):
    """(dq, dk, dv) of ``masked_truth`` by torch.autograd, for float64 inputs and upstream dO."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, _ = masked_truth(q, k, v, keep, scale, softcap)
    return torch.autograd.grad(o, (q, k, v), do)

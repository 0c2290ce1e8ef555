"""Property tests for the kernels: whatever the shapes, layouts, GQA ratio, scale, mask and dtype, the
forward and the backward (fed the forward's own o, lse and (m, l)) agree with the float64 truth.

Hypothesis draws fresh examples on every run (no fixed list); a failure prints the
``@reproduce_failure`` blob that replays it exactly (print_blob), and ``--hypothesis-seed=N`` replays a
whole run. Each example runs through the Triton interpreter on a CPU, so shapes stay small.
"""

import pytest
import torch

from flashtile.kernels.backward import flash_attention_backward
from flashtile.kernels.forward import flash_attention
from tests._grids import LONG
from tests._truth import truth_with_grads

from ._helpers import DEVICE, ON_GPU

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

LAYOUTS = ["contiguous", "bthd", "offset", "expanded_batch", "head_dim_outer"]
# Tolerance per unit of the natural size of each output (|v| for o, the gradient's largest entry for
# gradients): fp32 runs exact fp32 dots; fp16 rounds P and dS to fp16 before three of the matmuls.
REL = {torch.float32: 5e-3 if ON_GPU else 1e-4, torch.float16: 2e-2}
# (B, H_kv, group): the interpreter's time grows with B x H (a program per batch, head and query tile). The
# offsets a bug could get wrong show with 2 of each: the batch's (B = 2, also under expanded_batch's stride
# 0), the key head's (H_kv = 2) and the query head -> key head map (group 2 or 3). make test leaves out the
# two products above 6, (2, 2, 2) and (2, 2, 3): every pair of values of two of the axes is still drawn, in
# a case of at most 6 heads in all; make test-long (FLASHTILE_TEST_LONG) draws from all 12.
HEADS = [(B, H_kv, group) for B in (1, 2) for H_kv in (1, 2) for group in (1, 2, 3) if LONG or B * H_kv * group <= 6]


def make(shape, layout, dtype, gen):
    """A tensor of ``shape`` (B, H, T, D) with fresh normal values, laid out as ``layout``."""
    B, H, T, D = shape
    if layout == "bthd":  # a (B, T, H, D) projection viewed as (B, H, T, D)
        return torch.randn(B, T, H, D, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    if layout == "offset":  # a slice that starts past the storage's first element, rows D + 3 apart
        base = torch.randn(B, H, T + 1, D + 3, generator=gen).to(DEVICE, dtype)
        return base[:, :, 1:, 2 : D + 2]
    if layout == "expanded_batch":  # one batch entry broadcast to B: batch stride 0
        return torch.randn(1, H, T, D, generator=gen).to(DEVICE, dtype).expand(B, H, T, D)
    if layout == "head_dim_outer":  # the head dim is the slowest axis of the storage
        return torch.randn(D, B, H, T, generator=gen).to(DEVICE, dtype).permute(1, 2, 3, 0)
    return torch.randn(B, H, T, D, generator=gen).to(DEVICE, dtype)


def assert_close_relative(actual, expected, rel, name, natural_size=0.0):
    """Error within rel x the larger of the expected values and the output's natural size: dQ that is 0
    in exact arithmetic (a row with one key) is still a sum of terms of size |τ| |dO| |V| |K|."""
    size = max(expected.abs().max().item(), natural_size)
    floor = torch.finfo(actual.dtype).tiny  # below it a 16-bit output rounds to 0 or a subnormal
    err = (actual.double().cpu() - expected.cpu()).abs().max().item()
    assert err <= rel * size + floor, f"{name}: max error {err:.3g} > {rel:g} x {size:.3g} + {floor:.3g}"


@hypothesis.given(  # examples per run: the profile of the root conftest (60, or 300 in make test-long)
    heads=st.sampled_from(HEADS),
    Tq=st.integers(1, 40),
    Tk=st.integers(1, 40),
    D=st.sampled_from([4, 16, 24, 32, 40]),
    mask=st.sampled_from([(False, "upper_left"), (True, "upper_left"), (True, "lower_right")]),
    scale=st.one_of(st.none(), st.floats(-1.5, 1.5), st.just(0.0)),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    layouts=st.tuples(*(st.sampled_from(LAYOUTS) for _ in range(4))),
    blocks=st.sampled_from([(None, None), (16, 16), (16, 32), (32, 16)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_forward_and_backward_match_float64_for_any_input(
    heads, Tq, Tk, D, mask, scale, dtype, layouts, blocks, seed
):
    (B, H_kv, group), (causal, alignment) = heads, mask
    gen = torch.Generator().manual_seed(seed)
    H = H_kv * group
    q = make((B, H, Tq, D), layouts[0], dtype, gen)
    k = make((B, H_kv, Tk, D), layouts[1], dtype, gen)
    v = make((B, H_kv, Tk, D), layouts[2], dtype, gen)
    do = make((B, H, Tq, D), layouts[3], dtype, gen)
    block_q, block_k = blocks

    o, lse, stats = flash_attention(q, k, v, causal=causal, scale=scale, alignment=alignment, block_q=block_q,
                                    block_k=block_k, return_stats=True)  # fmt: skip
    dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do, causal=causal, scale=scale, block_q=block_q,
                                          block_k=block_k, alignment=alignment, stats=stats)  # fmt: skip
    o_ref, lse_ref, (dq_ref, dk_ref, dv_ref) = truth_with_grads(q, k, v, do, causal, scale, alignment)

    rel = REL[dtype]
    assert torch.equal(torch.isneginf(lse).cpu(), torch.isneginf(lse_ref).cpu())  # the rows that see nothing
    for name, t in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"{name} has NaN on finite input"
    assert_close_relative(o, o_ref, rel, "o")
    finite = torch.isfinite(lse_ref).cpu()
    if finite.any():  # lse's error follows its own size (the largest score plus log Tk)
        assert_close_relative(lse.cpu()[finite], lse_ref.cpu()[finite], rel, "lse")
    tau = abs(D**-0.5 if scale is None else scale)
    amax = lambda t: t.abs().max().item()
    assert_close_relative(dq, dq_ref, rel, "dq", tau * amax(do) * amax(v) * amax(k))
    assert_close_relative(dk, dk_ref, rel, "dk", tau * amax(do) * amax(v) * amax(q))
    assert_close_relative(dv, dv_ref, rel, "dv", amax(do))

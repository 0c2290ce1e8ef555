"""The textbook kernels (``flashtile.kernels.textbook``) against the float64 formula of tests/_truth.py.

Without CUDA these run in Triton's interpreter on the CPU (the root conftest sets TRITON_INTERPRET=1): fp16
and fp32 only, since the interpreter computes bf16 wrongly. The tiles are fixed (64 x 64 for fp16, 16 x 32
or 16 x 16 for fp32), so T = 130 gives three fp16 query tiles, the last one two rows long. The tests marked
``gpu`` run the compiled kernels on a CUDA device at realistic sizes, bf16 included:
``python -m pytest -m gpu tests/kernels/test_textbook.py -q``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import flashtile
from flashtile.kernels import textbook
from flashtile.kernels.textbook import textbook_backward, textbook_forward
from tests._grids import covering
from tests._sm90 import compiled, register
from tests._truth import assert_close_to_truth, truth_with_grads

from ._helpers import DEVICE, FORWARD_TOL, LSE_TOL, randn

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# fp32: exact fp32 dots ("ieee") everywhere; fp16: P and dS are rounded to fp16 before three of the five
# backward matmuls (the package's own backward tests hold the same bounds, tests/kernels/test_backward.py).
GRAD_TOL = {F32: dict(atol=1e-4, rtol=1e-4), F16: dict(atol=1e-2, rtol=1e-2)}
MASKS = {"full": (False, "upper_left"), "causal": (True, "upper_left"), "causal_lr": (True, "lower_right")}


def make_inputs(B, H, Tq, Tk, D, dtype, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    q, do = randn(B, H, Tq, D, dtype=dtype, generator=gen), randn(B, H, Tq, D, dtype=dtype, generator=gen)
    k, v = randn(B, H, Tk, D, dtype=dtype, generator=gen), randn(B, H, Tk, D, dtype=dtype, generator=gen)
    return q.to(device), k.to(device), v.to(device), do.to(device)


def check_against_truth(q, k, v, do, causal, scale, alignment="upper_left"):
    """Forward and backward of the textbook kernels against autograd through the float64 formula."""
    o, lse = textbook_forward(q, k, v, causal, scale, alignment=alignment)
    grads = textbook_backward(q, k, v, o, lse, do, causal, scale, alignment=alignment)
    o_ref, lse_ref, grads_ref = truth_with_grads(q, k, v, do, causal, scale, alignment)
    assert o.dtype == q.dtype and lse.dtype == F32 and lse.shape == q.shape[:3]
    assert_close_to_truth(o, o_ref, "o", **FORWARD_TOL[q.dtype])
    assert_close_to_truth(lse, lse_ref, "lse", **LSE_TOL[q.dtype])
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert g.dtype == q.dtype and g.shape == g_ref.shape, name
        assert_close_to_truth(g, g_ref, name, **GRAD_TOL[q.dtype])
    return o, lse, grads


# Every pair of (mask, lengths, head dim, dtype, scale) at least once (tests/_grids.py): T = 1, 37 (one
# ragged tile) and 130 (ragged last tile), Tq != Tk both ways, D padded (40 -> 64) and not.
@pytest.mark.parametrize(
    "causal,alignment,Tq,Tk,D,dtype,scale",
    covering(mask=MASKS, T=[(1, 1), (37, 37), (130, 130), (37, 130), (130, 37), (1, 130)], D=[16, 40, 64, 128],
             dtype={"fp32": F32, "fp16": F16}, scale={"default": None, "given": -0.3}),
)  # fmt: skip
def test_textbook_matches_float64_truth(causal, alignment, Tq, Tk, D, dtype, scale):
    q, k, v, do = make_inputs(1, 2, Tq, Tk, D, dtype, seed=Tq * 1000 + Tk + D)
    check_against_truth(q, k, v, do, causal, scale, alignment)


def test_rows_that_see_no_key_get_o_zero_lse_minus_inf_and_zero_gradients():
    """Lower-right with Tq = 130 > Tk = 37: rows 0 .. 92 see no key. Their o is exactly 0, their lse -inf,
    their dq exactly 0; the other rows still match the truth (check_against_truth)."""
    q, k, v, do = make_inputs(1, 2, 130, 37, 40, F32, seed=5)
    o, lse, (dq, _, _) = check_against_truth(q, k, v, do, True, None, "lower_right")
    assert torch.equal(o[:, :, :93], torch.zeros_like(o[:, :, :93]))
    assert torch.isneginf(lse[:, :, :93]).all() and torch.isfinite(lse[:, :, 93:]).all()
    assert torch.equal(dq[:, :, :93], torch.zeros_like(dq[:, :, :93])) and dq[:, :, 93:].abs().sum() > 0


def test_zero_scale_averages_the_visible_values():
    """τ = 0: every score is 0, so each row's o is the mean of the values it sees and lse = log(count)."""
    q, k, v, do = make_inputs(1, 1, 37, 37, 16, F32, seed=6)
    o, lse, _ = check_against_truth(q, k, v, do, True, 0.0)
    counts = torch.arange(1, 38, dtype=torch.float64)
    torch.testing.assert_close(lse[0, 0].double(), counts.log(), atol=1e-6, rtol=0)


def test_skip_tiles_are_never_read():
    """Causal, fp16 (64 x 64 tiles), T = 200. Query tile 0 (rows 0 .. 63) needs key tile 0 only, and key
    tile 1 (keys 64 .. 127) is seen from query row 64 on: NaN in every key and value from key 64 on leaves
    o and dq of rows 0 .. 63 as they were, NaN in every query and dO row before 64 leaves dk and dv of keys
    64 on as they were. Control: the same poison one row further in reaches the output."""
    q, k, v, do = make_inputs(1, 1, 200, 200, 16, F16, seed=13)
    o, lse = textbook_forward(q, k, v, True)
    dq, dk, dv = textbook_backward(q, k, v, o, lse, do, True)

    def poisoned(x, start, stop):
        x = x.clone()
        x[:, :, start:stop] = float("nan")
        return x

    for first in (64, 63):  # keys and values NaN from ``first`` on
        k_bad, v_bad = poisoned(k, first, 200), poisoned(v, first, 200)
        o_bad, lse_bad = textbook_forward(q, k_bad, v_bad, True)
        dq_bad = textbook_backward(q, k_bad, v_bad, o_bad, lse_bad, do, True)[0]
        clean = torch.equal(o_bad[:, :, :64], o[:, :, :64]) and torch.equal(dq_bad[:, :, :64], dq[:, :, :64])
        assert clean == (first == 64), first
    for last in (64, 65):  # queries and dO NaN before ``last``
        q_bad, do_bad = poisoned(q, 0, last), poisoned(do, 0, last)
        _, dk_bad, dv_bad = textbook_backward(q_bad, k, v, o, lse, do_bad, True)
        clean = torch.equal(dk_bad[:, :, 64:], dk[:, :, 64:]) and torch.equal(dv_bad[:, :, 64:], dv[:, :, 64:])
        assert clean == (last == 64), last


def test_strided_views_are_read_in_place():
    """(B, T, H, D) storage viewed as (B, H, T, D), and a dO whose head dim is the outer axis: the kernels
    read strides, so the answers are those of contiguous copies."""
    B, T, H, D = 1, 37, 2, 40
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, T, H, D, generator=gen).to(DEVICE).transpose(1, 2) for _ in range(3))
    do = torch.randn(B, H, D, T, generator=gen).to(DEVICE).transpose(-1, -2)
    assert not q.is_contiguous() and do.stride(-1) != 1
    o, lse, grads = check_against_truth(q, k, v, do, True, None)
    contiguous = [t.contiguous() for t in (q, k, v, do)]
    o_c, lse_c = textbook_forward(*contiguous[:3], True)
    torch.testing.assert_close(o, o_c)
    torch.testing.assert_close(lse, lse_c)
    for g, g_c in zip(grads, textbook_backward(*contiguous[:3], o_c, lse_c, contiguous[3], True)):
        torch.testing.assert_close(g, g_c)


def test_negative_bit_views_are_read_as_their_values():
    """A view with the negative bit (its memory holds -x) gives what its values give, as in flashtile.attention."""
    q, k, v, do = make_inputs(1, 2, 37, 37, 16, F32, seed=12)
    neg = lambda x: torch._neg_view(-x)  # noqa: E731 - values x, memory -x
    assert neg(q).is_neg() and torch.equal(neg(q), q)
    o, lse = textbook_forward(q, k, v, True)
    o_n, lse_n = textbook_forward(neg(q), neg(k), neg(v), True)
    assert torch.equal(o, o_n) and torch.equal(lse, lse_n)
    grads = textbook_backward(q, k, v, o, lse, do, True)
    for g, g_n in zip(grads, textbook_backward(neg(q), k, v, neg(o), lse, neg(do), True)):
        assert torch.equal(g, g_n)


def test_lse_means_what_the_package_lse_means():
    """The textbook backward runs on flashtile.attention's (o, lse), and the textbook's lse is the package's."""
    q, k, v, do = make_inputs(1, 2, 130, 70, 64, F32, seed=8)
    o, lse = flashtile.attention(q, k, v, is_causal=True, return_lse=True)
    o_tb, lse_tb = textbook_forward(q, k, v, True)
    assert lse_tb.dtype == lse.dtype and lse_tb.shape == lse.shape
    torch.testing.assert_close(lse_tb, lse, **LSE_TOL[F32])
    _, _, grads_ref = truth_with_grads(q, k, v, do, True)
    for name, g, g_ref in zip(("dq", "dk", "dv"), textbook_backward(q, k, v, o, lse, do, True), grads_ref):
        assert_close_to_truth(g, g_ref, name, **GRAD_TOL[F32])


# --- bad input: the package's errors, plus what only the textbook kernels refuse ---------------------------


def _bad(change):
    """(q, k, v, kwargs) of a small good call with one thing changed."""
    q, k, v, _ = make_inputs(1, 2, 16, 16, 16, F32, seed=9)
    kwargs = {}
    if change == "q not a tensor":
        q = q.tolist()
    elif change == "rank 3":
        q = q[0]
    elif change == "dtype mismatch":
        v = v.half()
    elif change == "int dtype":
        q, k, v = (t.int() for t in (q, k, v))
    elif change == "empty":
        q = q[:, :, :0]
    elif change == "head dim mismatch":
        k = k[..., :8]
    elif change == "batch mismatch":
        k, v = torch.cat([k, k]), torch.cat([v, v])
    elif change == "v shape":
        v = v[:, :, :8]
    elif change == "causal not a bool":
        kwargs["causal"] = 1
    elif change == "scale nan":
        kwargs["scale"] = float("nan")
    elif change == "scale a string":
        kwargs["scale"] = "0.1"
    elif change == "scale too large":
        kwargs["scale"] = 1e39
    elif change == "alignment":
        kwargs["alignment"] = "center"
    return q, k, v, kwargs


ATTENTION_NAMES = {"query": "q", "key": "k", "value": "v", "is_causal": "causal"}


@pytest.mark.parametrize(
    "change",
    ["q not a tensor", "rank 3", "dtype mismatch", "int dtype", "empty", "head dim mismatch", "batch mismatch",
     "v shape", "causal not a bool", "scale nan", "scale a string", "scale too large", "alignment"],
)  # fmt: skip
def test_bad_input_raises_what_flashtile_attention_raises(change):
    """The same type and message as flashtile.attention, with the textbook's argument names (q, not query)."""
    q, k, v, kwargs = _bad(change)
    with pytest.raises((TypeError, ValueError)) as theirs:
        flashtile.attention(q, k, v, **{("is_causal" if n == "causal" else n): x for n, x in kwargs.items()})
    with pytest.raises(theirs.type) as ours:
        textbook_forward(q, k, v, **kwargs)
    expected = re.sub(r"\b(query|key|value|is_causal)\b", lambda m: ATTENTION_NAMES[m.group(1)], str(theirs.value))
    assert str(ours.value) == expected
    if change not in ("causal not a bool", "alignment", "scale nan", "scale a string", "scale too large"):
        return
    good_q, good_k, good_v, _ = _bad("none")
    o, lse = textbook_forward(good_q, good_k, good_v)
    with pytest.raises(theirs.type, match=re.escape(expected)):  # the backward runs the same checks
        textbook_backward(good_q, good_k, good_v, o, lse, o, **kwargs)


@pytest.mark.parametrize(
    "change,error,match",
    [
        ("gqa", ValueError, "no GQA"),
        ("head dim 129", ValueError, "head dims 1 to 128"),
        ("float64", TypeError, "the textbook kernels take float16, bfloat16 and float32"),
        ("lse float64", TypeError, "lse must have dtype float32"),
        ("lse shape", ValueError, r"lse must have shape \(B, H, Tq\)"),
        ("do shape", ValueError, "do must have shape"),
        ("o dtype", TypeError, "o has dtype torch.float16 but q"),
    ],
)
def test_what_only_the_textbook_refuses(change, error, match):
    q, k, v, do = make_inputs(1, 2, 16, 16, 16, F32, seed=10)
    if change == "gqa":
        k, v = k[:, :1], v[:, :1]
    elif change == "head dim 129":
        q, k, v = (torch.cat([t] * 9, dim=-1)[..., :129] for t in (q, k, v))
    elif change == "float64":
        q, k, v = q.double(), k.double(), v.double()
    if change in ("gqa", "head dim 129", "float64"):
        with pytest.raises(error, match=match):
            textbook_forward(q, k, v)
        return
    o, lse = textbook_forward(q, k, v)
    if change == "lse float64":
        lse = lse.double()
    elif change == "lse shape":
        lse = lse[:, :, :8]
    elif change == "do shape":
        do = do[:, :, :8]
    elif change == "o dtype":
        o = o.half()
    with pytest.raises(error, match=match):
        textbook_backward(q, k, v, o, lse, do)


@pytest.mark.skipif(DEVICE == "cuda", reason="bf16 CPU tensors exist only off the GPU path")
def test_bf16_cpu_tensors_are_refused_not_computed_wrongly():
    q = torch.zeros(1, 1, 16, 16, dtype=BF16)
    with pytest.raises(TypeError, match="interpreter computes bfloat16 wrongly"):
        textbook_forward(q, q, q)


# --- the listings and the compiled kernels ------------------------------------------------------------------


def listing_lines(name: str) -> int:
    """Lines of the named snippet section of kernels/textbook.py, markers excluded."""
    lines = Path(textbook.__file__).read_text().splitlines()
    start, end = lines.index(f"# --8<-- [start:{name}]"), lines.index(f"# --8<-- [end:{name}]")
    return end - start - 1


def test_each_kernel_is_one_short_listing():
    """The chapters show the forward whole (<= 95 lines of at most 88 columns) and the three backward kernels
    whole (<= 175, at most 88 columns too)."""
    assert 0 < listing_lines("textbook-forward") <= 95
    assert 0 < listing_lines("textbook-backward") <= 175
    assert 0 < listing_lines("textbook-launch") <= 50


SM90_BODY = """
import torch
from flashtile.kernels import textbook as tb

def like_a_launch(fn, dtype, D, causal, backward):
    # Compiled as a launch on contiguous tensors specialises it (_sm90's sm90_like_a_launch).
    bq, bk = tb.textbook_blocks(D, dtype, backward)
    constexprs = dict(HEAD_DIM=D, HEAD_DIM_PAD=tb.head_dim_pad(D), BLOCK_Q=bq, BLOCK_K=bk, CAUSAL=causal,
                      DOT_PRECISION=tb.dot_precision(dtype))
    ptr = "*" + {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    types = {n: ptr for n in ("Q", "K", "V", "O", "DO", "DK", "DV", "DQ")}
    types.update(LSE="*fp32", DELTA="*fp32", scale="fp32", qk_scale="fp32")
    return sm90_like_a_launch(fn, types, constexprs, num_warps=tb.NUM_WARPS, num_stages=tb.NUM_STAGES)

def spill_bytes(kernel):
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([triton.knobs.nvidia.ptxas.path, "-v", "--gpu-name=sm_90a", f"{tmp}/k.ptx", "-o",
                              f"{tmp}/k.o"], capture_output=True, text=True, check=True).stderr
    return int(re.search(r"(\\d+) bytes spill stores", log).group(1))

import re, subprocess, tempfile
out = []
# The kernels that hold the most per thread: at D = 128 in bf16 the forward's 64 x 64 tiles and the dK/dV
# program's k, v, dk and dv; in fp32 the dK/dV program at D = 64. (Compiling each kernel at each setting
# takes minutes of CPU; these three passed with the rest when the settings were chosen.)
for fn, dtype, D, backward in ((tb.textbook_forward_kernel, torch.bfloat16, 128, False),
                               (tb.textbook_dkdv_kernel, torch.bfloat16, 128, True),
                               (tb.textbook_dkdv_kernel, torch.float32, 64, True)):
    kernel = like_a_launch(fn, dtype, D, True, backward)
    out.append([str(dtype), D, fn.fn.__name__, kernel.metadata.shared, spill_bytes(kernel)])
print(json.dumps({"kernels": out}))
"""
register("textbook", SM90_BODY)


@pytest.mark.xdist_group("sm90")  # one worker runs every sm_90 compile test, one after the other (tests/_sm90.py)
def test_the_kernels_compile_for_sm90_at_their_settings_without_spills(tmp_path_factory):
    """The interpreter never compiles; this does (tests/_sm90.py), for the H200, at the tiles the launchers
    pick, causal (the larger kernels): shared memory within the 227 KiB an sm_90 block may have, and no
    register spills."""
    kernels = compiled("textbook", tmp_path_factory)["kernels"]
    assert len(kernels) == 3
    for dtype, D, name, shared, spilled in kernels:
        assert shared <= 227 * 1024, (dtype, D, name, shared)
        assert spilled == 0, (dtype, D, name, spilled)


# --- on the GPU ---------------------------------------------------------------------------------------------

# (B, H, Tq, Tk, D, causal, dtype): each dtype, both masks, ragged T, Tq != Tk both ways, D 64 and 128.
GPU_CASES = [
    (2, 4, 1037, 1037, 64, True, BF16),
    (2, 4, 1024, 1024, 128, False, BF16),
    (1, 4, 1500, 777, 128, True, BF16),
    (1, 4, 777, 1500, 128, True, F16),
    (2, 4, 1037, 1037, 64, False, F16),
    (1, 4, 1000, 1000, 64, True, F32),
    (1, 2, 777, 1500, 128, False, F32),
]


def sdpa_with_grads(q, k, v, do, causal):
    """torch's SDPA forward and backward in q's dtype on the same inputs (upper-left causal, its is_causal)."""
    q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, is_causal=causal)
    return o, torch.autograd.grad(o, (q_, k_, v_), do)


def max_error(a, ref):
    finite = torch.isfinite(ref)
    return (a.double()[finite] - ref[finite]).abs().max().item()


@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"B{c[0]}-H{c[1]}-Tq{c[2]}-Tk{c[3]}-D{c[4]}-"
                         f"{'causal' if c[5] else 'full'}-{str(c[6])[6:]}")  # fmt: skip
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_textbook_on_the_gpu_against_float64_and_sdpa(case):
    """16-bit: every output's largest error against the float64 formula (on the same rounded inputs) is at
    most twice SDPA's own, SDPA running in the same dtype (FlashAttention's test criterion, also the
    package's, tests/kernels/test_backward_gpu.py); lse, float32 in every dtype, within 1e-4 as on the CPU.
    fp32: the kernels multiply in exact fp32 ("ieee"); sums of up to 1,500 terms of order 1 keep about
    1e-5, so 5e-5 for o and lse (the package's GPU forward bound) and 2e-4 for the gradients, whose
    terms are products of two such sums."""
    B, H, Tq, Tk, D, causal, dtype = case
    q, k, v, do = make_inputs(B, H, Tq, Tk, D, dtype, seed=Tq + Tk + D, device="cuda")
    o, lse = textbook_forward(q, k, v, causal)
    grads = textbook_backward(q, k, v, o, lse, do, causal)
    o_ref, lse_ref, grads_ref = truth_with_grads(q, k, v, do, causal)
    assert_close_to_truth(lse, lse_ref, "lse", **(LSE_TOL[dtype] if dtype != F32 else dict(atol=5e-5, rtol=5e-5)))
    if dtype == F32:
        assert_close_to_truth(o, o_ref, "o", atol=5e-5, rtol=5e-5)
        for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
            assert_close_to_truth(g, g_ref, name, atol=2e-4, rtol=2e-4)
        return
    o_sdpa, grads_sdpa = sdpa_with_grads(q, k, v, do, causal)
    for name, x, x_sdpa, x_ref in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_sdpa, *grads_sdpa),
                                      (o_ref, *grads_ref)):  # fmt: skip
        assert x.dtype == dtype and torch.isfinite(x).all(), name
        err, err_sdpa = max_error(x, x_ref), max_error(x_sdpa, x_ref)
        assert err <= 2 * err_sdpa + 1e-6, f"{name}: error {err:.3g} > 2 x SDPA's {err_sdpa:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rows_that_see_no_key_on_the_gpu():
    """Lower-right, Tq = 1000 > Tk = 300, bf16: rows 0 .. 699 get o = 0, lse = -inf and dq = 0 exactly."""
    q, k, v, do = make_inputs(1, 4, 1000, 300, 64, BF16, seed=11, device="cuda")
    o, lse = textbook_forward(q, k, v, True, alignment="lower_right")
    dq, dk, dv = textbook_backward(q, k, v, o, lse, do, True, alignment="lower_right")
    assert torch.equal(o[:, :, :700], torch.zeros_like(o[:, :, :700])) and torch.isneginf(lse[:, :, :700]).all()
    assert torch.equal(dq[:, :, :700], torch.zeros_like(dq[:, :, :700]))
    _, lse_ref, grads_ref = truth_with_grads(q, k, v, do, True, None, "lower_right")
    assert_close_to_truth(lse, lse_ref, "lse", **LSE_TOL[BF16])
    for name, g, g_ref in zip(("dq", "dk", "dv"), (dq, dk, dv), grads_ref):
        assert_close_to_truth(g, g_ref, name, atol=5e-2, rtol=5e-2)  # bf16 keeps 8 bits: 2**-8 = 4e-3 per term

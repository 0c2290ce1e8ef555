"""The FP8 forward kernel (flashtile.kernels.fp8_forward) against the float64 emulation of its own rounding.

On the GPU: realistic shapes, FlashAttention-3's outlier inputs, every granularity, and the bar of
issue 34: the kernel's RMSE against float64 attention of the original inputs is within 2x of the
emulation's, and the kernel sits much closer to the emulation than either does to the truth.

On the CPU (Triton's interpreter): the interpreter's float32 -> E4M3 cast is wrong where rounding
carries into the next binade (124.9 becomes 64, not 128) and in the subnormals, so the CPU tests use
inputs on which nothing needs rounding: integer codes, power-of-two factors and τ = ln 2, so that every
score is an integer in log2 units, every p a power of two and every 448 r p a normal E4M3 value. There
the kernel must equal the emulation to float32 accumulation; masks, GQA, strides, the factors and the
online update are all exercised. A test pins the cast bug itself: it fails the day the interpreter is
fixed, and then these cases can take random inputs.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flashtile.fp8 import quantize
from flashtile.kernels.fp8_forward import fp8_config, fp8_forward, keys_contiguous, one_per_head
from flashtile.reference.fp8 import fp8_attention_forward, fp8_block_k
from tests._grids import LONG
from tests._sm90 import compile_in_fresh_process
from tests._truth import attention_truth

ON_GPU = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")]
cpu_only = pytest.mark.skipif(ON_GPU, reason="the interpreter cases; the GPU has its own")


def exact_case(B, H, H_kv, Tq, Tk, seed):
    """E4M3 codes in {-1, 0, 1} (q: at most 3 nonzero per row, D = 6), descale_q in {1, 2}, descale_k = 1,
    descale_v in {1/2, 1}: with τ = ln 2 every score is an integer of at most 6 in log2 units, so
    448 r p >= 448 * 2^-13 is a normal E4M3 value and no cast rounds."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-1, 2, (B, H, Tq, 6), generator=gen).float()
    q[..., 3:] = 0  # |q . k| <= 3
    k, v = (torch.randint(-1, 2, (B, H_kv, Tk, 6), generator=gen).float() for _ in range(2))
    descale_q = torch.randint(1, 3, (B, H, Tq), generator=gen).float()
    descale_k = torch.ones(B, H_kv, Tk)
    descale_v = torch.randint(1, 3, (B, H_kv, Tk), generator=gen).float() / 2
    return [x.to(torch.float8_e4m3fn) for x in (q, k, v)] + [descale_q, descale_k, descale_v]


CPU_CASES = [  # (B, H, H_kv, Tq, Tk, causal, alignment)
    (1, 2, 2, 70, 70, False, "upper_left"),
    (2, 4, 2, 37, 100, True, "lower_right"),  # GQA, ragged key tiles
    (1, 3, 1, 100, 45, True, "lower_right"),  # MQA, the first 55 rows see no key
    (1, 2, 1, 65, 65, True, "upper_left"),
]


@cpu_only
@pytest.mark.parametrize("B, H, H_kv, Tq, Tk, causal, alignment", CPU_CASES)
def test_kernel_equals_the_emulation_where_nothing_rounds(B, H, H_kv, Tq, Tk, causal, alignment):
    args = exact_case(B, H, H_kv, Tq, Tk, seed=Tq + Tk)
    o, lse = fp8_forward(*args, causal, math.log(2), alignment=alignment, out_dtype=torch.float32, block_k=32)
    o_e, lse_e = fp8_attention_forward(*args, causal, math.log(2), 32, alignment)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_e))
    torch.testing.assert_close(lse.double(), lse_e, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(o.double(), o_e, rtol=1e-5, atol=1e-6)
    assert o_e.abs().max() > 0.1  # not a vacuous comparison of zeros


@cpu_only
@pytest.mark.parametrize("scale", [-math.log(2), 0.0, 1e-300])
def test_kernel_equals_the_emulation_for_negative_and_vanishing_scales(scale):
    """τ's sign is folded into q's codes (so that the row max of s is dq times that of the raw dot scaled by
    dk): a negative τ, τ = 0 and a τ below float32's range give the emulation's answer."""
    args = exact_case(1, 2, 1, 50, 70, seed=4)
    o, lse = fp8_forward(*args, True, scale, alignment="lower_right", out_dtype=torch.float32, block_k=32)
    o_e, lse_e = fp8_attention_forward(*args, True, scale, 32, "lower_right")
    torch.testing.assert_close(lse.double(), lse_e, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(o.double(), o_e, rtol=1e-5, atol=1e-6)


def per_head(B, H, T, values, gen):
    """(B, H, T) factors one per (batch, head), drawn from ``values``, laid out as ``quantize`` lays out per-head
    factors: a (B, H, 1) tensor expanded, stride 0 along T."""
    pick = torch.randint(0, len(values), (B, H, 1), generator=gen)
    pick[0, 0] = 0  # the first head takes the first value
    return torch.tensor(values)[pick].expand(B, H, T)


def exact_case_per_head(B, H, H_kv, Tq, Tk, seed, k_per_head, v_per_head):
    """``exact_case`` with k's and/or V's factors one per (batch, head), stride 0 along T. k's head factor is
    1 or 2 and q's row factors are 1 or 2 divided by it, so every score is still an integer of at most 6 in
    log2 units; V's head factor is 1/2 or 1 (every ratio exactly 1). Nothing rounds."""
    q8, k8, v8, dq, dk, dv = exact_case(B, H, H_kv, Tq, Tk, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if k_per_head:
        dk = per_head(B, H_kv, Tk, [2.0, 1.0], gen)
        dq = dq / dk[:, :, :1].repeat_interleave(H // H_kv, 1)  # dq dk in {1, 2}, powers of two: exact
    if v_per_head:
        dv = per_head(B, H_kv, Tk, [0.5, 1.0], gen)
    return [q8, k8, v8, dq, dk, dv]


STEPS = [(True, False), (False, True), (True, True)]  # (k's factors one per head, V's): the kernel's other steps


@cpu_only
@pytest.mark.parametrize("k_per_head, v_per_head", STEPS)
@pytest.mark.parametrize("B, H, H_kv, Tq, Tk, causal, alignment", CPU_CASES[1:3])
def test_each_step_of_the_kernel_equals_the_emulation_where_nothing_rounds(B, H, H_kv, Tq, Tk, causal, alignment,
                                                                          k_per_head, v_per_head):  # fmt: skip
    """Factors one per head (the layout ``quantize`` gives per tensor and per head) take the kernel's cheaper
    steps: k's factor folded into q's row factor (no multiply of the scores), no ratio on P. Each gives the
    emulation's answer, at the kernel's own key tile (``block_k=None``: 128 at this head dim) and at 32."""
    args = exact_case_per_head(B, H, H_kv, Tq, 3 * Tk, Tq + Tk, k_per_head, v_per_head)
    assert one_per_head(args[4]) == k_per_head and one_per_head(args[5]) == v_per_head
    for block_k in (None, 32):
        o, lse = fp8_forward(*args, causal, math.log(2), alignment=alignment, out_dtype=torch.float32, block_k=block_k)
        o_e, lse_e = fp8_attention_forward(*args, causal, math.log(2), block_k, alignment)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_e))
        torch.testing.assert_close(lse.double(), lse_e, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(o.double(), o_e, rtol=1e-5, atol=1e-6)
        assert o_e.abs().max() > 0.1


@cpu_only
def test_the_key_tile_follows_the_head_dim_in_kernel_and_emulation():
    """P is rounded against the running max of each key tile, so kernel and emulation take the same tile by
    default: 128 keys to D = 128, 64 above (``fp8_block_k``; the kernel's ``fp8_config`` says the same)."""
    assert [fp8_block_k(D) for D in (6, 64, 96, 128, 129, 256)] == [128, 128, 128, 128, 64, 64]
    assert all(fp8_config(D)["block_k"] == fp8_block_k(D) for D in (16, 64, 128, 256))
    args = exact_case(1, 2, 2, 40, 300, seed=11)
    o, _ = fp8_forward(*args, True, math.log(2), alignment="lower_right", out_dtype=torch.float32)
    o_128, _ = fp8_attention_forward(*args, True, math.log(2), 128, "lower_right")
    o_default, _ = fp8_attention_forward(*args, True, math.log(2), None, "lower_right")
    assert torch.equal(o_default, o_128)
    torch.testing.assert_close(o.double(), o_128, rtol=1e-5, atol=1e-6)


@cpu_only
def test_no_ratio_on_p_is_bit_identical_to_ratios_of_one():
    """V's factors one per head skip the ratios (every one is exactly 1): the same bits as the general step
    given the same factors laid out one per row, on random inputs (where P does round)."""
    gen = torch.Generator().manual_seed(12)
    (q8, dq), (k8, dk), (v8, dv) = (quantize(torch.randn(1, 2, 150, 32, generator=gen), g)
                                    for g in ("block", "block", "head"))  # fmt: skip
    assert one_per_head(dv) and not one_per_head(dk)
    skipped = fp8_forward(q8, k8, v8, dq, dk, dv, True, out_dtype=torch.float32)
    multiplied = fp8_forward(q8, k8, v8, dq, dk, dv.contiguous(), True, out_dtype=torch.float32)
    assert torch.equal(skipped[0], multiplied[0]) and torch.equal(skipped[1], multiplied[1])


@cpu_only
def test_kernel_reads_views_through_their_strides():
    q8, k8, v8, dq, dk, dv = exact_case(1, 2, 2, 40, 40, seed=1)
    expected = fp8_forward(q8, k8, v8, dq, dk, dv, True, math.log(2), out_dtype=torch.float32, block_k=32)
    q_view = q8.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, T, D) view of a (B, T, H, D) tensor
    got = fp8_forward(q_view, k8, v8, torch._neg_view(-dq), dk, dv, True, math.log(2), out_dtype=torch.float32,
                      block_k=32)  # fmt: skip
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@cpu_only
def test_the_interpreters_e4m3_cast_is_still_wrong_where_rounding_carries():
    """If this fails, the interpreter's cast was fixed: compare kernel and emulation on random inputs too."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(X, Y, N: tl.constexpr):
        offsets = tl.arange(0, N)
        tl.store(Y + offsets, tl.load(X + offsets).to(tl.float8e4nv))

    x = torch.tensor([124.9, 1.0, 448.0, 3.0, 0.3125, 104.0, 2.0**-9, 0.5, 7.0, 13.0, 20.0, 60.0, 1.5, 2.5, 5.0, 6.0])
    y = torch.empty(16, dtype=torch.float8_e4m3fn)
    cast[(1,)](x, y, 16)
    assert y.float()[0].item() == 64.0 != x[:1].to(torch.float8_e4m3fn).float().item()  # the carry is lost
    assert torch.equal(y.float()[1:], x[1:])  # exact values survive: what the CPU cases rely on


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(block_k=48), ValueError, "block_k must be a power of two of at least 32"),
    (dict(block_k=16), ValueError, "block_k must be a power of two of at least 32"),
    (dict(out_dtype=torch.float64), TypeError, "out_dtype must be one of"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
])  # fmt: skip
def test_bad_options_are_refused_by_name(kwargs, error, message):
    args = exact_case(1, 2, 2, 8, 8, seed=2)
    with pytest.raises(error, match=message):
        fp8_forward(*args, **{"out_dtype": torch.float32, **kwargs})


def test_float_inputs_are_refused_with_the_way_to_quantise():
    q8, k8, v8, dq, dk, dv = exact_case(1, 2, 2, 8, 8, seed=3)
    with pytest.raises(TypeError, match="flashtile.fp8.quantize"):
        fp8_forward(q8.float(), k8, v8, dq, dk, dv, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="descale_v must hold positive finite factors"):
        fp8_forward(q8, k8, v8, dq, dk, dv * 0, out_dtype=torch.float32)


SM90_BODY = """
import re, subprocess, tempfile, triton
from triton.compiler import ASTSource
from flashtile.kernels import fp8_forward as f8
fn = f8.fp8_forward_kernel
names = list(inspect.signature(fn.fn).parameters)
E4M3_TILE = r"tensor<\\d+x\\d+x!tt\\.ptr<f8E4M3FN>"  # a 2-D tile of E4M3 pointers
out = []
for D, causal, v_unit_stride, per_head in ((128, True, "stride_vt", True), (128, True, "stride_vt", False),
                                           (64, False, "stride_vt", True), (64, False, "stride_vt", False),
                                           (256, True, "stride_vt", True), (256, True, "stride_vt", False),
                                           (128, False, "stride_vd", False)):
    # a launch's specialisation: unit strides (V's along the keys, as keys_contiguous lays it out, or, the
    # control, along D as a row-major V has it), 16-divisible pointers, other strides and lengths; factors
    # one per head (stride 0 along T: no factor on the scores, no ratio on P) or one per row
    config = f8.fp8_config(D)
    constexprs = dict(HEAD_DIM=D, HEAD_DIM_PAD=D, BLOCK_Q=config["block_q"], BLOCK_K=config["block_k"],
                      CAUSAL=causal, SIGN=1, HEAVIEST_FIRST=causal, INTERPRETED=False, K_ROWS=not per_head,
                      V_RATIOS=not per_head, stride_qd=1, stride_kd=1, stride_od=1, stride_dqt=0 if per_head else 1,
                      **{v_unit_stride: 1})
    types = {n: "*fp8e4nv" for n in ("Q", "K", "V")}
    types.update(DQ="*fp32", DK="*fp32", VR="*fp32", VS="*fp32", O="*bf16", LSE="*fp32", qk_scale="fp32")
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    aligned = [n for n in names if n not in constexprs
               and (types.get(n, "").startswith("*") or n.startswith("stride_") or n in ("Tq", "Tk"))]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=config["num_warps"], num_stages=config["num_stages"]))
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(ptx)
        log = subprocess.run([triton.knobs.nvidia.ptxas.path, "-v", "--gpu-name=sm_90a", f"{tmp}/k.ptx", "-o",
                              f"{tmp}/k.o"], capture_output=True, text=True, check=True).stderr
    spills = int(re.search(r"(\\d+) bytes spill stores", log).group(1))
    out.append(dict(D=D, v_unit_stride=v_unit_stride, per_head=per_head, block_k=config["block_k"],
                    shared=kernel.metadata.shared, spills=spills, serialized="C7514" in log,
                    registers=int(re.search(r"Used (\\d+) registers", log).group(1)),
                    imprecise=sorted({int(n) for n in re.findall(r"warp_group_dot [^\\n]*maxNumImpreciseAcc = (\\d+)",
                                                                  ttgir)}),
                    mma=sorted(set(re.findall(r"wgmma\\.mma_async[.a-z0-9]*", ptx))),
                    casts=len(re.findall(r"cvt\\.rn\\.satfinite\\.e4m3x2\\.f32", ptx)),
                    fp32_multiplies=len(re.findall(r"\\bmul\\.f32", ptx)),
                    tile_loads=len(re.findall(r"tt\\.load [^\\n]*" + E4M3_TILE, ttgir)),
                    tile_copies=len(re.findall(r"async_copy_global_to_local [^\\n]*" + E4M3_TILE, ttgir))))
print(json.dumps({"kernels": out}))
"""


@pytest.mark.skipif(not LONG, reason="compiling for sm_90 takes about a minute of CPU: make test-long runs it")
def test_both_dots_compile_to_e4m3_tensor_core_instructions_for_sm90():
    """Compiled for the H200 without a GPU (tests/_sm90.py): QKᵀ and PV are E4M3 x E4M3 warpgroup MMAs with
    float32 accumulators, P's cast rounds to nearest and saturates, no register spills, within the 255
    registers a thread may hold and the shared memory of an SM (two programs of 4 warps an SM to D = 128:
    at most half of it each). With V's keys contiguous (what keys_contiguous gives the kernel) the only
    E4M3 tile loaded through registers is q's: the k and v tiles are copied to shared memory ahead. The
    control: a row-major V is loaded into registers in every key step (the first version, which ran at a
    quarter of the bf16 forward's speed). Factors one per head compile to fewer float32 multiplies than
    factors one per row (no factor on the scores, no ratio on P).

    The PV dot is the shipped form: acc passed in, its product added in float32 every BLOCK_K keys
    (``max_num_imprecise_acc``), and ptxas serialises the kernel's wgmmas for it (C7514). A measured trade,
    not a bug: the same sums written outside the dot compile without C7514 (the control below) and ran 9-16 %
    slower on the H200 (sweeps/fp8-forward-steps-pv-outside-dot.json). If C7514 goes away, time both forms
    again (bench/probes/fp8/fp8_forward_steps.py, step_off pv_acc_in_dot) before changing the kernel."""
    kernels = compile_in_fresh_process(SM90_BODY)["kernels"]
    for kernel in kernels:
        assert kernel["mma"] and all(m.endswith(".f32.e4m3.e4m3") for m in kernel["mma"]), kernel
        assert kernel["casts"] > 0 and kernel["spills"] == 0 and kernel["registers"] <= 255, kernel
        shared_limit = 227 * 1024 // (2 if kernel["D"] <= 128 else 1)
        assert kernel["shared"] <= shared_limit, kernel
        assert kernel["block_k"] == (128 if kernel["D"] <= 128 else 64), kernel
        assert kernel["block_k"] in kernel["imprecise"], kernel  # the PV dot: acc in, a float32 add a key tile
        assert kernel["serialized"], kernel  # ptxas's C7514 for that form: the trade measured and taken
    for head, rows in zip(kernels[0:6:2], kernels[1:6:2]):
        assert head["fp32_multiplies"] < rows["fp32_multiplies"], (head, rows)
    keys, *_, rows = kernels
    assert keys["tile_loads"] == 1 and keys["tile_copies"] >= 4, keys  # q; k and v, before and in the loop
    assert rows["tile_loads"] > 1, rows


PV_FORMS_BODY = """
import subprocess, tempfile, triton
from tests.kernels._fp8_pv_forms import pv_forms
out = {}
for pass_acc in (True, False):
    kernel = sm90_like_a_launch(pv_forms, dict(Q="*fp8e4nv", K="*fp8e4nv", V="*fp8e4nv", O="*fp32"),
                                dict(PASS_ACC=pass_acc), num_warps=8, num_stages=3)
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([triton.knobs.nvidia.ptxas.path, "-v", "--gpu-name=sm_90a", f"{tmp}/k.ptx", "-o",
                              f"{tmp}/k.o"], capture_output=True, text=True, check=True).stderr
    out["passed_in" if pass_acc else "outside"] = "C7514" in log
print(json.dumps(out))
"""


@pytest.mark.skipif(not LONG, reason="compiling for sm_90 takes about a minute of CPU: make test-long runs it")
def test_acc_passed_into_the_pv_dot_serialises_every_wgmma_for_sm90():
    """The control for the kernel's C7514 above: it comes from the PV form. The same sums with acc passed into
    the E4M3 dot (``max_num_imprecise_acc``, the package's form) make ptxas serialise every wgmma; added to acc
    outside the dot, they do not. Yet the form without C7514 measured 9-16 % slower in the whole kernel
    (sweeps/fp8-forward-steps-pv-outside-dot.json against sweeps/fp8-forward-steps.json), so the package
    keeps acc in the dot: the note is ptxas's warning, not the measured cost."""
    here = str(Path(__file__).resolve().parents[2])  # the repository: the fresh process imports tests.kernels
    serialized = compile_in_fresh_process(f"import sys; sys.path.insert(0, {here!r})\n" + PV_FORMS_BODY)
    assert serialized == {"passed_in": True, "outside": False}


def test_v_is_given_to_the_kernel_with_its_keys_contiguous():
    v = torch.randn(2, 3, 40, 16).to(torch.float8_e4m3fn)  # row-major: stride 1 along D
    laid_out = keys_contiguous(v)
    assert laid_out.stride(2) == 1 and torch.equal(laid_out.view(torch.uint8), v.view(torch.uint8))
    assert keys_contiguous(laid_out) is laid_out  # no second copy
    one_key = v[:, :, :1]
    assert keys_contiguous(one_key) is one_key


# ---- on the GPU -------------------------------------------------------------------------------------------

GPU_CASES = {  # name: (B, H, H_kv, Tq, Tk, D, causal, alignment)
    "full-2k-d128": (1, 4, 4, 2048, 2048, 128, False, "upper_left"),
    "causal-2k-d64": (2, 4, 4, 2048, 2048, 64, True, "upper_left"),
    "gqa-lower-right": (1, 8, 2, 700, 1500, 128, True, "lower_right"),
    "ragged-d256": (1, 2, 2, 1037, 1037, 256, True, "upper_left"),
    "tall-lower-right-d96": (1, 2, 1, 300, 200, 96, True, "lower_right"),
    "full-1k-d64": (2, 4, 2, 1000, 1000, 64, False, "upper_left"),
    "full-1k-d256": (1, 4, 4, 1000, 1000, 256, False, "upper_left"),
}
# (q's and k's granularity, V's): each of the kernel's steps (k or V one per head, or per row) at each granularity
GRANULARITY_PAIRS = [("tensor", "tensor"), ("head", "head"), ("block", "head"), ("head", "block"),
                     ("block", "block")]


def outlier_inputs(B, H, T, D, gen):
    x = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)
    pick = torch.rand(B, H, T, D, generator=gen, dtype=torch.float64) < 1e-3
    return torch.where(pick, 10 * torch.randn(B, H, T, D, generator=gen, dtype=torch.float64), x)


def on_gpu(x):
    """x on the GPU in its layout: factors one per head keep their stride 0 along T (``.cuda()`` would lay
    them out one per row, and the kernel would take its general step)."""
    if x.dim() == 3 and x.stride(-1) == 0:
        return x[..., :1].cuda().expand(x.shape)
    return x.cuda()


def rmse(a, b):
    return (a.double().cpu() - b.double().cpu()).pow(2).mean().sqrt().item()


# ---- what the kernel may differ from the emulation by ------------------------------------------------------
#
# The kernel computes every step of the emulation in float32, and rounds q, k, v and P where the emulation
# does; float32 alone would put the two 1e-6 apart. What is left is the sm_90 E4M3 dot: it sums its products
# in the tensor core's own accumulator, which keeps about 13 to 14 significant bits, not float32's 24 (the
# raw q8 . k8 over the head dim, and each tile's P8 V8 over its block_k keys; acc then adds the tile in float32).
# An error δs in a score moves 448 r p by 448 r p δs; the E4M3 code of P changes only where that crosses a
# rounding midpoint, and then by one step of E4M3 (2^-4 to 2^-3 of it). So o moves by whole E4M3 steps of P
# on the few entries near a midpoint, a perturbation whose size depends on the inputs: per tensor with an
# outlier channel (no rotation at D = 96), the raw dot runs up to 448^2 per product and its rounding reaches
# 1e-2 in s, against 1e-4 with the rotation. The bar is therefore not a fixed fraction of the error: it is
# computed by running the emulation's steps with both dots summed in a 13-bit accumulator (each add rounded
# to 13 significant bits, in order: a coarser accumulator than the hardware's), and the kernel must stay
# within 1.5 times that model's distance from the emulation. A kernel that forgets to round P, masks one key
# too many or drops a rescale lands 3 to 100 times further (bench/PERF_LOG.md, "The FP8 forward's second
# run"); summing the rounded P into l shows in lse, which the exact-score test holds to float32.
MODEL_BITS = 13


def rounded_to(x, bits):
    """x rounded to ``bits`` significant bits, ties to even (0 stays 0)."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(torch.ldexp(mantissa, torch.full_like(exponent, bits))), exponent - bits)


def short_accumulator_model(q8, k8, v8, dq, dk, dv, causal, alignment, bits, block_k=64):
    """o (float64) of the FP8 forward computed exactly but for the roundings the kernel does, with both dots
    summed one product at a time in an accumulator of ``bits`` significant bits (None: exactly). Written from
    the definition (the emulation's module is what it checks), on the inputs' device."""
    B, H, Tq, D = q8.shape
    group, Tk = H // k8.shape[1], k8.shape[2]
    q, k, v = q8.double(), k8.double().repeat_interleave(group, 1), v8.double().repeat_interleave(group, 1)
    dq, dk, dv = dq.double(), dk.double().repeat_interleave(group, 1), dv.double().repeat_interleave(group, 1)
    v_scale = dv.amax(-1, keepdim=True)  # (B, H, 1)
    offset = 0 if alignment == "upper_left" else Tk - Tq
    i = torch.arange(Tq, device=q.device)[:, None]
    m = torch.full((B, H, Tq), float("-inf"), dtype=torch.float64, device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(B, H, Tq, D, dtype=torch.float64, device=q.device)
    for k_start in range(0, Tk, block_k):
        keys = slice(k_start, min(k_start + block_k, Tk))
        raw = torch.zeros(B, H, Tq, keys.stop - k_start, dtype=torch.float64, device=q.device)
        for d in range(D):  # the raw dot, one product at a time
            raw = raw + q[..., d, None] * k[..., None, keys, d]
            raw = raw if bits is None else rounded_to(raw, bits)
        s = D**-0.5 * raw * dq[..., None] * dk[..., None, keys]
        if causal:
            s = s.masked_fill(torch.arange(k_start, keys.stop, device=q.device)[None, :] > i + offset, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
        alpha, p = torch.exp(m - m_safe), torch.exp(s - m_safe[..., None])
        l = alpha * l + p.sum(-1)
        p8 = (p * (dv / v_scale)[..., None, keys] * 448).clamp(max=448).to(torch.float8_e4m3fn).double()
        pv = torch.zeros_like(acc)
        for j in range(keys.stop - k_start):  # the tile's P8 V8, one key at a time
            pv = pv + p8[..., j, None] * v[..., k_start + j, None, :]
            pv = pv if bits is None else rounded_to(pv, bits)
        acc = alpha[..., None] * acc + pv
        m = m_new
    empty = (l == 0)[..., None]
    return torch.where(empty, 0.0, acc * (v_scale / 448)[..., None] / torch.where(empty, 1.0, l[..., None]))


def test_the_model_without_short_accumulators_is_the_emulation():
    """The bar's model, with exact sums, computes what the emulation does (so the bar measures only the
    accumulator): on outlier inputs, per block, GQA, causal lower-right."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = outlier_inputs(1, 4, 50, 32, gen), outlier_inputs(1, 2, 90, 32, gen), outlier_inputs(1, 2, 90, 32, gen)
    (q8, dq), (k8, dk), (v8, dv) = (quantize(x, "block", block=16) for x in (q, k, v))
    o_e, _ = fp8_attention_forward(q8, k8, v8, dq, dk, dv, True, None, 64, "lower_right")
    o_model = short_accumulator_model(q8, k8, v8, dq, dk, dv, True, "lower_right", None)
    torch.testing.assert_close(o_model, o_e, rtol=1e-12, atol=1e-12)
    o_short = short_accumulator_model(q8, k8, v8, dq, dk, dv, True, "lower_right", MODEL_BITS)
    assert 0 < rmse(o_short, o_e) < 0.5 * rmse(o_e, attention_truth(q, k, v, True, None, "lower_right")[0])


@pytest.mark.parametrize("granularity, v_granularity", GRANULARITY_PAIRS)
@pytest.mark.parametrize("name", list(GPU_CASES))
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_kernel_tracks_the_emulation_on_outlier_inputs(name, granularity, v_granularity):
    B, H, H_kv, Tq, Tk, D, causal, alignment = GPU_CASES[name]
    gen = torch.Generator().manual_seed(len(name) + D)
    q, k, v = outlier_inputs(B, H, Tq, D, gen), outlier_inputs(B, H_kv, Tk, D, gen), outlier_inputs(B, H_kv, Tk, D, gen)
    rotate = D & (D - 1) == 0
    (q8, dq), (k8, dk) = (quantize(x, granularity, rotate=rotate) for x in (q, k))
    v8, dv = quantize(v, v_granularity)
    block_k = fp8_block_k(D)  # the kernel's key tile, and the emulation's default
    o_e, lse_e = fp8_attention_forward(q8, k8, v8, dq, dk, dv, causal, None, None, alignment)
    o_truth, lse_truth = attention_truth(q, k, v, causal, None, alignment)
    inputs = [on_gpu(x) for x in (q8, k8, v8, dq, dk, dv)]
    assert one_per_head(inputs[4]) == (granularity != "block") and one_per_head(inputs[5]) == (v_granularity != "block")
    model_distance = rmse(short_accumulator_model(*inputs, causal, alignment, MODEL_BITS, block_k), o_e)
    for out_dtype in (torch.float32, torch.bfloat16):
        o, lse = fp8_forward(*inputs, causal, alignment=alignment, out_dtype=out_dtype)
        assert o.dtype == out_dtype and torch.isfinite(o).all()
        seen = torch.isfinite(lse_e)
        assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(lse_e))
        # the short accumulator of the raw dot moves lse too: held against the error the rounding of q and k
        # already gives it
        lse_k, lse_emulated, lse_true = lse.cpu().double()[seen], lse_e[seen], lse_truth[seen]
        lse_error = (lse_emulated - lse_true).abs()
        assert (lse_k - lse_emulated).abs().max() < 0.25 * lse_error.max()
        assert rmse(lse_k, lse_emulated) < 0.25 * rmse(lse_emulated, lse_true)
        error_kernel, error_emulation = rmse(o, o_truth), rmse(o_e, o_truth)
        assert error_kernel <= 2 * error_emulation  # the targets' bar
        # bf16 output adds its own rounding of o, at most 2^-9 of each value: its RMSE on top
        rounding = rmse(o_e.to(out_dtype), o_e)
        assert rmse(o, o_e) < 1.5 * model_distance + 2 * rounding, (rmse(o, o_e), model_distance, rounding)


def exact_score_case(B, H, Tq, Tk, D, seed, per_head=False):
    """Codes of q and k in {-3, ..., 3}, so that every raw dot and each of its partial sums is an integer
    below 9 D <= 2^11, which a 13-bit accumulator holds exactly: the scores are the emulation's to float32.
    The factors are random (positive) and V is quantised per block of rows, so P does round, with r != 1;
    ``per_head``: k's factors one per head and V quantised per head (the kernel's other step: k's factor in
    q's row factor, no ratio on P)."""
    gen = torch.Generator().manual_seed(seed)
    q8, k8 = (torch.randint(-3, 4, (B, H, T, D), generator=gen).float().to(torch.float8_e4m3fn) for T in (Tq, Tk))
    dq = 0.3 + 0.3 * torch.rand(B, H, Tq, generator=gen)
    dk = 0.3 + 0.3 * torch.rand(B, H, 1 if per_head else Tk, generator=gen)
    v8, dv = quantize(torch.randn(B, H, Tk, D, generator=gen, dtype=torch.float64), "head" if per_head else "block",
                      keys_contiguous=True)  # fmt: skip
    return [q8, k8, v8, dq, dk.expand(B, H, Tk), dv]


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_kernel_equals_the_emulation_where_scores_are_exact(causal, per_head):
    """With exact raw dots the kernel's lse is the emulation's to float32 (a wrong l, say one that sums the
    rounded P, moves it by 1e-3), and its o is off by no more than the PV accumulator allows; with k's
    factor folded into q's row factor too (one rounding of a float32 product apart from the emulation's
    order, 2^-24 of s)."""
    inputs = [on_gpu(x) for x in exact_score_case(2, 4, 1000, 1000, 128, seed=7, per_head=per_head)]
    assert one_per_head(inputs[4]) == one_per_head(inputs[5]) == per_head
    o_e, lse_e = fp8_attention_forward(*inputs, causal)
    o, lse = fp8_forward(*inputs, causal, out_dtype=torch.float32)
    torch.testing.assert_close(lse.double(), lse_e, rtol=0, atol=2e-5)
    # here o's distance is the PV sums' alone; their rounding direction is not known (toward zero would bias
    # them), so the model keeps one bit fewer: P not rounded still lands about 40x past the bar, a key too many 600x
    model_distance = rmse(short_accumulator_model(*inputs, causal, "upper_left", MODEL_BITS - 1, fp8_block_k(128)), o_e)
    assert rmse(o, o_e) < 1.5 * model_distance + 1e-6, (rmse(o, o_e), model_distance)
    assert o_e.abs().max() > 0.1


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_no_ratio_on_p_is_bit_identical_to_ratios_of_one_on_the_gpu(D):
    """The compiled step without V's ratios gives the bits of the general step given ratios of exactly 1."""
    gen = torch.Generator(device="cuda").manual_seed(D)
    (q8, dq), (k8, dk) = (quantize(torch.randn(2, 4, 700, D, generator=gen, device="cuda"), "block") for _ in range(2))
    v8, dv = quantize(torch.randn(2, 4, 700, D, generator=gen, device="cuda"), "head", keys_contiguous=True)
    for causal in (False, True):
        skipped = fp8_forward(q8, k8, v8, dq, dk, dv, causal)
        multiplied = fp8_forward(q8, k8, v8, dq, dk, dv.contiguous(), causal)
        assert torch.equal(skipped[0], multiplied[0]) and torch.equal(skipped[1], multiplied[1])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_a_call_with_quantized_factors_does_not_wait_for_the_gpu():
    """Factors that quantize made are not read on the host again: the whole call, checks included, runs
    with no synchronisation (PyTorch raises on one under sync debug mode "error"); a fresh user tensor of
    factors is read once, by its first call."""
    q8, k8, v8, dq, dk, dv = (x.cuda() for x in exact_score_case(1, 2, 256, 256, 64, seed=8))
    (q8, dq), (k8, dk) = (quantize(x.double() * f[..., None].double(), "head") for x, f in ((q8, dq), (k8, dk)))
    v8, dv = quantize(v8.double() * dv[..., None].double(), "block", keys_contiguous=True)
    fp8_forward(q8, k8, v8, dq, dk, dv, True)  # the first launch compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o, _ = fp8_forward(q8, k8, v8, dq, dk, dv, True)
        fresh = dq.clone()  # a copy: not vouched for, so this call reads it
        with pytest.raises(RuntimeError, match="synchroniz"):
            fp8_forward(q8, k8, v8, fresh, dk, dv, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(o).all()

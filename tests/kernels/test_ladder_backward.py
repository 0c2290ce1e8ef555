"""The backward ladder's rungs (``flashtile.kernels.ladder.backward_<n>_<idea>``) against the float64 formula.

Each rung is the rung before it with one idea changed, and each is tested as the textbook backward is
(tests/kernels/test_textbook.py): in Triton's interpreter on the CPU, fp16 and fp32 (the interpreter computes
bf16 wrongly), every rung's dq, dk and dv against autograd through the float64 formula (tests/_truth.py),
causal or not, both alignments, ragged lengths, Tq != Tk both ways, padded head dims; then what each idea
could break: the TMA path (taken from 1k tokens where the layout allows; the interpreter emulates the
descriptors) and the heaviest-first launch order give the pointer path's bits; a row that sees no key gets
exactly zero. Last, every rung's kernels compile for sm_90 at the settings the rung picks, without spills.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from flashtile.kernels._host import use_tma
from flashtile.kernels.ladder import entry_point, rungs
from flashtile.kernels.textbook import textbook_forward
from tests._grids import covering
from tests._sm90 import compiled, register
from tests._truth import assert_close_to_truth, truth_with_grads

from ._helpers import DEVICE, randn

F32, F16 = torch.float32, torch.float16
# as the textbook's: fp32 multiplies in exact fp32; fp16 rounds P and dS to fp16 before three matmuls
GRAD_TOL = {F32: dict(atol=1e-4, rtol=1e-4), F16: dict(atol=1e-2, rtol=1e-2)}
MASKS = {"full": (False, "upper_left"), "causal": (True, "upper_left"), "causal_lr": (True, "lower_right")}
RUNGS = {rung.name: rung for rung in rungs("backward")[1:]}  # rung 0, the textbook, has its own tests


def make_inputs(B, H, Tq, Tk, D, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q, do = (randn(B, H, Tq, D, dtype=dtype, generator=gen) for _ in range(2))
    k, v = (randn(B, H, Tk, D, dtype=dtype, generator=gen) for _ in range(2))
    return q, k, v, do


def run_rung(rung, q, k, v, do, causal, scale=None, alignment="upper_left"):
    """The rung's (dq, dk, dv) on the textbook forward's o and lse."""
    o, lse = textbook_forward(q, k, v, causal, scale, alignment=alignment)
    return entry_point(rung, "backward")(q, k, v, o, lse, do, causal, scale, alignment=alignment)


def check_against_truth(rung, q, k, v, do, causal, scale=None, alignment="upper_left"):
    grads = run_rung(rung, q, k, v, do, causal, scale, alignment)
    _, _, grads_ref = truth_with_grads(q, k, v, do, causal, scale, alignment)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert g.dtype == q.dtype and g.shape == g_ref.shape and g.is_contiguous(), name
        assert_close_to_truth(g, g_ref, name, **GRAD_TOL[q.dtype])
    return grads


def test_the_rungs_are_numbered_and_each_states_one_idea():
    """Rungs 1, 2, ... (the registry raises on a gap), each with a one-sentence IDEA, a docstring, a
    ``backward`` with the textbook's signature, and listing lines of at most 88 columns."""
    assert [rung.index for rung in RUNGS.values()] == list(range(1, len(RUNGS) + 1)) and len(RUNGS) >= 3
    textbook = inspect.signature(entry_point(rungs("backward")[0], "backward"))
    for rung in RUNGS.values():
        module = rung.load()
        assert module.__doc__ and module.IDEA.endswith(".") and module.IDEA.count(". ") == 0, rung.name
        assert inspect.signature(module.backward) == textbook, rung.name
        lines = Path(module.__file__).read_text().splitlines()
        listing = lines[lines.index("# --8<-- [start:rung]") + 1 : lines.index("# --8<-- [end:rung]")]
        assert listing and max(len(line) for line in listing) <= 88, rung.name


# Every pair of (rung, mask, lengths, head dim, dtype, scale) at least once (tests/_grids.py): T = 1, 37 (one
# ragged tile) and 130 (a ragged last tile at every tile size), Tq != Tk both ways, D padded (40 -> 64) and not.
@pytest.mark.parametrize(
    "rung,causal,alignment,Tq,Tk,D,dtype,scale",
    covering(rung=RUNGS, mask=MASKS, T=[(1, 1), (37, 37), (130, 130), (37, 130), (130, 37), (1, 130)],
             D=[16, 40, 64, 128], dtype={"fp32": F32, "fp16": F16}, scale={"default": None, "given": -0.3}),
)  # fmt: skip
def test_rung_matches_float64_truth(rung, causal, alignment, Tq, Tk, D, dtype, scale):
    q, k, v, do = make_inputs(1, 2, Tq, Tk, D, dtype, seed=Tq * 1000 + Tk + D)
    check_against_truth(rung, q, k, v, do, causal, scale, alignment)


@pytest.mark.parametrize("rung", list(RUNGS.values()), ids=list(RUNGS))
def test_rows_that_see_no_key_get_zero_gradients(rung):
    """Lower-right with Tq = 130 > Tk = 37: rows 0 .. 92 see no key. Their dq is exactly 0; the other rows
    and dk, dv still match the truth."""
    q, k, v, do = make_inputs(1, 2, 130, 37, 40, F32, seed=5)
    dq, _, _ = check_against_truth(rung, q, k, v, do, True, None, "lower_right")
    assert torch.equal(dq[:, :, :93], torch.zeros_like(dq[:, :, :93])) and dq[:, :, 93:].abs().sum() > 0


@pytest.mark.parametrize("rung", list(RUNGS.values()), ids=list(RUNGS))
def test_strided_views_give_what_contiguous_copies_give(rung):
    """(B, T, H, D) storage viewed as (B, H, T, D), and a dO whose head dim is the outer axis (no TMA for it):
    the rungs read strides, and write contiguous gradients."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 37, 2, 40, generator=gen).to(DEVICE).transpose(1, 2) for _ in range(3))
    do = torch.randn(1, 2, 40, 37, generator=gen).to(DEVICE).transpose(-1, -2)
    grads = check_against_truth(rung, q, k, v, do, True)
    for g, g_c in zip(grads, run_rung(rung, *(t.contiguous() for t in (q, k, v, do)), True)):
        torch.testing.assert_close(g, g_c)


LONG = 1030  # from 1k tokens the TMA rungs load the streamed tiles through descriptors; 1030 = 16 * 64 + 6


@pytest.mark.parametrize("causal,alignment", [(True, "upper_left"), (True, "lower_right"), (False, "upper_left")])
def test_tma_and_the_launch_order_change_no_bit(causal, alignment):
    """At 1k tokens rung tma fetches the streamed tiles through (emulated) descriptors, with zeros past the
    ragged last tile, where rung row_terms_in_dq loads them through pointers; rung heaviest_first then
    reorders the programs of 2 x 2 heads. Neither changes a bit of dq, dk, dv; and all match the truth."""
    q, k, v, do = make_inputs(2, 2, LONG, LONG - 40, 16, F16, seed=21)
    assert use_tma("auto", q, do, k, v) is not None  # the interpreter emulates TMA: the descriptor path runs
    pointers = check_against_truth(RUNGS["row_terms_in_dq"], q, k, v, do, causal, None, alignment)
    for later in ("tma", "heaviest_first"):
        grads = run_rung(RUNGS[later], q, k, v, do, causal, alignment=alignment)
        assert all(torch.equal(a, b) for a, b in zip(grads, pointers)), later


# --- the compiled kernels ----------------------------------------------------------------------------------------

SM90_BODY = """
import re, subprocess, tempfile
import torch
from flashtile.kernels.ladder import rungs

def spill_bytes(kernel):
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([triton.knobs.nvidia.ptxas.path, "-v", "--gpu-name=sm_90a", f"{tmp}/k.ptx", "-o",
                              f"{tmp}/k.o"], capture_output=True, text=True, check=True).stderr
    return int(re.search(r"(\\d+) bytes spill stores", log).group(1))

out = []
# bf16, causal (the larger kernels), at the settings each rung picks: the dK/dV kernel at D = 64 and 128 and
# the dQ kernel at 128, through pointers, and where a rung has TMA, through descriptors too (spelled as
# Triton's launcher mangles a TensorDescriptor argument)
for rung in rungs("backward")[1:]:
    module = rung.load()
    for D, name in ((64, "dkdv"), (128, "dkdv"), (128, "dq")):
        fn = getattr(module, name + "_kernel")
        params = inspect.signature(fn.fn).parameters
        bq, bk, warps, stages = module.settings(D, torch.bfloat16)[name]
        for tma in (False, True) if "USE_TMA" in params else (False,):
            types = {n: "*bf16" for n in ("Q", "K", "V", "O", "DO", "DK", "DV", "DQ")}
            types.update(LSE="*fp32", DELTA="*fp32", ROWS="*fp32", scale="fp32", qk_scale="fp32")
            if tma:
                streamed, rows = (("Q", "DO"), bq) if name == "dkdv" else (("K", "V"), bk)
                types.update({n: f"tensordesc<bf16[1, 1, {rows}, {D}]>" for n in streamed})
            constexprs = dict(HEAD_DIM=D, HEAD_DIM_PAD=D, BLOCK_Q=bq, BLOCK_K=bk, CAUSAL=True, USE_TMA=tma,
                              HEAVIEST_FIRST=True, DOT_PRECISION="tf32")
            constexprs = {n: x for n, x in constexprs.items() if n in params}
            kernel = sm90_like_a_launch(fn, types, constexprs, num_warps=warps, num_stages=stages)
            out.append([rung.name, name, D, tma, kernel.metadata.shared, spill_bytes(kernel)])
print(json.dumps({"kernels": out}))
"""
register("ladder_backward", SM90_BODY)


@pytest.mark.xdist_group("sm90")  # one worker runs every sm_90 compile test, one after the other (tests/_sm90.py)
def test_every_rung_compiles_for_sm90_at_its_settings_without_spills(tmp_path_factory):
    """The interpreter never compiles; this does (tests/_sm90.py), for the H200: shared memory within the
    227 KiB an sm_90 block may have, and no register spilled to local memory."""
    kernels = compiled("ladder_backward", tmp_path_factory)["kernels"]
    assert {k[0] for k in kernels} == set(RUNGS)
    for rung, name, D, tma, shared, spilled in kernels:
        assert shared <= 227 * 1024, (rung, name, D, tma, shared)
        assert spilled == 0, (rung, name, D, tma, spilled)

"""The forward ladder (``flashtile.kernels.ladder``, forward_<n>_<idea>.py) against the float64 formula of
tests/_truth.py, rung by rung.

Each rung is a complete kernel with the textbook's contract, so each gets the textbook's battery
(tests/kernels/test_textbook.py): fp16 and fp32 in Triton's interpreter (its bf16 is wrong), causal and not,
both alignments, ragged T, Tq != Tk both ways, a row that sees no key, head dims that are not powers of two,
default and negative scales, and three layouts: contiguous (the TMA path from rung 3 on, where the settings
take it), a (B, T, H, D) view (strided, still TMA-able) and a head dim that is the outer axis of the storage
(pointers only). The cases are chosen so that every pair of values of any two axes, the rung included, comes
up at least once (tests/_grids.py). The rungs take the GPU's tile sizes in the interpreter too (128 x 64, 128
x 128, 64 x 64; 16 x 32 and 16 x 16 in fp32), so T = 130 and 300 give ragged tiles and several key tiles,
and T = 256 none (where rung 5 compiles no masked loop). The last tests compile every rung for the H200
(sm_90) without a GPU and check that none spills registers.
"""

from __future__ import annotations

import difflib
import inspect
from pathlib import Path

import pytest
import torch

from flashtile.kernels.ladder import entry_point, rungs
from flashtile.kernels.textbook import textbook_forward
from tests._grids import covering
from tests._sm90 import compiled, register
from tests._truth import assert_close_to_truth, attention_truth

from ._helpers import DEVICE, FORWARD_TOL, LSE_TOL

F32, F16 = torch.float32, torch.float16
LADDER = rungs("forward")
RUNGS = {rung.name: rung for rung in LADDER[1:]}  # rung 0, the textbook, has its own tests
ROOT = Path(__file__).resolve().parents[2]
MASKS = {"full": (False, "upper_left"), "causal": (True, "upper_left"), "causal_lr": (True, "lower_right")}
LAYOUTS = ["bhtd", "bthd", "head_dim_outer"]


def forward_of(name: str):
    return entry_point(RUNGS[name], "forward")


def make_inputs(B, H, Tq, Tk, D, dtype, seed, layout="bhtd"):
    """q, k, v with the given values in the given layout: (B, H, T, D) contiguous, a (B, H, T, D) view of a
    contiguous (B, T, H, D) tensor, or a view of a (B, H, D, T) tensor (the head dim strided by T)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for T in (Tq, Tk, Tk):
        x = torch.randn(B, H, T, D, generator=gen).to(dtype)
        if layout == "bthd":
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        elif layout == "head_dim_outer":
            x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
        out.append(x.to(DEVICE))
    return out


def check_against_truth(forward, q, k, v, causal, scale=None, alignment="upper_left"):
    o, lse = forward(q, k, v, causal, scale, alignment=alignment)
    o_ref, lse_ref = attention_truth(q.double(), k.double(), v.double(), causal, scale, alignment)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.dtype == F32 and lse.shape == q.shape[:3]
    assert_close_to_truth(o, o_ref, "o", **FORWARD_TOL[q.dtype])
    assert_close_to_truth(lse, lse_ref, "lse", **LSE_TOL[q.dtype])
    return o, lse


@pytest.mark.parametrize(
    "name,causal,alignment,Tq,Tk,D,dtype,scale,layout",
    covering(rung=list(RUNGS), mask=MASKS,
             T=[(1, 1), (37, 37), (130, 130), (256, 256), (37, 300), (300, 37), (1, 300)],
             D=[16, 40, 64, 128], dtype={"fp32": F32, "fp16": F16}, scale={"default": None, "given": -0.3},
             layout=LAYOUTS),
)  # fmt: skip
def test_every_rung_matches_float64_truth(name, causal, alignment, Tq, Tk, D, dtype, scale, layout):
    q, k, v = make_inputs(1, 2, Tq, Tk, D, dtype, seed=Tq * 1000 + Tk + D, layout=layout)
    check_against_truth(forward_of(name), q, k, v, causal, scale, alignment)


@pytest.mark.parametrize("name", list(RUNGS))
def test_rows_that_see_no_key_get_o_zero_and_lse_minus_inf(name):
    """Lower-right with Tq = 300 > Tk = 37: rows 0 .. 262 see no key (two whole query tiles of 128 rows, and
    part of the third). Their o is exactly 0 and their lse -inf; the other rows match the truth."""
    q, k, v = make_inputs(1, 2, 300, 37, 40, F16, seed=5)
    o, lse = check_against_truth(forward_of(name), q, k, v, True, None, "lower_right")
    assert torch.equal(o[:, :, :263], torch.zeros_like(o[:, :, :263]))
    assert torch.isneginf(lse[:, :, :263]).all() and torch.isfinite(lse[:, :, 263:]).all()


@pytest.mark.parametrize("name", list(RUNGS))
def test_zero_scale_averages_the_visible_values(name):
    """τ = 0: every score is 0 (from rung 4 on, sign 0 folded into q), so each row's o is the mean of the
    values it sees and lse = log(count)."""
    q, k, v = make_inputs(1, 1, 37, 37, 16, F32, seed=6)
    o, lse = check_against_truth(forward_of(name), q, k, v, True, 0.0)
    counts = torch.arange(1, 38, dtype=torch.float64)
    torch.testing.assert_close(lse[0, 0].double(), counts.log(), atol=1e-6, rtol=0)
    means = v[0, 0].double().cumsum(0) / counts[:, None]
    torch.testing.assert_close(o[0, 0].double(), means, atol=2e-6, rtol=0)


def test_rung_1_is_the_textbook_kernel_at_other_settings():
    """Rung 1 changes only the launch: where its settings are the textbook's tiles (fp32), it computes the
    textbook's bits; in fp16 it takes other tiles, and the bits may differ within rounding."""
    q, k, v = make_inputs(1, 2, 130, 300, 40, F32, seed=7)
    for causal in (False, True):
        o, lse = forward_of("launch_settings")(q, k, v, causal)
        o_tb, lse_tb = textbook_forward(q, k, v, causal)
        assert torch.equal(o, o_tb) and torch.equal(lse, lse_tb)


@pytest.mark.parametrize("name", [n for n in RUNGS if n not in ("launch_settings", "addresses_once")])
def test_tma_and_pointer_paths_give_the_same_bits(name, monkeypatch):
    """From rung 3 on, contiguous fp16 inputs at d = 80 load through TMA descriptors (the interpreter emulates
    them) and the same values with a strided head dim through pointers, at the same tiles: the results are
    the same bits. The descriptors are counted, so that the test fails if either path stops being taken."""
    module = RUNGS[name].load()
    made = []
    monkeypatch.setattr(module, "tile_descriptor", lambda *a: made.append(a) or _descriptor(*a))
    q, k, v = make_inputs(1, 2, 130, 300, 80, F16, seed=8)
    q_s, k_s, v_s = make_inputs(1, 2, 130, 300, 80, F16, seed=8, layout="head_dim_outer")
    assert torch.equal(q, q_s) and q_s.stride(-1) != 1
    for causal in (False, True):
        del made[:]
        o, lse = module.forward(q, k, v, causal)
        assert len(made) == 3  # q, k and v through descriptors
        o_s, lse_s = module.forward(q_s, k_s, v_s, causal)
        assert len(made) == 3  # none more: pointers
        assert torch.equal(o, o_s) and torch.equal(lse, lse_s)


def _descriptor(*args):
    from flashtile.kernels._host import tile_descriptor

    return tile_descriptor(*args)


def test_heaviest_first_changes_the_order_not_a_bit():
    """The last rung differs from the one before only in which program takes which tile: on a causal grid of
    several heads, batches and query tiles (the interpreter counts the H200's SMs, so the grid is a few waves
    and the heads are renumbered in chunks) the outputs are the same bits. A tile computed twice, or never,
    would leave o uninitialised somewhere."""
    order, before = LADDER[-1], LADDER[-2]
    assert order.name == "heaviest_first"
    q, k, v = make_inputs(2, 3, 300, 300, 64, F16, seed=9)
    for alignment in ("upper_left", "lower_right"):
        o, lse = entry_point(order, "forward")(q, k, v, True, alignment=alignment)
        o_b, lse_b = entry_point(before, "forward")(q, k, v, True, alignment=alignment)
        assert torch.equal(o, o_b) and torch.equal(lse, lse_b)


@pytest.mark.parametrize("name", list(RUNGS))
@pytest.mark.parametrize(
    "change,error,match",
    [("gqa", ValueError, "no GQA"), ("head dim 129", ValueError, "head dims 1 to 128"),
     ("float64", TypeError, "the textbook kernels take float16, bfloat16 and float32"),
     ("causal not a bool", TypeError, "causal")],
)  # fmt: skip
def test_each_rung_refuses_what_the_textbook_refuses(name, change, error, match):
    q, k, v = make_inputs(1, 2, 16, 16, 16, F32, seed=10)
    kwargs = {}
    if change == "gqa":
        k, v = k[:, :1], v[:, :1]
    elif change == "head dim 129":
        q, k, v = (torch.cat([t] * 9, dim=-1)[..., :129] for t in (q, k, v))
    elif change == "float64":
        q, k, v = q.double(), k.double(), v.double()
    else:
        kwargs["causal"] = 1
    with pytest.raises(error, match=match):
        textbook_forward(q, k, v, **kwargs)
    with pytest.raises(error, match=match):
        forward_of(name)(q, k, v, **kwargs)


# --- the files as the chapter shows them ------------------------------------------------------------------


def section(path: Path, name: str) -> list[str]:
    lines = path.read_text().splitlines()
    start, end = lines.index(f"# --8<-- [start:{name}]"), lines.index(f"# --8<-- [end:{name}]")
    return [line for line in lines[start + 1 : end] if not line.startswith("# --8<--")]


def listing(rung) -> list[str]:
    return [line for name in rung.sections for line in section(ROOT / rung.path, name)]


def test_the_rungs_are_numbered_from_1_and_each_says_its_idea():
    assert [rung.index for rung in LADDER] == list(range(len(LADDER))) and len(LADDER) >= 2
    for rung in LADDER[1:]:
        module = rung.load()
        assert module.__doc__ and module.__doc__.startswith(f"Forward rung {rung.index}:"), rung.name
        assert module.IDEA.endswith(".") and module.IDEA.count(". ") == 0, rung.name  # one sentence
        assert list(inspect.signature(module.forward).parameters) == ["q", "k", "v", "causal", "scale",
                                                                      "alignment"]  # fmt: skip


@pytest.mark.parametrize("rung", LADDER, ids=lambda r: r.name)
def test_listings_fit_88_columns(rung):
    """The chapter shows every listing, and the diff between two rungs, without a horizontal scroll."""
    long = [line for line in listing(rung) if len(line) > 88]
    assert not long, long[:3]


@pytest.mark.parametrize("rung", LADDER[1:], ids=lambda r: r.name)
def test_each_rung_is_a_small_diff_from_the_one_before(rung):
    """One idea per rung: the unified diff against the rung before changes at most 75 lines (added plus
    removed), and at least one."""
    before = LADDER[rung.index - 1]
    diff = difflib.unified_diff(listing(before), listing(rung), lineterm="", n=0)
    changed = [line for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert 0 < len(changed) <= 75, len(changed)


# --- compiled for the H200 ------------------------------------------------------------------------------

SM90_BODY = """
import importlib, re, subprocess, tempfile
import torch

def spill_bytes(kernel):
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([triton.knobs.nvidia.ptxas.path, "-v", "--gpu-name=sm_90a", f"{tmp}/k.ptx", "-o",
                              f"{tmp}/k.o"], capture_output=True, text=True, check=True).stderr
    return int(re.search(r"(\\d+) bytes spill stores", log).group(1))

def like_a_launch(module, dtype, D, causal, T):
    # The rung's own settings for a (T, T) call on contiguous tensors, TMA where they take it
    rung = importlib.import_module(module)
    params = inspect.signature(rung.launch_settings).parameters
    settings = rung.launch_settings(D, dtype, causal, T, **({"tma": True} if "tma" in params else {}))
    options = dict(num_warps=settings.pop("num_warps"), num_stages=settings.pop("num_stages"))
    cap = settings.pop("maxnreg")
    if cap:
        options["maxnreg"] = cap
    pad, ty = rung.head_dim_pad(D), {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    types = dict(Q="*" + ty, K="*" + ty, V="*" + ty, O="*" + ty, LSE="*fp32", qk_scale="fp32")
    if settings.get("USE_TMA"):  # what mangle_type(TensorDescriptor(...)) gives
        rows = dict(Q=settings["BLOCK_Q"], K=settings["BLOCK_K"], V=settings["BLOCK_K"])
        types.update({n: f"tensordesc<{ty}[1, 1, {r}, {pad}]>" for n, r in rows.items()})
    constexprs = dict(settings, HEAD_DIM=D, HEAD_DIM_PAD=pad, CAUSAL=causal,
                      DOT_PRECISION=rung.dot_precision(dtype))
    names = rung.forward_kernel.arg_names
    constexprs.update({n: x for n, x in (("SIGN", 1), ("MASKED_TILES", causal), ("HEAVIEST_FIRST", causal))
                       if n in names})
    kernel = sm90_like_a_launch(rung.forward_kernel, types, constexprs, **options)
    return [kernel.metadata.shared, spill_bytes(kernel), "cp.async.bulk.tensor" in kernel.asm["ptx"],
            bool(settings.get("USE_TMA"))]

out = []
for module in MODULES:
    # the largest tiles (bf16, d = 128, causal: 128 x 128) and the register-capped 128-key steps at d = 64
    for dtype, D, causal in ((torch.bfloat16, 128, True), (torch.bfloat16, 64, False)):
        out.append([module, str(dtype), D, causal, *like_a_launch(module, dtype, D, causal, 2048)])
# fp32 on the CUDA cores, in the last rung
out.append([MODULES[-1], "torch.float32", 64, True, *like_a_launch(MODULES[-1], torch.float32, 64, True, 2048)])
print(json.dumps({"kernels": out}))
"""
register("ladder-forward", f"MODULES = {[rung.module for rung in LADDER[1:]]!r}\n" + SM90_BODY)


@pytest.mark.xdist_group("sm90")  # one worker runs every sm_90 compile test, one after the other (tests/_sm90.py)
def test_every_rung_compiles_for_sm90_at_its_settings_without_spills(tmp_path_factory):
    """Compiled for the H200 (tests/_sm90.py) at the settings each rung's launcher picks for T = 2048: shared
    memory within the 227 KiB an sm_90 block may have, no register spills, and the copy engine's
    bulk-tensor loads exactly where the settings take TMA (a control that the TMA compiles are TMA)."""
    kernels = compiled("ladder-forward", tmp_path_factory)["kernels"]
    assert len(kernels) == 2 * (len(LADDER) - 1) + 1
    assert any(tma for *_, tma in kernels) and not all(tma for *_, tma in kernels)
    for module, dtype, D, causal, shared, spilled, bulk, tma in kernels:
        case = (module.rsplit(".", 1)[-1], dtype, D, causal)
        assert shared <= 227 * 1024, (*case, shared)
        assert spilled == 0, (*case, spilled)
        assert bulk == tma, case

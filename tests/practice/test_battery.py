"""The practice battery, run against the package, the untouched skeletons, and the gallery of bugs.

The battery is written once (``flashtile.practice.battery``); here it is pointed at three kinds of
implementation. The package must pass every step, the skeleton must fail every step with a "write
..." hint, and each planted bug must fail the step that should catch it, at the case that exposes it,
with the hint that names it, while the same reader code without the bug passes (the control).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flashtile.practice import battery
from flashtile.practice.battery import (
    HINT_ALIGNMENT,
    HINT_ARANGE,
    HINT_BATCH,
    HINT_LSE,
    HINT_MASK_BACKWARD,
    HINT_MAX,
    HINT_MEMORY,
    HINT_MEMORY_BACKWARD,
    HINT_NEG_INF,
    HINT_PADDED,
    HINT_RESCALE,
    HINT_SCALE,
    HINT_SKIP,
    HINT_SKIPPED_TILE_READ,
    HINT_STRIDES,
    HINT_UNITS,
    run_step,
)
from flashtile.practice.steps import STEPS, step_named
from flashtile.practice.truth import attention_grads_truth, backward_equations

from . import _reader_backward_kernel, _reader_drills, _reader_forward, _reader_kernels, _reader_online_softmax

REPO = Path(__file__).resolve().parents[2]
PRACTICE = REPO / "src" / "flashtile" / "practice"


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.name)
def test_package_passes_every_case_of_every_step(step):
    result = run_step(step, importlib.import_module(step.package_module))
    assert result.ok, [(f.case, f.error) for f in result.failures]
    assert result.passed == len(step.cases()) >= 3


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.name)
def test_untouched_skeleton_fails_every_step_with_a_write_hint(step):
    skeleton = importlib.import_module(f"flashtile.practice.skeletons.{step.file}")
    result = run_step(step, skeleton, fast=True)
    assert not result.ok and result.passed == 0
    (failure,) = result.failures
    assert failure.error.startswith("NotImplementedError: TODO")
    assert failure.hint.name == "write" and failure.hint.nudge == f"write {', '.join(step.functions)} in {step.file}.py"
    assert failure.chapter == step.chapter


READERS = {
    "online_softmax": lambda: _reader_online_softmax.make(),
    "forward": lambda: _reader_forward.make(),
    "causal": lambda: _reader_forward.make(),
    "backward": lambda: _reader_forward.make_backward(),
    "fused_softmax": lambda: _reader_kernels.make_softmax(),
    "forward_kernel": lambda: _reader_kernels.make_forward(),
    "backward_kernel": lambda: _reader_backward_kernel.make_backward(),
    "autograd": lambda: _reader_drills.make_autograd(),
    "gqa": lambda: _reader_drills.make_gqa(),
    "window": lambda: _reader_drills.make_window(),
    "paged": lambda: _reader_drills.make_decode(),
    "decode": lambda: _reader_drills.make_decode(),
    "varlen": lambda: _reader_drills.make_varlen(),
    "sink": lambda: _reader_drills.make_sinks(),
    "sink_gradient": lambda: _reader_drills.make_sink_gradient(),
}


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.name)
def test_control_a_readers_own_code_without_the_bugs_passes(step):
    result = run_step(step, READERS[step.name]())
    assert result.ok, [(f.case, f.error) for f in result.failures]


f16 = torch.float16
# (bug, step that catches it, the implementation, a phrase of the first failing case, the hint it gets)
GALLERY = [
    ("forgotten rescale", "online_softmax", lambda: _reader_online_softmax.make(rescale=False),
     "between -40 and 1000", HINT_RESCALE),
    ("an update that never rescales l (stats in two passes)", "online_softmax",
     lambda: _reader_online_softmax.make(update_rescales=False), "update from a state of 8 columns", HINT_RESCALE),
    ("exp(-inf - (-inf)) in the online update", "online_softmax",
     lambda: _reader_online_softmax.make(guard_neg_inf=False), "first 9 columns -inf", HINT_NEG_INF),
    ("exp(-inf - (-inf)) in merge only", "online_softmax", lambda: _reader_online_softmax.make(guard_merge=False),
     "merge two empty states", HINT_NEG_INF),
    ("max not subtracted in the online softmax", "online_softmax",
     lambda: _reader_online_softmax.make(subtract_max=False), "between -40 and 1000", HINT_MAX),
    ("forgotten rescale in the forward", "forward", lambda: _reader_forward.make(rescale=False),
     "blocks divide T", HINT_RESCALE),
    ("scale ignored in the forward", "forward", lambda: _reader_forward.make(scale_ignored=True), "τ = 60",
     HINT_SCALE),
    ("max not subtracted in the forward", "forward", lambda: _reader_forward.make(subtract_max=False), "τ = 60",
     HINT_MAX),
    ("m and l kept in float16", "forward", lambda: _reader_forward.make(stats_dtype=f16), "float16 inputs", HINT_LSE),
    ("a bf16 lse", "forward", lambda: _reader_forward.make(lse_dtype=torch.bfloat16), "blocks divide T", HINT_LSE),
    ("an fp16 lse", "forward", lambda: _reader_forward.make(lse_dtype=f16), "blocks divide T", HINT_LSE),
    ("untiled: the whole score matrix", "forward", lambda: _reader_forward.make(untiled=True), "memory", HINT_MEMORY),
    ("alignment ignored", "causal", lambda: _reader_forward.make(alignment_ignored=True), "diagonal ends bottom-right",
     HINT_ALIGNMENT),
    ("scale ignored under causal", "causal", lambda: _reader_forward.make(scale_ignored=True),
     "diagonal ends bottom-right", HINT_SCALE),
    ("exp(-inf - (-inf)) in the forward", "causal", lambda: _reader_forward.make(guard_neg_inf=False),
     "the first 27 rows see no key", HINT_NEG_INF),
    ("causal skip off by one", "causal", lambda: _reader_forward.make(floor_tile_count=True),
     "ragged last tiles", HINT_SKIP),
    ("no causal tile skipping", "causal", lambda: _reader_forward.make(skip_tiles=False), "hold NaN",
     HINT_SKIPPED_TILE_READ),
    ("mask only in the forward", "backward", lambda: _reader_forward.make_backward(mask_in_backward=False),
     "causal, ragged tiles", HINT_MASK_BACKWARD),
    ("scale ignored in the backward", "backward", lambda: _reader_forward.make_backward(scale_ignored=True),
     "τ = 0.3", HINT_SCALE),
    ("alignment ignored in the backward", "backward", lambda: _reader_forward.make_backward(alignment_ignored=True),
     "causal, Tq < Tk", HINT_ALIGNMENT),
    ("exp(-inf - (-inf)) in the backward (masked scores, lse = -inf)", "backward",
     lambda: _reader_forward.make_backward(guard_neg_inf=False), "rows that see no key", HINT_NEG_INF),
    ("autograd through the full softmax: no tiles, no D", "backward",
     lambda: _reader_forward.make_backward(untiled=True), "memory", HINT_MEMORY_BACKWARD),
    ("non-power-of-two tl.arange", "fused_softmax", lambda: _reader_kernels.make_softmax(pow2_block=False),
     "not a power of two", HINT_ARANGE),
    ("max not subtracted in the softmax kernel", "fused_softmax",
     lambda: _reader_kernels.make_softmax(subtract_max=False), "from -40 to 1000", HINT_MAX),
    ("a grid without the batch axis", "forward_kernel", lambda: _reader_kernels.make_forward(batch_axis=False),
     "2 batches", HINT_BATCH),
    ("scale ignored in the kernel", "forward_kernel", lambda: _reader_kernels.make_forward(scale_ignored=True),
     "2 batches", HINT_SCALE),
    ("lse left in log2 units", "forward_kernel", lambda: _reader_kernels.make_forward(lse_log2=True),
     "2 batches", HINT_UNITS),
    ("padded keys scoring 0", "forward_kernel", lambda: _reader_kernels.make_forward(padded_keys_neg_inf=False),
     "11 padded keys", HINT_PADDED),
    ("alignment ignored in the kernel", "forward_kernel",
     lambda: _reader_kernels.make_forward(alignment_ignored=True), "the first 27 rows see no key", HINT_ALIGNMENT),
    ("exp2(-inf - (-inf)) in the kernel", "forward_kernel", lambda: _reader_kernels.make_forward(guard_neg_inf=False),
     "the first 27 rows see no key", HINT_NEG_INF),
    ("no causal tile skipping in the kernel", "forward_kernel",
     lambda: _reader_kernels.make_forward(skip_tiles=False), "hold NaN", HINT_SKIPPED_TILE_READ),
    ("(b, h) flattened with the head stride", "forward_kernel",
     lambda: _reader_kernels.make_forward(flat_heads=True), "transposed (B, T, H, D) views", HINT_BATCH),
    ("wrong strides on a transposed view", "forward_kernel", lambda: _reader_kernels.make_forward(use_strides=False),
     "transposed (B, T, H, D) views", HINT_STRIDES),
    ("m and l kept in float16 in the kernel", "forward_kernel", lambda: _reader_kernels.make_forward(stats_fp16=True),
     "float16 inputs", HINT_LSE),
]


@pytest.mark.parametrize("bug, step, impl, case, hint", GALLERY, ids=[g[0] for g in GALLERY])
def test_each_gallery_bug_fails_the_step_that_should_catch_it(bug, step, impl, case, hint):
    result = run_step(step_named(step), impl(), stop_at_first_failure=True)
    assert not result.ok, f"{bug}: step {step} passed"
    first = result.failures[0]
    assert case in first.case, f"{bug}: first failure is {first.case!r}: {first.error}"
    assert first.hint.name == hint.name, f"{bug}: hint {first.hint!r}"
    cases = step_named(step).cases()
    failing = next(c for c in cases if c.name == first.case)
    assert result.passed == cases.index(failing)  # the cases before it pass: the step fails for this bug only
    # the cases are deterministic and --fast keeps their order, so --fast fails at the same case
    assert failing.fast, f"{bug}: caught only without --fast"


def test_a_mistake_no_rule_knows_gets_what_differs_and_no_guess():
    """o off on one row by an arbitrary amount: no symptom rule fits, so the hint says which entries differ and
    by how much, and names no mistake."""
    good = _reader_forward.make().flash_attention_forward

    def odd(*args, **kwargs):
        o, lse = good(*args, **kwargs)
        o = o.clone()
        o[..., 5, :] *= 1.37
        return o, lse

    result = run_step(step_named("forward"), SimpleNamespace(flash_attention_forward=odd), stop_at_first_failure=True)
    hint = result.failures[0].hint
    assert hint.name == "none" and hint.nudge.startswith("no diagnosis"), hint
    assert "5 of 32" in hint.nudge and "truth times 1.37" in hint.nudge, hint.nudge
    assert hint.text("formula") == hint.nudge  # no formula to give when nothing is recognised


def test_a_backward_kernel_mistake_no_rule_knows_gets_what_differs_and_no_guess():
    """dK and dQ each off on one row by a different amount: two gradients wrong, no known mistake's, so no
    rule fits and the hint says where each differs; the control (the same kernel, untouched) passes."""
    right = _reader_backward_kernel.make_backward().flash_attention_backward

    def odd(*args, **kwargs):
        dq, dk, dv = (g.clone() for g in right(*args, **kwargs))
        dq[..., 3, :] *= 1.37
        dk[..., 5, :] *= 0.8
        return dq, dk, dv

    step = step_named("backward_kernel")
    assert run_step(step, SimpleNamespace(flash_attention_backward=right), fast=True).ok
    result = run_step(step, SimpleNamespace(flash_attention_backward=odd), stop_at_first_failure=True)
    hint = result.failures[0].hint
    assert hint.name == "none" and hint.nudge.startswith("no diagnosis"), hint
    assert "dk: 32 of 1024 entries wrong" in hint.nudge and "5 of 32" in hint.nudge, hint.nudge
    assert "every wrong entry is the truth times 0.8" in hint.nudge, hint.nudge  # float32: 0.8 within its rounding


def test_an_error_raised_by_the_readers_code_is_not_given_a_guess():
    def broken(*args, **kwargs):
        raise IndexError("index 16 is out of bounds for dimension 2 with size 16")

    result = run_step(step_named("causal"), SimpleNamespace(flash_attention_forward=broken), fast=True)
    assert {f.hint.name for f in result.failures} == {"error"}


def test_the_backward_equations_are_the_gradients_at_the_same_scale_and_mask():
    q, k, v = (battery.randn(1, 2, T, 8, seed=i) for i, T in enumerate((20, 37, 37)))
    do = battery.randn(1, 2, 20, 8, seed=3)
    for causal, scale, alignment in [(False, 0.3, "upper_left"), (True, None, "lower_right"), (True, 2, "upper_left")]:
        o, lse, *grads = attention_grads_truth(q, k, v, do, causal, scale, alignment)
        for g, r in zip(backward_equations(q, k, v, o, lse, do, causal, scale, alignment), grads):
            assert torch.allclose(g, r, atol=1e-12)


def test_a_reader_that_exits_fails_the_case_and_the_rest_still_runs():
    def exits(*args, **kwargs):
        raise SystemExit(0)

    result = run_step(step_named("backward"), SimpleNamespace(flash_attention_backward=exits), fast=True)
    assert result.passed == 0 and len(result.failures) == len([c for c in step_named("backward").cases() if c.fast])
    assert result.failures[0].error.startswith("SystemExit: your code tried to end the checker")


def test_a_keyboard_interrupt_still_stops_the_run():
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_step(step_named("backward"), SimpleNamespace(flash_attention_backward=interrupted))


def test_the_footprint_sees_a_full_score_matrix_and_not_a_tile():
    q = battery.randn(1, 1, 512, 8)
    with battery.Footprint() as full:
        torch.softmax(q @ q.transpose(-1, -2), dim=-1)
    with battery.Footprint() as tile:
        torch.softmax(q[..., :128, :] @ q[..., :128, :].transpose(-1, -2), dim=-1)
    assert full.largest_tensor == 512 * 512 * 8 and tile.largest_tensor == 128 * 128 * 8
    with battery.Footprint() as numpy_full:
        q[0, 0].numpy() @ q[0, 0].numpy().T
    assert numpy_full.python_peak >= 512 * 512 * 8


def test_the_arange_bug_reports_tritons_own_message():
    result = run_step(step_named("fused_softmax"), _reader_kernels.make_softmax(pow2_block=False),
                      stop_at_first_failure=True)
    assert "power of 2" in result.failures[0].error


def test_a_module_missing_a_function_fails_with_its_name():
    result = run_step(step_named("online_softmax"), object(), fast=True, stop_at_first_failure=True)
    assert "defines no online_softmax_update, online_softmax_stats, lse_from_stats, merge" in result.failures[0].error


def test_the_battery_and_its_truth_import_nothing_else_from_flashtile():
    for name in ("battery.py", "drills.py", "truth.py"):
        tree = ast.parse((PRACTICE / name).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 1 and node.module in ("truth", "battery", "drills") or node.level == 0, (
                    name, node.module)
                assert not (node.module or "").startswith("flashtile"), (name, node.module)
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("flashtile") for a in node.names), name


def _slug(heading: str) -> str:
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.name)
def test_every_step_links_a_chapter_section_that_exists(step):
    page, _, anchor = step.chapter.partition("#")
    source = REPO / "docs" / (page.rstrip("/") + ".md")
    assert source.is_file(), step.chapter
    headings = [line.lstrip("#").strip() for line in source.read_text(encoding="utf-8").splitlines()
                if line.startswith("## ")]
    assert anchor in {_slug(h) for h in headings}, (step.chapter, headings)


def test_every_case_name_says_its_shapes_or_sizes():
    for step in STEPS:
        for case in step.cases():
            assert re.search(r"\d", case.name), (step.name, case.name)


def test_steps_follow_the_labs_order():
    assert [s.name for s in STEPS] == [
        "online_softmax", "forward", "causal", "backward", "fused_softmax", "forward_kernel", "backward_kernel",
        "autograd", "gqa", "window", "paged", "decode", "varlen", "sink", "sink_gradient"]


def test_the_footprint_is_not_wrapped_to_disable_dynamo():
    # torch wraps a TorchDispatchMode subclass's __torch_dispatch__ to disable Dynamo, and the wrapper imports
    # torch._dynamo (seconds, hundreds of modules) on the first operation measured; the battery's modes opt out,
    # a plain mode (the control) is wrapped
    from torch.utils._python_dispatch import TorchDispatchMode

    class Plain(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert hasattr(Plain.__dict__["__torch_dispatch__"], "__wrapped__")  # the control
    for mode in (battery.Footprint, battery._PassThrough):
        assert not hasattr(mode.__dict__["__torch_dispatch__"], "__wrapped__"), mode
    with battery.Footprint() as footprint:
        torch.ones(4, 2) @ torch.ones(2, 3)
    assert footprint.widest_product == (4, 3)

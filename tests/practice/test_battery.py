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

import pytest
import torch

from flashtile.practice import battery
from flashtile.practice.battery import (
    HINT_ARANGE,
    HINT_LSE,
    HINT_MASK_BACKWARD,
    HINT_NEG_INF,
    HINT_PADDED,
    HINT_RESCALE,
    HINT_SKIP,
    HINT_STRIDES,
    STEPS,
    run_step,
    step_named,
)

from . import _reader_forward, _reader_kernels, _reader_online_softmax

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
    assert failure.hint == f"write {', '.join(step.functions)} in {step.file}.py"
    assert failure.chapter == step.chapter


READERS = {
    "online_softmax": lambda: _reader_online_softmax.make(),
    "forward": lambda: _reader_forward.make(),
    "causal": lambda: _reader_forward.make(),
    "backward": lambda: _reader_forward.make_backward(),
    "fused_softmax": lambda: _reader_kernels.make_softmax(),
    "forward_kernel": lambda: _reader_kernels.make_forward(),
}


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.name)
def test_control_a_readers_own_code_without_the_bugs_passes(step):
    result = run_step(step, READERS[step.name]())
    assert result.ok, [(f.case, f.error) for f in result.failures]


# (bug, step that catches it, the implementation, a phrase of the first failing case, its hint, cases passed first)
GALLERY = [
    ("forgotten rescale", "online_softmax", lambda: _reader_online_softmax.make(rescale=False),
     "a rising row", HINT_RESCALE, 1),
    ("exp(-inf - (-inf)) in the online update", "online_softmax",
     lambda: _reader_online_softmax.make(guard_neg_inf=False),
     "first 9 columns -inf", HINT_NEG_INF, 5),
    ("exp(-inf - (-inf)) in the forward", "causal", lambda: _reader_forward.make(guard_neg_inf=False),
     "the first 27 rows see no key", HINT_NEG_INF, 4),
    ("causal skip off by one", "causal", lambda: _reader_forward.make(floor_tile_count=True),
     "ragged last tiles", HINT_SKIP, 1),
    ("a bf16 lse", "forward", lambda: _reader_forward.make(lse_dtype=torch.bfloat16),
     "blocks divide T", HINT_LSE, 0),
    ("an fp16 lse", "forward", lambda: _reader_forward.make(lse_dtype=torch.float16),
     "blocks divide T", HINT_LSE, 0),
    ("mask only in the forward", "backward", lambda: _reader_forward.make_backward(mask_in_backward=False),
     "causal, ragged tiles", HINT_MASK_BACKWARD, 2),
    ("non-power-of-two tl.arange", "fused_softmax", lambda: _reader_kernels.make_softmax(pow2_block=False),
     "not a power of two", HINT_ARANGE, 1),
    ("exp2(-inf - (-inf)) in the kernel", "forward_kernel", lambda: _reader_kernels.make_forward(guard_neg_inf=False),
     "the first 27 rows see no key", HINT_NEG_INF, 3),
    ("padded keys scoring 0", "forward_kernel", lambda: _reader_kernels.make_forward(padded_keys_neg_inf=False),
     "11 padded keys", HINT_PADDED, 1),
    ("wrong strides on a transposed view", "forward_kernel", lambda: _reader_kernels.make_forward(use_strides=False),
     "transposed (B, T, H, D) views", HINT_STRIDES, 4),
]


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the NaN bugs, on purpose
@pytest.mark.parametrize("bug, step, impl, case, hint, passed_before", GALLERY, ids=[g[0] for g in GALLERY])
def test_each_gallery_bug_fails_the_step_that_should_catch_it(bug, step, impl, case, hint, passed_before):
    result = run_step(step_named(step), impl(), stop_at_first_failure=True)
    assert not result.ok, f"{bug}: step {step} passed"
    first = result.failures[0]
    assert case in first.case, f"{bug}: first failure is {first.case!r}: {first.error}"
    assert first.hint == hint, f"{bug}: hint {first.hint!r}"
    assert result.passed == passed_before  # the cases before it pass: the step fails for this bug only


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("bug, step, impl", [(g[0], g[1], g[2]) for g in GALLERY], ids=[g[0] for g in GALLERY])
def test_the_fast_subset_still_catches_every_gallery_bug(bug, step, impl):
    assert not run_step(step_named(step), impl(), fast=True, stop_at_first_failure=True).ok


def test_the_arange_bug_reports_tritons_own_message():
    result = run_step(step_named("fused_softmax"), _reader_kernels.make_softmax(pow2_block=False),
                      stop_at_first_failure=True)
    assert "power of 2" in result.failures[0].error


def test_a_module_missing_a_function_fails_with_its_name():
    result = run_step(step_named("online_softmax"), object(), fast=True, stop_at_first_failure=True)
    assert "defines no online_softmax_update, online_softmax_stats, lse_from_stats, merge" in result.failures[0].error


def test_the_battery_and_its_truth_import_nothing_else_from_flashtile():
    for name in ("battery.py", "truth.py"):
        tree = ast.parse((PRACTICE / name).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 1 and node.module in ("truth",) or node.level == 0, (name, node.module)
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
    assert [s.name for s in battery.STEPS] == [
        "online_softmax", "forward", "causal", "backward", "fused_softmax", "forward_kernel"]

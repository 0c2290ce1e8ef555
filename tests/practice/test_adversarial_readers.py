"""Readers' code that games the checker: a strip-wise forward with a planted causal bug, and forged results."""

from __future__ import annotations

import pytest

from flashtile.practice.battery import HINT_MEMORY, run_step, step_named
from flashtile.practice.cli import main
from tests.practice import _reader_strips


@pytest.mark.parametrize("step", ["forward", "causal"])
def test_a_strip_wise_forward_with_a_planted_causal_bug_fails_forward_and_causal(step):
    result = run_step(step_named(step), _reader_strips)
    assert not result.ok
    cases = " | ".join(f.case + " -> " + f.error for f in result.failures)
    assert "not FlashAttention's tiling" in cases or "was created" in cases, cases
    if step == "causal":  # the planted bug: the mask dropped at Tq = Tk = 64 and 128
        assert "Tq=64 Tk=64" in cases and "max abs error" in cases, cases
    assert all(f.hint == HINT_MEMORY for f in result.failures if "tiling" in f.error)


def test_the_checker_exits_non_zero_on_the_strip_wise_forward(tmp_path, capfd):
    (tmp_path / "forward.py").write_text("from tests.practice._reader_strips import *  # noqa: F403\n",
                                         encoding="utf-8")
    capfd.readouterr()
    code = main(["check", str(tmp_path), "--step", "forward", "--step", "causal"])
    out = capfd.readouterr().out
    assert code == 1, out
    assert "FAILED forward" in out and "FAILED causal" in out
    assert "0 of 2 steps pass" in out

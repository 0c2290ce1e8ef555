"""Mutation smoke test: plant one real bug at a time in a copy of the package and check that the test
suite notices. A suite that stays green on a broken kernel tests nothing.

Each mutant names the source file, an exact piece of it (present exactly once, so a refactor cannot turn
the mutant into a silent no-op) and its broken replacement, and the tests that must fail. The copy is
imported through PYTHONPATH in a fresh pytest process; the mutant is killed when that run fails
(pytest exit code 1), not when it crashes on import (exit code 2 or more would hide a typo here).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


class Mutant(NamedTuple):
    path: str  # under src/flashtile
    old: str
    new: str
    tests: tuple[str, ...]
    needs_gpu: bool = False


MUTANTS = {
    # The launcher's favourite bug: assume K is contiguous, so a (B, T, H, D) view is read wrongly.
    "forward_ignores_the_key_row_stride": Mutant(
        "kernels/forward.py",
        "j0[None, :].to(tl.int64) * stride_kt",
        "j0[None, :].to(tl.int64) * HEAD_DIM",
        ("tests/kernels/test_forward.py",),
    ),
    # The softmax kernel reads columns as if they were adjacent.
    "softmax_ignores_the_column_stride": Mutant(
        "kernels/softmax.py",
        "x = tl.load(X + row * stride_xr + cols * stride_xc,",
        "x = tl.load(X + row * stride_xr + cols,",
        ("tests/kernels/test_softmax.py",),
    ),
    # The causal mask applied in the forward only: the dK/dV kernel lets hidden keys take gradient.
    "mask_only_in_the_forward": Mutant(
        "kernels/backward.py",
        "            keep = visible(rows[None, :], keys[:, None], Tq, Tk, offset, CAUSAL)",
        "            keep = visible(rows[None, :], keys[:, None], Tq, Tk, offset, False)",
        ("tests/kernels/test_backward.py",),
    ),
    # lse kept in the input dtype: 16 bits cannot carry what the backward subtracts.
    "lse_in_the_input_dtype": Mutant(
        "reference/forward.py",
        "lse = torch.empty(q.shape[:-1], dtype=c, device=q.device)",
        "lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)",
        ("tests/test_numerics.py", "tests/reference/test_forward.py"),
    ),
    # The hand-off in mixed units: m stored scaled while the backward subtracts it from raw dots.
    "hand_off_in_mixed_units": Mutant(
        "kernels/forward.py",
        "tl.store(rows + n_rows, m, mask=row_ok)",
        "tl.store(rows + n_rows, m * qk_scale, mask=row_ok)",
        ("tests/kernels/test_backward.py",),
    ),
    # tf32 for fp32 inputs in the backward only: the recomputed raw dots no longer match the forward's.
    # The interpreter multiplies in full fp32 whatever it is told, so only a GPU can see this one.
    "tf32_in_the_backward": Mutant(
        "kernels/backward.py",
        "DOT_PRECISION=dot_precision(q.dtype)",
        'DOT_PRECISION="tf32"',
        ("tests/test_numerics.py::test_backward_on_the_forwards_own_statistics_is_exact_at_any_logit_magnitude",),
        needs_gpu=True,
    ),
}


def copy_of_the_package(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "src"


def run_pytest(src: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(src), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_control_the_copy_is_what_the_tests_import_and_it_passes(tmp_path):
    src = copy_of_the_package(tmp_path)
    (tmp_path / "test_where.py").write_text(
        "import flashtile\n\ndef test_where():\n    print('IMPORTED', flashtile.__file__)\n"
    )
    where = run_pytest(src, "-s", str(tmp_path / "test_where.py"))
    assert f"IMPORTED {src / 'flashtile' / '__init__.py'}" in where.stdout, where.stdout[-2000:]
    clean = run_pytest(src, "tests/kernels/test_softmax.py")  # an unmutated copy passes what a mutant fails
    assert clean.returncode == 0, (clean.stdout + clean.stderr)[-2000:]


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.gpu) if MUTANTS[n].needs_gpu else n for n in sorted(MUTANTS)]
)
def test_each_planted_bug_fails_at_least_one_test(name, tmp_path):
    mutant = MUTANTS[name]
    if mutant.needs_gpu and not torch.cuda.is_available():
        pytest.skip("this bug is invisible in the Triton interpreter; run on a GPU (make gpu-test runs it)")
    src = copy_of_the_package(tmp_path)
    target = src / "flashtile" / mutant.path
    source = target.read_text()
    assert source.count(mutant.old) == 1, f"{name}: the code to mutate is no longer in {mutant.path}"
    target.write_text(source.replace(mutant.old, mutant.new))
    run = run_pytest(src, *mutant.tests)
    tail = (run.stdout + run.stderr)[-2000:]
    assert run.returncode == 1, f"{name}: expected failing tests (exit 1), got exit {run.returncode}:\n{tail}"

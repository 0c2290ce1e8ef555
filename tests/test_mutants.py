"""Mutation smoke test: plant one real bug at a time in a copy of the package and check that the test
suite notices. A suite that stays green on a broken kernel tests nothing.

Each mutant names the source file, an exact piece of it (present exactly once, so a refactor cannot turn
the mutant into a silent no-op), its broken replacement, and the one test that must fail on it (a test
that kills it; the others that would too are not run again). All copies run in one Python process
(tests/_mutant_driver.py: torch is imported once, the package copy and the tests are imported afresh for
each); a mutant is killed when its test fails (pytest exit code 1), not when it cannot even be
collected (exit code 2 or more would hide a typo here). A control run first checks that the copy is what
the tests import, and that the unmutated copy passes every one of those tests (one pytest session for
all of them: a mutant's test then fails for its mutant, not for how the driver runs it).
"""

from __future__ import annotations

import json
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
    kills: str  # the test (a pytest node id) that fails on this mutant
    needs_gpu: bool = False


MUTANTS = {
    # The launcher's favourite bug: assume K is contiguous, so a (B, T, H, D) view is read wrongly.
    "forward_ignores_the_key_row_stride": Mutant(
        "kernels/forward.py",
        "j0[None, :].to(tl.int64) * stride_kt",
        "j0[None, :].to(tl.int64) * HEAD_DIM",
        "tests/kernels/test_forward.py::test_forward_reads_transposed_views_without_a_copy",
    ),
    # The softmax kernel reads columns as if they were adjacent.
    "softmax_ignores_the_column_stride": Mutant(
        "kernels/softmax.py",
        "X + row * stride_xr + cols * stride_xc, mask=inside",
        "X + row * stride_xr + cols, mask=inside",
        "tests/kernels/test_softmax.py::test_softmax_kernel_itself_reads_a_column_stride",
    ),
    # The causal mask applied in the forward only: the dK/dV kernel lets hidden keys take gradient.
    "mask_only_in_the_forward": Mutant(
        "kernels/backward.py",
        "                           band_lo, band_hi, CAUSAL, BAND)  # fmt: skip",
        "                           band_lo, band_hi, False, BAND)  # fmt: skip",
        "tests/kernels/test_backward.py::test_backward_from_an_external_lse_alone",
    ),
    # lse kept in the input dtype: 16 bits cannot carry what the backward subtracts.
    "lse_in_the_input_dtype": Mutant(
        "reference/forward.py",
        "lse = torch.empty(q.shape[:-1], dtype=c, device=q.device)",
        "lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)",
        "tests/test_numerics.py::test_the_reference_tier_backpropagates_its_own_16_bit_forward",
    ),
    # The hand-off in mixed units: m stored scaled while the backward subtracts it from raw dots.
    "hand_off_in_mixed_units": Mutant(
        "kernels/forward.py",
        "tl.store(rows + n_rows, m, mask=row_ok)",
        "tl.store(rows + n_rows, m * qk_scale, mask=row_ok)",
        "tests/kernels/test_backward.py::test_backward_matches_when_head_dim_is_not_a_power_of_two",
    ),
    # tf32 for fp32 inputs in the backward only: the recomputed raw dots no longer match the forward's.
    # The interpreter multiplies in full fp32 whatever it is told, so only a GPU can see this one.
    "tf32_in_the_backward": Mutant(
        "kernels/backward.py",
        "DOT_PRECISION=dot_precision(q.dtype)",
        'DOT_PRECISION="tf32"',
        "tests/test_numerics.py::test_backward_on_the_forwards_own_statistics_is_exact_at_any_logit_magnitude",
        needs_gpu=True,
    ),
}


def copy_of_the_package(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "src"


def run_in_one_process(tmp_path: Path, jobs: list[dict]) -> dict[str, dict]:
    """Each job {"name", "src", "nodes"} through tests/_mutant_driver.py; its result by name."""
    jobs_file, results_file = tmp_path / "jobs.json", tmp_path / "results.json"
    jobs_file.write_text(json.dumps(jobs))
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_mutant_driver.py"), str(jobs_file), str(results_file)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0 and results_file.exists(), (run.stdout + run.stderr)[-3000:]
    results = {r["name"]: r for r in json.loads(results_file.read_text())}
    for r in results.values():
        r["log"] = run.stdout
    return results


def plant(name: str, tmp_path: Path) -> Path:
    """A copy of the package with mutant ``name`` planted in it."""
    mutant = MUTANTS[name]
    src = copy_of_the_package(tmp_path / name)
    target = src / "flashtile" / mutant.path
    source = target.read_text()
    assert source.count(mutant.old) == 1, f"{name}: the code to mutate is no longer in {mutant.path}"
    target.write_text(source.replace(mutant.old, mutant.new))
    return src


def check_killed(names: list[str], tmp_path: Path) -> None:
    """The unmutated copy passes each mutant's test and is what the tests import; each mutant fails it."""
    kills = sorted({MUTANTS[n].kills for n in names})
    jobs = [{"name": "clean", "src": str(copy_of_the_package(tmp_path / "clean")), "nodes": kills}]
    jobs += [{"name": n, "src": str(plant(n, tmp_path)), "nodes": [MUTANTS[n].kills]} for n in names]
    results = run_in_one_process(tmp_path, jobs)
    for job in jobs:
        r = results[job["name"]]
        assert r["imported"] == str(Path(job["src"]) / "flashtile" / "__init__.py"), f"{job['name']}: {r['imported']}"
    control = results["clean"]
    assert control["exit"] == 0, f"the unmutated copy fails one of {kills}:\n{control['log'][-3000:]}"
    survivors = {n: results[n]["exit"] for n in names if results[n]["exit"] != 1}
    log = results[names[0]]["log"][-3000:]
    assert not survivors, f"mutants not killed (pytest exit code, 1 expected): {survivors}\n{log}"


def test_each_planted_bug_fails_the_test_that_guards_it(tmp_path):
    check_killed(sorted(n for n, m in MUTANTS.items() if not m.needs_gpu), tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="this bug is invisible in the Triton interpreter")
def test_each_bug_only_a_gpu_can_see_fails_the_test_that_guards_it(tmp_path):
    check_killed(sorted(n for n, m in MUTANTS.items() if m.needs_gpu), tmp_path)

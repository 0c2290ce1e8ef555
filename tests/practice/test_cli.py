"""``python -m flashtile.practice`` end to end: init, check on skeletons, on the package's code, on a bug."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashtile.practice.battery import SITE, STEPS
from flashtile.practice.cli import main

HERE = Path(__file__).resolve().parent


def practice(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashtile.practice", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=300)


def test_help_lists_the_commands_and_the_steps(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "init" in out and "check" in out and "forward_kernel" in out


def test_init_writes_every_skeleton_and_a_readme_without_section_markers(tmp_path, capsys):
    assert main(["init", str(tmp_path / "mine")]) == 0
    written = sorted(p.name for p in (tmp_path / "mine").iterdir())
    assert written == sorted({f"{s.file}.py" for s in STEPS} | {"README.md"})
    for path in (tmp_path / "mine").iterdir():
        text = path.read_text(encoding="utf-8")
        assert "--8<--" not in text
        if path.suffix == ".py":
            compile(text, str(path), "exec")
            assert "raise NotImplementedError" in text
    readme = (tmp_path / "mine" / "README.md").read_text(encoding="utf-8")
    assert all(f"`{s.name}`" in readme and f"{SITE}{s.chapter}" in readme for s in STEPS)
    assert "check ." in readme


def test_init_refuses_to_overwrite_without_force(tmp_path, capsys):
    assert main(["init", str(tmp_path)]) == 0
    (tmp_path / "forward.py").write_text("# my work\n", encoding="utf-8")
    assert main(["init", str(tmp_path)]) == 1
    assert (tmp_path / "forward.py").read_text(encoding="utf-8") == "# my work\n"
    assert "already exist" in capsys.readouterr().err
    assert main(["init", str(tmp_path), "--force"]) == 0


def test_check_on_the_untouched_skeleton_fails_every_step_with_help(tmp_path):
    assert main(["init", str(tmp_path)]) == 0
    proc = practice("check", tmp_path, "--fast")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "0 of 6 steps pass" in out
    for step in STEPS:
        assert f"FAILED {step.name}: B=" in out or f"FAILED {step.name}: " in out
        assert f"read:  {SITE}{step.chapter}" in out
    assert "NotImplementedError: TODO" in out and "hint:  write flash_attention_forward in forward.py" in out


def test_check_passes_when_the_packages_functions_are_copied_in(tmp_path):
    for step in STEPS:
        (tmp_path / f"{step.file}.py").write_text(f"from {step.package_module} import *  # noqa: F403\n",
                                                  encoding="utf-8")
    proc = practice("check", tmp_path, "--fast")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "6 of 6 steps pass" in proc.stdout


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_check_names_the_failing_case_of_a_planted_bug_and_exits_nonzero(tmp_path):
    (tmp_path / "forward_kernel.py").write_text(
        f"import sys\nsys.path.insert(0, {str(HERE.parent)!r})\n"
        "from practice._reader_kernels import make_forward\n"
        "flash_attention = make_forward(padded_keys_neg_inf=False).flash_attention\n", encoding="utf-8")
    proc = practice("check", tmp_path, "--step", "forward_kernel")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED forward_kernel: B=1 H=2 Tq=20 Tk=37 D=16, block_q=16 block_k=16, no mask" in proc.stdout
    assert "padded keys (columns j >= Tk of the last tile) must score -inf, not 0" in proc.stdout
    assert "0 of 1 steps pass" in proc.stdout


def test_a_file_that_does_not_import_fails_its_step_with_the_error(tmp_path):
    (tmp_path / "online_softmax.py").write_text("def online_softmax_update(:\n", encoding="utf-8")
    proc = practice("check", tmp_path, "--step", "online_softmax")
    assert proc.returncode == 1
    assert "FAILED online_softmax: importing online_softmax.py" in proc.stdout and "SyntaxError" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter re-run only happens without CUDA")
def test_check_turns_the_interpreter_on_by_itself_when_there_is_no_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = practice("check", "--package", "--step", "fused_softmax", "--fast", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Triton interpreter on the CPU" in proc.stdout and "1 of 1 steps pass" in proc.stdout


def test_check_without_a_directory_is_a_usage_error():
    proc = practice("check")
    assert proc.returncode == 2 and "check needs DIR" in proc.stderr

"""``python -m flashtile.practice`` end to end: init, check on skeletons, on the package's code, on a bug."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashtile.practice.battery import SITE
from flashtile.practice.cli import main
from flashtile.practice.steps import STEPS, step_named

HERE = Path(__file__).resolve().parent


def practice(*args, env=None) -> subprocess.CompletedProcess:
    """``python -m flashtile.practice ARGS`` as its own process: the entry point a reader types."""
    return subprocess.run([sys.executable, "-m", "flashtile.practice", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=300)


def practice_here(capfd, *args) -> subprocess.CompletedProcess:
    """``main(ARGS)`` in this process, the checker's output and its workers' standard error read from the file
    descriptors (capfd): the same checker, its worker processes and their time limits, one Python start fewer
    than ``practice`` (which test_check_on_skeletons_and_a_planted_bug_fails_every_step_with_help keeps)."""
    capfd.readouterr()  # nothing from before this run
    code = main([str(a) for a in args])
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["main", *map(str, args)], code, out, err)


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


def test_check_on_skeletons_and_a_planted_bug_fails_every_step_with_help(tmp_path):
    # one run of the command a reader types, two checks: the untouched skeletons fail every step with a
    # "write ..." hint, and a kernel with a planted bug fails at the case that exposes it, with its hint
    assert main(["init", str(tmp_path)]) == 0
    (tmp_path / "forward_kernel.py").write_text(
        f"import sys\nsys.path.insert(0, {str(HERE.parents[1])!r})\n"
        "from tests.practice._reader_kernels import make_forward\n"
        "flash_attention = make_forward(padded_keys_neg_inf=False).flash_attention\n", encoding="utf-8")
    proc = practice("check", tmp_path, "--hint", "formula")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert f"0 of {len(STEPS)} steps pass" in out
    for step in STEPS:
        assert f"FAILED {step.name}: " in out
        assert f"read:  {SITE}{step.chapter}" in out
    assert "NotImplementedError: TODO" in out and "hint:  write flash_attention_forward in forward.py" in out
    assert "FAILED forward_kernel: B=1 H=2 Tq=20 Tk=37 D=16, block_q=16 block_k=16, no mask" in out
    assert "(and 1 more; -v shows them)" in out  # D = 24 pads keys too
    # the nudge names the symptom and where to look; --hint formula adds the formula on a line of its own
    assert "hint:  your output is attention with the padded keys (columns j >= Tk of the last tile) scoring 0" in out
    assert "formula: s = tl.where(j[None, :] < Tk, s, float('-inf'))" in out


def test_the_default_hint_is_the_nudge_without_the_formula():
    from flashtile.practice.battery import HINT_PADDED, Failure, StepResult
    from flashtile.practice.cli import build_parser, failure_report
    from flashtile.practice.steps import step_named

    assert build_parser().parse_args(["check", "x"]).hint == "nudge"
    result = StepResult(step_named("forward_kernel"), failures=[Failure("case", "error", HINT_PADDED, "ch")])
    assert HINT_PADDED.nudge in failure_report(result) and "formula:" not in failure_report(result)
    assert f"formula: {HINT_PADDED.formula}" in failure_report(result, level="formula")


def test_check_passes_when_the_packages_functions_are_copied_in(tmp_path, capfd, monkeypatch):
    # one run, two checks: the reader's folder of right code passes, and without CUDA the checker turns the
    # Triton interpreter on by itself (TRITON_INTERPRET unset) and shows none of the interpreter's warnings
    for step in STEPS:
        (tmp_path / f"{step.file}.py").write_text(f"from {step.package_module} import *  # noqa: F403\n",
                                                  encoding="utf-8")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the workers get the checker's environment
    proc = practice_here(capfd, "check", tmp_path, "--fast")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(STEPS)} of {len(STEPS)} steps pass" in proc.stdout
    if not torch.cuda.is_available():  # the interpreter is chosen only without CUDA
        assert "Triton interpreter on the CPU" in proc.stdout
        assert "Warning" not in proc.stderr, proc.stderr  # numpy's "invalid value" from the interpreter


def test_check_package_checks_the_packages_own_functions(monkeypatch):
    # the flag's plumbing only; that the package passes every case is test_battery's
    # test_package_passes_every_case_of_every_step, and a full run of the checker is the test above
    import flashtile.practice.cli as cli

    calls = []
    monkeypatch.setattr(cli, "check", lambda *args: calls.append(args) or 0)
    assert main(["check", "--package", "--step", "forward_kernel", "--fast"]) == 0
    assert main(["check", "--package", "some/folder/that/is/ignored"]) == 0
    assert [c[:3] for c in calls] == [(None, ["forward_kernel"], True), (None, None, False)]


def test_check_without_a_directory_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["check"])
    assert exit_.value.code == 2 and "check needs DIR" in capsys.readouterr().err


def test_init_on_a_file_or_an_unwritable_path_is_a_clean_error(tmp_path, capsys, monkeypatch):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n", encoding="utf-8")
    assert main(["init", str(a_file)]) == 2
    assert main(["init", str(a_file / "mine")]) == 2  # a folder inside a file
    err = capsys.readouterr().err
    assert "is not a folder" in err and "cannot write into" in err and "Traceback" not in err
    assert a_file.read_text(encoding="utf-8") == "mine\n"

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "write_text", refuse)  # a read-only place, whoever runs the test
    assert main(["init", str(tmp_path / "mine")]) == 2
    err = capsys.readouterr().err
    assert "cannot write into" in err and "Permission denied" in err and "Traceback" not in err


def test_check_on_a_missing_folder_is_a_clean_error(tmp_path, capsys):
    assert main(["check", str(tmp_path / "nowhere")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_verbose_shows_every_failure_and_the_default_the_first_with_a_count():
    from flashtile.practice.battery import Failure, StepResult
    from flashtile.practice.cli import failure_report
    from flashtile.practice.steps import step_named

    result = StepResult(step_named("forward"), failures=[Failure(f"case {n}", f"error {n}", "hint", "ch") for n in
                                                          range(3)])
    short, full = failure_report(result), failure_report(result, verbose=True)
    assert "case 0" in short and "(and 2 more; -v shows them)" in short and "case 1" not in short
    assert all(f"case {n}" in full and f"error {n}" in full for n in range(3)) and "more" not in full


HOSTILE = {  # each file tries to stop the checker a different way
    "online_softmax.py": """
from flashtile.reference.online_softmax import lse_from_stats, merge, online_softmax_stats
from flashtile.reference.online_softmax import online_softmax_update as right


def online_softmax_update(m, l, x_block):
    while bool((l > 0).any()):  # an infinite loop, from a state that has seen something
        pass
    return right(m, l, x_block)
""",
    "forward.py": """
import sys

from flashtile.reference.forward import flash_attention_forward as right


def flash_attention_forward(q, k, v, **kwargs):
    if kwargs.get("scale") == 60.0:
        sys.exit(0)
    return right(q, k, v, **kwargs)
""",
    "backward.py": "raise SystemExit(0)\n",
    "fused_softmax.py": "def fused_softmax(:\n",  # a file that does not even parse
    # the last step, so that no worker has to start after this one ends: the resume after a lost worker is
    # the hang's (online_softmax), here what is checked is that the end of the process is noticed and named
    "forward_kernel.py": """
import os

print("leaving now")
os._exit(0)
""",
}


def test_the_readers_code_cannot_stop_or_hang_the_checker(tmp_path, capfd):
    # a hang in a case (the worker stopped at the time limit, a new one goes on from the next case), sys.exit
    # in a case, SystemExit and a SyntaxError at import, and os._exit at import (the process ended): two
    # worker processes in all, the second one's end the last thing that happens
    for name, text in HOSTILE.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    steps = [a for s in ("online_softmax", "forward", "backward", "fused_softmax", "forward_kernel")
             for a in ("--step", s)]
    proc = practice_here(capfd, "check", tmp_path, *steps, "--fast", "-v", "--time-limit", "3")
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "FAILED online_softmax: update from a state of 8 columns" in out
    assert "TimeoutError: no answer within the time limit of 3 s" in out
    assert "FAILED forward: B=1 H=2 Tq=16 Tk=24" in out and "SystemExit: your code tried to end the checker" in out
    assert "FAILED backward: importing backward.py\n  error: SystemExit: your code tried to end the checker" in out
    assert "FAILED fused_softmax: importing fused_softmax.py\n  error: SyntaxError" in out
    assert ("FAILED forward_kernel: importing forward_kernel.py\n"
            "  error: the process running your code ended (exit status 0) during this case") in out
    assert "leaving now" in proc.stderr  # the reader's prints reach the terminal, not the checker's channel
    counts = {line.split()[0]: line.split()[-1] for line in out.splitlines()
              if line.split() and line.split()[0] in {s.name for s in STEPS}}
    fast = {s.name: len([c for c in s.cases() if c.fast]) for s in STEPS}
    # every case after the one that hung (a new worker) or exited (the same worker) still ran, and passed
    assert counts == {"online_softmax": f"{fast['online_softmax'] - 1}/{fast['online_softmax']}",
                      "forward": f"{fast['forward'] - 1}/{fast['forward']}", "backward": "0/1",
                      "fused_softmax": "0/1", "forward_kernel": "0/1"}, out
    assert "0 of 5 steps pass" in out


def test_a_spawned_worker_gives_the_same_verdicts_as_a_forked_one(tmp_path, capfd, monkeypatch):
    # where os.fork is not safe (macOS, Windows, a torch built with CUDA) the worker is a fresh interpreter:
    # the package's step passes, a planted bug fails at its case, and a hang is stopped and the next case goes on
    import flashtile.practice.cli as cli

    monkeypatch.setattr(cli, "can_fork", lambda: False)
    forks = []
    monkeypatch.setattr(cli.os, "fork", lambda: forks.append(1))  # must not be called
    (tmp_path / "online_softmax.py").write_text(
        f"import sys\nsys.path.insert(0, {str(HERE.parents[1])!r})\n"
        "from tests.practice._reader_online_softmax import make\n\nglobals().update(vars(make(guard_merge=False)))\n"
        "_update = online_softmax_update\n\n\ndef online_softmax_update(m, l, x):\n"
        "    while x.shape[-1] == 6:  # the update from a state: a hang\n        pass\n    return _update(m, l, x)\n",
        encoding="utf-8")
    proc = practice_here(capfd, "check", tmp_path, "--step", "online_softmax", "--fast", "-v", "--time-limit", "3")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED online_softmax: update from a state of 8 columns" in proc.stdout
    assert "TimeoutError: no answer within the time limit of 3 s" in proc.stdout
    assert "FAILED online_softmax: merge two empty states" in proc.stdout
    n = len([c for c in step_named("online_softmax").cases() if c.fast])
    assert f"{n - 2}/{n}" in proc.stdout  # every other case ran, in the worker started after the hang, and passed
    proc = practice_here(capfd, "check", "--package", "--step", "online_softmax", "--fast")
    assert proc.returncode == 0 and "1 of 1 steps pass" in proc.stdout, proc.stdout + proc.stderr
    assert not forks


@pytest.mark.parametrize("step", ["backward", "forward_kernel", "backward_kernel"])
def test_one_steps_check_costs_under_4_seconds_of_cpu(step):
    # CPU time (the checker and its worker), not wall time, so that other work on the machine does not
    # count: on an idle 2-core machine one step's check, Python's start and torch's import included, takes
    # about what it costs; the exit skips the interpreter's teardown of torch's modules, so the output must
    # still be whole when it returns
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = practice("check", "--package", "--step", step)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("1 of 1 steps pass")
    assert cpu < 4.0, f"{step}: {cpu:.2f} s of CPU"


def test_the_autograd_step_runs_its_gradients_in_the_worker(tmp_path, capfd):
    # the graph cannot cross processes: the worker runs the call and its backward, and measures what autograd
    # saved; a right Function passes, one that lets autograd record the tiles fails the saved-bytes case
    here = f"import sys\nsys.path.insert(0, {str(HERE.parents[1])!r})\nfrom tests.practice._reader_drills import "
    (tmp_path / "autograd.py").write_text(here + "make_autograd\nreference_attention = make_autograd()"
                                          ".reference_attention\n", encoding="utf-8")
    proc = practice_here(capfd, "check", tmp_path, "--step", "autograd")
    assert proc.returncode == 0 and "1 of 1 steps pass" in proc.stdout, proc.stdout + proc.stderr
    (tmp_path / "autograd.py").write_text(here + "make_autograd\nreference_attention = make_autograd("
                                          "no_function=True).reference_attention\n", encoding="utf-8")
    proc = practice_here(capfd, "check", tmp_path, "--step", "autograd")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED autograd: B=1 H=1 Tq=128 Tk=128" in proc.stdout and "autograd saved" in proc.stdout
    assert "hint:  autograd saved more than q, k, v, o and lse" in proc.stdout


def test_the_backward_kernel_step_runs_a_readers_kernels_in_the_worker(tmp_path, capfd):
    # the reader's Triton backward, imported in the worker (the interpreter on a CPU): right, it passes; with
    # dV accumulated from P instead of Pᵀ, every case fails and the first names dV's line
    source = (HERE / "_reader_backward_kernel.py").read_text(encoding="utf-8")
    (tmp_path / "backward_kernel.py").write_text(source, encoding="utf-8")
    proc = practice_here(capfd, "check", tmp_path, "--step", "backward_kernel")
    assert proc.returncode == 0 and "1 of 1 steps pass" in proc.stdout, proc.stdout + proc.stderr
    old = "dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT)"
    assert source.count(old) == 1
    (tmp_path / "backward_kernel.py").write_text(
        source.replace(old, "dv += tl.dot(tl.trans(pt).to(do.dtype), do, input_precision=DOT)"), encoding="utf-8")
    proc = practice_here(capfd, "check", tmp_path, "--step", "backward_kernel")
    n = len(step_named("backward_kernel").cases())
    assert proc.returncode == 1 and f"0/{n}" in proc.stdout, proc.stdout + proc.stderr
    assert f"(and {n - 1} more; -v shows them)" in proc.stdout
    assert "hint:  dQ and dK are right, so P and dS are, and dV is not" in proc.stdout

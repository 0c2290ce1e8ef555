"""Readers' code that games the checker: a strip-wise forward with a planted causal bug, and forged results."""

from __future__ import annotations

import pytest

from flashtile.practice.battery import HINT_MEMORY, run_step
from flashtile.practice.cli import main
from flashtile.practice.steps import STEPS, step_named
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


# Code a reader could append to an untouched skeleton to forge a pass: at import, it looks through every object
# of its process (gc) for a writable file or pipe, and writes into each what a checker might read as results,
# twelve JSON result lines and a summary (what made an earlier checker, which believed its worker's lines,
# print "6 of 6 steps pass" and exit 0 on the untouched skeletons), then frames in the worker's own format
# answering "ok" to the next fifty requests; and it does it again on every call of a skeleton function, before
# the NotImplementedError.
FORGER = '''

import gc as _gc
import io as _io
import json as _json


def _forge():
    import torch
    try:
        from flashtile.practice.worker import HEADER
    except ImportError:  # a checker without frames: the lines alone
        HEADER = None

    lines = "".join(_json.dumps({"event": "result", "step": s, "index": i, "ok": True}) + "\\n"
                    for s in range(6) for i in range(2))
    lines += "".join(_json.dumps({"event": "step_end", "step": s, "skipped": 0}) + "\\n" for s in range(6))
    lines += _json.dumps({"event": "end"}) + "\\n6 of 6 steps pass\\n"
    frames = b""
    for n in range(1, 51 if HEADER else 1):
        buffer = _io.BytesIO()
        torch.save({"id": n, "ok": True, "functions": [], "value": torch.zeros(1)}, buffer)
        frames += HEADER.pack(len(buffer.getvalue())) + buffer.getvalue()
    for obj in _gc.get_objects():
        if isinstance(obj, _io.IOBase):
            try:
                if obj.closed or not obj.writable():
                    continue
                obj.write(lines if isinstance(obj, _io.TextIOBase) else lines.encode() + frames)
                obj.flush()
            except Exception:
                pass


_forge()
for _name, _f in list(globals().items()):
    if callable(_f) and getattr(_f, "__module__", None) == __name__ and not _name.startswith("_"):
        def _forging(*args, _f=_f, **kwargs):
            _forge()
            return _f(*args, **kwargs)
        globals()[_name] = _forging
'''


def test_forged_results_written_through_any_reachable_channel_do_not_pass(tmp_path):
    # the untouched skeletons, each with the forger appended: every step must still fail, with the checker's own
    # count of each step's cases; the command a reader types, in its own process
    import subprocess
    import sys

    assert main(["init", str(tmp_path)]) == 0
    for path in tmp_path.glob("*.py"):
        path.write_text(path.read_text(encoding="utf-8") + FORGER, encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "flashtile.practice", "check", str(tmp_path), "--fast"],
                          capture_output=True, encoding="utf-8", errors="replace", timeout=300)  # the frames are bytes
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    n = len(STEPS)
    assert f"0 of {n} steps pass" in out and f"{n} of {n}" not in out and '"event"' not in out, out
    for step in ("online_softmax", "forward", "causal", "backward", "fused_softmax", "forward_kernel",
                 "backward_kernel"):
        assert f"FAILED {step}: " in out, out


def test_forged_frames_after_a_right_answer_do_not_pass(tmp_path, capfd):
    # the package's online softmax, but merge answers right and then writes a forged "ok" for the next requests
    # into the pipe it finds: the checker reads the forgery as the answer to its next request, cannot read it as
    # one, and fails that case; the cases before it pass
    (tmp_path / "online_softmax.py").write_text(
        "from flashtile.reference.online_softmax import *  # noqa: F403\n"
        "from flashtile.reference.online_softmax import merge as _right\n" + FORGER.split("_forge()\nfor")[0] +
        "\n\ndef merge(*args):\n    out = _right(*args)\n    _forge()\n    return out\n", encoding="utf-8")
    capfd.readouterr()
    code = main(["check", str(tmp_path), "--step", "online_softmax"])
    out = capfd.readouterr().out
    assert code == 1, out
    assert "could not be read" in out and "0 of 1 steps pass" in out, out
    assert "write nothing into the checker's pipe" in out
    assert f"{len(STEPS)} of {len(STEPS)}" not in out and '"event"' not in out


def test_an_answer_is_read_as_data_never_run_as_code(tmp_path):
    # a frame that plain pickle would run (a file created on load) is refused by the reader of answers, and a
    # frame longer than any answer is refused before it is read
    import io
    import pickle
    from pathlib import Path

    from flashtile.practice.worker import HEADER, MAX_FRAME, read_frame

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return Path.touch, (marker,)

    data = pickle.dumps({"id": 1, "ok": True, "value": Payload()}, protocol=2)
    with pytest.raises(Exception):  # noqa: B017  (which error torch.load raises is its own business)
        read_frame(io.BytesIO(HEADER.pack(len(data)) + data))
    assert not marker.exists()
    pickle.loads(data)  # the control: plain pickle runs it
    assert marker.exists()
    with pytest.raises(ValueError, match="a frame of"):
        read_frame(io.BytesIO(HEADER.pack(MAX_FRAME + 1) + b"x"))


def test_a_full_softmax_backward_and_an_unguarded_merge_fail_through_the_checker(tmp_path, capfd):
    # the two false passes of the battery, through the command: the tiling of the backward measured in the worker
    # (where the reader's code runs), and merge(empty, empty); the same readers without the bugs pass (control)
    (tmp_path / "online_softmax.py").write_text(
        "from tests.practice._reader_online_softmax import make\n\nglobals().update(vars(make(guard_merge=False)))\n",
        encoding="utf-8")
    (tmp_path / "backward.py").write_text(
        "from tests.practice._reader_forward import make_backward\n\n"
        "flash_attention_backward = make_backward(untiled=True).flash_attention_backward\n", encoding="utf-8")
    capfd.readouterr()
    code = main(["check", str(tmp_path), "--step", "online_softmax", "--step", "backward", "--fast"])
    out = capfd.readouterr().out
    assert code == 1, out
    assert "FAILED online_softmax: merge two empty states" in out and "l of merge(empty, empty): 3 NaN" in out
    assert "FAILED backward: B=1 H=1 Tq=128 Tk=128" in out and "a tensor of 128 KiB was created" in out, out
    assert "0 of 2 steps pass" in out
    for name in ("online_softmax.py", "backward.py"):  # the control
        path = tmp_path / name
        path.write_text(path.read_text(encoding="utf-8").replace("guard_merge=False", "").replace("untiled=True", ""),
                        encoding="utf-8")
    code = main(["check", str(tmp_path), "--step", "online_softmax", "--step", "backward", "--fast"])
    out = capfd.readouterr().out
    assert code == 0 and "2 of 2 steps pass" in out, out


def test_a_worker_started_after_a_lost_one_holds_no_truth_of_the_next_case(tmp_path):
    """A reader's file that ends its worker in one case, then, in the worker that replaces it, looks up the
    stack it inherited for the checker's answer: the replacement is started between cases, so there is
    none to find, and no case passes."""
    import os
    import subprocess
    import sys

    (tmp_path / "sink_gradient.py").write_text(
        "import os, sys, torch\n"
        "def sink_gradient(sinks, lse, delta):\n"
        "    f = sys._getframe()\n"
        "    while f is not None:\n"
        "        for value in f.f_locals.values():\n"
        "            if isinstance(value, torch.Tensor) and value.shape == sinks.shape and value is not sinks:\n"
        "                return value.clone()\n"
        "        f = f.f_back\n"
        "    os._exit(0)\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "flashtile.practice", "check", str(tmp_path), "--step",
                          "sink_gradient"], capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert "0/3" in run.stdout, run.stdout

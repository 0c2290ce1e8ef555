"""``python -m flashtile.practice interview`` end to end, with scripted answers on standard input and a
record in a temporary folder."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from flashtile.practice.bank import load_bank
from flashtile.practice.cli import main
from flashtile.practice.mock import draw, load_record


def interview(*args, stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashtile.practice", "interview", *map(str, args)], input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_a_mock_interview_end_to_end_then_the_missed_question_comes_first(tmp_path, monkeypatch, capsys):
    mine, record = tmp_path / "mine", tmp_path / "record.json"
    assert main(["init", str(mine)]) == 0
    (mine / "online_softmax.py").write_text("from flashtile.reference.online_softmax import *  # noqa: F403\n",
                                            encoding="utf-8")
    capsys.readouterr()
    # three answers (text, an empty line, then whether it matched), then Enter for the coding step's check
    script = "m and l per row\n\ny\nI do not know\n\nn\n\n\n"
    proc = interview("--questions", 3, "--seed", 7, "--dir", mine, "--step", "online_softmax", "--minutes", 5,
                     "--record", record, stdin=script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    drawn = [line.split("[")[1].split(" ")[0] for line in out.splitlines() if line.startswith("Question ")]
    assert len(drawn) == 3 and drawn == [q.id for q in draw(load_bank(), load_record(record.with_name("none.json")),
                                                          3, None, random.Random(7))]
    bank = {q.id: q for q in load_bank()}
    for qid in drawn:  # each question, its tag, then its model answer and derivation link
        assert f"[{qid} · {bank[qid].group} · {bank[qid].difficulty}]" in out
        assert f"Derived in: {bank[qid].derivation}" in out
    assert out.count("Model answer:") == 3
    assert "Coding: step online_softmax" in out and "passed after" in out
    saved = json.loads(record.read_text(encoding="utf-8"))
    (session,) = saved["sessions"]
    assert [q["id"] for q in session["questions"]] == drawn
    assert [q["got"] for q in session["questions"]] == [True, False, False]  # the third answer was empty
    assert session["questions"][0]["answer"] == "m and l per row"
    assert session["coding"]["passed"] and session["coding"]["seconds_to_pass"] >= 0
    assert saved["steps"]["online_softmax"]["passed"] and saved["steps"]["online_softmax"]["attempts"] == 1
    assert {qid for qid, q in saved["questions"].items() if q["last"] == "missed"} == set(drawn[1:])

    # the second interview, in this process: the two missed questions first; a coding step that fails, then stop
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n\n\nstop\n"))
    assert main(["interview", "--questions", "2", "--seed", "1", "--dir", str(mine), "--step", "forward",
                 "--record", str(record)]) == 0
    out = capsys.readouterr().out
    again = [line.split("[")[1].split(" ")[0] for line in out.splitlines() if line.startswith("Question ")]
    assert set(again) == set(drawn[1:])
    assert "FAILED forward" in out and "write flash_attention_forward in forward.py" in out
    saved = json.loads(record.read_text(encoding="utf-8"))
    assert len(saved["sessions"]) == 2 and saved["sessions"][1]["coding"] == {
        "step": "forward", "passed": False, "checks": 1, "seconds": saved["sessions"][1]["coding"]["seconds"],
        "seconds_to_pass": None}
    assert saved["questions"][drawn[1]]["attempts"] == 2 and saved["questions"][drawn[1]]["missed"] == 2


def test_the_record_defaults_to_the_practice_folder_and_never_goes_in_the_package(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["interview", "--questions", "1", "--dir", str(tmp_path), "--seed", "0"]) == 0
    assert (tmp_path / ".flashtile-practice-record.json").is_file()
    package = Path(__import__("flashtile").__file__).parent
    assert main(["interview", "--record", str(package / "practice" / "record.json")]) == 2
    assert "must not be inside the flashtile package" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("[1, 2]", encoding="utf-8")
    assert main(["interview", "--record", str(tmp_path / "bad.json")]) == 2
    assert "not a practice record" in capsys.readouterr().err


def test_draw_takes_the_chosen_difficulties_and_the_missed_questions_first():
    bank = load_bank()
    record = {"questions": {"C5": {"last": "missed", "when": "2026-01-02"}, "A8": {"last": "missed",
                                                                                "when": "2026-01-03"},
                            "A1": {"last": "right", "when": "2026-01-04"}}}
    drawn = draw(bank, record, 5, ["hard"], random.Random(0))
    assert [q.id for q in drawn[:2]] == ["A8", "C5"]  # the most recently missed first
    assert all(q.difficulty == "hard" for q in drawn) and len(drawn) == 5
    assert len({q.id for q in draw(bank, {"questions": {}}, 100, None, random.Random(0))}) == len(bank)


@pytest.mark.parametrize("args", [["--questions", "-1"], ["--minutes", "0"]])
def test_bad_arguments_are_clean_errors(args, capsys, tmp_path):
    assert main(["interview", "--record", str(tmp_path / "r.json"), *args]) == 2
    assert "must be" in capsys.readouterr().err

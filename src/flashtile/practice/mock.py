"""``python -m flashtile.practice interview``: a mock interview from the question bank, with a record.

It draws questions (the ones missed last time first), takes a typed answer to each, then shows the
model answer and the chapter that derives it and asks whether you had it; then, given ``--dir``, a
coding step against a timer, checked by the practice battery as often as you like until it passes or
the time is up. A JSON record (``--record``; by default in the practice folder, or in your home
folder without one, never inside the package) keeps every attempt, the time each step took to pass,
and which questions were missed, so that the next interview starts with those.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import random
import sys
import time
from pathlib import Path
from typing import TextIO

from .bank import DIFFICULTIES, Question, load_bank
from .steps import STEP_NAMES, step_named

RECORD_NAME = ".flashtile-practice-record.json"
PACKAGE = Path(__file__).resolve().parents[1]  # flashtile/: the record never goes in here


def default_record(directory: Path | None) -> Path:
    """Where the record goes without --record: the practice folder, else the home folder."""
    return (directory if directory is not None else Path.home()) / RECORD_NAME


def check_record_path(path: Path) -> Path:
    resolved = path.expanduser().resolve()
    if resolved == PACKAGE or PACKAGE in resolved.parents:
        raise ValueError(f"--record must not be inside the flashtile package ({PACKAGE}); got {path}")
    if resolved.is_dir():
        raise ValueError(f"--record must be a file path, got the folder {path}")
    return resolved


def load_record(path: Path) -> dict:
    """The record at ``path``, or an empty one; ValueError for a file that is not a record."""
    empty = {"version": 1, "sessions": [], "questions": {}, "steps": {}}
    if not path.exists():
        return empty
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the record {path}: {exc}") from None
    if not (isinstance(record, dict) and record.get("version") == 1):
        raise ValueError(f"{path} is not a practice record (no \"version\": 1)")
    for key, value in empty.items():
        record.setdefault(key, value)
    return record


def save_record(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)  # a whole record or the old one, never half of one


def draw(bank: list[Question], record: dict, n: int, difficulties: list[str] | None, rng: random.Random):
    """n questions: those whose last answer was missed first (the most recent first), then the others in
    a random order, all of the chosen difficulties."""
    pool = [q for q in bank if not difficulties or q.difficulty in difficulties]
    seen = record["questions"]
    missed = sorted((q for q in pool if seen.get(q.id, {}).get("last") == "missed"),
                    key=lambda q: seen[q.id].get("when", ""), reverse=True)
    rest = [q for q in pool if q not in missed]
    rng.shuffle(rest)
    return (missed + rest)[:n]


def _read_block(stdin: TextIO) -> tuple[str, bool]:
    """Lines up to an empty one; (text, eof)."""
    lines = []
    while True:
        line = stdin.readline()
        if not line:
            return "\n".join(lines), True
        if not line.strip():
            return "\n".join(lines), False
        lines.append(line.rstrip("\n"))


def ask_questions(questions: list[Question], stdin: TextIO, out: TextIO) -> list[dict]:
    results = []
    for n, q in enumerate(questions, 1):
        print(f"\nQuestion {n}/{len(questions)}  [{q.id} · {q.group} · {q.difficulty}]\n{q.text}", file=out)
        print("Type your answer; an empty line ends it.", file=out, flush=True)
        began = time.monotonic()
        answer, eof = _read_block(stdin)
        seconds = time.monotonic() - began
        print(f"\nModel answer:\n{q.plain_answer()}\nDerived in: {q.derivation}", file=out)
        got = False
        if answer.strip() and not eof:
            print("Did your answer have it? [y/n] ", end="", file=out, flush=True)
            got = stdin.readline().strip().lower().startswith("y")
        results.append({"id": q.id, "difficulty": q.difficulty, "seconds": round(seconds, 1), "answer": answer,
                        "got": got})
        print("noted: " + ("right" if got else "missed (drawn first next time)"), file=out)
    return results


def coding_step(step: str, directory: Path, minutes: float, stdin: TextIO, out: TextIO, check) -> dict:
    """Check ``step`` in ``directory`` each time Enter is pressed, until it passes, the time is up or the
    input ends; the time to pass counts from the prompt."""
    s = step_named(step)
    print(f"\nCoding: step {s.name} ({s.summary}). Write {', '.join(s.functions)} in {directory / (s.file + '.py')}."
          f"\nYou have {minutes:g} minutes. Press Enter to check, or type 'stop'.", file=out, flush=True)
    began, checks = time.monotonic(), 0
    while True:
        line = stdin.readline()
        elapsed = time.monotonic() - began
        if not line or line.strip().lower() == "stop":
            return {"step": step, "passed": False, "checks": checks, "seconds": round(elapsed, 1),
                    "seconds_to_pass": None}
        checks += 1
        report = io.StringIO()
        with contextlib.redirect_stdout(report):
            status = check(directory, [step], False)
        out.write(report.getvalue())
        elapsed = time.monotonic() - began
        if status == 0:
            over = elapsed > minutes * 60
            print(f"passed after {elapsed:.0f} s and {checks} check(s)" + (" (over time)" if over else ""), file=out)
            return {"step": step, "passed": True, "over_time": over, "checks": checks, "seconds": round(elapsed, 1),
                    "seconds_to_pass": round(elapsed, 1)}
        if elapsed > minutes * 60:
            print(f"time is up ({minutes:g} minutes): the step does not pass yet", file=out)
            return {"step": step, "passed": False, "checks": checks, "seconds": round(elapsed, 1),
                    "seconds_to_pass": None}
        print(f"{(minutes * 60 - elapsed) / 60:.1f} minutes left. Fix it and press Enter to check again.", file=out,
              flush=True)


def next_step(record: dict) -> str:
    """The first step of the lab's order that has never passed (the last one when all have)."""
    passed = {name for name, s in record["steps"].items() if s.get("passed")}
    return next((name for name in STEP_NAMES if name not in passed), STEP_NAMES[-1])


def interview(n_questions: int, difficulties: list[str] | None, directory: Path | None, step: str | None,
              minutes: float, record_path: Path | None, seed: int | None, stdin: TextIO | None = None,
              out: TextIO | None = None, check=None) -> int:
    """One mock interview (see the module's docstring); exit status 0. ``check`` runs the coding step's
    battery: the CLI passes its own ``check`` (this module does not import the CLI back)."""
    stdin, out = stdin or sys.stdin, out or sys.stdout
    if n_questions < 0:
        raise ValueError(f"--questions must be 0 or more, got {n_questions}")
    if not minutes > 0:
        raise ValueError(f"--minutes must be a positive number, got {minutes}")
    if difficulties and not set(difficulties) <= set(DIFFICULTIES):
        raise ValueError(f"--difficulty must be among {', '.join(DIFFICULTIES)}, got {difficulties}")
    path = check_record_path(record_path or default_record(directory))
    record = load_record(path)
    bank = load_bank()
    questions = draw(bank, record, n_questions, difficulties, random.Random(seed))
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"Mock interview: {len(questions)} question(s)" + (", then a coding step" if directory else "")
          + f". Record: {path}", file=out)
    answers = ask_questions(questions, stdin, out)
    session = {"started": now, "questions": answers}
    for a in answers:
        entry = record["questions"].setdefault(a["id"], {"attempts": 0, "missed": 0})
        entry["attempts"] += 1
        entry["missed"] += not a["got"]
        entry["last"] = "right" if a["got"] else "missed"
        entry["when"] = now
    if directory is not None:
        if check is None:
            raise ValueError("a coding step needs check, the battery's runner (the CLI passes its own)")
        chosen = step or next_step(record)
        coding = coding_step(chosen, directory, minutes, stdin, out, check)
        session["coding"] = coding
        entry = record["steps"].setdefault(chosen, {"attempts": 0, "passed": False, "best_seconds_to_pass": None})
        entry["attempts"] += 1
        if coding["passed"]:
            entry["passed"] = True
            best = entry["best_seconds_to_pass"]
            entry["best_seconds_to_pass"] = min(best, coding["seconds_to_pass"]) if best else coding["seconds_to_pass"]
    else:
        print("\n(no coding step: give --dir DIR, a folder from `python -m flashtile.practice init DIR`)", file=out)
    record["sessions"].append(session)
    save_record(path, record)
    right = sum(a["got"] for a in answers)
    missed = [a["id"] for a in answers if not a["got"]]
    print(f"\n{right} of {len(answers)} right" + (f"; missed {', '.join(missed)} (first next time)" if missed else "")
          + (f"; step {session['coding']['step']} " + ("passed" if session["coding"]["passed"] else "not passed")
             if "coding" in session else "") + f". Record saved to {path}", file=out)
    return 0

"""The practice pages keep their promises: at least 40 questions, each tagged, each answer collapsed on
a page of its own, linking the chapter that derives it and running a claim; the question page and the
bank (the answers page, which ``practice interview`` reads) list the same questions."""

from __future__ import annotations

import re
from pathlib import Path

from flashtile.practice.bank import BANK, DIFFICULTIES, SITE, load_bank

DOCS = Path(__file__).resolve().parents[2] / "docs"
INTERVIEW = DOCS / "practice" / "interview.md"
ANSWERS = DOCS / "practice" / "interview-answers.md"
PAGE_QUESTION = re.compile(r"^\*\*([AGIDC]\d+)\. (.+?)\*\*\n\*(\w+)\* · \[answer\]\(interview-answers\.md#(\w+)\)\n"
                           r"\{: #(\w+) \}$", re.M)


def test_the_answers_page_is_the_bank_itself():
    assert ANSWERS.resolve() == BANK.resolve()


def test_at_least_40_questions_in_five_groups_each_tagged():
    bank = load_bank()
    assert len(bank) >= 40
    assert [g for g in dict.fromkeys(q.group for q in bank)] == ["Algorithm", "GPU", "Inference", "Distributed",
                                                                   "Coding"]
    assert {q.difficulty for q in bank} == set(DIFFICULTIES)
    assert BANK.read_text(encoding="utf-8").count('??? success "Answer"') == len(bank)


def test_the_question_page_lists_the_banks_questions_without_their_answers():
    text = INTERVIEW.read_text(encoding="utf-8")
    on_page = [(m.group(1), m.group(2), m.group(3)) for m in PAGE_QUESTION.finditer(text)]
    assert on_page == [(q.id, q.text, q.difficulty) for q in load_bank()]
    for m in PAGE_QUESTION.finditer(text):
        assert m.group(4) == m.group(5) == m.group(1).lower()  # the link and the anchor
    assert "??? success" not in text  # no answer on the page a reader opens first


def test_every_answer_links_a_chapter_that_exists_and_runs_a_claim():
    for q in load_bank():
        page, _, anchor = q.derivation.removeprefix(SITE).partition("/#")
        assert (DOCS / f"{page.rstrip('/')}.md").is_file(), (q.id, q.derivation)
        assert "assert" in q.claim, q.id


def test_the_fixed_answers_say_what_was_missing():
    bank = {q.id: q for q in load_bank()}
    assert "\\max(0," in bank["C4"].answer and "\\min(q_{start} + B_r, T_q)" in bank["C4"].answer
    assert "0/0" in bank["A17"].answer and "SDPA" in bank["A17"].answer
    assert "\\ln 2" in bank["G8"].answer and "lse" in bank["G8"].answer
    assert "n_\\text{page}" in bank["I5"].answer and "$P$ token slots" not in bank["I5"].answer

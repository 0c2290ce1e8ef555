"""The practice pages keep their promises: at least 40 hidden answers, each linking the chapter that
derives it and running a claim."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
INTERVIEW = DOCS / "practice" / "interview.md"
CHAPTER_LINK = re.compile(r"\]\(\.\./(part-[abc]/[a-z0-9-]+)\.md(#[a-z0-9-]+)?\)")


def _answers() -> list[str]:
    """The text of each question, from its bold label up to the next one."""
    text = INTERVIEW.read_text(encoding="utf-8")
    return re.split(r"\n\*\*[AGIDC]\d+\. ", text)[1:]


def test_interview_page_has_at_least_40_questions_in_five_groups():
    text = INTERVIEW.read_text(encoding="utf-8")
    assert text.count('??? success "Answer"') == len(_answers()) >= 40
    groups = re.findall(r"^## (\w+)", text, flags=re.M)
    assert groups == ["Algorithm", "GPU", "Inference", "Distributed", "Coding"]


def test_every_answer_links_a_chapter_that_exists():
    for answer in _answers():
        links = CHAPTER_LINK.findall(answer)
        assert links, f"no chapter link in: {answer[:80]!r}"
        for page, _anchor in links:
            assert (DOCS / f"{page}.md").is_file(), page


def test_every_answer_runs_a_claim():
    for answer in _answers():
        assert "    ```python\n" in answer, f"an answer without an executed claim: {answer[:80]!r}"

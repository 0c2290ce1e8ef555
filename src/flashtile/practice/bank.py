"""The interview question bank: ``interview_answers.md`` beside this file, read as data.

That file is the site's answers page (``docs/practice/interview-answers.md`` is a link to it), so the
page and ``python -m flashtile.practice interview`` draw on one text: each question is a heading
``### A17. <question> {#a17}``, a difficulty tag (*easy*, *medium*, *hard*), and a collapsed answer
whose prose is the model answer, whose first link into a chapter is the derivation, and whose
``python`` block is the claim that asserts the answer's numbers.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

BANK = Path(__file__).with_name("interview_answers.md")
SITE = "https://flashtile.github.io/flashtile/"
DIFFICULTIES = ("easy", "medium", "hard")

_GROUP = re.compile(r"^## (\w+)\s*$", re.M)
_QUESTION = re.compile(r"^### ([AGIDC]\d+)\. (.+?) \{#([a-z]\d+)\}\s*$", re.M)
_TAG = re.compile(r"^\*(easy|medium|hard)\*", re.M)
_CHAPTER = re.compile(r"\]\(\.\./(part-[abc]/[a-z0-9-]+)\.md(#[a-z0-9-]+)?\)")
_DERIVED = re.compile(r"[Dd]erived\s+in:\s*\[[^\]]*" + _CHAPTER.pattern[1:])
_LINK = re.compile(r"\[([^\]]+)\]\([^)]+\)")


@dataclass(frozen=True)
class Question:
    id: str  # "A17"
    group: str  # "Algorithm", "GPU", "Inference", "Distributed", "Coding"
    difficulty: str  # easy, medium or hard
    text: str  # the question, as on the page (Markdown, TeX math between $)
    answer: str  # the model answer's prose, dedented (Markdown)
    claim: str  # the python block that asserts the answer's numbers
    derivation: str  # the site URL of the chapter section that derives it

    def plain_answer(self) -> str:
        """The answer for a terminal: links reduced to their text."""
        return _LINK.sub(r"\1", self.answer)


def _entry(group: str, qid: str, text: str, body: str) -> Question:
    tag = _TAG.search(body)
    if tag is None:
        raise ValueError(f"question {qid} has no difficulty tag (*easy*, *medium* or *hard*)")
    marker = '??? success "Answer"\n'
    if marker not in body:
        raise ValueError(f"question {qid} has no collapsed answer")
    block = textwrap.dedent(body.split(marker, 1)[1])
    prose, _, rest = block.partition("```python\n")
    claim = rest.partition("```")[0]
    chapter = _DERIVED.search(prose) or _CHAPTER.search(prose)  # the link after "Derived in:", else the first
    if chapter is None:
        raise ValueError(f"question {qid}'s answer links no chapter")
    page, anchor = chapter.group(1), chapter.group(2) or ""
    return Question(qid, group, tag.group(1), text, prose.strip(), claim, f"{SITE}{page}/{anchor}")


def load_bank(path: Path = BANK) -> list[Question]:
    """Every question of the bank, in the page's order."""
    text = path.read_text(encoding="utf-8")
    questions = []
    groups = _GROUP.split(text)[1:]
    for group, body in zip(groups[::2], groups[1::2]):
        found = list(_QUESTION.finditer(body))
        for n, match in enumerate(found):
            end = found[n + 1].start() if n + 1 < len(found) else len(body)
            if match.group(3) != match.group(1).lower():
                raise ValueError(f"question {match.group(1)} has the anchor #{match.group(3)}")
            questions.append(_entry(group, match.group(1), match.group(2), body[match.end():end]))
    return questions

"""Word budgets: a chapter is read in one sitting, so its main flow has a size limit.

A page's main-flow words are the words of its rendered ``<article>`` outside collapsed ``<details>``
blocks (``??? note``, ``??? success "Answer"``): prose, tables, math source and code listings all count,
since a reader scrolls past all of them. Every chapter stays within 6,000, the performance chapter
within 5,000 (its tables are most of what it has to say); the appendix (the lab notebook) is exempt.
The counts come from the built site, the pages as a reader gets them.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytestmark = pytest.mark.site

CHAPTER_BUDGET = 6000
BUDGETS = {"part-b/performance": 5000}  # page -> a tighter budget than CHAPTER_BUDGET
EXEMPT = ("appendix/",)  # prefixes of pages with no budget


class _MainFlow(HTMLParser):
    """Counts whitespace-separated words of text inside <article>, outside <details>, <script>, <style>."""

    def __init__(self) -> None:
        super().__init__()
        self.article = 0  # depth of <article> elements around the current text
        self.collapsed = 0  # depth of <details> inside the article
        self.code_for_the_browser = 0  # depth of <script> and <style>: never read, never counted
        self.words = 0
        self.hidden_words = 0  # words inside <details>: the collapsed part, counted apart

    def handle_starttag(self, tag, attrs):
        if tag == "article":
            self.article += 1
        elif self.article and tag == "details":
            self.collapsed += 1
        elif tag in ("script", "style"):
            self.code_for_the_browser += 1

    def handle_endtag(self, tag):
        if tag == "article":
            self.article -= 1
        elif self.article and tag == "details":
            self.collapsed -= 1
        elif tag in ("script", "style"):
            self.code_for_the_browser -= 1

    def handle_data(self, data):
        n = len(re.findall(r"\S+", data))
        if not self.article or self.code_for_the_browser:
            return
        if self.collapsed:
            self.hidden_words += n
        else:
            self.words += n


def main_flow_words(html: str) -> tuple[int, int]:
    """(main-flow words, words inside collapsed blocks) of one rendered page."""
    parser = _MainFlow()
    parser.feed(html)
    parser.close()
    return parser.words, parser.hidden_words


def _pages(site: Path) -> dict[str, Path]:
    """Page path ("part-b/performance") -> its index.html, for every page of the built site."""
    return {
        f.parent.relative_to(site).as_posix(): f
        for f in sorted(site.rglob("index.html"))
        if f.parent != site and f.parent.name != "404"
    }


def test_the_counter_skips_collapsed_blocks_and_counts_code():
    html = (
        "<html><body><nav>menu words never count</nav><article class='md-content__inner'>"
        "<h1>Two words</h1><p>one two three</p>"
        "<pre><code>x = attention(q, k, v)\nassert x</code></pre>"  # code: 7 words
        "<details class='note'><summary>Hidden summary</summary><p>four five six seven</p>"
        "<details><p>nested eight</p></details><p>still hidden</p></details>"
        "<script>var a = 1;</script><table><tr><td>cell one</td><td>cell two</td></tr></table>"
        "</article><footer>footer words</footer></body></html>"
    )
    words, hidden = main_flow_words(html)
    assert words == 2 + 3 + 7 + 4  # heading, paragraph, code, table; not the details, script, nav, footer
    assert hidden == 2 + 4 + 2 + 2
    # The control: the same page with the block open (no <details>) counts its words in the main flow.
    opened = html.replace("<details class='note'>", "<div>").replace("</details><script>", "</div><script>")
    assert main_flow_words(opened.replace("<details>", "<div>").replace("</details>", "</div>")) == (words + hidden, 0)


def test_the_counter_agrees_with_the_site_on_a_page_with_collapsed_answers(built_site):
    """Check-yourself answers are collapsed on the performance page: they exist and are not counted."""
    html = (built_site / "part-b" / "performance" / "index.html").read_text(encoding="utf-8")
    words, hidden = main_flow_words(html)
    assert words > 1000 and hidden > 100
    assert "<details" in html and "<pre" in html and "<code" in html  # collapsed blocks and code are both there


def test_every_chapter_is_within_its_word_budget(built_site):
    pages = _pages(built_site)
    assert "part-b/performance" in pages and any(p.startswith("appendix/") for p in pages)
    over = {}
    for name, path in pages.items():
        if name.startswith(EXEMPT):
            continue
        budget = BUDGETS.get(name, CHAPTER_BUDGET)
        words, _ = main_flow_words(path.read_text(encoding="utf-8"))
        if words > budget:
            over[name] = f"{words} main-flow words, budget {budget}"
    assert not over, f"over budget (move what a reader may skip into ??? note blocks or the lab notebook): {over}"

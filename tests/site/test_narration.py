"""No project narration outside the appendix: a page teaches and measures, it does not tell the project's story.

Read from the built site, the pages as a reader gets them (prose, tables, shown code and claims alike):
issue numbers, commit hashes, the lab notebook or PERF_LOG cited as a source, and "targets" belong in
the appendix (the lab notebook), never in a chapter. Two things may stay: a benchmark table's
provenance line ("Measured on ... (commit abc1234)"), and a link to the lab notebook for the variants
that lost (the link's own text may say "lab notebook").
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest

from tests.site._site_docs import DOCS, doc_pages, page_url

pytestmark = pytest.mark.site

EXEMPT = ("appendix/",)
PAGES = [p for p in doc_pages() if not page_url(p).startswith(EXEMPT)]

NARRATION = {
    # the project's issues; another project's bug, named with the project ("Triton issue 11584"), may stay
    "an issue number": re.compile(r"(?<!Triton )(?<!PyTorch )\bissues?\s+#?\d+\b|(?<![\w&/])#\d{2,}\b", re.I),
    "PERF_LOG": re.compile(r"PERF_LOG"),
    "the lab notebook as a source": re.compile(r"\blab notebook\b", re.I),
    "a target": re.compile(r"\btarget(?:s|ed)?\b(?!\s*=)", re.I),  # not Python's target= keyword
    # 7 to 40 hex digits with at least one digit and one letter: a commit, as git abbreviates it
    "a commit hash": re.compile(r"(?<![\w.#-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])"),
}
PROVENANCE = re.compile(r"^\s*Measured on ")


class _Text(HTMLParser):
    """The article's text in blocks (one per paragraph, cell, list item or code block), leaving out the
    text of links to the lab notebook and of MathJax's source, which is not shown as written."""

    BLOCKS = {"p", "li", "td", "th", "pre", "h1", "h2", "h3", "h4", "summary", "div"}

    def __init__(self) -> None:
        super().__init__()
        self.blocks: list[str] = [""]
        self.article = 0
        self.skip: list[str] = []  # tags whose text is not read, innermost last

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.article += tag == "article"
        if tag in self.BLOCKS:
            self.blocks.append("")
        if tag == "a" and "appendix/lab-notebook" in (attrs.get("href") or ""):
            self.skip.append("a")
        elif tag in ("script", "style"):
            self.skip.append(tag)

    def handle_endtag(self, tag):
        self.article -= tag == "article"
        if self.skip and self.skip[-1] == tag:
            self.skip.pop()
        if tag in self.BLOCKS:
            self.blocks.append("")

    def handle_data(self, data):
        if self.article and not self.skip:
            self.blocks[-1] += data


def narration(html: str) -> list[str]:
    """What reads as project narration in a page's article: 'kind: text around it', one per hit."""
    parser = _Text()
    parser.feed(html)
    found = []
    for block in parser.blocks:
        if PROVENANCE.match(block):
            continue
        for kind, pattern in NARRATION.items():
            for m in pattern.finditer(block):
                found.append(f"{kind}: {block[max(0, m.start() - 50):m.end() + 30]!r}")
    return found


def test_the_check_finds_each_kind_and_spares_provenance_and_the_appendix_link():
    page = (
        "<article><p>issue 34 asked for 1.5×; see #46.</p><p>Measured at a83d9b3, PERF_LOG says so.</p>"
        "<p>The targets set for this kernel (lab notebook).</p>"
        "<p>Measured on an NVIDIA H200 (commit 03eda60); method: median.</p>"
        '<p>The <a href="../appendix/lab-notebook/">lab notebook</a> has the runs.</p>'
        "<pre><code>x = 0x1f; h = 'deadbeef'; n = 1234567; sha = 'ab12cd3'</code></pre></article>"
    )
    kinds = [hit.split(":")[0] for hit in narration(page)]
    assert sorted(kinds) == sorted([
        "an issue number", "an issue number", "a commit hash", "PERF_LOG", "a target",
        "the lab notebook as a source", "a commit hash",
    ])  # fmt: skip


@pytest.mark.parametrize("src", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_no_page_outside_the_appendix_narrates_the_project(built_site, src):
    html = (built_site / page_url(src) / "index.html").read_text(encoding="utf-8")
    found = narration(html)
    assert not found, f"{src.relative_to(DOCS)}: project narration belongs in the appendix:\n" + "\n".join(found[:15])

"""The glossary is the site's one vocabulary: every entry is linked from a chapter, every link lands.

Each chapter links the first use of a glossary symbol in its prose to the symbol's row in
``glossary.md``, whose code cells carry the anchors (``` `m`{#running-max} ```). These tests read the
built site: the anchors a browser can land on, and the links as MkDocs rewrote them.
"""

from __future__ import annotations

from collections import Counter
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import pytest

from tests.site._site_docs import DOCS, doc_pages, page_url

pytestmark = pytest.mark.site

GLOSSARY = DOCS / "glossary.md"
CHAPTERS = [p for p in doc_pages() if p.suffix == ".md" and p.parent.name in ("part-a", "part-b", "part-c")]


class _Anchors(HTMLParser):
    """The ids of an HTML page (those inside a <table> apart), and the links of its article, in order.

    Only the article: the navigation and the footer link every page, the glossary included.
    """

    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.table_ids: list[str] = []
        self.hrefs: list[str] = []
        self._tables = 0
        self._article = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self._tables += tag == "table"
        self._article += tag == "article"
        if "id" in attrs:
            self.ids.add(attrs["id"])
            if self._tables:
                self.table_ids.append(attrs["id"])
        if tag == "a" and attrs.get("href") and self._article:
            self.hrefs.append(attrs["href"])

    def handle_endtag(self, tag):
        self._tables -= tag == "table"
        self._article -= tag == "article"


def parse(built_site: Path, page: Path) -> _Anchors:
    parser = _Anchors()
    parser.feed((built_site / page_url(page) / "index.html").read_text(encoding="utf-8"))
    return parser


def glossary_links(built_site: Path, page: Path) -> list[str]:
    """The fragments of the page's links to the glossary, in page order ("" for a link to its top)."""
    base = "http://site/" + page_url(page)
    target = "/" + page_url(GLOSSARY)
    out = []
    for href in parse(built_site, page).hrefs:
        url = urlsplit(urljoin(base, href))
        if url.netloc == "site" and url.path == target:
            out.append(url.fragment)
    return out


@pytest.fixture(scope="module")
def entries(built_site) -> list[str]:
    """The anchor of every glossary row, in table order."""
    ids = parse(built_site, GLOSSARY).table_ids
    assert len(ids) >= 20, f"the glossary table has {len(ids)} anchored rows; is its markup still `name`{{#id}}?"
    return ids


def test_every_glossary_entry_is_linked_from_a_chapter(built_site, entries):
    linked = {fragment for page in CHAPTERS for fragment in glossary_links(built_site, page)}
    unlinked = [e for e in entries if e not in linked]
    assert not unlinked, f"glossary entries that no chapter links to: {unlinked}"


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: p.relative_to(DOCS).as_posix())
def test_every_link_to_the_glossary_lands_on_an_entry(built_site, page):
    anchors = parse(built_site, GLOSSARY).ids
    broken = [f for f in glossary_links(built_site, page) if f and f not in anchors]
    assert not broken, f"{page.relative_to(DOCS)} links to glossary anchors that do not exist: {broken}"


@pytest.mark.parametrize("page", CHAPTERS, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_a_chapter_links_each_entry_once_at_its_first_use(built_site, page):
    """One link per symbol and chapter: at its first use, not at every use."""
    repeated = [f for f, n in Counter(glossary_links(built_site, page)).items() if n > 1]
    assert not repeated, f"{page.relative_to(DOCS)} links these glossary entries more than once: {repeated}"

"""The strict build itself, and what it must leave in the site folder."""

from __future__ import annotations

import json
import re

import pytest

from tests.site._site_docs import DOCS, doc_pages, page_url

pytestmark = pytest.mark.site


def test_strict_build_produces_a_page_for_every_source(built_site):
    built = {p.parent.relative_to(built_site).as_posix() for p in built_site.rglob("index.html")}
    built = {"" if b == "." else f"{b}/" for b in built}
    expected = {page_url(p) for p in doc_pages()}
    assert expected <= built, f"pages missing from the build: {sorted(expected - built)}"


def test_mathjax_is_served_from_the_site(built_site):
    bundle = built_site / "assets" / "mathjax" / "tex-svg.js"
    assert bundle.stat().st_size > 100_000, "tex-svg.js missing or truncated"
    assert (built_site / "assets" / "mathjax" / "input" / "tex" / "extensions").is_dir()


def test_no_page_references_a_cdn(built_site):
    """Static check behind the browser one: no script, stylesheet or image src points off-site."""
    external = re.compile(r"""<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=["'](?:https?:)?//""", re.I)
    offenders = {}
    for html in built_site.rglob("*.html"):
        hits = [m.group(0) for m in external.finditer(html.read_text(encoding="utf-8"))]
        # <link rel="canonical"> names the public URL; it is metadata, never fetched.
        hits = [h for h in hits if 'rel="canonical"' not in h]
        if hits:
            offenders[html.relative_to(built_site).as_posix()] = hits[:3]
    assert not offenders, offenders


def test_notebooks_are_executed_and_downloadable(built_site):
    notebooks = sorted(DOCS.rglob("*.ipynb"))
    assert notebooks, "no notebook under docs/"
    for nb in notebooks:
        folder = built_site / page_url(nb)
        html = (folder / "index.html").read_text(encoding="utf-8")
        # nbconvert renders each executed cell's output in a jp-OutputArea-output element.
        assert html.count("jp-OutputArea-output") > 0, f"{nb.name}: no cell output, was it executed?"
        assert 'class="md-button"' in html and f'href="{nb.name}"' in html, f"{nb.name}: no download button"
        copied = json.loads((folder / nb.name).read_text(encoding="utf-8"))
        assert copied["cells"], f"{nb.name}: downloadable copy is empty"


# What a search preview must never show: TeX written for MathJax, and a notebook's prompts and copy
# button. (A preview is the entry's text, shown raw by Material's search.)
RAW_IN_SEARCH = re.compile(r"\\[()\[\]]|\$\$|\\frac|\b(?:In|Out)\s*\[\s*\d*\s*\]:|Copied!|\u00b6")
# Outside code, neither a lone $ of notebook math nor any TeX command may be left either.
RAW_IN_SEARCH_PROSE = re.compile(r"\$|\\[A-Za-z]+")


def unreadable_search_entries(index: dict) -> list[str]:
    """Entries of a search index whose title or text holds TeX or notebook chrome, with what was found."""
    bad = []
    for entry in index["docs"]:
        for field in ("title", "text"):
            text = entry[field]
            prose = re.sub(r"<(pre|code)>.*?</\1>", " ", text, flags=re.S)
            found = RAW_IN_SEARCH.findall(text) + RAW_IN_SEARCH_PROSE.findall(prose)
            if found:
                at = min(text.find(f) for f in found if f in text)
                bad.append(f"{entry['location']} ({field}): {found[:3]} in {text[max(0, at - 40):at + 60]!r}")
    return bad


def test_search_index_holds_readable_text(built_site):
    """hooks/search_text.py gives the index math as text and no notebook chrome; the pages keep theirs."""
    index = json.loads((built_site / "search" / "search_index.json").read_text(encoding="utf-8"))
    assert len(index["docs"]) > 100, "the search index has too few entries; was the plugin disabled?"
    bad = unreadable_search_entries(index)
    assert not bad, f"{len(bad)} search entries show raw TeX or notebook chrome:\n" + "\n".join(bad[:10])
    # The math is still in the index, as text: the IO chapter's bound reads T^2 d^2 / M.
    io_text = " ".join(e["text"] for e in index["docs"] if e["location"].startswith("part-a/io-bound/"))
    assert "Θ(T^2 d^2 / M)" in io_text
    # And the pages themselves still carry the TeX, for MathJax.
    page = (built_site / "part-a" / "io-bound" / "index.html").read_text(encoding="utf-8")
    assert '<span class="arithmatex">\\(' in page

"""The strict build itself, and what it must leave in the site folder."""

from __future__ import annotations

import json
import re

import pytest
from _site_docs import DOCS, doc_pages, page_url

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

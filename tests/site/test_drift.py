"""Listings cannot drift from src: every include resolves, every src section is shown or excused."""

from __future__ import annotations

import re

import pytest

from tests.site._site_docs import (
    DOCS,
    REPO,
    SNIPPET_LINE,
    all_markers,
    diff_markers,
    diff_side_sections,
    doc_pages,
    fences,
    listings,
    sections_in,
    unused_sections,
)

pytestmark = pytest.mark.site

# Captures the escape: "" for a live marker, ";" for an escaped one.
ESCAPABLE_MARKER = re.compile(r"(;?)-{1,}8<-{1,}")

MARKDOWN_PAGES = [p for p in doc_pages() if p.suffix == ".md"]


def _used() -> set[tuple[str, str]]:
    """Sections a page shows: as a listing, or as a side of a generated diff (hooks/diffs.py)."""
    shown = {(lst.path, lst.section) for page in MARKDOWN_PAGES for lst in listings(page)}
    sides = {pair for page in MARKDOWN_PAGES for marker in diff_markers(page) for side in marker
             for pair in diff_side_sections(side)}  # fmt: skip
    return shown | sides


@pytest.mark.parametrize("page", MARKDOWN_PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_every_snippet_include_resolves_to_a_nonempty_section(page):
    for lst in listings(page):
        where = f"{lst.page}:{lst.line}"
        assert (REPO / lst.path).is_file(), f"{where}: {lst.path} does not exist"
        sections = sections_in(REPO / lst.path)
        assert lst.section in sections, f"{where}: {lst.path} has no section {lst.section!r}"
        assert any(line.strip() for line in sections[lst.section]), f"{where}: section {lst.section!r} is empty"


@pytest.mark.parametrize("page", MARKDOWN_PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_listings_are_titled_single_includes(page):
    """A listing fence holds exactly one include and is titled with its file: no pasted code."""
    for fence in fences(page):
        includes = [line for line in fence.body if SNIPPET_LINE.match(line)]
        if not includes:
            continue
        where = f"{fence.page}:{fence.line}"
        assert len(includes) == 1 and len(fence.body) == 1, f"{where}: a listing fence must hold one include only"
        path = SNIPPET_LINE.match(includes[0]).group("target").rpartition(":")[0]
        assert f'title="{path}"' in fence.info, f"{where}: listing must be titled {path!r}, got {fence.info!r}"


@pytest.mark.parametrize("page", MARKDOWN_PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_snippet_marker_only_used_in_the_checked_form(page):
    """Block includes, line ranges or bare markers would bypass these checks or eat prose.

    Outside a listing fence, pymdownx.snippets deletes any line holding a section marker, silently.
    Prose may show the marker only escaped as ``;--8<--`` (rendered without the ``;``), once per line:
    only the first escape on a line is undone.
    """
    include_lines = {
        fence.line + 1 + k for fence in fences(page) for k, line in enumerate(fence.body) if SNIPPET_LINE.match(line)
    }
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if n in include_lines:
            continue
        markers = ESCAPABLE_MARKER.findall(line)
        where = f"{page.relative_to(DOCS)}:{n}"
        assert all(markers), f"{where}: unescaped snippet marker outside a listing fence: {line!r}"
        assert len(markers) <= 1, f"{where}: more than one escaped marker on a line; split the line"
    for lst in listings(page):
        assert lst.section and "/" not in lst.section, f"{lst.page}:{lst.line}: include a named section"


def test_every_src_section_is_well_formed():
    for (path, name), types in all_markers().items():
        assert types == ["start", "end"], f"{path}: section {name!r} has markers {types}, expected start then end"


def test_every_src_section_is_shown_or_listed_as_unused():
    defined = set(all_markers())
    unused = unused_sections()
    orphans = defined - _used() - unused
    assert not orphans, (
        "sections shown on no page; include them or add 'path:name  # why' to tests/site/unused_sections.txt: "
        + ", ".join(f"{p}:{n}" for p, n in sorted(orphans))
    )


def test_unused_list_is_not_stale():
    unused = unused_sections()
    missing = unused - set(all_markers())
    assert not missing, f"unused_sections.txt names sections that do not exist: {sorted(missing)}"
    shown = unused & _used()
    assert not shown, f"unused_sections.txt names sections that a page shows: {sorted(shown)}"

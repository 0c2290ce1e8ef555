"""Every listing a page shows fits 88 columns, so that it reads on a laptop without a sideways scroll.

A listing is measured as the page shows it: the section extracted the way pymdownx.snippets extracts
it (marker lines of other sections dropped, the whole dedented, as ``dedent_subsections: true`` in
mkdocs.yml does), whether a fence includes it (``--8<-- "path:section"``) or a generated diff shows it
as one of its sides (``<!-- diff: ... -->``, hooks/diffs.py). Sections not yet reflowed are named in
wide_listings.txt ("path:section  # why"); that list can only shrink: a listed section that fits
now, or that no page shows any more, fails the test until its line is removed.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.site._site_docs import (
    REPO,
    SECTION_MARKER,
    diff_markers,
    diff_side_sections,
    doc_pages,
    listings,
    sections_in,
)

pytestmark = pytest.mark.site

WIDTH = 88
WIDE_LISTINGS_FILE = Path(__file__).with_name("wide_listings.txt")
MARKDOWN_PAGES = [p for p in doc_pages() if p.suffix == ".md"]


def shown_sections() -> list[tuple[str, str]]:
    """(repo-relative path, section) of every listing a page shows: included, or a side of a diff."""
    included = {(lst.path, lst.section) for page in MARKDOWN_PAGES for lst in listings(page)}
    sides = {
        pair
        for page in MARKDOWN_PAGES
        for marker in diff_markers(page)
        for side in marker
        for pair in diff_side_sections(side)
    }
    return sorted(included | sides)


def wide_listings() -> dict[tuple[str, str], str]:
    """(path, section) -> why, for every section wide_listings.txt excuses."""
    out: dict[tuple[str, str], str] = {}
    for n, raw in enumerate(WIDE_LISTINGS_FILE.read_text(encoding="utf-8").splitlines(), 1):
        entry, _, why = raw.partition("#")
        entry, why = entry.strip(), why.strip()
        if not entry:
            continue
        path, _, section = entry.rpartition(":")
        assert path and section, f"wide_listings.txt:{n}: expected 'path:section  # why', got {raw!r}"
        assert why, f"wide_listings.txt:{n}: {entry} says no reason ('path:section  # why')"
        assert (path, section) not in out, f"wide_listings.txt:{n}: {entry} is listed twice"
        out[(path, section)] = why
    return out


def numbered_section(path: str, section: str) -> list[tuple[int, str]] | None:
    """(line number in the file, text as shown) of each line of a section; None when there is none.

    The same extraction as ``sections_in`` (which the drift test and the browser test use), with each
    line's place in the file kept, so that a failure names the line to rewrap."""
    file = REPO / path
    if not file.is_file():
        return None
    body, inside, found = [], False, False
    for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        m = SECTION_MARKER.search(line)
        if m and m.group("name") == section:
            if m.group("type") == "start":
                inside = found = True
                continue
            if inside:
                break
        elif m:
            continue
        if inside:
            body.append((n, line))
    if not found:
        return None
    shown = textwrap.dedent("\n".join(text for _, text in body)).splitlines()
    assert shown == sections_in(file)[section], f"{path}:{section}: extracted unlike sections_in"
    return [(n, text) for (n, _), text in zip(body, shown)]


def too_wide(path: str, section: str) -> list[str]:
    """'path:section:line: width N: text' for each shown line wider than WIDTH."""
    lines = numbered_section(path, section) or []
    return [
        f"{path}:{section}:{n}: width {len(text.expandtabs())}: {text.strip()[:60]}"
        for n, text in lines
        if len(text.expandtabs()) > WIDTH
    ]


SHOWN = shown_sections()
WIDE = wide_listings()


@pytest.mark.parametrize("path,section", [s for s in SHOWN if s not in WIDE], ids=lambda x: x)
def test_shown_listing_fits_88_columns(path, section):
    wide = too_wide(path, section)
    assert not wide, (
        f"{len(wide)} line(s) wider than {WIDTH} columns as shown (reflow them, or, for now, add "
        f"'{path}:{section}  # why' to tests/site/wide_listings.txt):\n" + "\n".join(wide)
    )


def test_wide_listings_only_shrink():
    """Each excused section still exists, is still shown and is still too wide: the list only shrinks."""
    shown = set(SHOWN)
    stale = []
    for path, section in sorted(WIDE):
        entry = f"{path}:{section}"
        if numbered_section(path, section) is None:
            stale.append(f"{entry}: no such section any more")
        elif (path, section) not in shown:
            stale.append(f"{entry}: no page shows it any more")
        elif not too_wide(path, section):
            stale.append(f"{entry}: fits {WIDTH} columns now")
    assert not stale, "remove these lines from tests/site/wide_listings.txt:\n" + "\n".join(stale)


def test_the_check_sees_a_wide_line_and_spares_a_dedented_one(tmp_path, monkeypatch):
    """The measure is the dedented section: indentation the page drops does not count, the rest does."""
    src = tmp_path / "m.py"
    inner = "x" * (WIDTH - 4)
    src.write_text(
        "class A:\n"
        "    # --8<-- [start:fits]\n"
        f"    def f(self):\n        {inner}\n"
        "    # --8<-- [end:fits]\n"
        "    # --8<-- [start:wide]\n"
        f"    def g(self):\n        {inner}x\n"
        "    # --8<-- [end:wide]\n",
        encoding="utf-8",
    )
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    assert not too_wide("m.py", "fits")
    (wide,) = too_wide("m.py", "wide")
    assert wide.startswith(f"m.py:wide:8: width {WIDTH + 1}: xxx"), wide
    assert numbered_section("m.py", "missing") is None

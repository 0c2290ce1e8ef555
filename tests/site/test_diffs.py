"""Every diff a page shows is the diff of the two files' listing sections, as the files are now.

The pages' ``<!-- diff: old new -->`` lines become fenced diff blocks at build time (hooks/diffs.py). Here
the built page's diff blocks are read back from its HTML and compared, block by block and line by line,
with a unified diff computed by this test from the sections as ``tests/site/_site_docs.py`` extracts them
(the drift test's own extraction, not the hook's).
"""

from __future__ import annotations

import difflib
import html
import re

import pytest

from tests.site._site_docs import DOCS, REPO, diff_markers, diff_side_sections, doc_pages, page_url, sections_in

pytestmark = pytest.mark.site

PAGES = [p for p in doc_pages() if p.suffix == ".md" and diff_markers(p)]
DIFF_BLOCK = re.compile(r'<div class="language-diff highlight"><pre>.*?<code>(.*?)</code></pre></div>', re.S)


def expected_lines(side: str) -> list[str]:
    lines = []
    for path, name in diff_side_sections(side):
        lines += sections_in(REPO / path)[name]
    return lines


def shown_blocks(built_site, page) -> list[list[str]]:
    text = (built_site / page_url(page) / "index.html").read_text(encoding="utf-8")
    blocks = []
    for body in DIFF_BLOCK.findall(text):
        body = re.sub(r'<a id="[^"]*" name="[^"]*" href="[^"]*"></a>', "", body)  # line anchors, if any
        blocks.append(html.unescape(re.sub(r"<[^>]+>", "", body)).rstrip("\n").split("\n"))
    return blocks


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_each_shown_diff_is_the_files_diff(built_site, page):
    markers = diff_markers(page)
    blocks = shown_blocks(built_site, page)
    assert len(blocks) == len(markers), f"{len(markers)} diff lines in the source, {len(blocks)} diff blocks built"
    for (old, new), block in zip(markers, blocks):
        old_label, new_label = (side.partition("#")[0].removeprefix("src/flashtile/") for side in (old, new))
        truth = list(difflib.unified_diff(expected_lines(old), expected_lines(new), old_label, new_label, n=3,
                                          lineterm=""))  # fmt: skip
        assert truth, f"{old} and {new} do not differ"
        truth = [line.rstrip() for line in truth]  # the page drops a context line's lone space (a blank line)
        shown = [line.rstrip() for line in block]
        assert shown == truth, f"{page.name}: the diff of {new} against {old} is not the files' diff"


def test_the_pages_that_should_show_diffs_do():
    """The kernel chapters teach their ladders by diffs: each has at least one."""
    names = {p.relative_to(DOCS).as_posix() for p in PAGES}
    assert {"part-b/forward-kernel.md", "part-b/backward-kernel.md"} <= names, names

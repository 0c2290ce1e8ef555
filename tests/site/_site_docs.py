"""What the site tests know about the docs sources: pages, snippet listings, src sections, code blocks.

Kept free of MkDocs and Playwright so the drift test runs in a second and the browser test can
compare what it sees against what the sources say it should see.
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
SRC = REPO / "src"
UNUSED_SECTIONS_FILE = Path(__file__).with_name("unused_sections.txt")

# One snippet include per line: --8<-- "src/flashtile/x.py:section" (the only form we allow).
SNIPPET_LINE = re.compile(r"""^(?P<indent>[ \t]*)-{1,}8<-{1,}[ \t]+(?P<quote>["'])(?P<target>.+?)(?P=quote)[ \t]*$""")
# Any other use of the snippet marker in a page (block form, line ranges, escapes) is rejected by the
# drift test rather than silently left unchecked.
ANY_SNIPPET_MARKER = re.compile(r"-{1,}8<-{1,}")
# Section markers in src, as pymdownx.snippets reads them.
SECTION_MARKER = re.compile(
    r"-{1,}8<-{1,}[ \t]+\[[ \t]*(?P<type>start|end)[ \t]*:[ \t]*(?P<name>[a-z][-_0-9a-z]*)[ \t]*\]", re.I
)
FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})(?P<info>.*)$")


@dataclass(frozen=True)
class Listing:
    """A fenced block on a page whose body is one snippet include."""

    page: str  # docs-relative source path
    line: int  # 1-based line of the fence opening
    info: str  # the fence info string, e.g. python title="src/flashtile/reference/naive.py"
    path: str  # the snippet's file, repo-relative
    section: str

    @property
    def title(self) -> str | None:
        m = re.search(r'title="([^"]*)"', self.info)
        return m.group(1) if m else None


@dataclass(frozen=True)
class Fence:
    page: str
    line: int
    info: str
    body: list[str]


def doc_pages() -> list[Path]:
    """Every page MkDocs builds from docs/: Markdown files and notebooks."""
    return sorted(p for p in DOCS.rglob("*") if p.suffix in (".md", ".ipynb") and p.is_file())


def page_url(page: Path) -> str:
    """Site-relative URL of a page under use_directory_urls (index.md -> '', a/b.md -> 'a/b/')."""
    rel = page.relative_to(DOCS).with_suffix("")
    if rel.name == "index":
        rel = rel.parent
    return "" if str(rel) == "." else f"{rel.as_posix()}/"


def fences(page: Path) -> list[Fence]:
    """Top-level and indented (admonition) fenced code blocks of a Markdown page, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE_OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        ticks, indent = m.group("ticks"), m.group("indent")
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(ticks):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        out.append(Fence(page.relative_to(DOCS).as_posix(), i + 1, m.group("info").strip(), body))
        i = j + 1
    return out


def listings(page: Path) -> list[Listing]:
    """Snippet listings of a page, in page order."""
    out = []
    for fence in fences(page):
        for line in fence.body:
            m = SNIPPET_LINE.match(line)
            if m:
                path, _, section = m.group("target").rpartition(":")
                out.append(Listing(fence.page, fence.line, fence.info, path, section))
    return out


def bare_python_blocks(page: Path) -> list[Fence]:
    """Fences whose info string is exactly ``python``: the executed claims."""
    return [f for f in fences(page) if f.info == "python"]


DIFF_MARKER = re.compile(r"^[ \t]*<!-- diff: (?P<old>\S+) (?P<new>\S+) -->[ \t]*$")


def diff_markers(page: Path) -> list[tuple[str, str]]:
    """The (old, new) sides of every ``<!-- diff: old new -->`` line of a page, in page order; each side is
    ``path#section[+section...]`` (hooks/diffs.py renders them)."""
    return [(m.group("old"), m.group("new")) for line in page.read_text(encoding="utf-8").splitlines()
            if (m := DIFF_MARKER.match(line))]


def diff_side_sections(side: str) -> list[tuple[str, str]]:
    """``path#a+b`` -> [(path, "a"), (path, "b")]."""
    path, _, names = side.partition("#")
    return [(path, name) for name in names.split("+")]


def sections_in(path: Path) -> dict[str, list[str]]:
    """name -> lines of every snippet section in a source file, extracted like pymdownx.snippets.

    Marker lines of other sections inside a section are dropped, and the result is dedented, as
    ``dedent_subsections: true`` in mkdocs.yml does.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    names = {m.group("name") for line in lines if (m := SECTION_MARKER.search(line)) and m.group("type") == "start"}
    out = {}
    for name in names:
        body, inside = [], False
        for line in lines:
            m = SECTION_MARKER.search(line)
            if m and m.group("name") == name:
                if m.group("type") == "start":
                    inside = True
                    continue
                if inside:
                    break
            elif m:
                continue
            if inside:
                body.append(line)
        out[name] = textwrap.dedent("\n".join(body)).splitlines()
    return out


def section_text(path: str, section: str) -> str:
    return "\n".join(sections_in(REPO / path)[section])


def all_markers() -> dict[tuple[str, str], list[str]]:
    """(repo-relative path, name) -> marker types seen ("start"/"end"), over src/."""
    out: dict[tuple[str, str], list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        for line in path.read_text(encoding="utf-8").splitlines():
            m = SECTION_MARKER.search(line)
            if m:
                out.setdefault((path.relative_to(REPO).as_posix(), m.group("name")), []).append(m.group("type"))
    return out


def unused_sections() -> set[tuple[str, str]]:
    """Sections deliberately shown on no page, as listed in unused_sections.txt ("path:name  # why")."""
    out = set()
    for raw in UNUSED_SECTIONS_FILE.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            path, _, name = line.rpartition(":")
            out.add((path, name))
    return out


def notebook_markdown(page: Path) -> str:
    nb = json.loads(page.read_text(encoding="utf-8"))
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")


def site_public_url() -> str:
    """mkdocs.yml's site_url, where the site is deployed."""
    for line in (REPO / "mkdocs.yml").read_text(encoding="utf-8").splitlines():
        if line.startswith("site_url:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError("mkdocs.yml has no site_url")


def site_prefix() -> str:
    """The URL path the site is deployed under ('/flashtile/')."""
    return urlparse(site_public_url()).path or "/"

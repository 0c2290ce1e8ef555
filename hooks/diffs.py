"""Show the difference between two listings, generated from the files at build time.

The kernel chapters teach a kernel as a worklog: each rung differs from the one before by one idea, and
the page shows that difference. A diff pasted into Markdown drifts the moment either file changes; here
a line of its own in a page's source,

    <!-- diff: src/flashtile/kernels/textbook.py#textbook-forward+textbook-forward-launch OTHER#rung -->

(OTHER a rung's file, ``src/flashtile/kernels/ladder/forward_1_<idea>.py``)

is replaced, before the page is converted, by a fenced ``diff`` block: the unified diff (three lines of
context) of the named listing sections of the two files, each side the given sections in order, with the
section markers themselves left out and each section dedented, as the snippets extension shows a listing. The block
keeps the line's indentation, so that it may sit inside a collapsed ``??? note``. A missing file or
section, or two sides without a difference, stops the build (``mkdocs build --strict`` and the tests
run it): a rung that no longer differs from its predecessor is a page that lies.
"""

from __future__ import annotations

import difflib
import re
import textwrap
from pathlib import Path

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^(?P<indent>[ \t]*)<!-- diff: (?P<old>\S+) (?P<new>\S+) -->[ \t]*$", re.M)
SECTION = re.compile(r"^\s*# --8<-- \[(start|end):([\w-]+)\]\s*$")


def section_lines(spec: str, root: Path | None = None) -> list[str]:
    """The lines of ``path#name[+name...]``: each named listing section of the file, markers left out."""
    path, _, names = spec.partition("#")
    file = (root or ROOT) / path
    if not file.is_file() or not names:
        raise PluginError(f"diff: expected FILE#SECTION[+SECTION] with FILE under the repository, got {spec!r}")
    lines = file.read_text(encoding="utf-8").splitlines()
    out: list[str] = []
    for name in names.split("+"):
        body, inside, found = [], False, False
        for line in lines:
            marker = SECTION.match(line)
            if marker:
                if marker.group(2) == name:
                    inside = marker.group(1) == "start"
                    found = found or inside
                continue
            if inside:
                body.append(line)
        if not found:
            raise PluginError(f"diff: {path} has no listing section {name!r}")
        out += textwrap.dedent("\n".join(body)).splitlines()  # dedented, as the snippets show a section
    return out


def label(spec: str) -> str:
    """What a side is called above the diff: its file, from the package's root (``kernels/textbook.py``)."""
    path = spec.partition("#")[0]
    return path.removeprefix("src/flashtile/")


def render(old: str, new: str, indent: str = "", root: Path | None = None) -> str:
    """The fenced diff block for the marker ``<!-- diff: old new -->``, each line prefixed with ``indent``."""
    diff = list(difflib.unified_diff(section_lines(old, root), section_lines(new, root), label(old), label(new),
                                     n=3, lineterm=""))  # fmt: skip
    if not diff:
        raise PluginError(f"diff: {old} and {new} do not differ")
    return "\n".join(indent + line if line else line for line in ["```diff", *diff, "```"])


def on_page_markdown(markdown, page, config, files):
    return MARKER.sub(lambda m: render(m.group("old"), m.group("new"), m.group("indent")), markdown)

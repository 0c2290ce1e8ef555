"""What the test session may import by a bare name: nothing of the repository's own folders.

A folder of ``tests/`` or ``hooks/`` on ``sys.path`` turns its subfolders and files into top-level modules
that stand in for installed packages of the same name: ``tests/kernels`` on the path once made
``import kernels`` (Hugging Face's Kernel Hub, which transformers imports) find the project's test folder.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GUARDED = (REPO / "tests", REPO / "hooks", REPO)  # the repository root: its folders would be namespace packages

# Folder names of tests/ and hooks/ that are also names of packages on the package index, and the site's
# modules under hooks/ (MkDocs imports them by bare names while it builds, never here).
SHADOWABLE = ("kernels", "distributed", "bench", "reference", "integrations", "practice", "decode", "hooks",
              "fp8", "site", "figures", "offline", "notebooks", "render_plots", "render_tables", "search_text")


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def entries_inside_the_repository() -> list[str]:
    """The entries of ``sys.path`` that are the repository root, or lie inside ``tests/`` or ``hooks/``."""
    left = []
    for entry in sys.path:
        where = Path(entry or ".").resolve()
        if where == REPO or any(_inside(where, folder) for folder in GUARDED[:2]):
            left.append(entry)
    return left


def in_the_checkout(place: Path) -> bool:
    """A file or folder of the repository's own (not of the environment installed inside it, such as .venv)."""
    environment = Path(sys.prefix).resolve()
    return (place == REPO or REPO in place.parents) and not (place == environment or environment in place.parents)


def where_a_bare_name_resolves(name: str) -> list[Path]:
    """The files or folders ``import <name>`` would take, found without importing or installing anything."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        return []
    places = [Path(spec.origin)] if spec.origin not in (None, "namespace", "built-in", "frozen") else []
    places += [Path(p) for p in (spec.submodule_search_locations or [])]
    return [p.resolve() for p in places]

"""Every probe under bench/probes still imports, reaches the package through public modules only, and is listed.

A probe measures once on a GPU, but it imports the package every time it runs: a name the package renames or
moves breaks it silently, until someone needs it again. These tests import every probe under Triton's
interpreter (``tests/conftest.py`` sets it), read every import for a private module or name of flashtile
(``flashtile._plans``, ``kernels._host``, ``forward._write_rows``: the public seam is ``flashtile.kernels.parts``),
and hold the shelf's README to the files: one row per probe, no row without its file.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

PROBES = Path(__file__).resolve().parents[2] / "bench" / "probes"
FILES = sorted(p for p in PROBES.rglob("*.py"))
README = PROBES / "README.md"


def private_imports(source: str) -> list[str]:
    """The private parts of flashtile a module imports: a module path or an imported name with a leading underscore."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "flashtile":
            parts = node.module.split(".")
            found += [node.module for p in parts if p.startswith("_")][:1]
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "flashtile"
                      and any(p.startswith("_") for p in a.name.split("."))]  # fmt: skip
    return found


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(PROBES).as_posix())
def test_every_probe_imports(path, monkeypatch):
    monkeypatch.syspath_prepend(str(path.parent))  # as ``python bench/probes/<topic>/<probe>.py`` runs it
    spec = importlib.util.spec_from_file_location(f"probe_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.__doc__, f"{path.name} says nothing of what it measures"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(PROBES).as_posix())
def test_no_probe_imports_a_private_part_of_flashtile(path):
    assert private_imports(path.read_text()) == [], f"{path.name}: use flashtile.kernels.parts or a public module"


def test_the_private_import_check_sees_each_form():
    """The control: each way of reaching a private part is found, and public imports are not."""
    source = ("from flashtile._plans import cached_plan\nfrom flashtile.kernels import _host\n"
              "from flashtile.kernels.forward import _write_rows\nimport flashtile.kernels._jit\n"
              "from flashtile.kernels.parts import write_rows\nimport flashtile\n")  # fmt: skip
    assert private_imports(source) == ["flashtile._plans", "flashtile.kernels._host",
                                       "flashtile.kernels.forward._write_rows", "flashtile.kernels._jit"]


def test_the_readme_lists_every_probe_once_under_its_folder():
    listed = {}
    topic = None
    for line in README.read_text().splitlines():
        if line.startswith("## "):
            topic = line[3:].strip()
        match = re.match(r"\| `([a-z0-9_]+\.py)` \|.*\| (adopted|lost|superseded|retired)\b", line)
        if match and topic != "retired":
            assert match.group(1) not in listed, f"{match.group(1)} is listed twice"
            listed[match.group(1)] = topic
    on_disk = {p.name: p.parent.name for p in FILES}
    assert listed == on_disk, "bench/probes/README.md and the probe files differ"

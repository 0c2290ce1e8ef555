"""The test session imports the repository's helpers by full name and nothing of the repository by a bare one.

``tests/`` and every folder under it are packages (``tests._truth``, ``tests.decode._decode_cases``), pytest
imports them in its ``importlib`` mode (pyproject.toml), and no entry of ``sys.path`` points into ``tests/``,
``hooks/`` or the repository root. These tests hold that; ``tests/conftest.py`` also fails any test that
leaves such an entry behind.
"""

from __future__ import annotations

import sys

import pytest

from tests._imports import (
    REPO,
    SHADOWABLE,
    entries_inside_the_repository,
    in_the_checkout,
    where_a_bare_name_resolves,
)


def test_no_entry_of_sys_path_lies_in_tests_or_hooks_or_is_the_repository():
    assert entries_inside_the_repository() == [], sys.path


@pytest.mark.parametrize("name", SHADOWABLE)
def test_a_package_name_never_resolves_into_the_repository(name):
    places = where_a_bare_name_resolves(name)
    inside = [p for p in places if in_the_checkout(p)]
    assert inside == [], f"import {name} would take {inside}"


def test_the_guard_sees_an_entry_inside_tests(monkeypatch):
    """The control: the two checks above fail when the tests' folder is on the path."""
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    for name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:  # imported by transformers
        monkeypatch.delitem(sys.modules, name)  # find_spec answers from sys.modules first
    assert entries_inside_the_repository() == [str(REPO / "tests")]
    assert where_a_bare_name_resolves("kernels") == [(REPO / "tests" / "kernels" / "__init__.py").resolve(),
                                                      (REPO / "tests" / "kernels").resolve()]
    monkeypatch.undo()
    assert entries_inside_the_repository() == []


def test_the_kernel_hub_package_is_the_installed_one_when_it_is_installed():
    """transformers >= 5.25 imports Hugging Face's ``kernels``; when it is installed, it is that one we see."""
    pytest.importorskip("transformers")
    places = where_a_bare_name_resolves("kernels")
    if places:
        assert all("site-packages" in str(p) or "dist-packages" in str(p) for p in places), places

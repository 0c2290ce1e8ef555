"""The MkDocs hooks on their own: what they drop, and what they must not."""

from __future__ import annotations

import importlib.util
import re

import pytest
from _site_docs import DOCS, REPO

pytestmark = pytest.mark.site


def load_hook(name: str):
    spec = importlib.util.spec_from_file_location(f"hooks_{name}", REPO / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The plugin passes custom_mathjax_url="" (its default); nb2html alone defaults to cdnjs.
@pytest.mark.parametrize("mathjax_url", ["", "https://cdnjs.cloudflare.com/ajax/libs/mathjax/2.7.7/latest.js"])
def test_offline_hook_strips_what_nbconvert_loads_from_cdns(mathjax_url):
    """Render the real notebook with mkdocs-jupyter's template: the CDN tags are there, then gone."""
    from mkdocs_jupyter.convert import nb2html

    offline = load_hook("offline")
    remote = re.compile(r"""<script[^>]*\bsrc=|import\(["']https?://|cdnjs\.cloudflare\.com|x-mathjax-config""")
    raw = nb2html(
        str(DOCS / "notebooks" / "part-a-playground.ipynb"),
        execute=False,
        include_requirejs=False,
        custom_mathjax_url=mathjax_url,
    )
    assert remote.search(raw), "mkdocs-jupyter no longer emits these tags: simplify hooks/offline.py"
    stripped = offline.strip_notebook_cdn(raw)
    assert not remote.search(stripped), remote.search(stripped)
    assert stripped.count("jp-Cell") == raw.count("jp-Cell")  # the notebook itself is untouched


def test_offline_hook_keeps_the_repository_link():
    offline = load_hook("offline")
    header = '<a href="https://github.com/o/r" class="md-source" data-md-component="source">o/r</a>'
    assert offline.drop_source_facts(header) == '<a href="https://github.com/o/r" class="md-source" >o/r</a>'

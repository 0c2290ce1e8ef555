"""The MkDocs hooks on their own: what they drop, and what they must not."""

from __future__ import annotations

import re

import pytest

from tests._hooks import load_hook
from tests.site._site_docs import DOCS

pytestmark = pytest.mark.site



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


@pytest.mark.parametrize(
    ("tex", "text"),
    [
        (r"T \times T", "T × T"),
        (r"(m, \ell, \mathrm{acc})", "(m, ℓ, acc)"),
        (r"\frac{QK^\top}{\sqrt d}", "(QK^⊤)/√d"),
        (r"e^{S_{ij} - m}", "e^(S_ij - m)"),
        (r"\operatorname{lse} = m + \log \ell", "lse = m + log ℓ"),
        (r"B_c = \left\lfloor \frac{M}{4d} \right\rfloor", "B_c = ⌊ M/4d ⌋"),
        (r"\begin{aligned} a &= b \\ &\le c \end{aligned}", "a = b; ≤ c"),
        (r"\tilde O \in \mathbb{R}^{B_r \times d}", "Õ ∈ R^(B_r × d)"),
        (r"\lvert\tau\rvert\, u", "|τ| u"),
    ],
)
def test_search_text_reads_tex_as_a_reader_would(tex, text):
    assert load_hook("search_text").tex_to_text(tex) == text


def test_search_text_hook_changes_what_search_reads_and_not_the_page():
    """The search plugin (priority 0) sees text without TeX or notebook chrome; the page gets its HTML back."""
    from mkdocs.plugins import PluginCollection

    hook = load_hook("search_text")
    html = (
        '<p>A <span class="arithmatex">\\(T \\times T\\)</span> matrix.</p>'
        '<div class="jp-InputPrompt jp-InputArea-prompt">In&nbsp;[4]:</div>'
        '<span class="notice" hidden="">Copied!</span>'
        '<div class="clipboard-copy-txt" id="cell-4">x = 1</div>'
        '<div class="jp-RenderedHTMLCommon jp-RenderedMarkdown" data-mime-type="text/markdown">'
        "<p>Notation: $T_q$ queries and $$\\frac{a}{b}$$.</p></div>"
    )
    seen = []

    class Search:
        def on_page_context(self, context, page, config, nav):
            seen.append(page.content)
            return context

    plugins = PluginCollection()
    plugins["search"] = Search()
    plugins["hooks/search_text.py"] = hook
    page = type("Page", (), {"content": html})()
    plugins.on_page_context({}, page=page, config=None, nav=None)
    assert page.content == html
    assert seen == [
        "<p>A T × T matrix.</p>"
        '<div class="jp-RenderedHTMLCommon jp-RenderedMarkdown" data-mime-type="text/markdown">'
        "<p>Notation: T_q queries and a/b.</p></div>"
    ]


def test_the_perf_log_becomes_a_page_body_without_its_title():
    figures = load_hook("figures")
    text = "# Performance log\n\nIntro.\n\n## v1: first\n\n### detail\n\n```\n## code stays\n```\n"
    assert figures.perf_log_markdown(text) == "Intro.\n\n## v1: first\n\n### detail\n\n```\n## code stays\n```\n"
    assert figures.perf_log_markdown(figures.PERF_LOG.read_text()).startswith("One entry per version")

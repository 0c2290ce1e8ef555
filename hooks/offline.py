"""Keep every page load inside the site: serve MathJax from a pip package, strip CDN tags.

Three things would otherwise reach outside the built site when a page loads:

* MathJax. We serve MathJax 3 from the ``django-static-mathjax`` wheel instead of a CDN. The page
  loads ``assets/mathjax/tex-svg.js`` (SVG output carries its glyphs inline, so no font files are
  needed); the TeX extensions, the context menu and the speech engine are copied too because
  MathJax loads them lazily from the same folder (``\\require``, the menu's accessibility options).
* mkdocs-jupyter's notebook template. It emits a MathJax 2 ``<script src=cdnjs...>`` plus its
  ``text/x-mathjax-config`` block, and a mermaid loader that imports from cdnjs. Our MathJax 3
  typesets notebook markdown already (see ``docs/javascripts/mathjax-config.js``), and the playground
  has no mermaid diagrams, so both are removed from notebook pages.
* Material's repository widget. With a GitHub ``repo_url`` it fetches star and fork counts from
  api.github.com on load. The link itself stays; only the ``data-md-component="source"`` attribute
  that triggers the fetch is dropped.

The browser test (tests/site/test_browser.py) fails on any request that leaves 127.0.0.1, so if a
plugin upgrade brings a new CDN tag back, the suite says so.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.offline")

MATHJAX_DEST = "assets/mathjax"
# Relative to the package's es5/ folder: the entry bundle, then what it may load lazily.
MATHJAX_PARTS = ("tex-svg.js", "input/tex/extensions", "ui", "a11y", "sre")

_NOTEBOOK_CDN_TAGS = [
    # MathJax 2 loader from nbconvert's base/mathjax.html.j2
    re.compile(r'<!-- Load mathjax -->\s*<script src="[^"]*"> </script>', re.S),
    re.compile(r'<script type="text/x-mathjax-config">.*?</script>\s*<!-- End of mathjax configuration -->', re.S),
    # mermaid loader from nbconvert's lab/mermaidjs.html.j2
    re.compile(r'<script type="module">(?:(?!</script>).)*?cdnjs\.cloudflare\.com/ajax/libs/mermaid.*?</script>', re.S),
]


def mathjax_root() -> Path:
    """The es5/ folder of the MathJax 3 build that django-static-mathjax ships."""
    import mathjax  # the django-static-mathjax wheel's top-level package

    root = Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"
    if not (root / "tex-svg.js").is_file():
        raise FileNotFoundError(f"django-static-mathjax has no es5/tex-svg.js under {root}")
    return root


def on_files(files, config):
    root = mathjax_root()
    count = 0
    for part in MATHJAX_PARTS:
        path = root / part
        sources = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for src in sources:
            uri = f"{MATHJAX_DEST}/{src.relative_to(root).as_posix()}"
            files.append(File.generated(config, uri, abs_src_path=str(src)))
            count += 1
    log.info("serving MathJax from %s (%d files)", root, count)
    return files


def strip_notebook_cdn(html: str) -> str:
    for pattern in _NOTEBOOK_CDN_TAGS:
        html = pattern.sub("", html)
    return html


def on_page_content(html, page, config, files):
    if page.file.src_uri.endswith(".ipynb"):
        html = strip_notebook_cdn(html)
    return html


def drop_source_facts(html: str) -> str:
    return html.replace('data-md-component="source"', "")


def on_post_page(output, page, config):
    return drop_source_facts(output)


def on_post_template(output_content, template_name, config):
    # 404.html is a theme template, not a page: on_post_page never sees it.
    return drop_source_facts(output_content) if template_name.endswith(".html") else output_content

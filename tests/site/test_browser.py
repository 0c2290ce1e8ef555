"""Every built page in headless Chromium: offline, error-free, math typeset, listings equal to src.

Chromium is Debian's (/usr/bin/chromium) driven by the playwright package; `playwright install` is
never needed. Each page gets a fresh browser context that records every request, so a CDN script or
font that sneaks back in fails the test that loads it. Every page is checked at 1280 px, then the same
load is narrowed to phone width (390 px), where display math must keep its size and fit its column
without scrolling sideways. Screenshots are taken on request only (FLASHTILE_SCREENSHOTS=1; nothing asserts
on them), into artifacts/screenshots/ (git-ignored): <page>.png at 1280 px, <page>--390.png at 390 px.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.site._site_docs import (
    DOCS,
    REPO,
    doc_pages,
    fences,
    listings,
    notebook_markdown,
    page_url,
    section_text,
    site_public_url,
)

pytestmark = pytest.mark.site

SCREENSHOTS = REPO / "artifacts" / "screenshots"
TAKE_SCREENSHOTS = os.environ.get("FLASHTILE_SCREENSHOTS", "") not in ("", "0")
PAGES = doc_pages()
MATHJAX_TIMEOUT_MS = 60_000


class PageLog:
    """What one page load did: every request, every failure, every console error."""

    def __init__(self, page, base: str):
        self.base = base
        self.requests: list[str] = []
        self.failed: list[str] = []
        self.errors: list[str] = []
        page.on("request", lambda r: self.requests.append(r.url))
        page.on("requestfailed", lambda r: self.failed.append(f"{r.url} ({r.failure})"))
        page.on("response", lambda r: r.status >= 400 and self.failed.append(f"{r.url} (HTTP {r.status})"))
        page.on("console", lambda m: m.type == "error" and self.errors.append(f"{m.text} at {m.location.get('url')}"))
        page.on("pageerror", lambda e: self.errors.append(str(e)))

    def external(self) -> list[str]:
        origin = re.match(r"https?://[^/]+/", self.base).group(0)
        return [u for u in self.requests if not (u.startswith(origin) or u.startswith(("data:", "blob:")))]

    def assert_clean(self, what: str) -> None:
        assert not self.external(), f"{what}: requests outside the site: {self.external()}"
        assert not self.failed, f"{what}: failed requests: {self.failed}"
        assert not self.errors, f"{what}: console errors: {self.errors}"


DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}  # a common phone in portrait, in CSS pixels


def open_page(browser, site_url, viewport):
    context = browser.new_context(viewport=viewport, service_workers="block")
    pg = context.new_page()
    pg.log = PageLog(pg, site_url)
    return context, pg


@pytest.fixture
def page(browser, site_url):
    context, pg = open_page(browser, site_url, DESKTOP)
    yield pg
    context.close()


def wait_for_mathjax(page) -> None:
    ready = "() => window.MathJax && MathJax.startup && MathJax.startup.promise"
    page.wait_for_function(ready, timeout=MATHJAX_TIMEOUT_MS)
    page.evaluate("() => MathJax.startup.promise")


def screenshot_name(src: Path, suffix: str = "") -> Path:
    stem = src.relative_to(DOCS).with_suffix("").as_posix().replace("/", "__")
    return SCREENSHOTS / f"{stem}{suffix}.png"


def screenshot(page, path: Path, full_page: bool = False) -> None:
    """A screenshot to look at, only when FLASHTILE_SCREENSHOTS is set: nothing asserts on it."""
    if TAKE_SCREENSHOTS:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=path, full_page=full_page)


def expects_math(src: Path) -> bool:
    """Whether the source has $...$ math outside code (fences and inline code spans)."""
    if src.suffix == ".ipynb":
        return "$" in notebook_markdown(src)
    lines = src.read_text(encoding="utf-8").splitlines()
    in_fences = {f.line - 1 + k for f in fences(src) for k in range(len(f.body) + 2)}
    prose = "\n".join(line for n, line in enumerate(lines) if n not in in_fences)
    return "$" in re.sub(r"`[^`]*`", "", prose)


# The article's prose with code and typeset math removed: any "$" left there is TeX nobody typeset.
RAW_DOLLARS_JS = """() => {
  const article = document.querySelector("article").cloneNode(true);
  article.querySelectorAll("pre, code, .arithmatex, mjx-container, script").forEach((n) => n.remove());
  const text = article.textContent;
  const at = text.indexOf("$");
  return at < 0 ? "" : text.slice(Math.max(0, at - 60), at + 60);
}"""


def check_math(page, src: Path) -> None:
    wait_for_mathjax(page)
    where = src.relative_to(DOCS).as_posix()
    if src.suffix == ".md":
        pending = page.locator(".arithmatex:not(:has(mjx-container))")
        assert page.locator(".arithmatex").count() > 0, f"{where}: math in the source but no .arithmatex output"
        assert pending.count() == 0, f"{where}: untypeset math: {pending.first.inner_text()[:120]!r}"
        # TeX that arithmatex never recognised (say, $$ glued to a list item) stays as raw dollars.
        leftover = page.evaluate(RAW_DOLLARS_JS)
        assert not leftover, f"{where}: raw $ left in the prose: {leftover[:120]!r}"
    else:
        assert page.locator(".jp-RenderedMarkdown mjx-container").count() > 0, f"{where}: notebook math not typeset"
        leftover = [t for t in page.locator(".jp-RenderedMarkdown").all_inner_texts() if "$" in t]
        assert not leftover, f"{where}: raw $ left in notebook markdown: {leftover[0][:120]!r}"
    errors = page.locator('mjx-container [data-mml-node="merror"]')
    assert errors.count() == 0, f"{where}: TeX error: {errors.first.text_content()!r}"


# Every display equation, as the reader sees it. A formula's natural width is the width MathJax gave its
# SVG (in ex of the surrounding font), measured with an invisible probe of that width. An equation is
# readable if its SVG is drawn at that width and the box around it either shows all of it or scrolls
# sideways to reach the rest. The nearest ancestor that does not let content overflow visibly is the box.
DISPLAY_MATH_JS = """() => {
  const problems = [];
  document.querySelectorAll('mjx-container[display="true"]').forEach((c, n) => {
    const svg = c.querySelector(':scope > svg');
    if (!svg) return;
    const probe = document.createElement('div');
    probe.style.cssText = `position:absolute;visibility:hidden;height:0;width:${svg.getAttribute('width')}`;
    c.appendChild(probe);
    const natural = probe.getBoundingClientRect().width;
    probe.remove();
    const drawn = svg.getBoundingClientRect().width;
    let box = c.parentElement;
    while (box && getComputedStyle(box).overflowX === 'visible') box = box.parentElement;
    box = box || document.documentElement;
    const scrolls = ['auto', 'scroll'].includes(getComputedStyle(box).overflowX) && box.scrollWidth + 1 >= natural;
    const fits = box.clientWidth + 1 >= natural;
    if (drawn + 1 < natural || !(fits || scrolls)) {
      const tex = (c.querySelector('mjx-assistive-mml') || c).textContent.replace(/\\s+/g, ' ').slice(0, 60);
      problems.push(`equation ${n + 1} (${tex}): formula ${natural.toFixed(0)} px, drawn ${drawn.toFixed(0)} px, ` +
                    `box ${box.clientWidth} px (${fits ? 'fits' : scrolls ? 'scrolls' : 'neither fits nor scrolls'})`);
    }
  });
  return problems;
}"""


# At phone width a display equation must fit its box without scrolling: a formula cut off mid-symbol at
# the right edge reads as a different formula. Long equations are broken into aligned lines instead.
PHONE_MATH_JS = """() => [...document.querySelectorAll('mjx-container[display="true"]')].flatMap((c, n) => {
  const svg = c.querySelector(':scope > svg');
  if (!svg) return [];
  const box = c.parentElement.getBoundingClientRect().width;
  const drawn = svg.getBoundingClientRect().width;
  if (drawn <= box + 1) return [];
  const tex = (c.querySelector('mjx-assistive-mml') || c).textContent.replace(/\\s+/g, ' ').slice(0, 60);
  return [`equation ${n + 1} (${tex}): ${drawn.toFixed(0)} px in a ${box.toFixed(0)} px column`];
})"""


def check_phone_math(page, src: Path) -> None:
    """Every display equation's rendered width fits its container (no sideways scrolling) at phone width."""
    wide = page.evaluate(PHONE_MATH_JS)
    where = src.relative_to(DOCS).as_posix()
    width = page.viewport_size["width"]
    assert not wide, f"{where} at {width} px: display math wider than its column:\n" + "\n".join(wide)


def check_layout(page, src: Path) -> None:
    """Display math is drawn at full size (scrolling if need be), and nothing widens the page."""
    where = src.relative_to(DOCS).as_posix()
    problems = page.evaluate(DISPLAY_MATH_JS)
    assert not problems, f"{where} at {page.viewport_size['width']} px: unreadable display math:\n" + "\n".join(
        problems
    )
    page_width, viewport = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
    assert page_width <= viewport, f"{where}: the page is {page_width} px wide in a {viewport} px viewport"


# Collapsed notes (<details>) opened for the listing check, marked so that exactly those close again.
OPEN_DETAILS_JS = """() => document.querySelectorAll("details:not([open])").forEach((d) => {
  d.dataset.openedByTest = ""; d.open = true;
})"""
CLOSE_DETAILS_JS = """() => document.querySelectorAll("details[data-opened-by-test]").forEach((d) => {
  delete d.dataset.openedByTest; d.open = false;
})"""


def check_listings(page, src: Path) -> None:
    """Each titled code block equals its src section, in page order; blocks inside collapsed notes are
    read with the notes opened (a closed one renders no text), which are then closed again."""
    page.evaluate(OPEN_DETAILS_JS)
    try:
        _check_listings(page, src)
    finally:
        page.evaluate(CLOSE_DETAILS_JS)


# Every titled code block in page order, as the reader sees it (innerText): its title and its code, read in
# one call (a locator per block and field cost a round trip to the browser each, half a second a page).
TITLED_BLOCKS_JS = """() => [...document.querySelectorAll(".highlight")]
  .filter((block) => block.querySelector(":scope > .filename"))
  .map((block) => {
    const code = block.querySelectorAll("pre > code");
    return [block.querySelector(":scope > .filename").innerText, code.length === 1 ? code[0].innerText : null];
  })"""


def _check_listings(page, src: Path) -> None:
    expected = listings(src)
    blocks = page.evaluate(TITLED_BLOCKS_JS)
    assert len(blocks) == len(expected), (
        f"{src.name}: {len(blocks)} titled code blocks on the page, {len(expected)} listings in the source"
    )
    for (title, shown), lst in zip(blocks, expected):
        assert title.strip() == lst.path
        assert shown is not None, f"{src.name}: listing {lst.path}:{lst.section} is not one pre > code block"
        want = section_text(lst.path, lst.section)
        assert shown.strip(), f"{src.name}: listing {lst.path}:{lst.section} is empty"
        assert [line.rstrip() for line in shown.strip("\n").splitlines()] == [
            line.rstrip() for line in want.strip("\n").splitlines()
        ], f"{src.name}: listing {lst.path}:{lst.section} differs from src"


NEXT_FRAME_JS = "() => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)))"


@pytest.mark.parametrize("src", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_page_is_offline_clean_typeset_shows_live_src_and_reads_at_phone_width(page, site_url, src):
    """At 1280 px: offline, typeset, listings equal to src, images loaded. Narrowed to 390 px on the same
    load: every display equation keeps its size and fits its column; the page never scrolls."""
    where = src.relative_to(DOCS).as_posix()
    response = page.goto(site_url + page_url(src), wait_until="load")
    assert response.status == 200
    if expects_math(src):
        check_math(page, src)
    if src.suffix == ".md":
        check_listings(page, src)
    broken = page.evaluate("() => [...document.images].filter(i => !i.complete || !i.naturalWidth).map(i => i.src)")
    assert not broken, f"images that did not load: {broken}"
    page.wait_for_load_state("networkidle")
    check_layout(page, src)
    screenshot(page, screenshot_name(src), full_page=True)
    page.log.assert_clean(where)

    page.set_viewport_size(PHONE)
    page.evaluate(NEXT_FRAME_JS)  # the narrow layout laid out and painted before it is measured
    assert page.evaluate("() => window.innerWidth") == PHONE["width"]
    source = notebook_markdown(src) if src.suffix == ".ipynb" else src.read_text(encoding="utf-8")
    if "$$" in source:  # so that the check below cannot pass by finding no equation at all
        assert page.locator('mjx-container[display="true"]').count() > 0, f"{src.name}: no display math drawn"
    check_layout(page, src)
    check_phone_math(page, src)
    screenshot(page, screenshot_name(src, "--390"), full_page=True)
    page.log.assert_clean(f"{where} at 390 px")


def test_404_page_is_offline_clean(page, site_url):
    response = page.goto(site_url + "no-such-page/", wait_until="load")
    assert response.status == 404
    assert page.locator(".md-header").count() == 1, "the server did not answer with the site's 404.html"
    assert "404" in page.locator(".md-content").inner_text()
    page.wait_for_load_state("networkidle")
    screenshot(page, SCREENSHOTS / "404.png")
    # The 404 status of the page itself is the point, and on an error page Chromium asks the origin
    # for /favicon.ico, which GitHub Pages does not serve either; anything else failing is a bug.
    origin = "{0.scheme}://{0.netloc}".format(urlsplit(site_url))
    expected = (f"{site_url}no-such-page/", f"{origin}/favicon.ico")
    page.log.failed = [f for f in page.log.failed if not any(e in f for e in expected)]
    page.log.errors = [e for e in page.log.errors if not e.endswith(expected)]
    page.log.assert_clean("404.html")


def test_search_finds_logsumexp(page, site_url):
    page.goto(site_url, wait_until="load")
    page.wait_for_load_state("networkidle")  # the search worker has its index
    page.locator("input.md-search__input").click()
    # Material searches on key events; fill() would set the value without firing them.
    page.locator("input.md-search__input").press_sequentially("logsumexp", delay=20)
    results = page.locator(".md-search-result__item")
    results.first.wait_for(timeout=30_000)
    assert "logsumexp" in results.first.inner_text().lower()
    screenshot(page, SCREENSHOTS / "search-logsumexp.png")
    page.log.assert_clean("search")


def instant_targets() -> list[Path]:
    """A Markdown math page and a notebook with math: the two ways math reaches MathJax."""
    chapters = [p for p in PAGES if p.suffix == ".md" and p.name != "index.md" and expects_math(p)]
    notebooks = [p for p in PAGES if p.suffix == ".ipynb" and expects_math(p)]
    return chapters[:1] + notebooks[:1]


@pytest.mark.parametrize("src", instant_targets(), ids=lambda p: p.relative_to(DOCS).as_posix())
def test_instant_navigation_retypesets_math(page, site_url, src):
    """Material swaps the page body in place; MathJax must typeset the new body."""
    target = page_url(src)

    # Material only intercepts links listed in sitemap.xml, matched after copying protocol and
    # hostname (not the port) from the current page. Deployed, the sitemap's host is the page's host;
    # here the site runs on a random port, so rewrite the sitemap to this server as Pages would have it.
    public_base = site_public_url()
    local_origin = "{0.scheme}://{0.netloc}".format(urlsplit(site_url))
    public_origin = "{0.scheme}://{0.netloc}".format(urlsplit(public_base))

    def local_sitemap(route):
        body = route.fetch().text().replace(public_origin, local_origin)
        route.fulfill(body=body, content_type="application/xml")

    page.route("**/sitemap.xml", local_sitemap)
    page.goto(site_url, wait_until="load")
    wait_for_mathjax(page)
    page.wait_for_load_state("networkidle")  # instant navigation starts once sitemap.xml is in
    page.evaluate("() => { window.__same_document = true }")
    page.locator(f"nav.md-nav--primary a[href$='{target}']").first.click()
    page.wait_for_url(site_url + target)
    assert page.evaluate("() => window.__same_document === true"), "navigation reloaded the page; instant is off"
    container = ".arithmatex" if src.suffix == ".md" else ".jp-RenderedMarkdown"
    typeset = f"() => document.querySelector('{container} mjx-container') !== null"
    page.wait_for_function(typeset, timeout=MATHJAX_TIMEOUT_MS)
    check_math(page, src)
    page.log.assert_clean(f"instant navigation to {target}")


def test_dark_palette_renders(page, site_url):
    """Toggle to the slate scheme on a figure page and keep a screenshot to look at."""
    figure_pages = [p for p in PAGES if p.suffix == ".md" and "figures/" in p.read_text(encoding="utf-8")]
    src = figure_pages[0] if figure_pages else PAGES[0]
    page.goto(site_url + page_url(src), wait_until="load")
    page.locator("form[data-md-component='palette'] label:visible").first.click()
    assert page.evaluate("() => document.body.getAttribute('data-md-color-scheme')") == "slate"
    page.wait_for_load_state("networkidle")
    screenshot(page, screenshot_name(src, "--dark"), full_page=True)
    page.log.assert_clean("dark palette")


def test_notebook_download_link_serves_the_notebook(page, site_url):
    notebooks = [p for p in PAGES if p.suffix == ".ipynb"]
    assert notebooks
    for nb in notebooks:
        page.goto(site_url + page_url(nb), wait_until="load")
        link = page.locator("a.md-button[download]")
        assert link.count() == 1, f"{nb.name}: no download button"
        href = link.get_attribute("href")  # Material makes it absolute
        assert href.endswith(page_url(nb) + nb.name), href
        response = page.request.get(href)
        assert response.status == 200 and response.json()["cells"]

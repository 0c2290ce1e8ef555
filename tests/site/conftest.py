"""Session fixtures for the site tests: one strict build, one local server, one headless Chromium.

The build runs once per session (about half a minute, most of it executing the notebook) into a
temporary folder, or was run already into the folder FLASHTILE_SITE_DIR names; every test reads that
folder. The server mounts the site under the path of ``site_url`` (``/flashtile/``), like GitHub Pages
does, so the 404 page's absolute asset links are exercised too.
"""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.site._site_docs import REPO, site_prefix

ARTIFACTS = REPO / "artifacts"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")  # the same override as tools/system-deps.sh
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="session")
def built_site(tmp_path_factory) -> Path:
    """Run ``mkdocs build --strict`` once; return the site folder. Fails the session on any warning.

    FLASHTILE_SITE_DIR names a folder that ``mkdocs build --strict`` has just built (``make test-site``
    builds site/ once, the Pages workflow then deploys that same folder): the tests read it instead."""
    prebuilt = os.environ.get("FLASHTILE_SITE_DIR")
    if prebuilt:
        site = Path(prebuilt).resolve()
        if not (site / "index.html").is_file() or not (site / "404.html").is_file():
            pytest.fail(f"FLASHTILE_SITE_DIR={prebuilt}: no built site there (index.html and 404.html missing)")
        return site
    site = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "mkdocs-build.log").write_text(f"{proc.stderr}\n# build took {seconds:.1f} s\n")
    if proc.returncode != 0:
        pytest.fail(f"mkdocs build --strict failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    print(f"\nmkdocs build --strict: {seconds:.1f} s")
    return site


class _PrefixHandler(http.server.SimpleHTTPRequestHandler):
    prefix = "/"

    def translate_path(self, path):
        if not path.startswith(self.prefix):
            return ""  # outside the mount point: 404
        return super().translate_path("/" + path[len(self.prefix):])

    def send_error(self, code, message=None, explain=None):
        """Answer a missing page with the site's own 404.html, as GitHub Pages does."""
        page = Path(self.directory) / "404.html"
        if code != 404 or not page.is_file():
            return super().send_error(code, message, explain)
        body = page.read_bytes()
        self.send_response(404)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, *args):  # keep pytest output readable
        pass


@pytest.fixture(scope="session")
def site_url(built_site) -> str:
    """Base URL of the built site served on 127.0.0.1 from a background thread."""
    prefix = site_prefix()
    handler = functools.partial(type("Handler", (_PrefixHandler,), {"prefix": prefix}), directory=str(built_site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}{prefix}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def browser():
    """Debian's /usr/bin/chromium, else the one `playwright install chromium` downloaded, else stop.

    Without a browser every browser test would error on its own; stopping the session says it once,
    with the command that fixes it (the same one `make browser` prints).
    """
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        if Path(CHROMIUM).exists():
            executable = CHROMIUM
        elif Path(p.chromium.executable_path).exists():
            executable = p.chromium.executable_path
        else:
            pytest.exit(
                f"no Chromium for the browser test: neither {CHROMIUM} nor playwright's own. "
                "Run `make browser` (it installs Debian's chromium when it may, or prints the command to run).",
                returncode=1,
            )
        b = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield b
        b.close()

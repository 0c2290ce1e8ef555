"""`pytest --codeblocks docs/` must see every claim: count what it collects against the sources.

The claims themselves run in the unit invocation (`make test-unit`: one pytest start with
`--codeblocks tests docs`, beside the unit tests); this test guards the collection. A fence that
pytest-codeblocks silently ignores (a typo in the info string, an unclosed fence swallowing the next
block) would otherwise shrink the count without failing anything.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.site._site_docs import DOCS, REPO, bare_python_blocks, doc_pages

pytestmark = pytest.mark.site


def test_codeblocks_collects_every_bare_python_block():
    pages = [p for p in doc_pages() if p.suffix == ".md"]
    # A block after <!--pytest-codeblocks:cont--> is appended to the previous one, not collected alone.
    expected = 0
    for page in pages:
        lines = page.read_text(encoding="utf-8").splitlines()
        for block in bare_python_blocks(page):
            previous = next((lines[i].strip() for i in range(block.line - 2, -1, -1) if lines[i].strip()), "")
            expected += previous != "<!--pytest-codeblocks:cont-->"
    assert expected > 0, "no executable claim in docs/"
    # --noconftest: the root conftest (TRITON_INTERPRET, hypothesis profiles) has no part in what is collected,
    # and skipping it skips its torch import, most of this process's start
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--codeblocks", "--collect-only", "-q", "-p", "no:cacheprovider",
         "--noconftest", str(DOCS)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = [line for line in proc.stdout.splitlines() if re.match(r"^docs/.*\.md::line \d+$", line)]
    assert len(collected) == expected, f"collected {len(collected)} blocks, sources have {expected}:\n{proc.stdout}"


def test_a_continued_claim_continues_a_claim_not_a_listing():
    # <!--pytest-codeblocks:cont--> appends a block to the previous fence, whatever that fence is. After a
    # listing (```python title=...```, which pytest-codeblocks does not run) the claim would be glued to the
    # listing and never run: the in-a-model page's claims 3 to 7 were, until this test. A listing's code,
    # as pytest-codeblocks extracts it, must be its include line alone.
    from pytest_codeblocks import extract_from_file

    swallowed = [
        f"{page.relative_to(REPO)}:{block.lineno}"
        for page in doc_pages()
        if page.suffix == ".md"
        for block in extract_from_file(page)
        if (block.syntax or "").strip() != "python" and len(block.code.strip().splitlines()) > 1
        and "--8<--" in block.code
    ]  # fmt: skip
    assert not swallowed, f"claims continued after a listing, never run: {swallowed}"

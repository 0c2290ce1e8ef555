"""Runs pytest on one copy of the package after another, in one Python process (torch imported once).

Called by tests/test_mutants.py as ``python tests/_mutant_driver.py JOBS RESULTS``: JOBS is a JSON list of
{"name", "src", "nodes"}; for each job, everything imported from the previous copy, from tests/ and from
the root conftest is forgotten, the copy goes first on sys.path, pytest runs the tests ``nodes`` (pytest
node ids) in one session, and {"name", "exit", "imported"} (pytest's exit code, and the flashtile package
that was imported) is written to RESULTS as a JSON list.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def forget(copies: list[str]) -> None:
    """Drop every module from a package copy, from tests/ or the root conftest, so the next run imports anew."""
    mine = [str(ROOT / "tests"), str(ROOT / "conftest.py"), *copies]
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None) or ""
        if name == "flashtile" or name.startswith("flashtile.") or any(where.startswith(p) for p in mine):
            del sys.modules[name]


def main(jobs_file: str, results_file: str) -> None:
    import pytest

    jobs = json.loads(Path(jobs_file).read_text())
    results, copies = [], [job["src"] for job in jobs]
    # python puts this script's folder (tests/) first on the path: dropped, so tests/kernels is not ``kernels``
    base_path = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "tests"]
    for job in jobs:
        forget(copies)
        sys.path[:] = [job["src"], *base_path]
        nodes = [str(ROOT / node) for node in job["nodes"]]
        code = pytest.main(["-x", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *nodes])
        import flashtile

        results.append({"name": job["name"], "exit": int(code), "imported": flashtile.__file__})
        print(f"== {job['name']}: pytest exit {int(code)}, flashtile from {flashtile.__file__}", flush=True)
    Path(results_file).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])

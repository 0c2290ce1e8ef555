"""The site's modules under ``hooks/`` loaded as MkDocs loads them, for the tests that read them.

MkDocs puts ``hooks/`` on ``sys.path`` while it runs a hook file, so a hook imports its sibling modules by
their bare names (``figures`` imports ``render_plots``, which imports ``render_tables``). Here each file is
loaded the same way, but ``hooks/`` is on the path only while the module itself runs, and every bare name it
brought into ``sys.modules`` from ``hooks/`` is dropped afterwards: nothing of ``hooks/`` stays importable by a
bare name in the test session (``tests/test_env.py`` checks it), and the module keeps its own references to
what it imported.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path

HOOKS = Path(__file__).resolve().parents[1] / "hooks"


@cache
def load_hook(name: str):
    """``hooks/<name>.py`` as a module named ``flashtile_site_hooks.<name>``, loaded once per session."""
    path = HOOKS / f"{name}.py"
    if not path.is_file():
        raise ValueError(f"name: expected one of the files in hooks/, got {name!r}")
    spec = importlib.util.spec_from_file_location(f"flashtile_site_hooks.{name}", path)
    module = importlib.util.module_from_spec(spec)
    saved_path, before = sys.path.copy(), set(sys.modules)
    sys.path.insert(0, str(HOOKS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved_path
        for added in set(sys.modules) - before:
            where = getattr(sys.modules[added], "__file__", None) or ""
            if Path(where).resolve().parent == HOOKS:
                del sys.modules[added]
    return module

"""pytest configuration of the test package (the root ``conftest.py`` holds what the docs' claims need too).

- How the suite is dealt out to pytest-xdist workers, ``xdist_group`` honoured and the longest tests first, is
  ``tests/_xdist_plan.py``; its hook is re-exported here, where pytest finds it.
- No test may leave a folder of the repository's ``tests/`` or ``hooks/`` on ``sys.path``: a test that does
  fails, named, with the entries it left (``tests/test_imports.py`` says why).
- After a GPU test, the memory PyTorch's allocator keeps cached is handed back to the device: ``make gpu-test``
  runs four workers on one GPU, and a worker that holds the cache of its largest test (tens of GiB) left the
  others out of memory on an 80 GB H100.
"""

from __future__ import annotations

import pytest

from tests._imports import entries_inside_the_repository
from tests._xdist_plan import pytest_collection_modifyitems  # noqa: F401


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield
    left = entries_inside_the_repository()
    if left:
        raise AssertionError(f"{item.nodeid} left these folders of the repository on sys.path: {left}")
    return result


@pytest.fixture(autouse=True)
def _hand_back_cached_gpu_memory(request):
    yield
    if request.node.get_closest_marker("gpu") is not None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The versions this run tested, first in every report (the integration tests depend on transformers')."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in ("torch", "triton", "transformers", "kernels"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} not installed")
    return ["flashtile's test session: " + ", ".join(found)]

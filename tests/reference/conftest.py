import zlib

import pytest
import torch


@pytest.fixture
def rand(request):
    """Fresh float64 normal tensors from a generator seeded by the test's own id: a failure reproduces
    exactly on rerun, and the seed is shown in the report (``rand seed``) to rerun it by hand."""
    seed = zlib.crc32(request.node.nodeid.encode())
    request.node.user_properties.append(("rand seed", seed))
    gen = torch.Generator().manual_seed(seed)

    def make(*shape, dtype=torch.float64, scale=1.0):
        return scale * torch.randn(*shape, generator=gen, dtype=dtype)

    make.seed = seed
    return make


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Print the ``rand`` seed under a failing test's report."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for name, value in item.user_properties:
            if name == "rand seed":
                report.sections.append(("rand seed", f"generator seeded with {value} (crc32 of the test id)"))

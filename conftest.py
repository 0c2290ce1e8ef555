"""Root pytest configuration.

TRITON_INTERPRET must be set before any module that defines a ``@triton.jit`` kernel is imported,
because triton reads it when the decorator runs. On a machine without CUDA we switch the interpreter
on here, at the very top of the first file pytest imports.
"""

import os
import sys
from pathlib import Path

# tests/_truth.py (the independent float64 truth) is imported as ``_truth`` from every test directory.
sys.path.insert(0, str(Path(__file__).parent / "tests"))


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return torch.cuda.is_available()


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _hypothesis_profiles() -> None:
    """Examples per property test: 60 in ``make test``, 300 in ``make test-long`` (FLASHTILE_TEST_LONG=1).

    Each example of the kernel property test runs the Triton interpreter; 60 fresh examples per run, drawn
    anew each time, keep the unit suite short while the long profile explores further."""
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # pragma: no cover - hypothesis comes with the test extra
        return
    common = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("unit", max_examples=60, **common)
    settings.register_profile("long", max_examples=300, **common)
    settings.load_profile("long" if os.environ.get("FLASHTILE_TEST_LONG", "") not in ("", "0") else "unit")


_hypothesis_profiles()

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

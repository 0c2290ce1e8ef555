"""What the package runs on, asked in one place: whether Triton runs kernels on the CPU through its
interpreter, and how many SMs a device has.

Triton decides when a ``@triton.jit`` function is defined, from the environment variable
``TRITON_INTERPRET``. Asking Triton itself (``triton.knobs.runtime.interpret``) means flashtile's
dispatch can never disagree with the kernels it dispatches to: "1", "true", "on", "yes" (any case)
all mean yes, "0", "false", "" and anything else mean no, exactly as Triton reads them.
"""

from __future__ import annotations

import functools
import os

import torch

_TRUE = ("1", "true", "on", "yes", "y")  # Triton's own reading, for Triton builds without ``knobs``


# --8<-- [start:interpret]
def constant_under_compile(fn):
    """``torch.compiler.assume_constant_result(fn)``: torch.compile calls fn once while
    tracing and keeps its answer as a constant of the graph. That function imports
    torch._dynamo first (about 1.4 s of CPU in every process that imports flashtile,
    most of which never compile), then only sets this mark on fn; setting the mark
    ourselves defers the import to the first compile. tests/test_env.py checks that the
    two mark a function alike on the installed torch."""
    fn._dynamo_marked_constant = True
    return fn


# torch.compile reads it once, at trace time: Triton's knob is C code
@constant_under_compile
def is_interpreting() -> bool:
    """True when TRITON_INTERPRET asks for the interpreter, read the way Triton reads
    it."""
    try:
        from triton import knobs
    # no Triton at all (a platform without it), or a Triton older than knobs
    except ImportError:
        return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE
    return bool(knobs.runtime.interpret)
# --8<-- [end:interpret]


H200_SM_COUNT = 132  # what the split heuristics assume when there is no CUDA device to ask


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The SM count of a CUDA device, asked once per device; the H200's for any other device, so that every
    tier sizes its splits the same way."""
    if device.type != "cuda":
        return H200_SM_COUNT
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())

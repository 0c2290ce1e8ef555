"""Whether Triton runs kernels on the CPU through its interpreter: one answer for the whole package.

Triton decides when a ``@triton.jit`` function is defined, from the environment variable
``TRITON_INTERPRET``. Asking Triton itself (``triton.knobs.runtime.interpret``) means flashtile's
dispatch can never disagree with the kernels it dispatches to: "1", "true", "on", "yes" (any case)
all mean yes, "0", "false", "" and anything else mean no, exactly as Triton reads them.
"""

from __future__ import annotations

import os

_TRUE = ("1", "true", "on", "yes", "y")  # Triton's own reading, for Triton builds without ``knobs``


# --8<-- [start:interpret]
def is_interpreting() -> bool:
    """True when TRITON_INTERPRET asks for the interpreter, read the way Triton reads it."""
    try:
        from triton import knobs
    except ImportError:  # no Triton at all (a platform without it), or a Triton older than knobs
        return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE
    return bool(knobs.runtime.interpret)
# --8<-- [end:interpret]

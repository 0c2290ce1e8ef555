"""The parts the kernels are built of, by public names: for probes and studies that time a part, build a
variant of a kernel from the package's own pieces, or stub the launches to time the host path alone.

Each name here is the package's own object, not a copy (``KernelLaunch`` is the class every plan launches
through, so a probe that replaces its ``__call__`` stubs every launch). What the package itself calls
lives in ``kernels._host`` (host helpers) and ``kernels._jit`` (``@triton.jit`` helpers); code outside
``flashtile.kernels`` reaches them through this module, so the private modules can change shape without
breaking a probe silently: a name that moves is an import error here, which the probes' import test reports.
"""

from __future__ import annotations

from .._plans import cached_plan
from ._host import (
    KernelLaunch,
    heaviest_first_chunk,
    kernel_scale,
    resident_programs,
    specialization,
    tile_descriptor,
    tma_strides,
)
from ._host import _current_stream as current_stream  # the raw handle of the current CUDA stream
from ._jit import (
    delta_of_shift,
    full_key_tiles,
    fused_softmax_step,
    last_key_tile,
    multiply_subtract,
    program_tile,
)
from .forward import _forward_kernel as forward_kernel
from .forward import _write_rows as write_rows

__all__ = [
    "KernelLaunch",
    "cached_plan",
    "current_stream",
    "delta_of_shift",
    "forward_kernel",
    "full_key_tiles",
    "fused_softmax_step",
    "heaviest_first_chunk",
    "kernel_scale",
    "last_key_tile",
    "multiply_subtract",
    "program_tile",
    "resident_programs",
    "specialization",
    "tile_descriptor",
    "tma_strides",
    "write_rows",
]

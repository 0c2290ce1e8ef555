"""The Triton internals the fast launch relies on are those of the installed Triton.

``kernels._host.KernelLaunch`` (the one module that reaches past Triton's public launch) keeps what a first
launch compiled and calls its launcher directly: ``compiled.run(grid_x, grid_y, grid_z, stream,
compiled.function, compiled.packed_metadata, launch_metadata, enter_hook, exit_hook, *arguments)``, with the
constexprs after the arguments in ``kernel.arg_names`` order, and it steps aside when
``triton.knobs.runtime.launch_enter_hook`` is set. These are not public API: a Triton release may rename or
reorder them, and the fast path would then fail at its first GPU launch, or launch with shifted arguments.
These tests read the installed Triton's own source and objects on any machine, GPU or not, and name what moved.
"""

from __future__ import annotations

import inspect

import triton
import triton.compiler.compiler as triton_compiler

from flashtile.kernels import _host

# How Triton's own launch path calls a compiled kernel's launcher: the call KernelLaunch.__call__ repeats.
TRITONS_OWN_LAUNCH = (
    "self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed_metadata, launch_metadata,"
)


def test_the_compiled_launcher_is_called_as_kernel_launch_calls_it():
    source = " ".join(inspect.getsource(triton_compiler.CompiledKernel).split())
    expected = " ".join(TRITONS_OWN_LAUNCH.split())
    assert expected in source, (
        f"triton {triton.__version__}: CompiledKernel no longer launches with {TRITONS_OWN_LAUNCH!r}; "
        "kernels/_host.py KernelLaunch.__call__ passes its arguments in that order: update it (or take the "
        "full launch path only) before using this Triton"
    )
    for name in ("run", "function", "packed_metadata"):
        assert f"self.{name}" in source, (
            f"triton {triton.__version__}: CompiledKernel has no attribute {name!r}, which "
            "kernels/_host.py KernelLaunch._compile_and_launch keeps"
        )


def test_the_argument_names_and_the_launch_hook_are_where_kernel_launch_reads_them():
    jit_source = inspect.getsource(triton.runtime.jit.JITFunction)
    assert "self.arg_names" in jit_source, (
        f"triton {triton.__version__}: JITFunction has no arg_names; kernels/_host.py KernelLaunch orders the "
        "constexprs it passes after the arguments by it"
    )
    assert hasattr(triton.knobs.runtime, "launch_enter_hook"), (
        f"triton {triton.__version__}: triton.knobs.runtime.launch_enter_hook is gone; kernels/_host.py "
        "_launch_hooked reads it to leave profiled launches to Triton's full path"
    )
    assert _host.KernelLaunch.__call__.__module__ == _host.__name__  # the one module that holds the fast launch


def test_the_check_fails_for_a_launch_written_otherwise():
    """The control: the check above rejects a launcher call in another argument order."""
    source = " ".join(inspect.getsource(triton_compiler.CompiledKernel).split())
    reordered = "self.run(grid[0], grid[1], grid[2], self.function, stream, self.packed_metadata, launch_metadata,"
    assert reordered not in source

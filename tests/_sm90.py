"""Compile flashtile's Triton kernels for the H200 (sm_90) on a machine without a GPU.

The interpreter runs a kernel's Python, not Triton's compiler, so what only the compiler decides (the
instructions ``tl.dot`` becomes, atomics, shared memory, a type mismatch in a loop-carried value) is
checked on its output. ``compile_in_fresh_process(body)`` runs ``body`` in a new Python process without
TRITON_INTERPRET, after a prelude that defines ``sm90(fn, types, constexprs, **options)``, which compiles
``fn`` for ``GPUTarget("cuda", 90, 32)`` and returns the compiled kernel (``.asm["ptx"]``,
``.metadata.shared``), and ``sm90_like_a_launch(fn, types, constexprs, **options)``, the same with the
divisibility hints a launch on contiguous tensors adds. Parameters not named in ``types`` or
``constexprs`` take their default where they have one (as constexprs), and are int32 otherwise. The
body prints one JSON object on its last line; that object is returned.
Skipped where Triton has no NVIDIA backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent(
    """
    import inspect, json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def with_defaults(fn, types, constexprs):
        # A parameter with a default that the caller leaves out takes it, as a launch that omits it does
        # (the kernels' varlen switches: CU_Q=None, CU_K=None, ORDER=None, VARLEN=False)
        params = inspect.signature(fn.fn).parameters
        defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty
                    and n not in types and n not in constexprs}
        return dict(constexprs, **defaults)

    def sm90(fn, types, constexprs, **options):
        constexprs = with_defaults(fn, types, constexprs)
        signature = {name: "constexpr" if name in constexprs else types.get(name, "i32")
                     for name in inspect.signature(fn.fn).parameters}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)

    def sm90_like_a_launch(fn, types, constexprs, **options):
        # What a launch's specialisation adds for contiguous tensors at long T: head-dim strides of 1, and
        # 16-divisible pointers, strides and lengths (the hints that let loads be vectorised).
        names = list(inspect.signature(fn.fn).parameters)
        constexprs = with_defaults(fn, types, constexprs)
        constexprs = dict(constexprs, **{n: 1 for n in names if n.startswith("stride_") and n.endswith("d")})
        signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
        aligned = [n for n in names if n not in constexprs
                   and (types.get(n, "").startswith("*") or n.startswith("stride_") or n in ("Tq", "Tk"))]
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    """
)


def compile_in_fresh_process(body: str) -> dict:
    pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend (and its ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])

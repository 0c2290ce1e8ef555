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

The compile tests of the package's kernels share one process instead: each test module registers its
body (``register(name, body)``) when it is imported, and ``compiled(name, tmp_path_factory)`` returns
that body's JSON object from one fresh process that runs every registered body, each in a namespace of
its own (the prelude's names and nothing from another body), once per test run, whichever pytest-xdist
worker asks first. One interpreter start and one import of torch, Triton and flashtile (about 4 s of
CPU each) instead of one per test; what each body compiles, and with what, is unchanged. A body that
raises fails its own tests, with its traceback, and no other. Those tests carry
``pytest.mark.xdist_group("sm90")``, so one worker runs them one after the other and the other never
waits on the lock.
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


def _run_fresh(script: str, stdin: str = "", timeout: float = 300) -> dict:
    pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend (and its ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], input=stdin, capture_output=True, text=True, env=env,
                          timeout=timeout)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def compile_in_fresh_process(body: str) -> dict:
    return _run_fresh(PRELUDE + textwrap.dedent(body))


# Runs the bodies read from standard input ({name: body}), each with a copy of the prelude's globals; prints
# {name: {"out": its JSON object}} or {name: {"error": its traceback}}.
EVERY_BODY = """
import contextlib, io, sys, traceback
bodies = json.loads(sys.stdin.read())
prelude = dict(globals())
results = {}
for name, body in bodies.items():
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(body, f"<sm_90 body {name}>", "exec"), dict(prelude))
        results[name] = {"out": json.loads(printed.getvalue().strip().splitlines()[-1])}
    except Exception:
        results[name] = {"error": traceback.format_exc()[-3000:]}
print(json.dumps(results))
"""

_BODIES: dict[str, str] = {}


def register(name: str, body: str) -> str:
    """Adds ``body`` to the bodies that ``compiled`` runs together; returns ``name``."""
    _BODIES[name] = textwrap.dedent(body)
    return name


def compiled(name: str, tmp_path_factory) -> dict:
    """The JSON object that registered body ``name`` printed, every registered body compiled in one fresh
    process once per test run (a file in the folder that the run's xdist workers share, under a lock)."""
    from filelock import FileLock  # a dependency of torch

    pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend (and its ptxas) is not installed")
    bodies = dict(sorted(_BODIES.items()))
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path = root / f"sm90-{'-'.join(bodies)}.json"
    with FileLock(str(path) + ".lock"):
        if not path.is_file():
            path.write_text(json.dumps(_run_fresh(PRELUDE + EVERY_BODY, json.dumps(bodies), timeout=900)))
        result = json.loads(path.read_text())[name]
    if "error" in result:
        pytest.fail(f"the sm_90 body {name!r} raised:\n{result['error']}", pytrace=False)
    return result["out"]

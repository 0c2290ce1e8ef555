"""Root pytest configuration.

TRITON_INTERPRET must be set before any module that defines a ``@triton.jit`` kernel is imported,
because triton reads it when the decorator runs. On a machine without CUDA we switch the interpreter
on here, at the very top of the first file pytest imports.
"""

import inspect
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent


def _repository_root_off_the_path() -> None:
    """The repository's folders are never importable by a bare name in the test session.

    ``python -m pytest`` (and ``python -c``) put the current folder first on ``sys.path``; run from the
    repository root, that makes its folders ``hooks``, ``bench``, ``docs`` importable as top-level namespace
    packages, where a package of the same name may be installed (the way ``tests/kernels`` once stood in for
    Hugging Face's ``kernels``). The tests import their helpers by full name (``tests._truth``) through
    pytest's ``importlib`` import mode, which needs no entry on the path; the package itself is installed.
    pytest-xdist's workers copy this process's path, so they start without the entry too."""
    sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != REPO]


_repository_root_off_the_path()


def _threads_per_worker() -> None:
    """Under pytest-xdist, each worker's share of the cores for torch's and the BLAS's thread pools.

    Each worker (and each process it starts: the checker's workers, the mutation driver, the ring's ranks)
    would otherwise start a pool as large as the machine, so ``-n 2`` on 2 cores runs 4 busy threads and
    more, and the pools' threads wait for each other spinning: measured on the 2-core machine with its other
    core busy, a torch-heavy test file took 15-30 % more CPU. Set before anything imports torch or numpy
    (the pools read these variables when they start); a value the caller set is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 1:
        return
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, threads)
    if "torch" in sys.modules:  # imported by a plugin already: its pool is sized, resize it
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_threads_per_worker()


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return torch.cuda.is_available()


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_patches_the_language_once_per_launch() -> None:
    """A speed-up of Triton's interpreter for the tests; what it computes is unchanged.

    For each launch the interpreter swaps triton.language's builtins for numpy versions (``_patch_lang``),
    and restores them when the launch ends. It also calls ``_patch_lang`` again at every call of a
    @triton.jit helper inside the kernel, which finds the same modules patched already and re-walks them
    with ``inspect.getmembers``: about a quarter of the interpreter's time in these tests. Here a helper's
    call patches only when its module sees a language module that this launch has not patched yet (as
    the interpreter would). Left alone when this Triton's interpreter does not have the shape relied on.
    """
    if os.environ.get("TRITON_INTERPRET", "") in ("", "0"):
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - triton comes with the package on Linux
        return
    original = getattr(interpreter, "_patch_lang", None)
    launch = vars(getattr(interpreter, "GridExecutor", object)).get("__call__")  # where a launch patches
    launch_code = getattr(launch, "__code__", None)
    if not callable(original) or getattr(original, "once_per_launch", False) or launch_code is None:
        return
    patched: list[set[int]] = []  # per launch in progress: the language modules it has patched
    seen: dict = {}  # per function: the language modules its module sees (as _patch_lang finds them)

    def languages(fn) -> set[int]:
        if fn not in seen:
            seen[fn] = {id(m) for m in fn.__globals__.values() if inspect.ismodule(m) and m in (tl, tl.core)}
        return seen[fn]

    def patch_lang(fn):
        if sys._getframe(1).f_code is launch_code:  # a launch: patch, remember what, forget at its restore
            scope = original(fn)
            patched.append(set(languages(fn)))  # a copy: helpers may add to it
            restore = scope.restore

            def restore_and_forget():
                try:
                    restore()
                finally:
                    patched.pop()

            scope.restore = restore_and_forget
            return scope
        if patched and languages(fn) <= patched[-1]:
            return None  # a helper's call: nothing new to patch (the interpreter ignores what this returns)
        scope = original(fn)
        if patched:
            patched[-1] |= languages(fn)
        return scope

    patch_lang.once_per_launch = True
    interpreter._patch_lang = patch_lang


_interpreter_patches_the_language_once_per_launch()


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

"""The command line of practice mode: ``init`` writes skeletons, ``check`` runs the battery on them."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from .battery import SITE, STEP_NAMES, STEPS, Case, Step, StepResult, run_step

SKELETONS = Path(__file__).with_name("skeletons")
MARKER = "--8<--"


# --8<-- [start:parser]
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flashtile.practice",
        description="Write FlashAttention yourself, step by step, and check it against flashtile's battery.",
        epilog=f"steps, in order: {', '.join(STEP_NAMES)}. Chapters: {SITE}",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="write skeleton modules and a README into DIR")
    init.add_argument("dir", type=Path, metavar="DIR")
    init.add_argument("--force", action="store_true", help="overwrite files that already exist")
    check = sub.add_parser("check", help="run the battery against the modules in DIR")
    check.add_argument("dir", type=Path, nargs="?", metavar="DIR", help="your modules (default: the package's own)")
    check.add_argument("--step", action="append", choices=STEP_NAMES, metavar="NAME",
                       help=f"run only this step (repeatable): {', '.join(STEP_NAMES)}")
    check.add_argument("--fast", action="store_true", help="fewer cases per step")
    check.add_argument("--package", action="store_true", help="check flashtile's own functions instead of DIR")
    sub.add_parser("steps", help="list the steps, their files and chapters")
    return parser
# --8<-- [end:parser]


def readme() -> str:
    rows = "\n".join(f"| {n} | `{s.name}` | `{s.file}.py` | {', '.join(f'`{f}`' for f in s.functions)} | "
                     f"{SITE}{s.chapter} |" for n, s in enumerate(STEPS, 1))
    return f"""# Your FlashAttention

Each file here is a skeleton: the same function names and signatures as flashtile's own, a docstring
that states shapes and conventions, and a body that raises NotImplementedError. Fill them in, in
this order, and check each step as you go:

    python -m flashtile.practice check . --step online_softmax
    python -m flashtile.practice check .          # every step
    python -m flashtile.practice check . --fast   # fewer cases, quicker

| # | step | file | functions | chapter |
|---|---|---|---|---|
{rows}

The checker compares against a float64 truth computed from the definition (einsum and torch.softmax).
A failing case is named by its shapes, alignment and block sizes, with the error and a hint.
Triton steps run through the Triton interpreter when there is no CUDA device (the checker sets
TRITON_INTERPRET=1 before it imports your files); use float32 or float16 there, never bfloat16.
Your files may import each other (this folder is put on sys.path) and torch, triton, numpy.
"""


def init(directory: Path, force: bool) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    targets = {directory / f"{s.file}.py": SKELETONS / f"{s.file}.py" for s in STEPS}
    targets[directory / "README.md"] = None
    clash = [p for p in targets if p.exists()]
    if clash and not force:
        print(f"error: {', '.join(str(p) for p in clash)} already exist; use --force to overwrite", file=sys.stderr)
        return 1
    for target, source in targets.items():
        text = readme() if source is None else "".join(
            line for line in source.read_text(encoding="utf-8").splitlines(keepends=True) if MARKER not in line)
        target.write_text(text, encoding="utf-8")
        print(f"wrote {target}")
    print(f"\nnext: open {directory / 'README.md'}, then run: python -m flashtile.practice check {directory}")
    return 0


# --8<-- [start:interpreter]
def needs_interpreter() -> bool:
    """No GPU, and TRITON_INTERPRET not set by the caller: Triton must be told before it is imported.

    Triton reads TRITON_INTERPRET when a @triton.jit function is defined, and triton.language defines
    some of its own (tl.sum, tl.max) when it is imported; ``import flashtile`` has already imported it
    by the time this code runs. So ``check`` then re-runs itself in a fresh interpreter with the
    variable set, before anything imports triton.
    """
    import torch

    return not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ


def rerun_with_interpreter(argv: list[str]) -> int:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.call([sys.executable, "-m", "flashtile.practice", *argv], env=env)
# --8<-- [end:interpreter]


def backend() -> str:
    import torch

    if torch.cuda.is_available():
        return "compiled Triton on " + torch.cuda.get_device_name()
    if os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes", "y"):
        return "Triton interpreter on the CPU"
    return "no CUDA and TRITON_INTERPRET unset: Triton steps cannot run"


class Loader:
    """Imports the reader's DIR/<file>.py once each, or the package's own module for --package."""

    def __init__(self, directory: Path | None):
        self.directory = directory
        self.modules: dict[str, ModuleType] = {}
        if directory is not None and str(directory.resolve()) not in sys.path:
            sys.path.insert(0, str(directory.resolve()))  # the reader's files may import each other

    def load(self, step: Step) -> ModuleType:
        if self.directory is None:
            return importlib.import_module(step.package_module)
        if step.file not in self.modules:
            path = self.directory / f"{step.file}.py"
            if not path.is_file():
                raise FileNotFoundError(f"{path} does not exist (python -m flashtile.practice init writes it)")
            spec = importlib.util.spec_from_file_location(f"practice_{step.file}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            self.modules[step.file] = module
        return self.modules[step.file]


def progress(case: Case, ok: bool) -> None:
    print("." if ok else "F", end="", flush=True)


# --8<-- [start:check]
def check(directory: Path | None, steps: list[str] | None, fast: bool) -> int:
    where = "flashtile's own functions" if directory is None else f"{directory}/"
    print(f"checking {where} ({backend()}){', fast' if fast else ''}")
    loader = Loader(directory)
    chosen = [s for s in STEPS if not steps or s.name in steps]
    results: list[StepResult] = []
    for n, step in enumerate(chosen, 1):
        print(f"[{n}/{len(chosen)}] {step.name:<15} {step.file + '.py':<19} ", end="", flush=True)
        try:
            impl = loader.load(step)
        except Exception as exc:  # a syntax error or a failing import fails the step, with the message
            result = StepResult(step)
            result.failures.append(_import_failure(step, exc))
        else:
            result = run_step(step, impl, fast=fast, on_case=progress)
        results.append(result)
        print(f" {'ok' if result.ok else 'FAILED'}")
    for result in results:
        if not result.ok:
            print("\n" + failure_report(result))
    print(summary_table(results))
    return 0 if all(r.ok for r in results) else 1
# --8<-- [end:check]


def failure_report(result: StepResult) -> str:
    """The first failure of a step (it says the most): the case, the error, the hint, the chapter."""
    if result.ok:
        return f"{result.step.name}: all {result.passed} cases pass"
    failure, more = result.failures[0], len(result.failures) - 1
    return "\n".join([
        f"FAILED {result.step.name}: {failure.case}" + (f"  (and {more} more)" if more > 0 else ""),
        f"  error: {failure.error}",
        f"  hint:  {failure.hint}",
        f"  read:  {SITE}{failure.chapter}",
    ])


def _import_failure(step: Step, exc: Exception):
    from .battery import Failure, _short_error

    return Failure(f"importing {step.file}.py", _short_error(exc), "fix the file so that it imports", step.chapter)


def summary_table(results: list[StepResult]) -> str:
    lines = ["", f"{'step':<16}{'file':<20}{'result':<8}{'cases':>7}", "-" * 51]
    for r in results:
        cases = f"{r.passed}/{r.total}"
        lines.append(f"{r.step.name:<16}{r.step.file + '.py':<20}{'pass' if r.ok else 'FAIL':<8}{cases:>7}")
    failed = sum(not r.ok for r in results)
    lines.append(f"\n{len(results) - failed} of {len(results)} steps pass")
    return "\n".join(lines)


def list_steps() -> int:
    for n, s in enumerate(STEPS, 1):
        kind = "Triton" if s.triton else "PyTorch"
        print(f"{n}. {s.name:<15} {s.file + '.py':<19} {kind:<8} {s.summary}  ({SITE}{s.chapter})")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.command == "init":
        return init(args.dir, args.force)
    if args.command == "steps":
        return list_steps()
    if args.dir is None and not args.package:
        build_parser().error("check needs DIR (or --package for flashtile's own functions)")
    if needs_interpreter():
        return rerun_with_interpreter(argv)
    return check(None if args.package else args.dir, args.step, args.fast)

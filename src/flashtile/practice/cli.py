"""The command line of practice mode: ``init`` writes skeletons, ``check`` runs the battery on them."""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

from .battery import SITE, STEP_NAMES, STEPS, Failure, StepResult

TIME_LIMIT = 60.0  # seconds per case, and for importing each file

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
    check.add_argument("-v", "--verbose", action="store_true",
                       help="show every failing case (by default: the first of each step and a count)")
    check.add_argument("--time-limit", type=float, default=TIME_LIMIT, metavar="SECONDS",
                       help=f"fail a case (or a file's import) that runs longer than this (default {TIME_LIMIT:g}; "
                            "inf: no limit)")
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
    python -m flashtile.practice check . -v       # every failing case, not only the first of each step

| # | step | file | functions | chapter |
|---|---|---|---|---|
{rows}

The checker compares against a float64 truth computed from the definition (einsum and torch.softmax).
A failing case is named by its shapes, alignment and block sizes, with the error and a hint chosen
from what your output looks like. Your code runs in a separate process with a time limit per case
(--time-limit, 60 s by default), so a hang or a sys.exit fails its case and the rest still run; the
exit status is 0 only when every case passed.
Triton steps run through the Triton interpreter when there is no CUDA device (the checker sets
TRITON_INTERPRET=1 before it imports your files); use float32 or float16 there, never bfloat16.
Your files may import each other (this folder is put on sys.path) and torch, triton, numpy.
"""


def init(directory: Path, force: bool) -> int:
    """Write the skeletons; exit status 1 when files are already there (without --force), 2 for a DIR that
    cannot be a folder of files (an existing file, a path that cannot be written)."""
    if directory.exists() and not directory.is_dir():
        print(f"error: {directory} exists and is not a folder; give init a folder (new or existing)", file=sys.stderr)
        return 2
    targets = {directory / f"{s.file}.py": SKELETONS / f"{s.file}.py" for s in STEPS}
    targets[directory / "README.md"] = None
    clash = [p for p in targets if p.exists()]
    if clash and not force:
        print(f"error: {', '.join(str(p) for p in clash)} already exist; use --force to overwrite", file=sys.stderr)
        return 1
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for target, source in targets.items():
            text = readme() if source is None else "".join(
                line for line in source.read_text(encoding="utf-8").splitlines(keepends=True) if MARKER not in line)
            target.write_text(text, encoding="utf-8")
            print(f"wrote {target}")
    except OSError as exc:  # a read-only place, a file where a folder should be, a full disk
        print(f"error: cannot write into {directory}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"\nnext: open {directory / 'README.md'}, then run: python -m flashtile.practice check {directory}")
    return 0


# --8<-- [start:interpreter]
def worker_environment() -> dict[str, str]:
    """The worker's environment: TRITON_INTERPRET=1 when there is no GPU and the caller did not set it.

    Triton reads TRITON_INTERPRET when a @triton.jit function is defined, and triton.language defines
    some of its own (tl.sum, tl.max) when it is imported; ``import flashtile`` has already imported it
    by the time this code runs. The worker is a fresh interpreter, so the variable is set before
    anything there imports Triton.
    """
    import torch

    env = dict(os.environ)
    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in env:
        env["TRITON_INTERPRET"] = "1"
    return env
# --8<-- [end:interpreter]


def backend(env: dict[str, str]) -> str:
    import torch

    if torch.cuda.is_available():
        return "compiled Triton on " + torch.cuda.get_device_name()
    if env.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes", "y"):
        return "Triton interpreter on the CPU"
    return "no CUDA and TRITON_INTERPRET unset: Triton steps cannot run"


class Worker:
    """One ``python -m flashtile.practice.worker`` process and the events it sends, one JSON line each."""

    def __init__(self, spec: dict, env: dict[str, str]):
        posix = os.name == "posix"
        self.proc = subprocess.Popen([sys.executable, "-m", "flashtile.practice.worker", json.dumps(spec)],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, text=True,
                                     start_new_session=posix)  # its own group: a kill ends its children too
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        self.events.put(None)  # the worker ended

    def next(self, timeout: float):
        """The next event, None when the worker ended, or TimeoutError after ``timeout`` seconds."""
        try:
            # a wait beyond the platform's longest (threading.TIMEOUT_MAX, centuries) is that wait: inf may stand
            # for "no limit", and queue's own wait would meet it with OverflowError: timestamp out of range
            return self.events.get(timeout=min(timeout, threading.TIMEOUT_MAX))
        except queue.Empty:
            raise TimeoutError from None

    def exit_status(self) -> int | None:
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                if os.name == "posix":
                    os.killpg(self.proc.pid, signal.SIGKILL)
                else:
                    self.proc.kill()
            except ProcessLookupError:
                pass
        self.proc.wait()


def progress(ok: bool) -> None:
    print("." if ok else "F", end="", flush=True)


# --8<-- [start:check]
def check(directory: Path | None, steps: list[str] | None, fast: bool, verbose: bool = False,
          time_limit: float = TIME_LIMIT) -> int:
    """Run the chosen steps in a worker process; exit status 0 only when every case of every step passed."""
    env = worker_environment()
    where = "flashtile's own functions" if directory is None else f"{directory}/"
    print(f"checking {where} ({backend(env)}){', fast' if fast else ''}")
    chosen = [s for s in STEPS if not steps or s.name in steps]
    results = [StepResult(step) for step in chosen]
    spec = {"dir": None if directory is None else str(directory), "steps": [s.name for s in chosen], "fast": fast}
    position: tuple[int, int] | None = (0, 0)
    while position is not None:  # a new worker after each case that timed out or ended the process
        position = supervise(dict(spec, start=position), env, results, time_limit)
    for result in results:
        if not result.ok:
            print("\n" + failure_report(result, verbose))
    print(summary_table(results))
    return 0 if all(r.ok and r.passed for r in results) else 1
# --8<-- [end:check]


class WorkerError(RuntimeError):
    """The worker process could not start or stopped answering outside the reader's code."""


def supervise(spec: dict, env: dict[str, str], results: list[StepResult], time_limit: float):
    """Run one worker from spec["start"]; return where the next worker must start, or None when done."""
    worker = Worker(spec, env)
    running = None  # (step, case index or None while importing, case name)
    done = tuple(spec["start"])  # where a next worker would start: after the last case that ended
    heard = False
    try:
        while True:
            try:
                # starting Python, torch and the interpreter is not the reader's time; a case or an import is
                event = worker.next(time_limit if running else max(300.0, time_limit))
            except TimeoutError:
                if running is None:
                    raise WorkerError("the worker process did not answer for 300 s") from None
                return _lost(results, running, spec["fast"],
                             f"TimeoutError: no answer within the time limit of {time_limit:g} s (an infinite loop? "
                             "a loop far longer than the case needs?); the case was stopped",
                             "look for a loop whose bound never moves (while without an update, a tile index "
                             "that does not advance); raise the limit with --time-limit if your code is only slow")
            if event is None:
                status = worker.exit_status()
                if not heard:
                    raise WorkerError(f"the worker process ended before it started the battery (exit status {status})")
                if running is None:  # e.g. a thread of the reader's ended the process: the step cannot go on
                    step = done[0]
                    if step >= len(results):
                        return None
                    running = (step, None, f"after the case {done[1]} of {results[step].step.name}")
                return _lost(results, running, spec["fast"],
                             f"the process running your code ended (exit status {status}) during this case: "
                             "os._exit, a crash or a signal", "do not end the process from your code")
            heard = True
            step = event.get("step")
            kind = event["event"]
            if kind == "load":
                running = (step, None, f"importing {results[step].step.file}.py")
                if results[step].total == 0:
                    print(f"[{step + 1}/{len(results)}] {results[step].step.name:<15} "
                          f"{results[step].step.file + '.py':<19} ", end="", flush=True)
            elif kind == "import_failed":
                r = results[step]
                r.failures.append(Failure(f"importing {r.step.file}.py", event["error"], event["hint"], r.step.chapter))
                progress(False)
                _end_step(r)
                running, done = None, (step + 1, 0)
            elif kind == "case":
                running = (step, event["index"], event["name"])
            elif kind == "result":
                r = results[step]
                if event["ok"]:
                    r.passed += 1
                else:
                    r.failures.append(Failure(running[2], event["error"], event["hint"], r.step.chapter))
                progress(event["ok"])
                running, done = None, (step, event["index"] + 1)
            elif kind == "step_end":
                results[step].skipped = event["skipped"]
                _end_step(results[step])
                running, done = None, (step + 1, 0)
            elif kind == "end":
                return None
    finally:
        worker.kill()


def _end_step(result: StepResult) -> None:
    print(f" {'ok' if result.ok else 'FAILED'}")


def _lost(results: list[StepResult], running, fast: bool, error: str, hint: str):
    """Record the running case (or import) as failed; return where the next worker starts."""
    step, index, name = running
    r = results[step]
    r.failures.append(Failure(name, error, hint, r.step.chapter))
    progress(False)
    if index is None:  # the import itself: the step cannot run
        _end_step(r)
        return (step + 1, 0) if step + 1 < len(results) else None
    n_cases = len([c for c in r.step.cases() if c.fast or not fast])
    if index + 1 < n_cases:
        return (step, index + 1)
    _end_step(r)
    return (step + 1, 0) if step + 1 < len(results) else None


def failure_report(result: StepResult, verbose: bool = False) -> str:
    """A step's failures: the first (it says the most) and how many more, or with ``verbose`` every one,
    each with the case, the error, the hint and the chapter."""
    if result.ok:
        return f"{result.step.name}: all {result.passed} cases pass"
    shown = result.failures if verbose else result.failures[:1]
    more = len(result.failures) - len(shown)
    lines = []
    for failure in shown:
        lines += [f"FAILED {result.step.name}: {failure.case}" + (f"  (and {more} more; -v shows them)"
                                                                   if more > 0 else ""),
                  f"  error: {failure.error}",
                  f"  hint:  {failure.hint}",
                  f"  read:  {SITE}{failure.chapter}"]
    return "\n".join(lines)


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
    if not args.package and not args.dir.is_dir():
        print(f"error: {args.dir} is not a folder (python -m flashtile.practice init {args.dir} writes one)",
              file=sys.stderr)
        return 2
    if not args.time_limit > 0:  # NaN fails this too
        build_parser().error(f"--time-limit must be a positive number of seconds (inf for no limit), got "
                             f"{args.time_limit:g}")
    try:
        return check(None if args.package else args.dir, args.step, args.fast, args.verbose, args.time_limit)
    except WorkerError as exc:
        print(f"\nerror: {exc}; its messages are above", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130

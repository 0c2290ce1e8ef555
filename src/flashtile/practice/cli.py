"""The command line of practice mode: ``init`` writes skeletons, ``check`` runs the battery on them."""

from __future__ import annotations

import argparse
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from .battery import SITE, Failure, Hint, ReaderError, Sandboxed, Step, StepResult, run_step
from .steps import STEP_NAMES, STEPS

TIME_LIMIT = 60.0  # seconds per case, and for importing each file
HINT_LEVELS = ("nudge", "formula")

SKELETONS = Path(__file__).with_name("skeletons")
MARKER = "--8<--"


# --8<-- [start:parser]
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flashtile.practice",
        description="Write FlashAttention yourself, step by step, and check it against "
        "flashtile's battery.",
        epilog=f"steps, in order: {', '.join(STEP_NAMES)}. Chapters: {SITE}",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="write skeleton modules and a README into DIR")
    init.add_argument("dir", type=Path, metavar="DIR")
    init.add_argument(
        "--force", action="store_true", help="overwrite files that already exist"
    )
    check = sub.add_parser("check", help="run the battery against the modules in DIR")
    check.add_argument(
        "dir",
        type=Path,
        nargs="?",
        metavar="DIR",
        help="your modules (default: the package's own)",
    )
    check.add_argument("--step", action="append", choices=STEP_NAMES, metavar="NAME",
                       help=f"run only this step (repeatable): {', '.join(STEP_NAMES)}")
    check.add_argument("--fast", action="store_true", help="fewer cases per step")
    check.add_argument(
        "--package",
        action="store_true",
        help="check flashtile's own functions instead of DIR",
    )
    check.add_argument(
        "--hint",
        choices=HINT_LEVELS,
        default="nudge",
        help="nudge (default): each failure's symptom and where to look; formula: the "
        "formula too",
    )
    check.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show every failing case (by default: the first of each step and a count)",
    )
    check.add_argument(
        "--time-limit",
        type=float,
        default=TIME_LIMIT,
        metavar="SECONDS",
        help="fail a case (or a file's import) that runs longer than this (default "
        f"{TIME_LIMIT:g}; inf: no limit)",
    )
    sub.add_parser("steps", help="list the steps, their files and chapters")
    mock = sub.add_parser(
        "interview", help="a mock interview: questions, a timed coding step, a record"
    )
    mock.add_argument(
        "--questions",
        type=int,
        default=5,
        metavar="N",
        help="how many questions (default 5)",
    )
    mock.add_argument(
        "--difficulty",
        action="append",
        choices=("easy", "medium", "hard"),
        help="draw only questions of this difficulty (repeatable)",
    )
    mock.add_argument(
        "--dir",
        type=Path,
        metavar="DIR",
        help="your modules, for the coding step (none without)",
    )
    mock.add_argument(
        "--step",
        choices=STEP_NAMES,
        help="the coding step (default: the first not passed yet)",
    )
    mock.add_argument(
        "--minutes",
        type=float,
        default=30.0,
        help="time for the coding step (default 30)",
    )
    mock.add_argument(
        "--record",
        type=Path,
        metavar="FILE",
        help="the JSON record of attempts (default: "
        "DIR/.flashtile-practice-record.json, or in your home folder without --dir)",
    )
    mock.add_argument(
        "--seed", type=int, help="seed of the draw (default: a new draw each time)"
    )
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
    python -m flashtile.practice check . --hint formula   # each hint with its formula
    python -m flashtile.practice interview --dir .        # a mock interview: questions, then a timed step

| # | step | file | functions | chapter |
|---|---|---|---|---|
{rows}

The checker compares against a float64 truth computed from the definition (einsum and torch.softmax).
A failing case is named by its shapes, alignment and block sizes, with the error and a hint chosen
from what your output looks like: the output of a known mistake it matches (the symptom and where
to look; --hint formula adds the formula), or, when it matches none, what differs and no guess.
Your code runs in a separate process with a time limit per case (--time-limit, 60 s by default),
so a hang or a sys.exit fails its case and the rest still run; the
exit status is 0 only when every case passed. That process only answers calls: the checker builds each
case's inputs and judges every answer itself, so nothing your code prints or writes can pass a case.
Triton steps run through the Triton interpreter when there is no CUDA device (the checker sets
TRITON_INTERPRET=1 before it imports your files); use float32 or float16 there, never bfloat16
(the backward kernel's cases are float32).
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
    """The worker's environment: TRITON_INTERPRET=1 when there is no GPU and the caller
    did not set it.

    Triton reads TRITON_INTERPRET when a @triton.jit function is defined, and
    triton.language defines some of its own (tl.sum, tl.max) when it is imported, so the
    variable must be set before anything imports Triton. The worker is a fresh
    interpreter, or a fork of this one made while nothing here had imported Triton
    (``can_fork``), so it is.
    """
    env = dict(os.environ)
    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in env:
        env["TRITON_INTERPRET"] = "1"
    return env
# --8<-- [end:interpreter]


def backend(env: dict[str, str]) -> str:
    if torch.cuda.is_available():
        return "compiled Triton on " + torch.cuda.get_device_name()
    if env.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes", "y"):
        return "Triton interpreter on the CPU"
    return "no CUDA and TRITON_INTERPRET unset: Triton steps cannot run"


class WorkerError(RuntimeError):
    """The worker process could not start or stopped answering outside the reader's code."""


def can_fork() -> bool:
    """``os.fork`` for the worker where it is safe: Linux, a torch built without CUDA (no driver to
    inherit), and Triton not yet imported here without the interpreter the worker needs."""
    if not sys.platform.startswith("linux") or torch.version.cuda or torch.version.hip:
        return False
    return "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET", "") == worker_environment().get(
        "TRITON_INTERPRET", "")


class Worker:
    """One worker process (``flashtile.practice.worker``) seen from ``check``: requests go out on one pipe,
    and a thread puts each answer of the other (a dict, or ValueError for bytes that are not a frame) on
    ``events``, then None when the worker ended."""

    def __init__(self, directory: Path | None, env: dict[str, str], fork: bool):
        from . import worker

        requests_r, requests_w = os.pipe()
        answers_r, answers_w = os.pipe()
        self.proc = None
        if fork:
            self.pid = os.fork()
            if self.pid == 0:  # the child: it never returns into the checker's code
                try:
                    os.close(requests_w)
                    os.close(answers_r)
                    os.environ.clear()
                    os.environ.update(env)
                    worker.start_here(requests_r, answers_w, directory)
                finally:
                    os._exit(0)
        else:
            self.proc = subprocess.Popen([sys.executable, "-m", "flashtile.practice.worker",
                                          "-" if directory is None else str(directory)],
                                         stdin=requests_r, stdout=answers_w, env=env,
                                         start_new_session=os.name == "posix")  # a kill ends its children too
            self.pid = self.proc.pid
        os.close(requests_r)
        os.close(answers_w)
        self.requests = os.fdopen(requests_w, "wb")
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(os.fdopen(answers_r, "rb"), worker.read_frame), daemon=True).start()
        self.sent = 0
        self.writing = threading.Lock()  # one request's bytes at a time

    def _read(self, answers, read_frame) -> None:
        try:
            while (frame := read_frame(answers)) is not None:
                self.events.put(frame)
        except Exception as exc:  # noqa: BLE001  (whatever the bytes were, they are not an answer)
            self.events.put(ValueError(f"{type(exc).__name__}: {exc}"))
        self.events.put(None)  # the worker ended, or its answers can no longer be read

    def send(self, request: dict) -> int:
        """Send a request from a thread of its own (a worker stuck in the reader's code does not read, and a
        request larger than the pipe's buffer would block); return its id."""
        from .worker import write_frame

        self.sent += 1
        request = dict(request, id=self.sent)

        def write():
            try:
                with self.writing:
                    write_frame(self.requests, request)
            except (OSError, ValueError):  # the worker ended: its answer (None) says so
                pass

        threading.Thread(target=write, daemon=True).start()
        return self.sent

    def next(self, timeout: float):
        """The next event, None when the worker ended, or TimeoutError after ``timeout`` seconds."""
        try:
            # a wait beyond the platform's longest (threading.TIMEOUT_MAX, centuries) is that wait: inf may stand
            # for "no limit", and queue's own wait would meet it with OverflowError: timestamp out of range
            return self.events.get(timeout=min(timeout, threading.TIMEOUT_MAX))
        except queue.Empty:
            raise TimeoutError from None

    def exit_status(self) -> int | None:
        if self.proc is not None:
            try:
                return self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                return None
        for _ in range(50):
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.pid = None
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.1)
        return None

    def kill(self) -> None:
        if self.pid is None:  # already reaped
            self.requests.close()
            return
        try:
            if os.name == "posix":
                try:
                    os.killpg(self.pid, signal.SIGKILL)
                except ProcessLookupError:  # a child killed before its setsid
                    os.kill(self.pid, signal.SIGKILL)
            else:
                self.proc.kill()
        except ProcessLookupError:
            pass
        if self.proc is not None:
            self.proc.wait()
        else:
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass
        self.pid = None
        self.requests.close()


def _printable(text: str, limit: int = 600) -> str:
    """Text from the reader's process, safe to print: no control characters (no forged lines, no terminal
    escapes), at most ``limit`` characters."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def _decode(value):
    """An answer's value, checked to be plain data; ValueError for anything else."""
    if type(value) is torch.Tensor or value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) in (tuple, list):
        return type(value)(_decode(v) for v in value)
    if type(value) is dict and list(value) == ["__type__"] and isinstance(value["__type__"], str):
        return type(_printable(value["__type__"], 80) or "object", (), {})()  # an object of that type's name
    raise ValueError(f"a value of type {type(value).__name__} in an answer")


HINT_LOOP = Hint("time_limit", "look for a loop whose bound never moves (while without an update, a tile index that "
                 "does not advance); raise the limit with --time-limit if your code is only slow")
HINT_ENDED = Hint("ended", "do not end the process from your code")
HINT_CHANNEL = Hint("channel", "return your results; write nothing into the checker's pipe (print goes to standard "
                    "error)")


class Sandbox:
    """The reader's code, seen from ``check``: one worker process at a time, started again after a case that
    ran past the time limit, ended the process or garbled its answers. Each case gets ``time_limit`` seconds
    of the reader's time (waiting for answers; not the battery's own work, not a worker's start)."""

    def __init__(self, directory: Path | None, env: dict[str, str], time_limit: float):
        self.directory, self.env, self.time_limit = directory, env, time_limit
        self.fork = can_fork()
        self.worker: Worker | None = None
        self.loaded: tuple[str, str, tuple[str, ...]] | None = None  # the file the cases call
        self.unloaded = False  # a new worker that has not imported ``loaded`` yet
        self.start_case()  # which starts the first worker

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.worker is not None:
            self.worker.kill()

    def start_case(self) -> None:
        self.left = self.time_limit
        self.lost: ReaderError | None = None  # what ended this case's worker: later calls of the case fail so
        # A worker lost in the last case is replaced here, between cases: a fork made inside a case would
        # start with that case's inputs and float64 truth on its stack, where the reader's code could read
        # them (``sys._getframe``). The file is imported again at the case's first call.
        if self.worker is None:
            self._start()
            self.unloaded = self.loaded is not None

    def _start(self) -> None:
        self.worker = Worker(self.directory, self.env, self.fork)
        try:  # starting Python and torch is not the reader's time
            ready = self.worker.next(max(300.0, self.time_limit))
        except TimeoutError:
            self.worker.kill()
            raise WorkerError("the worker process did not answer for 300 s") from None
        if not isinstance(ready, dict) or ready.get("ready") is not True:
            status = self.worker.exit_status()
            self.worker.kill()
            raise WorkerError(f"the worker process ended before it started (exit status {status})")

    def _lose(self, error: str, hint: str) -> ReaderError:
        self.worker.kill()
        self.worker = None
        self.lost = ReaderError(error, hint)
        return self.lost

    def ask(self, request: dict) -> dict:
        """The worker's answer to one request, its ``ok`` checked; ReaderError for everything else."""
        if self.lost is not None:
            raise self.lost
        if self.worker is None:  # lost within this case (``lost`` is set then): only a guard
            self._start()
            self.unloaded = self.loaded is not None
        if self.unloaded and request["op"] == "call":  # a new worker: the file imported again first
            self.unloaded = False
            file, module, functions = self.loaded
            self.ask({"op": "load", "file": file, "module": module, "functions": list(functions)})
        sent = self.worker.send(request)
        began = time.monotonic()
        try:
            answer = self.worker.next(self.left)
        except TimeoutError:
            raise self._lose(f"TimeoutError: no answer within the time limit of {self.time_limit:g} s (an "
                             "infinite loop? a loop far longer than the case needs?); the case was stopped",
                             HINT_LOOP) from None
        finally:
            self.left -= time.monotonic() - began
        if answer is None:
            status = self.worker.exit_status()
            raise self._lose(f"the process running your code ended (exit status {status}) during this case: "
                             "os._exit, a crash or a signal", HINT_ENDED)
        if isinstance(answer, ValueError) or answer.get("id") != sent or type(answer.get("ok")) is not bool:
            why = answer if isinstance(answer, ValueError) else "an answer that is not the one asked for"
            raise self._lose(f"the answer of the process running your code could not be read ({_printable(str(why))})"
                             ": something wrote into the checker's pipe", HINT_CHANNEL)
        if not answer["ok"]:
            error = answer.get("error")
            raise ReaderError(_printable(error if isinstance(error, str) else "an error"), None,
                              unwritten=answer.get("unwritten") is True, exited=answer.get("exited") is True)
        return answer

    def load(self, step: Step) -> ReaderModule:
        answer = self.ask({"op": "load", "file": step.file, "module": step.package_module,
                           "functions": list(step.functions)})
        functions = answer.get("functions")
        if not (type(functions) is list and all(type(f) is str for f in functions)):
            raise self._lose("the answer of the process running your code could not be read: something wrote "
                             "into the checker's pipe", HINT_CHANNEL)
        self.loaded = (step.file, step.package_module, tuple(f for f in functions if f in step.functions))
        self.unloaded = False  # this worker has just imported it
        return ReaderModule(self, step.file, self.loaded[2])

    def call(self, file: str, function: str, args: tuple, kwargs: dict, footprint=None, grad=None):
        answer = self.ask({"op": "call", "file": file, "function": function, "args": list(args), "kwargs": kwargs,
                           "measure": footprint is not None, "grad": grad})
        try:
            value = _decode(answer.get("value"))
            if footprint is not None:
                largest, peak, rows, cols = answer["footprint"]
                if not all(type(n) is int for n in (largest, peak, rows, cols)):
                    raise ValueError("a footprint that is not four integers")
                footprint.largest_tensor = max(footprint.largest_tensor, largest)
                footprint.python_peak = max(footprint.python_peak, peak)
                if rows * cols > footprint.widest_product[0] * footprint.widest_product[1]:
                    footprint.widest_product = (rows, cols)
        except (ValueError, TypeError, KeyError) as exc:
            raise self._lose(f"the answer of the process running your code could not be read ({_printable(str(exc))})"
                             ": something wrote into the checker's pipe", HINT_CHANNEL) from None
        return value


class ReaderModule(Sandboxed):
    """The reader's module as the battery sees it: each of the step's functions it defines, called in the
    worker process; nothing else of it is reachable from here."""

    def __init__(self, sandbox: Sandbox, file: str, functions: tuple[str, ...]):
        self._sandbox, self._file, self._functions = sandbox, file, functions
        self._footprint = None

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in self._functions:
            raise AttributeError(name)
        return lambda *args, **kwargs: self._sandbox.call(self._file, name, args, kwargs, self._footprint)

    def grad_call(self, name: str, args: tuple, kwargs: dict, wrt: list[int], do):
        if name not in self._functions:
            raise AttributeError(name)
        value = self._sandbox.call(self._file, name, args, kwargs, grad={"wrt": list(wrt), "do": do})
        if not (type(value) is tuple and len(value) == 4 and type(value[2]) is int and type(value[3]) is int
                and (value[1] is None or type(value[1]) is tuple)):
            raise self._sandbox._lose("the answer of the process running your code could not be read: something "
                                      "wrote into the checker's pipe", HINT_CHANNEL)
        return value

    def measured(self, thunk):
        """``thunk()`` and the footprint of the calls it made, as the worker measured them around each call."""
        self._footprint = SimpleNamespace(largest_tensor=0, python_peak=0, widest_product=(0, 0))
        try:
            return thunk(), self._footprint
        finally:
            self._footprint = None


def progress(ok: bool) -> None:
    print("." if ok else "F", end="", flush=True)


def run_checked(step: Step, sandbox: Sandbox, fast: bool) -> StepResult:
    """One step: its file imported in the worker, its cases run and judged here."""
    sandbox.start_case()
    try:
        impl = sandbox.load(step)
    except ReaderError as exc:
        progress(False)
        return StepResult(step, failures=[Failure(f"importing {step.file}.py", exc.error, exc.hint or Hint(
            "import", "fix the file so that it imports: look at the line the error names"), step.chapter)])
    return run_step(step, impl, fast=fast, on_start=lambda n, case: sandbox.start_case(),
                    on_case=lambda n, case, failure: progress(failure is None))


# --8<-- [start:check]
def check(
    directory: Path | None,
    steps: list[str] | None,
    fast: bool,
    verbose: bool = False,
    time_limit: float = TIME_LIMIT,
    hint: str = "nudge",
) -> int:
    """Run the chosen steps, the reader's code in a worker process and every judgement
    here; exit status 0 only when every case of every step passed."""
    env = worker_environment()
    chosen = [s for s in STEPS if not steps or s.name in steps]
    results = []
    with Sandbox(directory, env, time_limit) as sandbox:
        where = "flashtile's own functions" if directory is None else f"{directory}/"
        print(f"checking {where} ({backend(env)}){', fast' if fast else ''}")
        for n, step in enumerate(chosen, 1):
            print(
                f"[{n}/{len(chosen)}] {step.name:<15} {step.file + '.py':<19} ",
                end="",
                flush=True,
            )
            results.append(run_checked(step, sandbox, fast))
            print(f" {'ok' if results[-1].ok else 'FAILED'}")
    for result in results:
        if not result.ok:
            print("\n" + failure_report(result, verbose, hint))
    print(summary_table(results))
    return 0 if all(r.ok and r.passed for r in results) else 1
# --8<-- [end:check]


def failure_report(result: StepResult, verbose: bool = False, level: str = "nudge") -> str:
    """A step's failures: the first (it says the most) and how many more, or with ``verbose`` every one,
    each with the case, the error, the hint at ``level`` (nudge, or formula too) and the chapter."""
    if result.ok:
        return f"{result.step.name}: all {result.passed} cases pass"
    shown = result.failures if verbose else result.failures[:1]
    more = len(result.failures) - len(shown)
    lines = []
    for failure in shown:
        lines += [f"FAILED {result.step.name}: {failure.case}" + (f"  (and {more} more; -v shows them)"
                                                                   if more > 0 else ""),
                  f"  error: {failure.error}",
                  f"  hint:  {failure.hint.text(level) if isinstance(failure.hint, Hint) else failure.hint}",
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
    if args.command == "interview":
        from .mock import interview

        if args.dir is not None and not args.dir.is_dir():
            print(f"error: {args.dir} is not a folder (python -m flashtile.practice init {args.dir} writes one)",
                  file=sys.stderr)
            return 2
        try:
            return interview(args.questions, args.difficulty, args.dir, args.step, args.minutes, args.record,
                             args.seed, check=check)
        except (ValueError, OSError) as exc:  # bad arguments, a record that is not one, a bank not installed
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("\ninterrupted: nothing recorded", file=sys.stderr)
            return 130
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
        return check(None if args.package else args.dir, args.step, args.fast, args.verbose, args.time_limit,
                     args.hint)
    except WorkerError as exc:
        print(f"\nerror: {exc}; its messages are above", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130

"""The process that runs the reader's code for ``check``, so that the reader's code cannot stop the checker.

``check`` starts ``python -m flashtile.practice.worker SPEC`` and reads one JSON line per event from
its standard output: a step's file being imported, a case starting, a case's result, a step's end.
The reader's own prints go to standard error (file descriptor 1 is pointed there before any of the
reader's code runs), so they cannot be mistaken for an event. ``check`` gives each case a time limit;
when a case runs past it, or the worker ends in the middle of one (``os._exit``, a crash), ``check``
records that case as failed and starts a new worker at the next case. A ``sys.exit`` or any other
exception is caught here, by ``run_step``, and fails only its case.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

from .battery import Failure, Step, _short_error, run_step, step_named, warm_up


class Loader:
    """Imports the reader's DIR/<file>.py once each, or the package's own module when DIR is None."""

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


def import_failure(step: Step, exc: BaseException) -> Failure:
    return Failure(f"importing {step.file}.py", _short_error(exc), "fix the file so that it imports", step.chapter)


def _exit_with_parent() -> None:
    """End this process when ``check`` is gone, even in the middle of the reader's infinite loop."""
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


# --8<-- [start:worker]
def main(spec: dict) -> None:
    channel = os.fdopen(os.dup(1), "w", buffering=1)  # the events' own copy of standard output
    os.dup2(2, 1)  # from here on, anything printed (by Python or by C code) goes to standard error
    sys.stdout.reconfigure(line_buffering=True)  # a print shows before an os._exit can lose it

    def send(**event) -> None:
        channel.write(json.dumps(event) + "\n")
        channel.flush()

    threading.Thread(target=_exit_with_parent, daemon=True).start()
    warm_up()  # torch's own imports, before the first case's clock and memory count start
    loader = Loader(None if spec["dir"] is None else Path(spec["dir"]))
    first_step, first_case = spec["start"]
    for s in range(first_step, len(spec["steps"])):
        step = step_named(spec["steps"][s])
        send(event="load", step=s)
        try:
            impl = loader.load(step)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # a syntax error, a failing import, even sys.exit at import time
            failure = import_failure(step, exc)
            send(event="import_failed", step=s, error=failure.error, hint=failure.hint)
            continue
        start = first_case if s == first_step else 0
        result = run_step(
            step, impl, fast=spec["fast"], start=start,
            on_start=lambda n, case, s=s: send(event="case", step=s, index=n, name=case.name),
            on_case=lambda n, case, failure, s=s: send(
                event="result", step=s, index=n, ok=failure is None,
                **({} if failure is None else {"error": failure.error, "hint": failure.hint})),
        )
        send(event="step_end", step=s, skipped=result.skipped)
    send(event="end")
# --8<-- [end:worker]


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    sys.stdout.flush()
    os._exit(0)  # whatever threads the reader's code left running

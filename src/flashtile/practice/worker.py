"""The process that runs the reader's code for ``check``: it imports the reader's files and answers calls.

The worker keeps no score and sees no case. It answers two requests from ``check`` (the trusted
process, ``flashtile.practice.cli``), one frame each on a pipe: *import this step's file* (the answer
names the step's functions the file defines) and *call this function on these inputs* (the answer is
what the function returned, or the error it raised, and, when asked, the ``Footprint`` of the call).
``check`` builds every input, compares every answer with the float64 truth itself and counts every
case of every step, so nothing the reader's code writes, into this pipe or anywhere else, can make a
case pass: a forged answer is only an answer, judged like a returned value, and a garbled one fails
its case.

A frame is 8 bytes of length and a ``torch.save`` of a dict of tensors, numbers, strings, tuples and
lists; ``check`` reads the worker's frames with ``torch.load(..., weights_only=True)``, which builds
tensors and plain data and never runs code. A returned value of another type travels as its type's
name only. The reader's prints go to standard error (file descriptor 1 is pointed there before any of
the reader's code runs). ``check`` starts the worker with ``os.fork`` where that is safe (Linux, no
CUDA), which saves a second import of torch, and as ``python -m flashtile.practice.worker DIR``
otherwise.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import os
import struct
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

from .battery import Footprint, _short_error, grad_call, warm_up

MAX_FRAME = 1 << 28  # bytes; an answer of the battery's cases is kilobytes
HEADER = struct.Struct("<Q")


def write_frame(out, message: dict) -> None:
    buffer = io.BytesIO()
    torch.save(message, buffer)
    data = buffer.getvalue()
    out.write(HEADER.pack(len(data)) + data)
    out.flush()


def read_frame(inp) -> dict | None:
    """The next frame's dict (loaded with weights_only=True), None at the end of the stream; ValueError for
    bytes that are not a frame."""
    header = inp.read(HEADER.size)
    if not header:
        return None
    if len(header) < HEADER.size:
        raise ValueError("a truncated frame header")
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ValueError(f"a frame of {size} bytes")
    data = inp.read(size)
    if len(data) < size:
        raise ValueError("a truncated frame")
    message = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(message, dict):
        raise ValueError(f"a frame holding a {type(message).__name__}")
    return message


def encode(value):
    """What a reader's function returned, as plain data: tensors (detached, plain torch.Tensor), numbers,
    strings, None, tuples and lists of them; anything else as ``{"__type__": its type's name}``."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        return value if type(value) is torch.Tensor else value.as_subclass(torch.Tensor)
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, tuple | list):
        return (tuple if isinstance(value, tuple) else list)(encode(v) for v in value)
    return {"__type__": type(value).__name__}


class Loader:
    """Imports the reader's DIR/<file>.py once each, or the package's own module when DIR is None."""

    def __init__(self, directory: Path | None):
        self.directory = directory
        self.modules: dict[str, ModuleType] = {}
        if directory is not None and str(directory.resolve()) not in sys.path:
            sys.path.insert(0, str(directory.resolve()))  # the reader's files may import each other

    def load(self, file: str, package_module: str) -> ModuleType:
        if self.directory is None:
            return importlib.import_module(package_module)
        if file not in self.modules:
            path = self.directory / f"{file}.py"
            if not path.is_file():
                raise FileNotFoundError(f"{path} does not exist (python -m flashtile.practice init writes it)")
            spec = importlib.util.spec_from_file_location(f"practice_{file}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            self.modules[file] = module
        return self.modules[file]


def _exit_with_parent() -> None:
    """End this process when ``check`` is gone, even in the middle of the reader's infinite loop."""
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def _error(exc: BaseException) -> dict:
    return {"ok": False, "error": _short_error(exc), "unwritten": isinstance(exc, NotImplementedError),
            "exited": isinstance(exc, SystemExit)}


# --8<-- [start:worker]
def serve(requests: int, answers: int, directory: Path | None) -> None:
    """Answer ``check``'s requests on the two pipe ends until the requests end; the
    reader's code runs here."""
    inp, out = os.fdopen(requests, "rb"), os.fdopen(answers, "wb")
    # input() in the reader's code reads nothing of ours
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    # from here on, anything printed (by Python or by C code) goes to standard error
    os.dup2(2, 1)
    # a print shows before an os._exit
    sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    # numpy's warnings from the Triton interpreter, on NaN it then discards
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.")
    # torch's own imports, before the first call's clock and memory count start
    warm_up()
    loader = Loader(directory)
    modules: dict[str, ModuleType] = {}
    write_frame(out, {"ready": True})
    while (request := read_frame(inp)) is not None:
        answer = {"id": request["id"]}
        try:
            if request["op"] == "load":
                module = loader.load(request["file"], request["module"])
                modules[request["file"]] = module
                answer.update(
                    ok=True,
                    functions=[
                        f
                        for f in request["functions"]
                        if callable(getattr(module, f, None))
                    ],
                )
            else:  # "call"
                function = getattr(modules[request["file"]], request["function"])
                # the call and its gradients, here where the graph is
                if request.get("grad") is not None:
                    grad = request["grad"]
                    value = grad_call(
                        function,
                        request["args"],
                        request["kwargs"],
                        grad["wrt"],
                        grad["do"],
                    )
                elif request["measure"]:
                    with Footprint() as footprint:
                        value = function(*request["args"], **request["kwargs"])
                    answer["footprint"] = [
                        footprint.largest_tensor,
                        footprint.python_peak,
                        *footprint.widest_product,
                    ]
                else:
                    value = function(*request["args"], **request["kwargs"])
                answer.update(ok=True, value=encode(value))
        except KeyboardInterrupt:
            raise
        # a syntax error, a failing import, sys.exit: the answer says which
        except BaseException as exc:
            answer.update(_error(exc))
        try:
            write_frame(out, answer)
        # a value torch.save cannot write: that is the answer's error
        except Exception as exc:
            write_frame(out, {"id": request["id"], **_error(exc)})
# --8<-- [end:worker]


def start_here(requests: int, answers: int, directory: Path | None) -> None:
    """The child's side of ``os.fork``: its own session, no file descriptor of the checker's but the pipe
    ends, one thread for torch (the parent's OpenMP pool did not survive the fork), then ``serve``."""
    os.setsid()
    keep = sorted({0, 1, 2, requests, answers})
    for low, high in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024]):
        os.closerange(low + 1, high)
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)
    torch.set_num_threads(1)
    serve(requests, answers, directory)


if __name__ == "__main__":
    serve(os.dup(0), os.dup(1), None if sys.argv[1] == "-" else Path(sys.argv[1]))
    os._exit(0)  # whatever threads the reader's code left running

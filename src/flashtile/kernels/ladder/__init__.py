"""The ladders: the textbook kernels turned into the package's, one idea per rung.

Each rung is a complete, runnable kernel file that differs from the rung before it by one idea, in the
order a reader would add them: ``forward_<n>_<idea>.py`` for the forward (rung 0 is
``kernels.textbook.textbook_forward``), ``backward_<n>_<idea>.py`` for the backward (rung 0 is
``kernels.textbook.textbook_backward``). A rung module says its idea in ``IDEA`` (one sentence) and holds its
whole kernel and launch between the listing markers ``rung``, which the chapters diff against the rung
before. They are teaching code: the textbook's inputs and checks, no switches; the package's kernels
(``kernels.forward``, ``kernels.backward``) are the ladders' last step.

    forward(q, k, v, causal=False, scale=None, *, alignment="upper_left") -> (o, lse)
    backward(q, k, v, o, lse, do, causal=False, scale=None, *, alignment="upper_left") -> (dq, dk, dv)
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
_RUNG_FILE = re.compile(r"^(forward|backward)_(\d+)_([a-z0-9_]+)\.py$")


@dataclass(frozen=True)
class Rung:
    """One rung: its index (0 = textbook), its name (the file's idea slug, "textbook" for rung 0), the
    module's dotted name, the listing sections its code is in, and the function that runs it."""

    index: int
    name: str
    module: str
    sections: tuple[str, ...]

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    @property
    def path(self) -> str:
        """The file, relative to the repository root (as the chapters' snippets and diffs name it)."""
        return "src/" + self.module.replace(".", "/") + ".py"


TEXTBOOK = {
    "forward": Rung(0, "textbook", "flashtile.kernels.textbook", ("textbook-forward", "textbook-forward-launch")),
    "backward": Rung(0, "textbook", "flashtile.kernels.textbook", ("textbook-backward", "textbook-backward-launch")),
}


def rungs(direction: str) -> list[Rung]:
    """The rungs of the ``"forward"`` or ``"backward"`` ladder, rung 0 (the textbook) first."""
    if direction not in TEXTBOOK:
        raise ValueError(f"direction: expected 'forward' or 'backward', got {direction!r}")
    found = []
    for path in HERE.glob(f"{direction}_*.py"):
        match = _RUNG_FILE.match(path.name)
        if match:
            found.append(Rung(int(match.group(2)), match.group(3), f"{__name__}.{path.stem}", ("rung",)))
    found.sort(key=lambda rung: rung.index)
    if [rung.index for rung in found] != list(range(1, len(found) + 1)):
        raise RuntimeError(f"the {direction} rungs are not numbered 1, 2, ...: {[r.module for r in found]}")
    return [TEXTBOOK[direction], *found]


def entry_point(rung: Rung, direction: str):
    """The rung's ``forward`` or ``backward`` function (rung 0: ``textbook_forward`` / ``textbook_backward``)."""
    module = rung.load()
    return getattr(module, f"textbook_{direction}" if rung.index == 0 else direction)

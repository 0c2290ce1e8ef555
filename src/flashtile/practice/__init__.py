"""Practice mode: write the package's functions yourself and run the project's battery against them.

    python -m flashtile.practice init mine          # skeleton modules and a README in mine/
    python -m flashtile.practice check mine         # every step, in the lab's order
    python -m flashtile.practice check mine --step forward --fast

``battery`` holds the cases, symptom rules and runner, written once and run against any module;
``drills`` the later steps' cases, built on the battery's parts; ``steps`` the list of steps in order;
``truth`` their float64 truth, which imports nothing else from flashtile; ``cli`` is the command line,
which runs the cases and judges them; ``worker`` is the process that imports the reader's code and only
answers calls of its functions; ``mock`` the mock interview, from the question bank (``bank``).
"""

from .battery import run_step
from .steps import STEP_NAMES, STEPS

__all__ = ["STEPS", "STEP_NAMES", "run_step"]

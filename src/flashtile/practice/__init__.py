"""Practice mode: write the package's functions yourself and run the project's battery against them.

    python -m flashtile.practice init mine          # skeleton modules and a README in mine/
    python -m flashtile.practice check mine         # every step, in the lab's order
    python -m flashtile.practice check mine --step forward --fast

``battery`` holds the steps and their cases, written once and run against any module; ``truth`` is
their float64 truth, which imports nothing else from flashtile; ``cli`` is the command line, which runs
the cases and judges them; ``worker`` is the process that imports the reader's code and only answers
calls of its functions.
"""

from .battery import STEP_NAMES, STEPS, run_step

__all__ = ["STEPS", "STEP_NAMES", "run_step"]

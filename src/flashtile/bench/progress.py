"""A text progress bar for long sweeps, on stderr, without a dependency (tqdm is not guaranteed).

One line per step: ``[ 12/180] ###------------- flashtile B=1 H=16 T=4096 D=128 causal bf16 bhtd  0:42, ~9:30 left``.
On a terminal the line is redrawn in place; into a pipe or a log (a remote GPU run) each step gets
its own line, so the log shows how far a run that was cut off had got.
"""

from __future__ import annotations

import sys
import time

BAR_WIDTH = 16


def clock(seconds: float) -> str:
    """'m:ss' (or 'h:mm:ss') of a duration."""
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def progress_line(index: int, total: int, label: str, elapsed_s: float | None = None) -> str:
    """The line shown when item ``index`` (1-based) of ``total`` starts.

    The bar counts the ``index - 1`` items already done; once one is done, the elapsed time and an
    estimate of the time left (at the mean rate so far) follow the label.
    """
    if not 1 <= index <= total:
        raise ValueError(f"need 1 <= index <= total, got index={index}, total={total}")
    done = index - 1
    filled = BAR_WIDTH * done // total
    line = f"[{index:>{len(str(total))}}/{total}] {'#' * filled}{'-' * (BAR_WIDTH - filled)} {label}"
    if elapsed_s is not None and done:
        left = elapsed_s / done * (total - done)
        line += f"  {clock(elapsed_s)}, ~{clock(left)} left"
    return line


class Progress:
    """``step(label)`` as each unit of work starts; ``close()`` at the end."""

    def __init__(self, total: int, stream=None, now=time.perf_counter):
        self.total, self.started, self.now = total, 0, now
        self.stream = sys.stderr if stream is None else stream
        self.start = now()
        self.inplace = hasattr(self.stream, "isatty") and self.stream.isatty()

    def step(self, label: str) -> None:
        self.started += 1
        line = progress_line(self.started, self.total, label, self.now() - self.start)
        if self.inplace:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.inplace:
            self.stream.write("\n")
        self.stream.flush()

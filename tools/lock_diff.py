"""Print how the packages installed in this environment differ from the lock.

    python tools/lock_diff.py requirements.lock

One line per package whose installed version is not the lock's (``name: lock 5.24.0, installed 5.25.0``),
then the packages installed that the lock does not list; ``make test-latest`` prints this before its run, so
that a red scheduled run names the releases it tested. Exits 0 either way: a difference is the point of that
run, not a failure.
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import distributions
from pathlib import Path


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lock: Path) -> dict[str, str]:
    found = {}
    for line in lock.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)", line)
        if m:
            found[canonical(m.group(1))] = m.group(2)
    return found


def main(lock_file: str) -> int:
    locked = pins(Path(lock_file))
    installed = {canonical(d.metadata["Name"]): d.version for d in distributions()}
    moved = [f"{n}: lock {v}, installed {installed[n]}" for n, v in sorted(locked.items())
             if n in installed and installed[n].split("+")[0] != v.split("+")[0]]
    missing = [f"{n}: lock {v}, not installed" for n, v in sorted(locked.items()) if n not in installed]
    extra = [f"{n}: installed {v}, not in the lock" for n, v in sorted(installed.items())
             if n not in locked and n not in ("flashtile", "pip", "setuptools", "wheel")]
    print(f"against {lock_file}: {len(moved)} moved, {len(missing)} not installed, {len(extra)} not in the lock")
    for line in moved + missing + extra:
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

"""``python -m flashtile.bench [NAME] [options]``, NAME one of forward, overhead, backward, softmax, decode,
train_step, masks, ladder, sinks, head_dims, ring, ring_parts; no name: every one-GPU table."""

from __future__ import annotations

import sys

from . import (
    backward,
    decode,
    forward,
    head_dims,
    ladder,
    masks,
    overhead,
    ring,
    ring_parts,
    sinks,
    softmax,
    train_step,
)

TABLES = {
    "forward": forward,
    "overhead": overhead,
    "backward": backward,
    "softmax": softmax,
    "decode": decode,
    "train_step": train_step,
    "masks": masks,
    "ladder": ladder,
    "sinks": sinks,
    "head_dims": head_dims,
}
# Two GPUs of one host (or two gloo processes with --cpu-smoke): run by name only, never by the no-name run.
RING = {"ring": ring, "ring_parts": ring_parts}
NAMES = {**TABLES, **RING}
USAGE = f"usage: python -m flashtile.bench [{'|'.join(NAMES)}] [options]; no name: every one-GPU table"


def main(argv: list[str]) -> None:
    if argv and argv[0] in ("-h", "--help"):
        names = "\n".join(f"  {name:<11} {module.__doc__.splitlines()[0]}" for name, module in NAMES.items())
        print(f"{USAGE}\n\n{names}\n\n{' and '.join(RING)} need two GPUs of one host and run only by name.\n"
              "python -m flashtile.bench NAME --help shows a table's options.")  # fmt: skip
        return
    if argv and argv[0] in NAMES:
        NAMES[argv[0]].main(argv[1:])
    elif not argv:
        for module in TABLES.values():
            module.main([])
    else:
        raise SystemExit(f"{USAGE}; got {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])

"""``python -m flashtile.bench [forward|overhead|backward|softmax|decode|train_step] [options]``; no name: all."""

from __future__ import annotations

import sys

from . import backward, decode, forward, overhead, softmax, train_step

TABLES = {
    "forward": forward,
    "overhead": overhead,
    "backward": backward,
    "softmax": softmax,
    "decode": decode,
    "train_step": train_step,
}


def main(argv: list[str]) -> None:
    if argv and argv[0] in ("-h", "--help"):
        names = "\n".join(f"  {name:<11} {module.__doc__.splitlines()[0]}" for name, module in TABLES.items())
        print(f"usage: python -m flashtile.bench [{'|'.join(TABLES)}] [options]; no name: all\n\n{names}\n\n"
              "python -m flashtile.bench NAME --help shows a table's options.")  # fmt: skip
        return
    if argv and argv[0] in TABLES:
        TABLES[argv[0]].main(argv[1:])
    elif not argv:
        for module in TABLES.values():
            module.main([])
    else:
        raise SystemExit(f"usage: python -m flashtile.bench [{'|'.join(TABLES)}] [options]; got {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])

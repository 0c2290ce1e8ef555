"""``python -m flashtile.practice``: see ``flashtile.practice.cli``."""

import sys

from .cli import main

sys.exit(main())

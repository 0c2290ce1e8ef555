"""The site's own modules under hooks/ (the table and plot renderers) imported as MkDocs imports them:
with hooks/ on ``sys.path``, as plain top-level modules."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "hooks"))

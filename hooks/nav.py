"""Let Part B pages join the navigation as they land, without placeholders.

mkdocs.yml lists the Part B chapters by their final paths. While another engineer is still writing
one, its file does not exist, and ``mkdocs build --strict`` would fail on the dangling nav entry.
This hook drops nav entries under ``OPTIONAL_PREFIX`` whose file is missing (and a section left
empty by that), logging each at INFO. Every other nav entry keeps MkDocs' strict checking, so a typo
in a Part A path still fails the build.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.nav")

OPTIONAL_PREFIX = "part-b/"


def _prune(items, docs_dir: Path):
    kept = []
    for item in items:
        if isinstance(item, dict):
            (title, value), = item.items()
            if isinstance(value, list):
                value = _prune(value, docs_dir)
                if not value:
                    log.info("nav: section %r has no pages yet; left out", title)
                    continue
                kept.append({title: value})
                continue
            path = value
        else:
            path = item
        if isinstance(path, str) and path.startswith(OPTIONAL_PREFIX) and not (docs_dir / path).is_file():
            log.info("nav: %s does not exist yet; left out", path)
            continue
        kept.append(item)
    return kept


def on_config(config):
    if config.nav:
        config.nav = _prune(config.nav, Path(config.docs_dir))
    return config

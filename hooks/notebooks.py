"""Notebook pages: run them like the tests do, and offer the .ipynb for download.

* Notebooks are executed at build time by a Jupyter kernel that inherits this process's
  environment. Without a GPU, Triton kernels only run in Triton's interpreter, which must be
  switched on before any ``@triton.jit`` module is imported, so the switch is set here, at
  configuration time, the same way the root ``conftest.py`` sets it for pytest.
* mkdocs-jupyter's ``include_source: true`` copies ``x.ipynb`` next to the rendered page, but
  Material has no button for it; this hook adds one, linking to that copy.
"""

from __future__ import annotations

import os
from pathlib import PurePosixPath


def on_config(config):
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return config


def on_page_content(html, page, config, files):
    if not page.file.src_uri.endswith(".ipynb"):
        return html
    name = PurePosixPath(page.file.src_uri).name
    button = (
        f'<p><a class="md-button" href="{name}" download>Download {name}</a> '
        "and run it on a CPU. It needs flashtile and a Jupyter kernel: in the repository's "
        f"<code>.venv</code> (made by <code>make install</code>), <code>jupyter execute {name}</code> runs "
        "it top to bottom; to edit it, add a front end such as <code>pip install jupyterlab</code>.</p>"
    )
    # Right under the notebook's title when it has one, otherwise on top.
    title_end = html.find("</h1>")
    if title_end == -1:
        return button + html
    title_end += len("</h1>")
    return html[:title_end] + button + html[title_end:]

"""Put a download button under the title of every notebook page.

mkdocs-jupyter's ``include_source: true`` copies ``x.ipynb`` next to the rendered page, but
Material has no button for it; this hook adds one, linking to that copy.
"""

from __future__ import annotations

from pathlib import PurePosixPath


def on_page_content(html, page, config, files):
    if not page.file.src_uri.endswith(".ipynb"):
        return html
    name = PurePosixPath(page.file.src_uri).name
    button = (
        f'<p><a class="md-button" href="{name}" download>Download {name}</a> '
        "and run it with Jupyter on a CPU: it needs only the package and its test extras.</p>"
    )
    # Right under the notebook's title when it has one, otherwise on top.
    title_end = html.find("</h1>")
    if title_end == -1:
        return button + html
    title_end += len("</h1>")
    return html[:title_end] + button + html[title_end:]

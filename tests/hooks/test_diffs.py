"""hooks/diffs.py on files made here: the block it renders, and the errors that stop the build."""

from __future__ import annotations

import pytest

from tests._hooks import load_hook

pytest.importorskip("mkdocs", reason="the hook raises MkDocs' PluginError; the site's tests install MkDocs")
diffs = load_hook("diffs")

OLD = """import x
# --8<-- [start:body]
def f(a):
    # --8<-- [start:inner]
    return a + 1
    # --8<-- [end:inner]
# --8<-- [end:body]
# --8<-- [start:launch]
f(1)
# --8<-- [end:launch]
"""
NEW = OLD.replace("return a + 1", "return a + 2")


@pytest.fixture
def root(tmp_path):
    (tmp_path / "src" / "flashtile").mkdir(parents=True)
    (tmp_path / "src" / "flashtile" / "old.py").write_text(OLD)
    (tmp_path / "src" / "flashtile" / "new.py").write_text(NEW)
    return tmp_path


def test_a_diff_of_two_sections_each_side_markers_left_out(root):
    block = diffs.render("src/flashtile/old.py#body+launch", "src/flashtile/new.py#body+launch", "    ", root)
    assert block.split("\n") == [
        "    ```diff",
        "    --- old.py",
        "    +++ new.py",
        "    @@ -1,3 +1,3 @@",
        "     def f(a):",
        "    -    return a + 1",
        "    +    return a + 2",
        "     f(1)",
        "    ```",
    ]


def test_the_marker_line_is_replaced_in_place(root, monkeypatch):
    monkeypatch.setattr(diffs, "ROOT", root)
    page = "before\n<!-- diff: src/flashtile/old.py#inner src/flashtile/new.py#inner -->\nafter\n"
    out = diffs.on_page_markdown(page, None, None, None)
    assert out.startswith("before\n```diff\n--- old.py\n+++ new.py\n") and out.endswith("```\nafter\n")
    assert "-return a + 1\n+return a + 2" in out  # the inner section, dedented as the snippets show it


@pytest.mark.parametrize("old, new, message", [
    ("src/flashtile/old.py#body", "src/flashtile/old.py#body", "do not differ"),
    ("src/flashtile/old.py#nothere", "src/flashtile/new.py#body", "no listing section 'nothere'"),
    ("src/flashtile/gone.py#body", "src/flashtile/new.py#body", "expected FILE#SECTION"),
    ("src/flashtile/old.py", "src/flashtile/new.py#body", "expected FILE#SECTION"),
])  # fmt: skip
def test_what_cannot_be_shown_stops_the_build(root, old, new, message):
    with pytest.raises(diffs.PluginError, match=message):
        diffs.render(old, new, "", root)

"""Every GPU table on the site is its committed JSON, digit for digit, with its provenance."""

from pathlib import Path

import pytest

from flashtile.bench import tables

PAGES = sorted(p for p in (tables.ROOT / "docs").rglob("*.md") if tables.blocks(p.read_text()))


def test_every_table_is_on_a_page():
    names = sorted(name for page in PAGES for name, _ in tables.blocks(page.read_text()))
    assert names == sorted(tables.TABLES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_tables_equal_their_json(page: Path):
    for name, body in tables.blocks(page.read_text()):
        assert body == tables.render(name), (
            f"{page.name}: the '{name}' table differs from bench/results/{tables.TABLES[name][0]}; "
            "run python -m flashtile.bench.tables"
        )


@pytest.mark.parametrize("name", sorted(tables.TABLES))
def test_results_carry_provenance_and_every_provider(name):
    result = tables.load(tables.TABLES[name][0])
    meta = result["provenance"]
    assert "H200" in meta["gpu"] and meta["commit"] not in ("", "unknown")
    for key in ("torch", "triton", "cuda", "date_utc", "method"):
        assert meta[key]
    providers = {row["provider"] for row in result["rows"]}
    expected = {
        "softmax": {"flashtile", "torch_softmax", "unfused_5_kernels"},
        "decode": set(tables.DECODE_PROVIDERS),
    }.get(name, set(tables.ATTENTION_PROVIDERS))
    assert providers == expected


def test_first_forward_table_has_the_issue_shape():
    result = tables.load("forward.json")
    assert result["main_shape"] == dict(B=8, H=16, T=2048, D=64, causal=True)
    main = [r for r in result["rows"] if all(r[k] == v for k, v in result["main_shape"].items())]
    assert sorted(r["provider"] for r in main) == sorted(tables.ATTENTION_PROVIDERS)


def test_a_stale_table_is_detected():
    text = "<!-- bench-table: forward -->\n| made up |\n<!-- /bench-table -->\n"
    (name, body), = tables.blocks(text)
    assert name == "forward" and body != tables.render("forward")
    assert tables.blocks(tables.rewrite(text))[0][1] == tables.render("forward")

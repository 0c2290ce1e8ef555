"""The chapter's two-GPU table is bench/results/ring.json, digit for digit, and the JSON follows the schema."""


from flashtile.bench.common import load_result
from tests._hooks import load_hook

render_tables = load_hook("render_tables")

RESULT = load_result("ring.json")
ROW_FIELDS = {"pass", "provider", "B", "H", "H_kv", "Tq", "Tk", "D", "causal", "layout", "dtype", "ms", "tflops",
              "world_size", "speedup_vs_1gpu", "measures"}  # fmt: skip


def test_the_chapter_table_equals_the_committed_json():
    match = render_tables.RING_BLOCK.search(render_tables.RING_PAGE.read_text())
    assert match, "docs/part-c/ring-attention.md has no <!-- ring-table --> block"
    assert match.group("body") == render_tables.ring_table(RESULT), "run python hooks/render_tables.py"


def test_ring_json_follows_the_bench_schema_with_provenance():
    meta = RESULT["provenance"]
    assert "H200" in meta["gpu"] and meta["gpus"] == 2 and meta["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert meta["commit"] not in ("", "unknown")
    for key in ("torch", "triton", "cuda", "nccl", "date_utc", "method", "ring_GBps"):
        assert meta[key]
    for row in RESULT["rows"]:
        assert ROW_FIELDS <= set(row) and row["pass"] == "ring" and row["dtype"] == "bf16"
        assert row["provider"] in ("flashtile", "flashtile_ring") and row["measures"] in ("forward", "forward_backward")
    baselines = [r for r in RESULT["rows"] if r["provider"] == "flashtile"]
    assert baselines and all(r["world_size"] == 1 and r["speedup_vs_1gpu"] == 1.0 for r in baselines)


def test_a_stale_table_is_detected():
    stale = "<!-- ring-table -->\n| made up |\n<!-- /ring-table -->\n"
    assert render_tables.RING_BLOCK.search(stale).group("body") != render_tables.ring_table(RESULT)
    assert render_tables.RING_BLOCK.search(render_tables.rewrite_ring(stale)).group("body") == render_tables.ring_table(
        RESULT
    )

"""Every GPU table on the site is its committed JSON, digit for digit, with its provenance."""

import json
from pathlib import Path

import pytest

from flashtile.bench import shapes
from flashtile.bench.common import RESULTS, load_result
from tests._hooks import load_hook

render_tables = load_hook("render_tables")

PAGES = sorted(p for p in render_tables.DOCS.rglob("*.md") if render_tables.blocks(p.read_text()))
SCHEMA_FIELDS = {"pass", "provider", "B", "H", "H_kv", "Tq", "Tk", "D", "causal", "layout", "dtype", "ms", "tflops"}
FORWARD_FILES = sorted({json_name for json_name, _, _ in render_tables.TABLES.values() if json_name[:7] == "forward"})


def test_every_table_is_on_a_page():
    names = sorted(name for page in PAGES for name, _ in render_tables.blocks(page.read_text()))
    assert names == sorted(render_tables.TABLES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_tables_equal_their_json(page: Path):
    for name, body in render_tables.blocks(page.read_text()):
        assert body == render_tables.render(name), (
            f"{page.name}: the '{name}' table differs from bench/results/{render_tables.TABLES[name][0]}; "
            "run python hooks/render_tables.py"
        )


H100_TABLES = ("sinks", "head-dims")  # measured on an H100, the one card lent for them


@pytest.mark.parametrize("name", sorted(n for n in render_tables.TABLES if render_tables.measured(n)))
def test_results_carry_provenance_and_every_provider(name):
    result = load_result(render_tables.TABLES[name][0])
    meta = result["provenance"]
    card = ("H100", "H200") if name in H100_TABLES else ("H200",)  # the page names the card of each table
    assert any(c in meta["gpu"] for c in card) and meta["commit"] not in ("", "unknown")
    for key in ("torch", "triton", "cuda", "date_utc", "method"):
        assert meta[key]
    providers = {row["provider"] for row in result["rows"]}
    if name == "softmax":
        assert providers == {"flashtile", "torch_softmax", "unfused_5_kernels"}
    elif name == "decode":
        required = {"flashtile_split_k", "flashtile", "sdpa_cudnn", "sdpa_flash"}
        assert required <= providers <= {*required, "flashtile_split_k_pdl"}
        assert all(row.get("ms_graph") for row in result["rows"] if row["ms"] is not None)
    elif name == "masks":  # each case's rows say its mask (a window or packed documents); cuDNN runs full causal
        assert providers >= {"flashtile", "flex", "sdpa_cudnn"}
        assert all(row["mask"] == "causal" for row in result["rows"] if row["provider"] == "sdpa_cudnn")
        masks = {row["mask"] for row in result["rows"] if row["provider"] != "sdpa_cudnn"}
        assert masks and all(m.startswith(("window:", "documents:")) for m in masks)
        assert all(row["mask"] == row["case"] for row in result["rows"] if row["provider"] != "sdpa_cudnn")
    elif name == "forward-fp8":  # FP8 beside flashtile's bf16 forward and cuDNN, no other provider
        assert providers == {"flashtile", "flashtile_fp8", "sdpa_cudnn"}
        assert {row["dtype"] for row in result["rows"] if row["provider"] == "flashtile_fp8"} == {"fp8_e4m3"}
    elif name == "sinks":  # flashtile with and without sinks, Flex with and without the rescale, eager with sinks
        assert {(r["provider"], r["sinks"]) for r in result["rows"]} == {
            ("flashtile", True), ("flashtile", False), ("flex", True), ("flex", False), ("naive", True)}
    elif name == "head-dims":  # flashtile, the padded call and SDPA's three backends, every row with its D_v
        assert providers >= {"flashtile", "flashtile_padded", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient"}
        assert all(r["D_v"] < r["D"] for r in result["rows"])
    elif name in ("overhead", "overhead-decode", "train-step", "train-step-padded"):
        assert providers >= {"flashtile", "sdpa"}
    elif name.startswith("backward"):
        attention = set(render_tables.ATTENTION_PROVIDERS)
        assert attention <= providers <= {*attention, *render_tables.BACKWARD_OPTIONS}
    else:  # the forward tables: ours, cuDNN and flash at least
        assert providers >= set(render_tables.ATTENTION_PROVIDERS)


@pytest.mark.parametrize("json_name", [f for f in FORWARD_FILES if (RESULTS / f).is_file()])
def test_forward_results_follow_the_bench_schema(json_name):
    for row in load_result(json_name)["rows"]:
        assert SCHEMA_FIELDS <= set(row) and row["pass"] == "forward" and row["layout"] in ("bhtd", "bthd")
        assert (row["ms"] is None) == (row["tflops"] is None) == ("error" in row)


@pytest.mark.parametrize("name", [n for n in ("backward", "backward-models") if render_tables.measured(n)])
def test_backward_results_follow_the_bench_schema(name):
    for row in load_result(render_tables.TABLES[name][0])["rows"]:
        assert SCHEMA_FIELDS <= set(row) and row["pass"] == "backward" and row["layout"] in ("bhtd", "bthd")
        assert (row["ms"] is None) == (row["tflops"] is None) == ("error" in row)


def test_the_first_forward_table_has_the_seed_shape_first():
    rows = load_result("forward.json")["rows"]
    seed = (8, 16, 16, 2048, 2048, 64, True, "bhtd", "bf16")
    key = lambda r: (r["B"], r["H"], r["H_kv"], r["Tq"], r["Tk"], r["D"], r["causal"], r["layout"], r["dtype"])
    assert key(rows[0]) == seed
    assert {r["provider"] for r in rows if key(r) == seed} >= set(render_tables.ATTENTION_PROVIDERS)


def test_a_stale_table_is_detected():
    text = "<!-- bench-table: forward -->\n| made up |\n<!-- /bench-table -->\n"
    (name, body), = render_tables.blocks(text)
    assert name == "forward" and body != render_tables.render("forward")
    assert render_tables.blocks(render_tables.rewrite(text))[0][1] == render_tables.render("forward")


def test_a_table_not_yet_measured_says_so_and_names_its_command(monkeypatch, tmp_path):
    monkeypatch.setattr(render_tables, "RESULTS", tmp_path)
    assert not render_tables.measured("forward-models")
    assert render_tables.render("forward-models") == (
        "*Not yet measured: `python -m flashtile.bench forward --set models` writes "
        "`bench/results/forward-models.json`.*\n"
    )
    (tmp_path / "forward-models.json").write_text(json.dumps({"provenance": PROVENANCE, "rows": [ROW]}))
    assert render_tables.measured("forward-models")
    assert "| — | 2 | 16 / 4 | 2048 | 64 | yes | bthd | 300.0 |" in render_tables.render("forward-models")


PROVENANCE = dict(gpu="NVIDIA H200", torch="t", triton="tr", cuda="c", date_utc="d", commit="abc", method="m")
ROW = {"pass": "forward", "provider": "flashtile", "B": 2, "H": 16, "H_kv": 4, "Tq": 2048, "Tk": 2048, "D": 64,
       "causal": True, "layout": "bthd", "dtype": "bf16", "ms": 0.1, "tflops": 300.0}


def row(provider, T, D, causal, tflops=None, error=None, **kw):
    base = dict(ROW, provider=provider, B=16384 // T, H=2048 // D, H_kv=2048 // D, Tq=T, Tk=T, D=D, causal=causal,
                layout="bhtd", **kw)  # fmt: skip
    if tflops is None:
        return dict(base, ms=None, tflops=None, error=error)
    return dict(base, ms=1.0, tflops=tflops)


def test_the_sweep_table_puts_t_down_and_head_dim_and_mask_across():
    rows = [row("flashtile", 2048, 128, True, 300.0), row("sdpa_cudnn", 2048, 128, True, 400.0),
            row("sdpa_flash", 2048, 128, True, error="No available kernel: reasons"),
            row("flashtile", 512, 64, False, 100.0)]  # fmt: skip
    lines = render_tables.sweep_table({"rows": rows})
    assert lines[0] == "| dtype | T | D = 64, causal | D = 64, full | D = 128, causal | D = 128, full |"
    assert lines[2] == "| bf16 | 512 | — | 100 · — · — | — | — |"  # cuDNN missing: no ratio
    assert lines[3] == "| bf16 | 2048 | — | — | 75% (300 · 400 · fails) | — |"
    assert lines[-1] == "- flash fails at B=8 H=16 T=2048 D=128 bhtd bf16: No available kernel: reasons"
    assert len(lines) == 8  # header, rule, two T, blank, "Not run:", blank, one reason


def test_the_sweep_table_leaves_out_a_head_dim_the_file_has_no_cell_of():
    rows = [row("flashtile", 2048, 128, True, 300.0, dtype="fp16"),
            row("sdpa_cudnn", 2048, 128, True, 400.0, dtype="fp16")]
    lines = render_tables.sweep_table({"rows": rows})
    assert lines[0] == "| dtype | T | D = 128, causal | D = 128, full |"
    assert lines[2] == "| fp16 | 2048 | 75% (300 · 400 · —) | — |"


def test_every_wide_table_puts_its_ratio_first():
    """A reader on a phone sees the first columns only: the ratio to the baseline must be one of them."""
    first = {"forward": "flashtile / cuDNN", "forward-models": "flashtile / cuDNN", "backward": "flashtile / cuDNN",
             "backward-models": "flashtile / cuDNN", "decode": "split-K / cuDNN speed",
             "train-step": "SDPA / flashtile"}  # fmt: skip
    for name, column in first.items():
        header = render_tables.render(name).splitlines()[0]
        assert header.startswith(f"| {column} |"), (name, header)


def test_the_model_and_scaleup_tables_show_only_providers_present_and_why_one_did_not_run():
    rows = [dict(ROW), dict(ROW, provider="sdpa_cudnn", tflops=400.0), dict(ROW, provider="naive", ms=None,
            tflops=None, error="OOM")]  # fmt: skip
    lines = render_tables.models_table({"rows": rows})
    # The ratio first: on a phone it is the column on screen.
    assert lines[0] == "| flashtile / cuDNN | B | H / H_kv | T | D | causal | layout | flashtile | cuDNN | naive |"
    assert lines[2] == "| 75% | 2 | 16 / 4 | 2048 | 64 | yes | bthd | 300.0 | 400.0 | OOM |"
    assert len(lines) == 3  # an OOM is not a failure to explain
    skipped = dict(ROW, provider="sdpa_math", ms=None, tflops=None, error="skipped: fp32 scores 9 GiB > 8 GiB budget")
    lines = render_tables.scaleup_table({"rows": [dict(ROW), skipped]})
    assert lines == ["| T | flashtile | math |", "| --- | --- | --- |", "| 2048 | 300.0 | skip |"]


def test_the_overhead_table_lists_each_entry_point_in_both_modes():
    rows = [dict(provider="flashtile", mode="fwd", us_per_call=165.8), dict(provider="flashtile", mode="fwd+bwd",
            us_per_call=1162.1), dict(provider="flashtile_launcher", mode="fwd", us_per_call=89.5)]  # fmt: skip
    assert render_tables.overhead_table({"rows": rows})[2:] == ["| `flashtile` | 165.8 | 1162.1 |",
                                                         "| `flashtile_launcher` | 89.5 | — |"]  # fmt: skip


def test_the_decode_overhead_table_names_each_entry_point_and_divides_by_sdpa():
    rows = [dict(provider="flashtile_decode", mode="decode", us_per_call=30.0),
            dict(provider="sdpa", mode="decode", us_per_call=24.0),
            dict(provider="something_new", mode="decode", us_per_call=36.0)]  # fmt: skip
    assert render_tables.overhead_decode_table({"rows": rows}) == [
        "| entry point | µs per call | / SDPA |", "| --- | --- | --- |",
        "| `flashtile.decode_attention` | 30.0 | 1.25 |", "| SDPA (`enable_gqa=True`) | 24.0 | 1.00 |",
        "| `something_new` | 36.0 | 1.50 |"]  # fmt: skip


def _rows(provider_ms: dict, pass_="forward", **shape_kw) -> list[dict]:
    s = shapes.shape(8, 16, 2048, 64, True, **shape_kw)
    rows = []
    for provider, ms in provider_ms.items():
        row = dict({"pass": pass_, "provider": provider}, **s, ms=ms, tflops=None if ms is None else 100.0 / ms)
        if ms is None:
            row["error"] = "skipped: the textbook kernel has no GQA"
        rows.append(row)
    return rows


def test_the_site_tables_show_the_textbook_columns_once_measured():
    base = {"flashtile": 1.0, "sdpa_cudnn": 1.25, "sdpa_flash": 1.5}
    without = render_tables.forward_table({"rows": _rows(base)})
    with_textbook = render_tables.forward_table({"rows": _rows({**base, "flashtile_textbook": 2.0})})
    assert "textbook" not in without[0] and len(without[2].split("|")) == 14
    assert with_textbook[0].endswith("| textbook ms | TFLOP/s |") and with_textbook[2].endswith("| 2.000 | 50.0 |")
    assert with_textbook[2].startswith(without[2][:-1])  # the other columns unchanged
    back = render_tables.backward_table({"rows": _rows({**base, "flashtile_textbook": 2.0}, "backward")})
    assert "flashtile, textbook" in back[0] and "textbook / cuDNN" in back[0] and "| 0.62 |" in back[2]
    models = render_tables.models_table({"rows": _rows({**base, "flashtile_textbook": None}, H_kv=4)})
    assert "textbook" in models[0] and "skip" in models[2]

"""The tables on the Part B pages are the committed benchmark JSON, digit for digit.

The pages cannot run a GPU, so their numbers are written from bench/results/*.json. These tests
render each table from its JSON and check that the page contains exactly that text, so a re-run
benchmark whose page was not updated (or a hand-edited number) fails here.
Regenerate a table with:  python -m tests.kernels.test_results_tables
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROVIDERS = ("flashtile", "sdpa_cudnn", "sdpa_flash")


def _load(name: str) -> dict:
    return json.loads((ROOT / "bench" / "results" / name).read_text())


def forward_table(result: dict) -> str:
    """One line per shape: ms and TFLOP/s of each provider, and ours as a share of cuDNN's."""
    lines = [
        "| B | H | T | D | causal | flashtile ms | TFLOP/s | cuDNN ms | TFLOP/s | flash ms | TFLOP/s "
        "| flashtile / cuDNN |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    shapes = []
    for row in result["rows"]:
        key = (row["B"], row["H"], row["T"], row["D"], row["causal"])
        if key not in shapes:
            shapes.append(key)
    for key in shapes:
        by = {r["provider"]: r for r in result["rows"] if (r["B"], r["H"], r["T"], r["D"], r["causal"]) == key}
        cells = [str(x) for x in key[:4]] + ["yes" if key[4] else "no"]
        for p in PROVIDERS:
            cells += [f"{by[p]['ms']:.3f}", f"{by[p]['tflops']:.1f}"]
        cells.append(f"{by['flashtile']['tflops'] / by['sdpa_cudnn']['tflops']:.0%}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def softmax_table(result: dict) -> str:
    lines = [
        "| rows | cols | fused (ours) µs | GB/s | torch.softmax µs | GB/s | unfused µs | GB/s | unfused / fused |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    shapes = []
    for row in result["rows"]:
        if (row["rows"], row["cols"]) not in shapes:
            shapes.append((row["rows"], row["cols"]))
    for shape in shapes:
        by = {r["provider"]: r for r in result["rows"] if (r["rows"], r["cols"]) == shape}
        cells = [str(shape[0]), str(shape[1]) + (" (streamed)" if by["flashtile"]["streamed"] else "")]
        for p in ("flashtile", "torch_softmax", "unfused_5_kernels"):
            cells += [f"{1000 * by[p]['ms']:.1f}", f"{by[p]['useful_GBps']:.0f}"]
        cells.append(f"{by['unfused_5_kernels']['ms'] / by['flashtile']['ms']:.1f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def provenance_line(result: dict) -> str:
    p = result["provenance"]
    versions = f"torch {p['torch']}, triton {p['triton']}, CUDA {p['cuda']}"
    return f"{p['gpu']}, {versions}, {p['date_utc']}, commit {p['commit']}"


PAGES = {
    "forward-kernel.md": ("forward-first-table.json", forward_table),
    "fused-softmax.md": ("softmax-first-table.json", softmax_table),
}


def test_forward_page_table_equals_the_committed_json():
    _check_page("forward-kernel.md")


def test_softmax_page_table_equals_the_committed_json():
    _check_page("fused-softmax.md")


def test_first_table_has_the_issue_shape_and_all_providers():
    result = _load("forward-first-table.json")
    assert result["main_shape"] == dict(B=8, H=16, T=2048, D=64, causal=True)
    main = [r for r in result["rows"] if all(r[k] == v for k, v in result["main_shape"].items())]
    assert sorted(r["provider"] for r in main) == sorted(PROVIDERS)
    assert "H200" in result["provenance"]["gpu"] and result["provenance"]["commit"] != "unknown"


def _check_page(page: str) -> None:
    json_name, render = PAGES[page]
    result = _load(json_name)
    text = (ROOT / "docs" / "part-b" / page).read_text()
    assert render(result) in text, f"the table in docs/part-b/{page} differs from bench/results/{json_name}"
    assert provenance_line(result) in text, f"the provenance line in docs/part-b/{page} is out of date"


if __name__ == "__main__":
    for page, (json_name, render) in PAGES.items():
        if not (ROOT / "bench" / "results" / json_name).exists():
            continue
        result = _load(json_name)
        print(f"<!-- {page} <- bench/results/{json_name} -->\n{render(result)}\n\n{provenance_line(result)}\n")

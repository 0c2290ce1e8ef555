"""The Part B pages' GPU tables, rendered from the committed benchmark JSON.

The site builds without a GPU, so its numbers come from ``bench/results/*.json``. Each table sits on
its page between two HTML comments,

    <!-- bench-table: forward -->
    ...the rendered table and its provenance line...
    <!-- /bench-table -->

``python -m flashtile.bench.tables`` rewrites every such block from its JSON after a re-run, and
``tests/bench/test_tables.py`` fails if a page and its JSON disagree, so a hand-edited number or a
forgotten update cannot reach the site.
"""

from __future__ import annotations

import json
import re

from .common import RESULTS, ROOT

ATTENTION_PROVIDERS = ("flashtile", "sdpa_cudnn", "sdpa_flash")
BLOCK = re.compile(r"(<!-- bench-table: (?P<name>[a-z]+) -->\n)(?P<body>.*?)(<!-- /bench-table -->)", re.S)


def load(json_name: str) -> dict:
    return json.loads((RESULTS / json_name).read_text())


def _group(rows: list[dict], key) -> dict:
    """Rows grouped by shape (in first-seen order), then by provider."""
    groups: dict = {}
    for row in rows:
        groups.setdefault(key(row), {})[row["provider"]] = row
    return groups


def _line(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def forward_table(result: dict) -> list[str]:
    lines = [
        _line(["B", "H", "T", "D", "causal", "flashtile ms", "TFLOP/s", "cuDNN ms", "TFLOP/s", "flash ms", "TFLOP/s",
               "flashtile / cuDNN"]),  # fmt: skip
        _line(["---"] * 12),
    ]
    shape_of = lambda r: (r["B"], r["H"], r["T"], r["D"], r["causal"])
    for (B, H, T, D, causal), by in _group(result["rows"], shape_of).items():
        cells = [B, H, T, D, "yes" if causal else "no"]
        for p in ATTENTION_PROVIDERS:
            cells += [f"{by[p]['ms']:.3f}", f"{by[p]['tflops']:.1f}"]
        lines.append(_line([*cells, f"{by['flashtile']['tflops'] / by['sdpa_cudnn']['tflops']:.0%}"]))
    return lines


def backward_table(result: dict) -> list[str]:
    lines = [
        _line(["D", "T", "causal", "flashtile", "SDPA cuDNN", "SDPA flash", "flashtile / cuDNN", "flashtile / flash"]),
        _line(["---"] * 8),
    ]
    for (D, T, causal), by in sorted(_group(result["rows"], lambda r: (r["D"], r["T"], r["causal"])).items()):
        ours, cudnn, flash = (by[p]["tflops"] for p in ATTENTION_PROVIDERS)
        cells = [D, T, "yes" if causal else "no", f"{ours:.1f}", f"{cudnn:.1f}", f"{flash:.1f}"]
        lines.append(_line([*cells, f"{ours / cudnn:.2f}", f"{ours / flash:.2f}"]))
    return lines


def softmax_table(result: dict) -> list[str]:
    lines = [
        _line(["rows", "cols", "fused (ours) µs", "GB/s", "torch.softmax µs", "GB/s", "unfused µs", "GB/s",
               "unfused / fused"]),  # fmt: skip
        _line(["---"] * 9),
    ]
    for (n_rows, n_cols), by in _group(result["rows"], lambda r: (r["rows"], r["cols"])).items():
        cells = [n_rows, f"{n_cols}" + (" (streamed)" if by["flashtile"]["streamed"] else "")]
        for p in ("flashtile", "torch_softmax", "unfused_5_kernels"):
            cells += [f"{1000 * by[p]['ms']:.1f}", f"{by[p]['useful_GBps']:.0f}"]
        lines.append(_line([*cells, f"{by['unfused_5_kernels']['ms'] / by['flashtile']['ms']:.1f}x"]))
    return lines


DECODE_PROVIDERS = ("flashtile_split_k", "flashtile", "sdpa_cudnn", "sdpa_flash")


def decode_table(result: dict) -> list[str]:
    lines = [
        _line(["cache", "H / H_kv", "split-K µs", "TB/s", "forward kernel µs", "TB/s", "cuDNN µs", "TB/s",
               "flash µs", "TB/s", "split-K / cuDNN speed"]),  # fmt: skip
        _line(["---"] * 11),
    ]
    for (Tk, H, H_kv), by in _group(result["rows"], lambda r: (r["Tk"], r["H"], r["H_kv"])).items():
        cells = [f"{Tk // 1024}k", f"{H} / {H_kv}"]
        for p in DECODE_PROVIDERS:
            cells += [f"{1000 * by[p]['ms']:.1f}", f"{by[p]['tbps']:.2f}"]
        lines.append(_line([*cells, f"{by['sdpa_cudnn']['ms'] / by['flashtile_split_k']['ms']:.2f}"]))
    copy = result["copy"]
    lines += ["", f"Device-to-device copy in the same run: {copy['copy_tbps']:.2f} TB/s (read + write)."]
    return lines


# name in the page marker -> (JSON file, renderer)
TABLES = {
    "forward": ("forward.json", forward_table),
    "backward": ("backward.json", backward_table),
    "softmax": ("softmax.json", softmax_table),
    "decode": ("decode.json", decode_table),
}


def markdown_text(text: str) -> str:
    """Plain text for Markdown: a formula like 4*B*H*T*T*D must not turn into emphasis."""
    return text.replace("*", "\\*").replace("_", "\\_")


def provenance_line(result: dict) -> str:
    p = result["provenance"]
    return (
        f"Measured on an {p['gpu']} with torch {p['torch']}, triton {p['triton']} and CUDA {p['cuda']} "
        f"at {p['date_utc']} (commit {p['commit']}); method: {markdown_text(p['method'])}."
    )


def render(name: str) -> str:
    """The block body for table ``name``: the table, a blank line, the provenance line."""
    json_name, renderer = TABLES[name]
    result = load(json_name)
    return "\n".join(renderer(result)) + "\n\n" + provenance_line(result) + "\n"


def blocks(text: str) -> list[tuple[str, str]]:
    """(name, body) of every table block on a page."""
    return [(m.group("name"), m.group("body")) for m in BLOCK.finditer(text)]


def rewrite(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group("name")) + m.group(4), text)


def main() -> None:
    for page in sorted((ROOT / "docs").rglob("*.md")):
        text = page.read_text()
        if blocks(text):
            page.write_text(rewrite(text))
            print(f"rewrote {page.relative_to(ROOT)}: {', '.join(name for name, _ in blocks(text))}")


if __name__ == "__main__":
    main()

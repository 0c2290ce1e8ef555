"""Draw the site's figures from the package itself, at build time.

A figure pasted as a PNG drifts the moment the code changes. These are computed on every
``mkdocs build`` from the same functions the tests exercise, and registered as generated files, so
``![..](../figures/x.svg)`` links are checked by ``--strict`` like any other.

* ``figures/causal-*.svg``: every (query, key) pair of a causal attention matrix, coloured by the
  kind of tile ``flashtile.reference.causal.tile_map`` assigns it (full / diagonal / skip), with the
  pairs ``causal_mask`` hides drawn pale. Hand-written SVG: a grid needs no plotting library.
* ``figures/io-traffic.svg``: HBM traffic of standard attention and of FlashAttention from
  ``flashtile.reference.io_model``, against the on-chip memory M and the sequence length T, with
  FlashAttention's limit (12 + 16/d) T^2 d^2 / M and the lower bound no exact algorithm can beat drawn
  for comparison. matplotlib, rendered to SVG in memory.
* ``figures/memory-hierarchy.svg``: the H200's memory levels (registers, shared memory, L2, HBM) with
  their sizes and bandwidths, each figure marked as data sheet, derived or measured (``memory_levels``;
  the measured HBM copy rate is read from ``bench/results/ceilings.json``). Hand-written SVG.
* ``figures/training-curves.svg``: the "In a real model" chapter's training claim, run again and drawn
  by ``flashtile.integrations.training_curves``.
* ``figures/perf-*.svg``: the performance chapter's measured plots (scale-up, ratio to cuDNN, roofline),
  drawn by ``hooks/render_plots.py`` from the committed JSON under ``bench/results/``.

The appendix's lab notebook (``docs/appendix/lab-notebook.md``) shows ``bench/PERF_LOG.md``, the record
of every kernel change with its prediction and outcome, where its source has the line
``<!-- perf-log -->`` (``on_page_markdown``): the log stays
the one source. (pymdownx.snippets could include it, but the drift test allows only named src sections.)

MkDocs puts this folder on ``sys.path`` while it loads a hook, so ``render_plots`` (and the
``render_tables`` it uses) are imported here, at the top, as plain modules of the site's own.
"""

from __future__ import annotations

import io
import logging
from fractions import Fraction
from html import escape
from pathlib import Path

import render_plots
from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.figures")

# (file stem, Tq, Tk, block_q, block_k, alignment): the cases the causal chapter discusses.
CAUSAL_PANELS = [
    ("causal-square", 33, 33, 7, 11, "upper_left"),
    ("causal-wide-upper-left", 19, 33, 7, 11, "upper_left"),
    ("causal-wide-lower-right", 19, 33, 7, 11, "lower_right"),
    ("causal-tall-lower-right", 33, 19, 7, 11, "lower_right"),
]

# Saturated colour for visible pairs, pale one for pairs the mask hides inside that tile.
TILE_COLOURS = {
    "full": ("#3b6fb6", "#3b6fb6"),
    "diagonal": ("#e07b1a", "#f6d9bd"),
    "skip": ("#bdbdbd", "#e6e6e6"),
}
CELL = 10  # px per (query, key) pair
MARGIN_LEFT, MARGIN_TOP = 44, 58


def causal_tiles_svg(Tq: int, Tk: int, block_q: int, block_k: int, alignment: str) -> str:
    from flashtile.reference.causal import causal_mask, count_visited_tiles, tile_map, tile_ranges

    kinds = tile_map(Tq, Tk, block_q, block_k, alignment)
    mask = causal_mask(Tq, Tk, alignment).tolist()
    q_tiles, k_tiles = tile_ranges(Tq, block_q), tile_ranges(Tk, block_k)
    visited = count_visited_tiles(Tq, Tk, block_q, block_k, True, alignment)
    width = MARGIN_LEFT + Tk * CELL + 150
    height = MARGIN_TOP + Tq * CELL + 16
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{MARGIN_LEFT}" y="16" font-size="12" font-weight="bold">'
        f"{escape(f'Tq={Tq}, Tk={Tk}, block_q={block_q}, block_k={block_k}, {alignment}')}</text>",
        f'<text x="{MARGIN_LEFT}" y="32">'
        f"visited tiles: {visited} of {len(q_tiles) * len(k_tiles)}</text>",
        f'<text x="{MARGIN_LEFT}" y="{MARGIN_TOP - 6}">key j \u2192</text>',
        f'<text x="14" y="{MARGIN_TOP + 4}" transform="rotate(90 14 {MARGIN_TOP + 4})">query i \u2192</text>',
    ]
    for qi, (qs, qe) in enumerate(q_tiles):
        for ki, (ks, ke) in enumerate(k_tiles):
            solid, pale = TILE_COLOURS[kinds[qi][ki].value]
            for i in range(qs, qe):
                for j in range(ks, ke):
                    colour = solid if mask[i][j] else pale
                    out.append(
                        f'<rect x="{MARGIN_LEFT + j * CELL}" y="{MARGIN_TOP + i * CELL}" width="{CELL}" '
                        f'height="{CELL}" fill="{colour}" stroke="#ffffff" stroke-width="0.5"/>'
                    )
            x, y = MARGIN_LEFT + ks * CELL, MARGIN_TOP + qs * CELL
            w, h = (ke - ks) * CELL, (qe - qs) * CELL
            out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="none" stroke="#222" stroke-width="1.5"/>')
            out.append(
                f'<text x="{x + w / 2}" y="{y + h / 2 + 4}" text-anchor="middle" font-weight="bold" '
                f'fill="#111">{kinds[qi][ki].value[0].upper()}</text>'
            )
    legend_x = MARGIN_LEFT + Tk * CELL + 16
    for row, (name, (solid, pale)) in enumerate(TILE_COLOURS.items()):
        y = MARGIN_TOP + row * 36
        out.append(f'<rect x="{legend_x}" y="{y}" width="12" height="12" fill="{solid}"/>')
        out.append(f'<rect x="{legend_x + 13}" y="{y}" width="12" height="12" fill="{pale}"/>')
        out.append(f'<text x="{legend_x + 30}" y="{y + 10}">{name[0].upper()} = {name}</text>')
    y = MARGIN_TOP + 3 * 36
    out.append(f'<text x="{legend_x}" y="{y + 10}">dark: visible pair</text>')
    out.append(f'<text x="{legend_x}" y="{y + 26}">pale: masked pair</text>')
    out.append("</svg>")
    return "\n".join(out)


# The IO chapter's running example: one (batch, head), head dim 64, and M = 100,000 elements
# (about the 228 KiB of shared memory of one H100/H200 SM, in bf16).
IO_HEAD_DIM = 64
IO_T = 4096
IO_M = 100_000
IO_M_RANGE = [2**k for k in range(10, 21)]  # 1 Ki .. 1 Mi elements
IO_T_RANGE = [2**k for k in range(8, 16)]  # 256 .. 32 Ki tokens


def io_traffic_svg() -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flashtile.reference.io_model import (
        attention_traffic_lower_bound,
        flash_attention_traffic,
        standard_attention_traffic,
        theorem2_bound,
        traffic_ratio_limit,
    )

    d = IO_HEAD_DIM
    shape = "T\u00b2d\u00b2/M"
    lower = "lower bound (any exact)"
    # The panels are stacked and each legend sits under its panel, outside the axes: at a phone's width
    # (the figure drawn about 350 px wide) the 11 pt text comes out about 11 px high and hides no curve.
    with plt.rc_context({"svg.hashsalt": "flashtile", "font.size": 11, "legend.fontsize": 10}):
        fig, (by_m, by_t) = plt.subplots(2, 1, figsize=(4.8, 8.6), constrained_layout=True)
        ms = [M for M in IO_M_RANGE if 4 * d <= M <= IO_T * d]  # the theorem's range
        by_m.loglog(ms, [standard_attention_traffic(IO_T, d).total for _ in ms], "o-", label="standard")
        by_m.loglog(ms, [flash_attention_traffic(IO_T, d, M).total for M in ms], "s-", label="FlashAttention")
        # Powers of two: 4d divides every M here, so the T -> infinity limit is exactly 12 + 16/d.
        assert all(traffic_ratio_limit(d, M) == 12 + Fraction(16, d) for M in ms)
        by_m.loglog(ms, [(12 + 16 / d) * theorem2_bound(IO_T, d, M) for M in ms], "k--", label=f"(12 + 16/d) {shape}")
        low_ms = [M for M in ms if M >= d * d]  # the lower bound has the T^2 d^2 / M shape from M = d^2 on
        by_m.loglog(low_ms, [attention_traffic_lower_bound(IO_T, d, M) for M in low_ms], "k:", label=lower)
        by_m.set(xlabel="on-chip memory M (elements)", ylabel="HBM traffic (elements)",
                 title=f"against M, at T = {IO_T}, d = {d}")  # fmt: skip
        ts = IO_T_RANGE
        by_t.loglog(ts, [standard_attention_traffic(T, d).total for T in ts], "o-", label="standard")
        by_t.loglog(ts, [flash_attention_traffic(T, d, IO_M).total for T in ts], "s-", label="FlashAttention")
        slope = float(traffic_ratio_limit(d, IO_M))  # 4d does not divide 100,000: a little above 12 + 16/d
        label = f"{slope:.2f} {shape}"
        by_t.loglog(ts, [slope * theorem2_bound(T, d, IO_M) for T in ts], "k--", label=label)
        by_t.loglog(ts, [attention_traffic_lower_bound(T, d, IO_M) for T in ts], "k:", label=lower)
        by_t.set(xlabel="sequence length T", ylabel="HBM traffic (elements)",
                 title=f"against T, at M = {IO_M:,}, d = {d}")  # fmt: skip
        for ax in (by_m, by_t):
            ax.grid(True, which="major", alpha=0.3)
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
        plt.close(fig)
    return buf.getvalue()


# The H200's memory levels, fastest first, for figures/memory-hierarchy.svg. The on-chip levels are the
# GH100 chip's, which the H200 shares with the H100 SXM (NVIDIA's H100 architecture whitepaper); the
# HBM figures are the H200 data sheet's, beside the copy rate measured in bench/results/ceilings.json.
# Each line is (text, source): "D" a data-sheet / whitepaper figure, "=" derived from those, "M" measured.
H200_SMS, H200_BOOST_GHZ = 132, 1.98
SMEM_PER_SM_KIB, REGISTERS_PER_SM, SMEM_BYTES_PER_CLOCK = 228, 65_536, 128  # 32 banks x 4 bytes


def memory_levels(copy_tbps: float) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(name, what it is, [(line, source)]) for each level; ``copy_tbps`` is the measured HBM copy rate."""
    reg_kib = REGISTERS_PER_SM * 4 // 1024
    smem_tbps = SMEM_BYTES_PER_CLOCK * H200_SMS * H200_BOOST_GHZ * 1e9 / 1e12
    return [
        ("Registers", "per thread, inside each SM", [
            (f"{REGISTERS_PER_SM // 1024} Ki \u00d7 32-bit = {reg_kib} KiB per SM", "D"),
            (f"{reg_kib * H200_SMS / 1024:.0f} MiB over {H200_SMS} SMs", "="),
            ("feed the tensor cores; no published rate", ""),
        ]),
        ("Shared memory (SRAM)", "per SM; the M of Part A", [
            (f"up to {SMEM_PER_SM_KIB} KiB per SM (of 256 KiB L1)", "D"),
            (f"{SMEM_PER_SM_KIB * H200_SMS / 1024:.1f} MiB over {H200_SMS} SMs", "="),
            (f"{SMEM_BYTES_PER_CLOCK} B/clock/SM: {smem_tbps:.1f} TB/s in all", "="),
        ]),
        ("L2 cache", "one, shared by all SMs", [
            ("50 MB", "D"),
            ("no published rate; not measured here", ""),
        ]),
        ("HBM3e", "off chip: where tensors live", [
            ("141 GB", "D"),
            ("4.8 TB/s (data sheet)", "D"),
            (f"{copy_tbps} TB/s measured (a copy)", "M"),
        ]),
    ]  # fmt: skip


SOURCE_COLOURS = {"D": "#5b6770", "=": "#3b6fb6", "M": "#e07b1a"}


def memory_hierarchy_svg(copy_tbps: float) -> str:
    """The memory levels as a stack of cards, narrowest (fastest, smallest) on top: hand-written SVG,
    380 px wide, so that at a phone's width it is drawn at about its own size."""
    width, pad, line_h = 380, 10, 17
    levels = memory_levels(copy_tbps)
    out, y = [], 8
    fills = ["#fde7d3", "#e3ecf8", "#e8f3e6", "#ececec"]
    for index, (name, what, lines) in enumerate(levels):
        height = 26 + line_h * len(lines) + 6
        inset = 36 * (len(levels) - 1 - index) // 2  # narrower toward the top: a pyramid
        out.append(f'<rect x="{inset}" y="{y}" width="{width - 2 * inset}" height="{height}" rx="6" '
                   f'fill="{fills[index]}" stroke="#444" stroke-width="1"/>')  # fmt: skip
        out.append(f'<text x="{inset + pad}" y="{y + 19}" font-size="14" font-weight="bold">{escape(name)}</text>')
        out.append(f'<text x="{width - inset - pad}" y="{y + 19}" text-anchor="end" font-size="11" '
                   f'fill="#333">{escape(what)}</text>')  # fmt: skip
        for row, (text, source) in enumerate(lines):
            ty = y + 26 + line_h * (row + 1) - 4
            x = inset + pad
            if source:
                colour = SOURCE_COLOURS[source]
                out.append(f'<rect x="{x}" y="{ty - 11}" width="14" height="14" rx="3" fill="{colour}"/>')
                out.append(f'<text x="{x + 7}" y="{ty}" text-anchor="middle" font-size="11" fill="#fff" '
                           f'font-weight="bold">{escape(source)}</text>')  # fmt: skip
            out.append(f'<text x="{x + 20}" y="{ty}" font-size="12.5">{escape(text)}</text>')
        y += height + 8
    legend = [("D", "data sheet / whitepaper"), ("=", "derived from those"), ("M", "measured")]
    x = 0
    for source, text in legend:
        out.append(f'<rect x="{x}" y="{y}" width="14" height="14" rx="3" fill="{SOURCE_COLOURS[source]}"/>')
        out.append(f'<text x="{x + 7}" y="{y + 11}" text-anchor="middle" font-size="11" fill="#fff" '
                   f'font-weight="bold">{escape(source)}</text>')  # fmt: skip
        out.append(f'<text x="{x + 18}" y="{y + 11}" font-size="11">{escape(text)}</text>')
        x += 26 + 6 * len(text)
    y += 34
    out.append(f'<text x="0" y="{y}" font-size="11" fill="#333">faster and smaller toward the top; '
               f'sizes for one H200 SXM</text>')  # fmt: skip
    height = y + 8
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
            f'font-family="sans-serif">')  # fmt: skip
    return "\n".join([head, f'<rect width="{width}" height="{height}" fill="#ffffff"/>', *out, "</svg>"])


def on_files(files, config):
    for stem, Tq, Tk, block_q, block_k, alignment in CAUSAL_PANELS:
        svg = causal_tiles_svg(Tq, Tk, block_q, block_k, alignment)
        files.append(File.generated(config, f"figures/{stem}.svg", content=svg))
    files.append(File.generated(config, "figures/io-traffic.svg", content=io_traffic_svg()))
    from flashtile.bench.roofline import load_ceilings

    svg = memory_hierarchy_svg(load_ceilings()["tbps"])
    files.append(File.generated(config, "figures/memory-hierarchy.svg", content=svg))
    perf = render_plots.figures()
    for name, svg in perf.items():
        files.append(File.generated(config, f"figures/{name}", content=svg))
    files.append(File.generated(config, "figures/training-curves.svg", content=training_curves_figure()))
    log.info("drew %d causal tile maps, the IO traffic plot, %d performance plots and the training curves",
             len(CAUSAL_PANELS), len(perf))  # fmt: skip
    return files


def training_curves_figure() -> str:
    """The "In a real model" chapter's claim 3, trained again here and drawn: flashtile (reference tier)
    and transformers' SDPA on the tiny Llama, twelve AdamW steps from the same start (a few seconds)."""
    from transformers import LlamaConfig

    from flashtile.api import use_backend
    from flashtile.integrations.training_curves import TINY_LLAMA, training_curves, training_curves_svg
    from flashtile.integrations.transformers import register

    name = register()
    with use_backend("reference"):
        curves = training_curves(LlamaConfig(**TINY_LLAMA), (name, "sdpa"))
    return training_curves_svg(curves, {name: "flashtile", "sdpa": "transformers' SDPA"})


PERF_LOG = Path(__file__).resolve().parents[1] / "bench" / "PERF_LOG.md"
PERF_LOG_MARKER = "<!-- perf-log -->"


def perf_log_markdown(text: str) -> str:
    """bench/PERF_LOG.md as the body of a page: its title dropped, every other line as it is.

    ``on_page_markdown`` puts this where a page has the line ``<!-- perf-log -->`` (the lab notebook in
    the site's appendix, whose own title replaces the log's), so the log stays the one source and the
    page shows it as it is, whoever edited it last. Its entries keep their ``##`` headings and are the
    page's table of contents.
    """
    lines = text.splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return "\n".join(lines).strip() + "\n"


def on_page_markdown(markdown, page, config, files):
    if PERF_LOG_MARKER not in markdown:
        return markdown
    return markdown.replace(PERF_LOG_MARKER, perf_log_markdown(PERF_LOG.read_text(encoding="utf-8")))

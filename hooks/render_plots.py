"""The performance chapter's figures, drawn from the committed JSON at every site build (``hooks/figures.py``).

The site's code, not the package's: it reads what ``flashtile.bench`` wrote and draws it.

Each figure has a pure function that picks its points out of the result rows (tested on the CPU) and a
drawing function that turns them into SVG with matplotlib. Nothing is interpolated or filled in: a
provider or shape the JSON does not hold is simply not drawn, and a figure whose file does not exist
yet says so instead of showing data.

- ``scaleup_svg``: TFLOP/s against T per provider (``forward-scaleup.json``); a provider that ran
  out of memory or was skipped gets a cross at the bottom of the plot, labelled with the reason.
- ``ratio_svg``: each fused provider's TFLOP/s divided by cuDNN's over the standard sweep
  (``forward.json``), one panel with the causal mask and one without, solid lines for D = 64, dashed for
  D = 128 (the unfused ``sdpa_math`` and ``naive`` are left to the scale-up plot).
- ``roofline_svg``: the H200's roofline (``ceilings.json``) with the measured rows at their arithmetic
  intensity: the least-traffic intensity for every provider but ``naive``, which writes and reads the
  scores, and sits at the intensity of unfused attention.
- ``timeline_svg``: one forward program's time on its SM, split where the clock probe read it
  (``sweeps/forward-timeline.json``: start to the end of the key loop, epilogue, then the check for huge
  scores and the switch to the next program), as shares of the whole, at Tq = 2048 and d = 128 without
  a mask for each key count measured.
"""

from __future__ import annotations

import io

from render_tables import short_reason

from flashtile.bench.common import RESULTS, load_result
from flashtile.bench.roofline import arithmetic_intensity, load_ceilings, ridge_intensity, standard_attention_intensity
from flashtile.bench.shapes import is_standard

# One colour and marker per provider, the same in every figure.
STYLE = {
    "flashtile": ("#d62728", "o"),
    "sdpa_cudnn": ("#1f77b4", "s"),
    "sdpa_flash": ("#2ca02c", "^"),
    "sdpa_efficient": ("#9467bd", "v"),
    "sdpa_math": ("#8c564b", "D"),
    "flex": ("#ff7f0e", "P"),
    "naive": ("#7f7f7f", "X"),
}
LABEL = {"flashtile": "flashtile", "sdpa_cudnn": "SDPA cuDNN", "sdpa_flash": "SDPA flash",
         "sdpa_efficient": "SDPA efficient", "sdpa_math": "SDPA math", "flex": "flex", "naive": "naive"}  # fmt: skip
# The ratio plot shows the fused implementations; the unfused ones are the scale-up plot's subject.
RATIO_LEFT_OUT = ("sdpa_cudnn", "sdpa_math", "naive")
FIGSIZE = (4.8, 4.0)  # inches: drawn about 350 px wide on a phone, the 11 pt labels come out about 11 px high
FONT = {"svg.hashsalt": "flashtile", "font.size": 11, "legend.fontsize": 10}


def load_optional(json_name: str) -> dict | None:
    return load_result(json_name) if (RESULTS / json_name).is_file() else None


def _forward_rows(result: dict | None) -> list[dict]:
    return [r for r in result["rows"] if r.get("pass") == "forward"] if result else []


def _in_order(names) -> list[str]:
    return [p for p in STYLE if p in names] + sorted(set(names) - set(STYLE))


def scaleup_series(rows: list[dict]) -> tuple[dict, dict]:
    """({provider: [(T, TFLOP/s)]} of rows with a time, {provider: [(T, reason)]} of rows without), sorted by T."""
    measured, missing = {}, {}
    for r in rows:
        if r.get("ms") is not None:
            measured.setdefault(r["provider"], []).append((r["Tq"], r["tflops"]))
        else:
            missing.setdefault(r["provider"], []).append((r["Tq"], short_reason(r)))
    return {p: sorted(v) for p, v in measured.items()}, {p: sorted(v) for p, v in missing.items()}


def ratio_series(rows: list[dict]) -> dict:
    """{(D, causal): {provider: [(T, TFLOP/s / cuDNN's)]}} over the bf16 standard-sweep cells that have cuDNN."""
    cells: dict = {}
    for r in rows:
        if is_standard(r) and r["dtype"] == "bf16" and r.get("ms") is not None:
            cells.setdefault((r["D"], r["causal"], r["Tq"]), {})[r["provider"]] = r["tflops"]
    out: dict = {}
    for (D, causal, T), by in sorted(cells.items()):
        if "sdpa_cudnn" not in by:
            continue
        for provider, tflops in by.items():
            out.setdefault((D, causal), {}).setdefault(provider, []).append((T, tflops / by["sdpa_cudnn"]))
    return out


def roofline_points(rows: list[dict]) -> dict:
    """{provider: [(FLOP per byte, TFLOP/s)]}: naive at unfused attention's intensity, the rest at the least traffic.

    Naive rows are placed only when square and multi-head, the case the unfused traffic model counts.
    """
    points: dict = {}
    for r in rows:
        if r.get("ms") is None:
            continue
        if r["provider"] != "naive":
            intensity = arithmetic_intensity(r)
        elif r["Tq"] == r["Tk"] and r["H_kv"] == r["H"]:  # causal halves the FLOPs, not the traffic of S and P
            intensity = standard_attention_intensity(r["Tq"], r["D"], r["dtype"]) * (0.5 if r["causal"] else 1.0)
        else:
            continue
        points.setdefault(r["provider"], []).append((intensity, r["tflops"]))
    return points


TIMELINE_PARTS = (  # (key of the probe's row, label, colour): the intervals between the probe's clock reads
    ("start_to_loop_end", "start to end of key loop", STYLE["flashtile"][0]),
    ("epilogue", "epilogue (last PV, o, stores)", "#ff7f0e"),
    ("gap_on_sm", "the check, then the next program starts", "#7f7f7f"),
)


def timeline_parts(rows: list[dict]) -> list[tuple[int, dict]]:
    """[(Tk, {part: median µs})] of the package's rows at Tq = 2048 without a mask, by Tk.

    The probe writes each interval's 10%, 50% and 90% quantiles over the programs; the median is drawn.
    Rows of other versions of the kernel (``version`` other than the package) are left out.
    """
    picked = [r for r in rows if r.get("version", "package") == "package" and r["Tq"] == 2048 and not r["causal"]]
    return [(r["Tk"], {key: r[f"{key}_us_p10_p50_p90"][1] for key, _, _ in TIMELINE_PARTS})
            for r in sorted(picked, key=lambda r: r["Tk"])]  # fmt: skip


def _svg(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    return buf.getvalue()


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _not_measured(ax, command: str) -> None:
    """An empty panel that says what would fill it: no axes ticks, since there is no data to scale them."""
    ax.text(0.5, 0.5, f"not yet measured:\n{command}", ha="center", va="center", transform=ax.transAxes,
            color="#555555")  # fmt: skip
    ax.set_xticks([])
    ax.set_yticks([])


def _token_count(T: int) -> str:
    return f"{T // 1024}k" if T >= 1024 and T % 1024 == 0 else str(T)


def _t_axis(ax, ts) -> None:
    """A log-2 axis of sequence lengths, labelled 512, 1k, 2k, ... at the lengths measured."""
    ts = sorted(set(ts))
    ax.set_xticks(ts, [_token_count(T) for T in ts])
    ax.minorticks_off()


def _legend_below(fig, handles, ncol: int = 2) -> None:
    """One legend under the plot, outside the axes: it never hides a point, at any width."""
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncol=ncol, frameon=False)


def _handle(provider: str, **kw):
    from matplotlib.lines import Line2D

    colour, marker = STYLE.get(provider, ("#000000", "."))
    return Line2D([], [], color=colour, marker=marker, label=LABEL.get(provider, provider), **kw)


def scaleup_svg(result: dict | None) -> str:
    plt = _pyplot()
    measured, missing = scaleup_series(_forward_rows(result))
    with plt.rc_context(FONT):
        if not measured and not missing:
            fig, ax = plt.subplots(figsize=(FIGSIZE[0], 1.6), layout="constrained")
            _not_measured(ax, "python -m flashtile.bench forward --set scaleup")
            return _svg(fig)
        fig, ax = plt.subplots(figsize=FIGSIZE, layout="constrained")
        ax.set_xscale("log", base=2)
        names = _in_order(set(measured) | set(missing))
        stacked: dict = {}  # labels already written at each length: the next one goes above them
        for p in names:
            colour, marker = STYLE.get(p, ("#000000", "."))
            if p in measured:
                ts, tf = zip(*measured[p])
                ax.plot(ts, tf, marker=marker, color=colour)
            for T, reason in missing.get(p, []):
                ax.plot([T], [0], marker="x", color=colour, markersize=9, clip_on=False)
                height = 7 + 12 * stacked.get(T, 0)
                stacked[T] = stacked.get(T, 0) + 1
                ax.annotate(reason, (T, 0), textcoords="offset points", xytext=(0, height), ha="center", fontsize=9,
                            color=colour)  # fmt: skip
        first = _forward_rows(result)[0]
        ax.set_title(f"B = {first['B']}, H = {first['H']}, D = {first['D']}, "
                     f"{'causal' if first['causal'] else 'no mask'}, {first['dtype']}")  # fmt: skip
        ax.set_ylim(bottom=0)
        ax.margins(x=0.08)  # room for the labels of the first and last lengths
        _t_axis(ax, [T for v in (*measured.values(), *missing.values()) for T, _ in v])
        ax.set(xlabel="sequence length T", ylabel="TFLOP/s")
        ax.grid(True, alpha=0.3)
        _legend_below(fig, [_handle(p) for p in names])
        return _svg(fig)


def ratio_svg(result: dict | None) -> str:
    from matplotlib.lines import Line2D

    plt = _pyplot()
    series = ratio_series(_forward_rows(result))
    with plt.rc_context(FONT):
        fig, axes = plt.subplots(2, 1, figsize=(FIGSIZE[0], 6.4), sharex=True, layout="constrained")
        names = set()
        for ax, causal in zip(axes, (True, False)):
            ax.set_xscale("log", base=2)
            ax.axhline(1.0, color=STYLE["sdpa_cudnn"][0], linewidth=1.5, alpha=0.7)
            for D, dash in ((64, "-"), (128, "--")):
                by = series.get((D, causal), {})
                for p in _in_order(by):
                    if p in RATIO_LEFT_OUT:
                        continue
                    colour, marker = STYLE.get(p, ("#000000", "."))
                    ts, ratios = zip(*by[p])
                    ax.plot(ts, ratios, dash, marker=marker, color=colour)
                    names.add(p)
            ax.set(title=f"{'causal' if causal else 'no mask'}, bf16", ylabel="÷ cuDNN's TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
        if not names:
            for ax in axes:
                _not_measured(ax, "python -m flashtile.bench forward --set main")
        measured_ts = [T for by in series.values() for v in by.values() for T, _ in v]
        if measured_ts:
            _t_axis(axes[-1], measured_ts)
        axes[-1].set_xlabel("T (B·T = 16,384 tokens, H·D = 2,048)")
        styles = [Line2D([], [], color="#444444", linestyle=dash, label=f"D = {D}")
                  for D, dash in ((64, "-"), (128, "--"))]  # fmt: skip
        cudnn = Line2D([], [], color=STYLE["sdpa_cudnn"][0], linewidth=1.5, alpha=0.7, label="SDPA cuDNN = 1")
        _legend_below(fig, [_handle(p) for p in _in_order(names)] + [cudnn, *styles] if names else [])
        return _svg(fig)


def roofline_svg(ceilings: dict, results: list[dict | None]) -> str:
    plt = _pyplot()
    rows = [r for result in results for r in _forward_rows(result)]
    points = roofline_points(rows)
    peak, bandwidth = ceilings["tflops"], ceilings["tbps"]
    ridge = ridge_intensity(ceilings)
    with plt.rc_context(FONT):
        fig, ax = plt.subplots(figsize=FIGSIZE, layout="constrained")
        xs = [1.0, ridge, 2.0**14]
        ax.loglog(xs, [min(peak, x * bandwidth) for x in xs], color="black", linewidth=2)
        ax.axvline(ridge, color="black", linestyle=":", linewidth=1)
        ax.annotate(f"ridge {ridge:.0f}", (ridge, peak), textcoords="offset points", xytext=(-4, 4), ha="right",
                    fontsize=9)  # fmt: skip
        for d in (64, 128):  # unfused attention never gets past d/2 FLOP per byte, whatever T is
            ax.axvline(d / 2, color="#7f7f7f", linestyle="--", linewidth=1)
            ax.text(d / 2 * 0.9, 1.3, f"unfused, d = {d}", rotation=90, ha="right", va="bottom", fontsize=9,
                    color="#555555")  # fmt: skip
        for p in _in_order(points):
            colour, marker = STYLE.get(p, ("#000000", "."))
            xs_p, ys_p = zip(*points[p])
            ax.loglog(xs_p, ys_p, linestyle="none", marker=marker, color=colour, alpha=0.8)
        ax.set(xlabel="FLOP per byte of HBM traffic", ylabel="TFLOP/s",
               title=f"H200: {peak:g} TFLOP/s, {bandwidth:g} TB/s")  # fmt: skip
        ax.set_ylim(1, 2 * peak)
        ax.grid(True, which="major", alpha=0.3)
        _legend_below(fig, [_handle(p, linestyle="none") for p in _in_order(points)], ncol=3)
        return _svg(fig)


def timeline_svg(result: dict | None) -> str:
    plt = _pyplot()
    bars = timeline_parts(result["rows"] if result else [])
    with plt.rc_context(FONT):
        fig, ax = plt.subplots(figsize=(FIGSIZE[0], 3.4), layout="constrained")
        if not bars:
            _not_measured(ax, "bench/results/sweeps/forward-timeline.json")
            return _svg(fig)
        for y, (Tk, parts) in enumerate(bars):
            total, left = sum(parts.values()), 0.0
            for key, _, colour in TIMELINE_PARTS:
                share = 100 * parts[key] / total
                ax.barh(y, share, left=left, color=colour, height=0.6)
                left += share
            ax.text(2, y + 0.42, f"{_token_count(Tk)} keys: {total:.1f} µs a program", fontsize=10, va="center")
        ax.set_yticks([])
        ax.set_ylim(-0.5, len(bars) - 0.1)
        ax.set(xlim=(0, 100), xlabel="share of the program's time on its SM (%)",
               title="One program, d = 128, Tq = 2048, no mask")  # fmt: skip
        from matplotlib.patches import Patch

        _legend_below(fig, [Patch(color=colour, label=label) for _, label, colour in TIMELINE_PARTS], ncol=1)
        return _svg(fig)


def figures() -> dict[str, str]:
    """file name under figures/ -> SVG text, for every figure of the performance chapter."""
    main = load_optional("forward.json")
    scaleup = load_optional("forward-scaleup.json")
    models = load_optional("forward-models.json")
    return {
        "perf-scaleup.svg": scaleup_svg(scaleup),
        "perf-ratio.svg": ratio_svg(main),
        "perf-roofline.svg": roofline_svg(load_ceilings(), [main, scaleup, models]),
        "perf-timeline.svg": timeline_svg(load_optional("sweeps/forward-timeline.json")),
    }

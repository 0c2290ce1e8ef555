"""The site's GPU tables, rendered from the committed benchmark JSON.

The site builds without a GPU, so its numbers come from ``bench/results/*.json``. Each table sits on
its page between two HTML comments,

    <!-- bench-table: forward -->
    ...the rendered table and its provenance line...
    <!-- /bench-table -->

``python hooks/render_tables.py`` (from the repository root) rewrites every such block from its JSON
after a re-run (and the ring chapter's ``<!-- ring-table -->`` block from ``ring.json``), and
``tests/hooks/test_render_tables.py`` (``test_ring_table.py``) fails if a page and its JSON disagree, so
a hand-edited number or a forgotten update cannot reach the site. A table whose JSON does not exist yet
renders as one line saying so and naming the command that measures it; the next
``python hooks/render_tables.py`` after that run fills the block in.

This is the site's code, not the package's: the harness ``flashtile.bench`` measures and writes the
JSON, and this module (imported by ``hooks/render_plots.py`` and the tests) only reads it.

Forward results follow BENCH_SCHEMA.md (``Tq``, ``Tk``, ``H_kv``, ``layout``, ``dtype``). A provider
that did not run a shape (``ms: null``) shows as ``OOM``, ``skip`` (the math backend above its memory
budget) or ``fails``, with the reasons for ``fails`` listed under the table.
"""

from __future__ import annotations

import re
from pathlib import Path

from flashtile.bench.common import RESULTS, load_result
from flashtile.bench.shapes import STANDARD_D, STANDARD_T, is_standard

DOCS = Path(__file__).resolve().parents[1] / "docs"
ATTENTION_PROVIDERS = ("flashtile", "sdpa_cudnn", "sdpa_flash")
# Every forward provider, in table order, with its column name.
FORWARD_PROVIDERS = {"flashtile": "flashtile", "flashtile_textbook": "textbook",
                     "flashtile_rotated": "flashtile, rotated", "sdpa_cudnn": "cuDNN",
                     "sdpa_flash": "flash",
                     "sdpa_efficient": "efficient", "sdpa_math": "math", "flex": "flex", "naive": "naive"}  # fmt: skip
BLOCK = re.compile(r"(<!-- bench-table: (?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /bench-table -->)", re.S)


def _group(rows: list[dict], key) -> dict:
    """Rows grouped by shape (in first-seen order), then by provider."""
    groups: dict = {}
    for row in rows:
        groups.setdefault(key(row), {})[row["provider"]] = row
    return groups


def _line(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _ok(row: dict | None) -> bool:
    return row is not None and row.get("ms") is not None


def short_reason(row: dict | None) -> str:
    """The cell of a provider that has no time: not in the file, out of memory, skipped, or failed."""
    if row is None:
        return "—"
    error = row.get("error", "")
    return "OOM" if error == "OOM" else "skip" if error.startswith("skipped") else "fails"


def _heads(row: dict) -> str:
    return f"{row['H']}" if row["H_kv"] == row["H"] else f"{row['H']} / {row['H_kv']}"


def failures(rows: list[dict]) -> list[str]:
    """One Markdown list line per (provider, reason) among rows that failed (not OOM, not skipped)."""
    seen: dict = {}
    for row in rows:
        if not _ok(row) and short_reason(row) == "fails":
            seen.setdefault((row["provider"], row.get("error", "")), []).append(row)
    lines = []
    for (provider, error), where in seen.items():
        # one entry per shape, whichever passes failed at it (forward and backward name the same shape)
        described = dict.fromkeys(
            f"B={r['B']} H={_heads(r).replace(' ', '')} T={r['Tq']} D={r['D']}"
            + (f" D_v={r['D_v']}" if r.get("D_v", r["D"]) != r["D"] else "") + f" {r['layout']} {r['dtype']}"
            for r in where
        )
        lines.append(f"- {FORWARD_PROVIDERS.get(provider, provider)} fails at {'; '.join(described)}: "
                     f"{markdown_text(error)}")  # fmt: skip
    return ["", "Not run:", "", *lines] if lines else []


def forward_table(result: dict) -> list[str]:
    """Multi-head, bhtd, bf16 rows with flashtile, cuDNN and flash, one line per shape, in file order.

    The ratio comes first in every table with a dozen columns: on a phone only the first few columns
    are on screen, and the ratio is what a reader looks for."""
    # the textbook kernel's columns, once a run has measured it
    textbook = ("flashtile_textbook",) if any(r["provider"] == "flashtile_textbook" for r in result["rows"]) else ()
    lines = [
        _line(["flashtile / cuDNN", "B", "H", "T", "D", "causal", "flashtile ms", "TFLOP/s", "cuDNN ms", "TFLOP/s",
               "flash ms", "TFLOP/s", *(["textbook ms", "TFLOP/s"] if textbook else [])]),  # fmt: skip
        _line(["---"] * (12 + 2 * len(textbook))),
    ]
    keep = lambda r: (r["pass"] == "forward" and r["dtype"] == "bf16" and r["layout"] == "bhtd"
                      and r["H_kv"] == r["H"] and r["Tq"] == r["Tk"])  # fmt: skip
    shape_of = lambda r: (r["B"], r["H"], r["Tq"], r["D"], r["causal"])
    for (B, H, T, D, causal), by in _group([r for r in result["rows"] if keep(r)], shape_of).items():
        cells = [B, H, T, D, "yes" if causal else "no"]
        for p in (*ATTENTION_PROVIDERS, *textbook):
            row = by.get(p)
            cells += [f"{row['ms']:.3f}", f"{row['tflops']:.1f}"] if _ok(row) else [short_reason(row)] * 2
        ours, cudnn = by.get("flashtile"), by.get("sdpa_cudnn")
        ratio = f"{ours['tflops'] / cudnn['tflops']:.0%}" if _ok(ours) and _ok(cudnn) else "—"
        lines.append(_line([ratio, *cells]))
    return lines


def sweep_table(result: dict) -> list[str]:
    """The standard sweep as a grid: T down, (D, causal) across; each cell flashtile / cuDNN first, then
    flashtile · cuDNN · flash TFLOP/s in brackets (only the TFLOP/s where cuDNN has none). A cell the
    file does not hold is "—"; a head dim it holds no cell of gets no columns (the fp16 sweep runs
    D = 128 only)."""
    cells = {}
    for row in result["rows"]:
        if row["pass"] == "forward" and is_standard(row):
            cells.setdefault((row["Tq"], row["D"], row["causal"], row["dtype"]), {})[row["provider"]] = row
    dtypes = sorted({key[3] for key in cells}) or ["bf16"]
    head_dims = [D for D in STANDARD_D if any(key[1] == D for key in cells)] or list(STANDARD_D)
    columns = [(D, causal) for D in head_dims for causal in (True, False)]
    lines = [
        _line(["dtype", "T", *(f"D = {D}, {'causal' if causal else 'full'}" for D, causal in columns)]),
        _line(["---"] * (2 + len(columns))),
    ]
    for dtype in dtypes:
        for T in STANDARD_T:
            row_cells = []
            for D, causal in columns:
                by = cells.get((T, D, causal, dtype))
                if by is None:
                    row_cells.append("—")
                    continue
                tf = [f"{by[p]['tflops']:.0f}" if _ok(by.get(p)) else short_reason(by.get(p))
                      for p in ATTENTION_PROVIDERS]  # fmt: skip
                ours, cudnn = by.get("flashtile"), by.get("sdpa_cudnn")
                if _ok(ours) and _ok(cudnn):
                    row_cells.append(f"{ours['tflops'] / cudnn['tflops']:.0%} ({' · '.join(tf)})")
                else:
                    row_cells.append(" · ".join(tf))
            if any(c != "—" for c in row_cells):
                lines.append(_line([dtype, T, *row_cells]))
    return lines + failures([r for by in cells.values() for p, r in by.items() if p in ATTENTION_PROVIDERS])


def _providers_in(rows: list[dict]) -> list[str]:
    present = {r["provider"] for r in rows}
    return [p for p in FORWARD_PROVIDERS if p in present] + sorted(present - set(FORWARD_PROVIDERS))


def models_table(result: dict) -> list[str]:
    """One line per shape: TFLOP/s of every provider in the file, and flashtile / cuDNN."""
    rows = [r for r in result["rows"] if r["pass"] == "forward"]
    names = _providers_in(rows)
    lines = [
        _line(["flashtile / cuDNN", "B", "H / H_kv", "T", "D", "causal", "layout",
               *(FORWARD_PROVIDERS.get(p, p) for p in names)]),  # fmt: skip
        _line(["---"] * (7 + len(names))),
    ]
    shape_of = lambda r: (r["B"], r["H"], r["H_kv"], r["Tq"], r["D"], r["causal"], r["layout"], r["dtype"])
    for (B, H, H_kv, T, D, causal, layout, _dtype), by in _group(rows, shape_of).items():
        tf = [f"{by[p]['tflops']:.1f}" if _ok(by.get(p)) else short_reason(by.get(p)) for p in names]
        ours, cudnn = by.get("flashtile"), by.get("sdpa_cudnn")
        ratio = f"{ours['tflops'] / cudnn['tflops']:.0%}" if _ok(ours) and _ok(cudnn) else "—"
        lines.append(_line([ratio, B, f"{H} / {H_kv}", T, D, "yes" if causal else "no", layout, *tf]))
    return lines + failures(rows)


def scaleup_table(result: dict) -> list[str]:
    """T down, providers across, TFLOP/s (or why there is none)."""
    rows = [r for r in result["rows"] if r["pass"] == "forward"]
    names = _providers_in(rows)
    lines = [_line(["T", *(FORWARD_PROVIDERS.get(p, p) for p in names)]), _line(["---"] * (1 + len(names)))]
    for T, by in _group(rows, lambda r: r["Tq"]).items():
        lines.append(_line([T, *(f"{by[p]['tflops']:.1f}" if _ok(by.get(p)) else short_reason(by.get(p))
                                 for p in names)]))  # fmt: skip
    return lines + failures(rows)


def overhead_table(result: dict) -> list[str]:
    """Host time per call, µs, forward and forward + backward, per entry point."""
    lines = [_line(["entry point", "forward µs", "forward + backward µs"]), _line(["---"] * 3)]
    for provider in dict.fromkeys(r["provider"] for r in result["rows"]):  # in file order
        modes = {r["mode"]: r for r in result["rows"] if r["provider"] == provider}
        cells = [f"{modes[m]['us_per_call']:.1f}" if m in modes else "—" for m in ("fwd", "fwd+bwd")]
        lines.append(_line([f"`{provider}`", *cells]))
    return lines


DECODE_ENTRY_POINTS = {"flashtile_decode": "`flashtile.decode_attention`", "sdpa": "SDPA (`enable_gqa=True`)",
                       "flashtile_decode_launcher": "`kernels.decode.flash_decode` (returns lse too)",
                       "flashtile": "`flashtile.attention`, routed to the decode kernels"}  # fmt: skip


def overhead_decode_table(result: dict) -> list[str]:
    """Host time of one decode step per entry point, µs a call, and its ratio to SDPA's (rounded as the page's
    claims round it: from the µs columns)."""
    rows = result["rows"]
    (sdpa,) = (r["us_per_call"] for r in rows if r["provider"] == "sdpa")
    lines = [_line(["entry point", "µs per call", "/ SDPA"]), _line(["---"] * 3)]
    for r in rows:  # in file order
        name = DECODE_ENTRY_POINTS.get(r["provider"], f"`{r['provider']}`")
        lines.append(_line([name, f"{r['us_per_call']:.1f}", f"{r['us_per_call'] / sdpa:.2f}"]))
    return lines


BACKWARD_OPTIONS = {  # other flashtile providers: (column, ratio column); each appears once a run has measured it
    "flashtile_atomic_dq": ("flashtile, atomic dQ", "atomic dQ / cuDNN"),
    "flashtile_pointers": ("flashtile, pointer loads", "pointers / cuDNN"),
    "flashtile_tma": ("flashtile, TMA", "TMA / cuDNN"),
    "flashtile_textbook": ("flashtile, textbook", "textbook / cuDNN"),
    "flashtile_rotated": ("flashtile, rotated", "rotated / cuDNN"),
}


def _tflops(row: dict | None) -> str:
    return f"{row['tflops']:.1f}" if _ok(row) else short_reason(row)


def _ratio(row: dict | None, base: dict | None) -> str:
    return f"{row['tflops'] / base['tflops']:.2f}" if _ok(row) and _ok(base) else "—"


def _backward_columns(rows: list[dict]) -> tuple[list[str], list[str]]:
    """The opt-in providers the run measured, and the header cells: TFLOP/s of every provider, then each
    flashtile provider over cuDNN, then the default over SDPA's flash backend."""
    present = {r["provider"] for r in rows}
    options = [p for p in BACKWARD_OPTIONS if p in present]
    head = ["flashtile", *(BACKWARD_OPTIONS[p][0] for p in options), "SDPA cuDNN", "SDPA flash",
            *(BACKWARD_OPTIONS[p][1] for p in options), "flashtile / flash"]  # fmt: skip
    return options, head


def _backward_cells(by: dict, options: list[str]) -> list[str]:
    ours, cudnn, flash = (by.get(p) for p in ATTENTION_PROVIDERS)
    return [_tflops(ours), *(_tflops(by.get(p)) for p in options), _tflops(cudnn), _tflops(flash),
            *(_ratio(by.get(p), cudnn) for p in options), _ratio(ours, flash)]  # fmt: skip


def _backward_ratio(by: dict) -> str:
    """flashtile / cuDNN, the first column of the backward tables (on a phone, the one on screen)."""
    return _ratio(by.get("flashtile"), by.get("sdpa_cudnn"))


def backward_table(result: dict) -> list[str]:
    """TFLOP/s of the backward alone on the standard sweep; a column for each opt-in provider the run measured."""
    options, head = _backward_columns(result["rows"])
    lines = [_line(["flashtile / cuDNN", "D", "T", "causal", *head]), _line(["---"] * (4 + len(head)))]
    for (D, T, causal), by in sorted(_group(result["rows"], lambda r: (r["D"], r["Tq"], r["causal"])).items()):
        lines.append(_line([_backward_ratio(by), D, T, "yes" if causal else "no", *_backward_cells(by, options)]))
    return lines + failures(result["rows"])


def backward_models_table(result: dict) -> list[str]:
    """The backward at the model shapes: one line per shape, in the file's order."""
    options, head = _backward_columns(result["rows"])
    lines = [_line(["flashtile / cuDNN", "B", "H / H_kv", "T", "D", "layout", *head]), _line(["---"] * (6 + len(head)))]
    shape_of = lambda r: (r["B"], r["H"], r["H_kv"], r["Tq"], r["D"], r["causal"], r["layout"])
    for (B, H, H_kv, T, D, _causal, layout), by in _group(result["rows"], shape_of).items():
        lines.append(_line([_backward_ratio(by), B, f"{H} / {H_kv}", T, D, layout, *_backward_cells(by, options)]))
    return lines + failures(result["rows"])


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


def _decode_layout(row: dict) -> str:
    if row.get("page_size"):
        return f"pages of {row['page_size']}"
    return "ragged lengths" if row.get("ragged") else "contiguous"


def decode_table(result: dict) -> list[str]:
    """One row per decode shape: each provider's graphed time and rate, split-K's eager time, and
    split-K against cuDNN both ways. A provider that has no row for a shape (SDPA has no paged cache)
    shows a dash."""
    lines = [
        _line(["split-K / cuDNN speed", "B", "cache", "H / H_kv", "cache layout", "split-K µs (eager)",
               "split-K µs", "TB/s", "forward kernel TB/s", "cuDNN µs", "TB/s", "flash TB/s",
               "split-K / cuDNN, eager"]),  # fmt: skip
        _line(["---"] * 13),
    ]
    key = lambda r: (r["B"], r["Tk"], r["H"], r["H_kv"], r.get("page_size"), bool(r.get("ragged")))
    for (B, Tk, H, H_kv, _, _), by in _group(result["rows"], key).items():
        ours, cudnn = by["flashtile_split_k"], by.get("sdpa_cudnn")
        rate = lambda p, by=by: f"{by[p]['tbps_graph']:.2f}" if _ok(by.get(p)) and by[p].get("tbps_graph") else "—"
        versus = [
            f"{cudnn[k] / ours[k]:.2f}" if _ok(cudnn) and cudnn.get(k) and ours.get(k) else "—"
            for k in ("ms_graph", "ms")
        ]
        lines.append(_line([
            versus[0], B, f"{Tk // 1024}k", f"{H} / {H_kv}", _decode_layout(ours), f"{1000 * ours['ms']:.1f}",
            f"{1000 * ours['ms_graph']:.1f}", rate("flashtile_split_k"), rate("flashtile"),
            f"{1000 * cudnn['ms_graph']:.1f}" if _ok(cudnn) and cudnn.get("ms_graph") else "—", rate("sdpa_cudnn"),
            rate("sdpa_flash"), versus[1],
        ]))  # fmt: skip
    copy = result["copy"]
    lines += [
        "",
        f"Rates from the graphed times (one replay of a CUDA graph holding the call: the GPU's time). "
        f"Device-to-device copy in the same run: {copy['copy_tbps']:.2f} TB/s (read + write).",
    ]
    return lines


def train_step_table(result: dict) -> list[str]:
    """ms per training step of each model, flashtile against SDPA, and accuracy where it was checked."""
    lines = [
        _line(["SDPA / flashtile", "model", "B", "T", "flashtile ms", "SDPA ms", "logits error (flashtile / SDPA)",
               "gradient error (flashtile / SDPA)"]),  # fmt: skip
        _line(["---"] * 8),
    ]
    key = lambda r: (r["layers"], r["hidden"], r["H"], r["H_kv"], r["D"], r["B"], r["Tq"])
    for (layers, hidden, H, H_kv, D, B, T), by in _group(result["rows"], key).items():
        ours, sdpa = by["flashtile"], by["sdpa"]
        errors = [
            f"{ours[name]} / {sdpa[name]}" if ours.get(name) is not None else "—"
            for name in ("logits_max_abs_err", "grad_rel_err")
        ]
        model = f"{layers} layers, hidden {hidden}, {H} / {H_kv} heads, d = {D}"
        if ours.get("lengths"):  # a padded batch: its sequences' lengths, padded to T
            model += f", lengths {min(ours['lengths'])}-{max(ours['lengths'])} padded to T"
        lines.append(_line([f"{sdpa['ms'] / ours['ms']:.2f}", model, B, T, f"{ours['ms']:.2f}", f"{sdpa['ms']:.2f}",
                            *errors]))  # fmt: skip
    return lines


def masks_table(result: dict) -> list[str]:
    """Sliding windows: flashtile and compiled FlexAttention on the same mask, cuDNN's full causal beside them."""
    lines = [
        _line(["flashtile / flex", "pass", "mask", "B", "H", "T", "D", "flashtile ms", "TFLOP/s", "flex ms",
               "TFLOP/s", "cuDNN full causal ms"]),  # fmt: skip
        _line(["---"] * 12),
    ]
    key = lambda r: (r["pass"], r["B"], r["H"], r["Tq"], r["D"], r.get("case"))  # a 16k window, 16k documents
    for (pass_, B, H, T, D, _case), by in _group(result["rows"], key).items():
        ours, flex, full = by.get("flashtile"), by.get("flex"), by.get("sdpa_cudnn")
        mask = (ours["mask"] if ours else "—").replace(":", " ")  # "window 1023,0" or "documents 8"
        lines.append(_line([_ratio(ours, flex), pass_, mask, B, H, T, D,
                            f"{ours['ms']:.3f}" if _ok(ours) else short_reason(ours), _tflops(ours),
                            f"{flex['ms']:.3f}" if _ok(flex) else short_reason(flex), _tflops(flex),
                            f"{full['ms']:.3f}" if _ok(full) else short_reason(full)]))  # fmt: skip
    return lines


def fp8_forward_table(result: dict) -> list[str]:
    """The FP8 forward (E4M3 inputs, per-head factors) beside flashtile's bf16 forward and cuDNN's, same run."""
    lines = [
        _line(["FP8 / bf16", "FP8 / cuDNN", "D", "T", "causal", "B", "H", "FP8 ms", "TFLOP/s", "bf16 ms", "TFLOP/s",
               "cuDNN ms", "FP8 max error"]),  # fmt: skip
        _line(["---"] * 13),
    ]
    key = lambda r: (r["D"], r["Tq"], r["causal"], r["B"], r["H"])
    for (D, T, causal, B, H), by in _group(result["rows"], key).items():
        fp8, bf16, cudnn = by.get("flashtile_fp8"), by.get("flashtile"), by.get("sdpa_cudnn")
        lines.append(_line([_ratio(fp8, bf16), _ratio(fp8, cudnn), D, T, "yes" if causal else "no", B, H,
                            f"{fp8['ms']:.3f}" if _ok(fp8) else short_reason(fp8), _tflops(fp8),
                            f"{bf16['ms']:.3f}" if _ok(bf16) else short_reason(bf16), _tflops(bf16),
                            f"{cudnn['ms']:.3f}" if _ok(cudnn) else short_reason(cudnn),
                            fp8.get("max_abs_err_vs_fp32", "—") if fp8 else "—"]))  # fmt: skip
    return lines


def _ms(row: dict | None) -> str:
    return f"{row['ms']:.3f}" if _ok(row) else short_reason(row)


def _speed(base: dict | None, row: dict | None) -> str:
    """How much faster ``row`` runs than ``base``, same run: base time / row time, as ×1.23."""
    return f"×{base['ms'] / row['ms']:.2f}" if _ok(row) and _ok(base) else "—"


def sinks_table(result: dict) -> list[str]:
    """A sink per head: flashtile with it against itself without, Flex plus the lse rescale, and eager."""
    lines = [
        _line(["case", "pass", "with sinks ms", "vs no sink", "vs Flex + rescale", "no sink ms", "Flex + rescale ms",
               "eager ms", "no sink: vs Flex", "Flex ms"]),  # fmt: skip
        _line(["---"] * 10),
    ]
    cases: dict = {}  # (case, pass) -> {(provider, sinks): row}
    for r in result["rows"]:
        cases.setdefault((r["case"], r["pass"]), {})[r["provider"], r["sinks"]] = r
    for (case, pass_), by in cases.items():
        ours, plain = by.get(("flashtile", True)), by.get(("flashtile", False))
        flex, eager, flex_plain = by.get(("flex", True)), by.get(("naive", True)), by.get(("flex", False))
        lines.append(_line([case, pass_, _ms(ours), _speed(plain, ours), _speed(flex, ours), _ms(plain), _ms(flex),
                            _ms(eager), _speed(flex_plain, plain), _ms(flex_plain)]))  # fmt: skip
    return lines + failures(result["rows"])


HEAD_DIM_SDPA = {"sdpa_cudnn": "cuDNN", "sdpa_flash": "flash", "sdpa_efficient": "efficient"}


def head_dims_table(result: dict) -> list[str]:
    """d_v below d_qk: flashtile against v padded to d_qk and against the fastest SDPA backend that ran."""
    lines = [
        _line(["case", "pass", "flashtile ms", "vs padded", "vs fastest SDPA", "padded ms", "fastest SDPA ms",
               *(f"{name} ms" for name in HEAD_DIM_SDPA.values())]),  # fmt: skip
        _line(["---"] * (7 + len(HEAD_DIM_SDPA))),
    ]
    for (case, pass_), by in _group(result["rows"], lambda r: (r["case"], r["pass"])).items():
        ours, pad = by.get("flashtile"), by.get("flashtile_padded")
        ran = [by[p] for p in HEAD_DIM_SDPA if _ok(by.get(p))]
        best = min(ran, key=lambda r: r["ms"]) if ran else None
        best_cell = f"{best['ms']:.3f} ({HEAD_DIM_SDPA[best['provider']]})" if best else "none ran"
        lines.append(_line([case, pass_, _ms(ours), _speed(pad, ours), _speed(best, ours), _ms(pad), best_cell,
                            *(_ms(by.get(p)) for p in HEAD_DIM_SDPA)]))  # fmt: skip
    return lines + failures(result["rows"])


# name in the page marker -> (JSON file, renderer, the command that measures it)
TABLES = {
    "forward": ("forward.json", forward_table, "python -m flashtile.bench forward --set main"),
    "forward-sweep": ("forward.json", sweep_table, "python -m flashtile.bench forward --set main"),
    "forward-fp16": ("forward-fp16.json", sweep_table, "python -m flashtile.bench forward --set fp16"),
    "forward-models": ("forward-models.json", models_table, "python -m flashtile.bench forward --set models"),
    "forward-scaleup": ("forward-scaleup.json", scaleup_table, "python -m flashtile.bench forward --set scaleup"),
    "overhead": ("overhead.json", overhead_table, "python -m flashtile.bench overhead"),
    "overhead-decode": ("overhead-decode.json", overhead_decode_table, "python -m flashtile.bench overhead --decode"),
    "backward": ("backward.json", backward_table, "python -m flashtile.bench backward --set main"),
    "backward-models": ("backward-models.json", backward_models_table,
                        "python -m flashtile.bench backward --set models"),
    "forward-d256": ("forward-d256.json", models_table, "python -m flashtile.bench forward --set d256"),
    "backward-d256": ("backward-d256.json", backward_table, "python -m flashtile.bench backward --set d256"),
    "softmax": ("softmax.json", softmax_table, "python -m flashtile.bench softmax"),
    "decode": ("decode.json", decode_table, "python -m flashtile.bench decode"),
    "train-step": ("train_step.json", train_step_table, "python -m flashtile.bench.train_step"),
    "train-step-padded": ("train_step_padded.json", train_step_table, "python -m flashtile.bench.train_step --padded"),
    "masks": ("masks.json", masks_table, "python -m flashtile.bench masks"),
    "sinks": ("sinks.json", sinks_table, "python -m flashtile.bench sinks"),
    "head-dims": ("head-dims.json", head_dims_table, "python -m flashtile.bench head_dims"),
    "forward-fp8": ("forward-fp8.json", fp8_forward_table,
                    "python -m flashtile.bench forward --set main --providers flashtile,flashtile_fp8,sdpa_cudnn"),
}


def measured(name: str) -> bool:
    """Whether the JSON of table ``name`` exists."""
    return (RESULTS / TABLES[name][0]).is_file()


def markdown_text(text: str) -> str:
    """Plain text for Markdown: a formula like 4*B*H*T*T*D must not turn into emphasis, and a placeholder
    like <case> must not turn into an HTML tag."""
    return text.replace("*", "\\*").replace("_", "\\_").replace("<", "&lt;")


def provenance_line(result: dict) -> str:
    p = result["provenance"]
    return (
        f"Measured on an {p['gpu']} with torch {p['torch']}, triton {p['triton']} and CUDA {p['cuda']} "
        f"at {p['date_utc']} (commit {p['commit']}); method: {markdown_text(p['method'])}."
    )


def render(name: str) -> str:
    """The block body for table ``name``: the table, a blank line, the provenance line (or "not yet measured")."""
    json_name, renderer, command = TABLES[name]
    if not measured(name):
        return f"*Not yet measured: `{command}` writes `bench/results/{json_name}`.*\n"
    result = load_result(json_name, RESULTS)
    return "\n".join(renderer(result)) + "\n\n" + provenance_line(result) + "\n"


# The ring chapter's table (bench/results/ring.json, written by ``python -m flashtile.bench ring``) has a
# provenance of its own (GPUs, NCCL, the ring's transfer rate), so its block has a marker of its own.
RING_BLOCK = re.compile(r"(<!-- ring-table -->\n)(?P<body>.*?)(<!-- /ring-table -->)", re.S)
RING_PAGE = DOCS / "part-c" / "ring-attention.md"


def ring_table(result: dict) -> str:
    """The chapter's table: one line per (T, causal, what was timed), times in ms, then the provenance.

    The speed-up comes first: on a phone only the first few columns are on screen."""
    rows = result["rows"]
    world = max(r["world_size"] for r in rows)
    several_H = len({r["H"] for r in rows}) > 1
    head = ["speed-up", *(["H"] if several_H else []), "T", "causal", "timed", "1 GPU ms", "ring 1 GPU ms",
            f"ring {world} GPUs ms", f"TFLOP/s ({world} GPUs)", "rel. error ×10³: o / dq / dk / dv"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_shape: dict = {}
    for r in rows:
        by_shape.setdefault((r["H"], r["Tq"], r["causal"], r["measures"]), {})[r["provider"], r["world_size"]] = r
    for (H, T, causal, measures), by in by_shape.items():
        wide = by["flashtile_ring", world]
        names = ("o", "dq", "dk", "dv") if measures == "forward_backward" else ("o",)
        errors = " / ".join(f"{1000 * wide['rel_err_vs_1gpu'][k]:.1f}" for k in names)
        T_name = f"{T // 1024}k" if T % 1024 == 0 else str(T)
        one_gpu, ring_one_gpu = by["flashtile", 1]["ms"], by["flashtile_ring", 1]["ms"]
        cells = [f"{wide['speedup_vs_1gpu']:.2f}x", *([H] if several_H else []), T_name, "yes" if causal else "no",
                 measures.replace("_", " + "), f"{one_gpu:.1f}", f"{ring_one_gpu:.1f}", f"{wide['ms']:.1f}",
                 f"{wide['tflops']:.0f}", errors]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    p = {k: v.replace("*", "\\*").replace("_", "\\_") if isinstance(v, str) else v
         for k, v in result["provenance"].items()}  # plain text in Markdown: * and _ are not emphasis
    lines += [
        "",
        f"Measured on {p['gpus']}x {p['gpu']} (NCCL {p['nccl']}, NVLink multicast off; ring transfer "
        f"{p['ring_GBps']:.0f} GB/s per direction) with torch {p['torch']}, triton {p['triton']}, CUDA {p['cuda']} "
        f"at {p['date_utc']} (commit {p['commit']}); B = {rows[0]['B']}, "
        + ("" if several_H else f"H = {rows[0]['H']}, ") + f"H\\_kv = H, D = {rows[0]['D']}, "
        f"{rows[0]['dtype']}. Method: {p['method']}.",
    ]
    return "\n".join(lines) + "\n"


def rewrite_ring(text: str) -> str:
    """``text`` with its ring table block, if it has one, rendered again from bench/results/ring.json."""
    if not RING_BLOCK.search(text):
        return text
    result = load_result("ring.json", RESULTS)
    return RING_BLOCK.sub(lambda m: m.group(1) + ring_table(result) + m.group(3), text)


def blocks(text: str) -> list[tuple[str, str]]:
    """(name, body) of every table block on a page."""
    return [(m.group("name"), m.group("body")) for m in BLOCK.finditer(text)]


def rewrite(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group("name")) + m.group(4), text)


def main() -> None:
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        names = [name for name, _ in blocks(text)] + (["ring"] if RING_BLOCK.search(text) else [])
        if names:
            page.write_text(rewrite_ring(rewrite(text)))
            print(f"rewrote {page.relative_to(DOCS.parent)}: {', '.join(names)}")


if __name__ == "__main__":
    main()

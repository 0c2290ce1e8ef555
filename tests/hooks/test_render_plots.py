"""The performance chapter's figures (``hooks/render_plots.py``): what they compute from the JSON, and that they
draw nothing else."""

from __future__ import annotations

from flashtile.bench import roofline
from tests._hooks import load_hook

render_plots = load_hook("render_plots")

CEILINGS = {"tflops": 800.0, "tbps": 4.0}


def row(provider, T, tflops=None, error=None, D=64, causal=False, B=4, H=16, **kw):
    base = {"pass": "forward", "provider": provider, "B": B, "H": H, "H_kv": kw.pop("H_kv", H), "Tq": T, "Tk": T,
            "D": D, "causal": causal, "layout": "bhtd", "dtype": "bf16", **kw}  # fmt: skip
    return dict(base, ms=None, tflops=None, error=error) if tflops is None else dict(base, ms=1.0, tflops=tflops)


def test_scaleup_series_keep_measured_points_and_mark_the_rest():
    rows = [row("naive", 1024, 100.0), row("naive", 256, 50.0), row("naive", 32768, error="OOM"),
            row("sdpa_math", 32768, error="skipped: fp32 scores 64 GiB > 8 GiB budget"), row("flashtile", 256, 200.0)]
    measured, missing = render_plots.scaleup_series(rows)
    assert measured == {"naive": [(256, 50.0), (1024, 100.0)], "flashtile": [(256, 200.0)]}
    assert missing == {"naive": [(32768, "OOM")], "sdpa_math": [(32768, "skip")]}


def test_ratio_series_divide_by_cudnn_in_the_same_cell_and_drop_cells_without_it():
    rows = [row("flashtile", 2048, 300.0, D=128, causal=True, B=8, H=16),
            row("sdpa_cudnn", 2048, 400.0, D=128, causal=True, B=8, H=16),
            row("flashtile", 4096, 350.0, D=128, causal=True, B=4, H=16),  # no cuDNN at this cell
            row("flashtile", 2048, 308.0, D=64, causal=True, B=8, H=16),  # the seed: not a sweep cell (H*D = 1024)
            row("sdpa_cudnn", 2048, 370.0, D=64, causal=True, B=8, H=16)]  # fmt: skip
    assert render_plots.ratio_series(rows) == {(128, True): {"flashtile": [(2048, 0.75)], "sdpa_cudnn": [(2048, 1.0)]}}


def test_roofline_points_put_naive_at_the_unfused_intensity():
    rows = [row("flashtile", 1024, 300.0), row("naive", 1024, 100.0), row("naive", 1024, 60.0, causal=True),
            row("naive", 2048, error="OOM"), row("naive", 1024, 90.0, H_kv=4)]  # fmt: skip
    points = render_plots.roofline_points(rows)
    assert points["flashtile"] == [(512.0, 300.0)]
    unfused = roofline.standard_attention_intensity(1024, 64)
    assert points["naive"] == [(unfused, 100.0), (unfused / 2, 60.0)]  # causal halves FLOPs, not traffic; GQA left out


def test_figures_draw_from_rows_and_say_when_nothing_is_measured():
    empty = render_plots.scaleup_svg(None)
    drawn = render_plots.scaleup_svg({"rows": [row("naive", 1024, 100.0), row("naive", 2048, error="OOM")]})
    assert empty.startswith("<?xml") and drawn.startswith("<?xml") and empty != drawn
    assert render_plots.ratio_svg(None).startswith("<?xml")
    assert render_plots.roofline_svg(CEILINGS, [None]).startswith("<?xml")
    assert render_plots.timeline_svg(None).startswith("<?xml")
    names = {"perf-scaleup.svg", "perf-ratio.svg", "perf-roofline.svg", "perf-timeline.svg"}
    assert set(render_plots.figures()) == names


def test_timeline_parts_take_the_package_medians_at_2k_without_a_mask_by_key_count():
    def clock_row(Tk, causal=False, version="package", Tq=2048, loop=30.0):
        return {"Tq": Tq, "Tk": Tk, "causal": causal, "version": version,
                "start_to_loop_end_us_p10_p50_p90": [loop - 1, loop, loop + 1],
                "epilogue_us_p10_p50_p90": [1.2, 1.4, 1.6], "gap_on_sm_us_p10_p50_p90": [0.3, 0.4, 0.5]}  # fmt: skip

    rows = [clock_row(4096, loop=60.0), clock_row(128, loop=4.5), clock_row(2048, causal=True),
            clock_row(2048, version="nocheck"), clock_row(512, Tq=512)]  # fmt: skip
    parts = render_plots.timeline_parts(rows)
    assert [Tk for Tk, _ in parts] == [128, 4096]
    assert parts[1][1] == {"start_to_loop_end": 60.0, "epilogue": 1.4, "gap_on_sm": 0.4}
    legacy = {key: value for key, value in clock_row(2048).items() if key != "version"}  # the first file's rows
    assert render_plots.timeline_parts([legacy])[0][0] == 2048

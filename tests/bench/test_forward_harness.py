"""The forward benchmark's logic on the CPU: shape sets, rows, checks, errors, progress, plan. No CUDA needed.

Providers are either fakes (a function of q, k, v) or the real ones that run on a CPU (flashtile in the
Triton interpreter, SDPA's math and flash backends, naive); timers are fakes that count their calls.
"""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch

from flashtile.bench import forward, overhead, progress, shapes
from flashtile.bench import providers as prov
from flashtile.bench.common import attention_flops, attention_tflops
from tests._truth import attention_truth

SCHEMA_FIELDS = ["pass", "provider", "B", "H", "H_kv", "Tq", "Tk", "D", "causal", "layout", "dtype", "ms", "tflops"]


class CountingTimer:
    """A timer that runs the function once and reports a fixed time; counts what it was asked to time."""

    def __init__(self, ms: float = 1.0):
        self.ms, self.calls = ms, 0

    def __call__(self, fn) -> float:
        self.calls += 1
        fn()
        return self.ms


def fake_build(table: dict):
    """A ``build`` for ``measure_provider``: provider name -> function of (q, k, v), or an exception to raise."""

    def build(name, shape, device, launch):
        made = table[name]
        if isinstance(made, BaseException):
            raise made
        return made

    return build


def small(causal=True, **kw) -> dict:
    return shapes.shape(kw.pop("B", 1), kw.pop("H", 4), kw.pop("T", 48), kw.pop("D", 16), causal,
                        dtype=kw.pop("dtype", "fp32"), **kw)  # fmt: skip


def inputs_and_truth(s: dict):
    q, k, v = prov.make_inputs(s, device="cpu")
    return q, k, v, prov.reference_output(q, k, v, s["causal"])


# ---- shape sets -----------------------------------------------------------------------------------


def test_the_standard_sweep_is_the_schemas_24_shapes():
    sweep = shapes.standard_sweep()
    assert len(sweep) == 24 and len({tuple(s.items()) for s in sweep}) == 24
    for s in sweep:
        assert s["B"] * s["Tq"] == 16384 and s["H"] * s["D"] == 2048
        assert s["Tq"] == s["Tk"] and s["H_kv"] == s["H"] and s["layout"] == "bhtd" and s["dtype"] == "bf16"
        assert shapes.is_standard(s)
    assert {s["Tq"] for s in sweep} == {512, 1024, 2048, 4096, 8192, 16384}
    assert {(s["D"], s["causal"]) for s in sweep} == {(64, True), (64, False), (128, True), (128, False)}


def test_the_sets_hold_the_seed_models_fp16_and_a_doubling_scaleup():
    main = shapes.SETS["main"][1]()
    assert main[0] == shapes.SEED == dict(B=8, H=16, H_kv=16, Tq=2048, Tk=2048, D=64, causal=True, layout="bhtd",
                                          dtype="bf16")  # fmt: skip
    assert not shapes.is_standard(shapes.SEED)  # H * D = 1024: the seed is its own row, not a sweep cell
    fp16 = shapes.SETS["fp16"][1]()
    assert len(fp16) == 12 and all(s["dtype"] == "fp16" and s["D"] == 128 and shapes.is_standard(s) for s in fp16)
    models = shapes.model_shapes()
    key = lambda s: (s["B"], s["H"], s["H_kv"], s["Tq"], s["D"], s["causal"], s["layout"])
    for B, H, H_kv, T, D in [(2, 16, 4, 2048, 64), (2, 16, 16, 2048, 64), (1, 32, 8, 8192, 128), (4, 32, 8, 4096, 128)]:
        assert {(B, H, H_kv, T, D, True, layout) for layout in ("bhtd", "bthd")} <= set(map(key, models))
    assert (1, 16, 16, 4096, 128, True, "bhtd") in set(map(key, models))  # small B * H
    scaleup = shapes.scaleup_shapes()
    assert [s["Tq"] for s in scaleup] == [256 * 2**k for k in range(8)]
    assert {(s["B"], s["H"], s["D"], s["causal"]) for s in scaleup} == {(8, 16, 64, True)}  # the lab's shape
    d256 = shapes.SETS["d256"][1]()  # issue 35's head-dim-256 shapes: 16,384 tokens, H = 8, T 2k-8k, both masks
    assert sorted((s["B"] * s["Tq"], s["H"], s["Tq"], s["D"], s["causal"]) for s in d256) == sorted(
        (16384, 8, T, 256, causal) for T in (2048, 4096, 8192) for causal in (False, True))


def test_a_shape_refuses_heads_that_do_not_group():
    with pytest.raises(ValueError, match="multiple of H_kv"):
        shapes.shape(1, 6, 128, 64, True, H_kv=4)


# ---- FLOPs and rows ------------------------------------------------------------------------------


def test_flops_read_tq_tk_and_the_older_t_alike():
    new = dict(B=2, H=4, Tq=256, Tk=256, D=64, causal=True)
    old = dict(B=2, H=4, T=256, D=64, causal=True)
    assert attention_flops(new) == attention_flops(old) == 4 * 2 * 4 * 256 * 256 * 64 / 2
    wide = dict(new, Tq=16, Tk=256, causal=False)
    assert attention_flops(wide) == 4 * 2 * 4 * 16 * 256 * 64
    assert attention_flops(wide, "fwd+bwd") == 3.5 * attention_flops(wide)


def test_causal_flops_are_refused_for_non_square_shapes():
    with pytest.raises(ValueError, match="Tq == Tk"):
        attention_flops(dict(B=1, H=1, Tq=16, Tk=256, D=64, causal=True))


def test_a_row_has_every_schema_field_and_its_tflops_from_the_time():
    s = shapes.SEED
    row = forward.schema_row(s, "flashtile", 0.22291234, max_abs_err_vs_fp32=0.004)
    assert list(row)[: len(SCHEMA_FIELDS)] == SCHEMA_FIELDS
    assert row["pass"] == "forward" and row["ms"] == 0.2229 and row["max_abs_err_vs_fp32"] == 0.004
    assert row["tflops"] == round(4 * 8 * 16 * 2048**2 * 64 * 0.5 / 0.22291234e-3 / 1e12, 1)
    assert forward.schema_row(s, "x", 0.000012345)["ms"] == 1.234e-05  # 4 significant digits however small


def test_a_row_without_a_time_says_why():
    row = forward.schema_row(shapes.SEED, "naive", error="OOM")
    assert row["ms"] is None and row["tflops"] is None and row["error"] == "OOM"
    assert list(row)[: len(SCHEMA_FIELDS)] == SCHEMA_FIELDS
    with pytest.raises(ValueError, match="must say why"):
        forward.schema_row(shapes.SEED, "naive")


def test_error_reasons_are_short():
    assert forward.error_reason(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64 GiB")) == "OOM"
    assert forward.error_reason(RuntimeError("first line\nsecond line")) == "first line"
    assert len(forward.error_reason(RuntimeError("x" * 1000))) == 160


# ---- inputs and the truth ------------------------------------------------------------------------


def test_bthd_inputs_are_transposed_views_and_k_v_have_h_kv_heads():
    s = small(H=4, H_kv=2, layout="bthd")
    q, k, v = prov.make_inputs(s, device="cpu")
    assert q.shape == (1, 4, 48, 16) and k.shape == v.shape == (1, 2, 48, 16)
    assert not q.is_contiguous() and q.transpose(1, 2).is_contiguous()  # (B, T, H, D) in memory
    assert q.stride() == (48 * 4 * 16, 16, 4 * 16, 1)
    q2, _, _ = prov.make_inputs(dict(s, layout="bhtd"), device="cpu")
    assert q2.is_contiguous()


@pytest.mark.parametrize("causal", [False, True])
def test_the_float32_truth_matches_float64_in_chunks_and_with_gqa(causal):
    s = small(causal, H=4, H_kv=2, T=37)
    q, k, v = prov.make_inputs(s, device="cpu")
    expected, _ = attention_truth(q.double(), k.double(), v.double(), causal=causal)
    for chunk in (2**28, 4 * 37):  # one block of rows, or a single row at a time
        out = prov.reference_output(q, k, v, causal, chunk_elements=chunk)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)


# ---- measuring one provider ----------------------------------------------------------------------


def test_a_right_answer_is_timed_and_gets_its_error():
    s = small()
    q, k, v, truth = inputs_and_truth(s)
    timer = CountingTimer(0.5)
    good = lambda q, k, v: prov.naive_attention(q, k, v, s["causal"])
    row = forward.measure_provider("naive", s, q, k, v, truth, timer=timer, device="cpu",
                                   build=fake_build({"naive": good}))  # fmt: skip
    assert timer.calls == 1 and row["ms"] == 0.5 and row["max_abs_err_vs_fp32"] < 1e-5
    assert row["tflops"] == round(attention_tflops(s, 0.5), 1)


@pytest.mark.parametrize("wrong", ["causal_mask_missing", "plus_0_1", "nan_row"])
def test_a_provider_that_disagrees_is_never_timed(wrong):
    s = small()
    q, k, v, truth = inputs_and_truth(s)
    fn = {
        "causal_mask_missing": lambda q, k, v: prov.naive_attention(q, k, v, False),
        "plus_0_1": lambda q, k, v: prov.naive_attention(q, k, v, True) + 0.1,
        "nan_row": lambda q, k, v: prov.naive_attention(q, k, v, True).index_fill(2, torch.tensor([5]), math.nan),
    }[wrong]
    timer = CountingTimer()
    with pytest.raises(prov.WrongAnswer, match="disagrees with the float32 truth"):
        forward.measure_provider("sdpa_flash", s, q, k, v, truth, timer=timer, device="cpu",
                                 build=fake_build({"sdpa_flash": fn}))  # fmt: skip
    assert timer.calls == 0


def test_a_wrong_output_within_the_absolute_tolerance_is_caught_by_the_relative_one():
    """No mask at T = 8192: every output is an average of 8192 values, so |o| is small and 1.3 o is off by little."""
    s = small(False, H=1, T=8192, D=16, dtype="bf16")
    q, k, v = (t.float() for t in prov.make_inputs(s, device="cpu"))
    truth = prov.reference_output(q, k, v, False, chunk_elements=2**24)
    wrong = truth * 1.3
    assert (wrong - truth).abs().max() < prov.TOLERANCE["bf16"][0]  # the absolute bound alone would pass it
    with pytest.raises(prov.WrongAnswer, match="relative"):
        prov.check_output("x", wrong, truth, "bf16")
    prov.check_output("x", truth.bfloat16(), truth, "bf16")  # control: bf16 rounding of the truth passes


def test_out_of_memory_becomes_a_row_and_the_run_goes_on():
    s = small()
    q, k, v, truth = inputs_and_truth(s)

    def oom_in_timing(fn):
        raise torch.OutOfMemoryError("CUDA out of memory")

    good = lambda q, k, v: prov.naive_attention(q, k, v, True)
    table = {"naive": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 GiB"), "sdpa_math": good}
    rows = [forward.measure_provider(name, s, q, k, v, truth, timer=CountingTimer(), device="cpu",
                                     build=fake_build(table)) for name in table]  # fmt: skip
    assert rows[0]["ms"] is None and rows[0]["error"] == "OOM" and rows[0]["tflops"] is None
    assert rows[1]["ms"] == 1.0  # the next provider runs
    late = forward.measure_provider("naive", s, q, k, v, truth, timer=oom_in_timing, device="cpu",
                                    build=fake_build({"naive": good}))  # fmt: skip
    assert late["ms"] is None and late["error"] == "OOM"


def test_a_backend_that_refuses_the_shape_becomes_a_row_with_its_reason():
    s = small()
    q, k, v, truth = inputs_and_truth(s)

    def refuses(q, k, v):
        warnings.warn("Flash attention requires q, k, v to have the same last dimension", UserWarning, stacklevel=1)
        raise RuntimeError("No available kernel. Aborting execution.")

    row = forward.measure_provider("sdpa_flash", s, q, k, v, truth, timer=CountingTimer(), device="cpu",
                                   build=fake_build({"sdpa_flash": refuses}))  # fmt: skip
    assert row["ms"] is None
    assert row["error"] == "No available kernel: Flash attention requires q, k, v to have the same last dimension"


def test_a_skipped_provider_says_so():
    big = shapes.shape(4, 16, 32768, 64, False)
    with pytest.raises(prov.Skip, match="GiB > 8 GiB"):
        prov.build("sdpa_math", big, device="cpu")
    assert prov.math_scores_bytes(big) == 4 * 4 * 16 * 32768**2
    assert callable(prov.build("sdpa_math", shapes.shape(4, 16, 4096, 64, False), device="cpu"))  # 4 GiB fits
    s = small()
    q, k, v, truth = inputs_and_truth(s)
    row = forward.measure_provider("sdpa_math", s, q, k, v, truth, timer=CountingTimer(), device="cpu",
                                   build=fake_build({"sdpa_math": prov.Skip("skipped: too big")}))  # fmt: skip
    assert row["ms"] is None and row["error"] == "skipped: too big"


def test_a_flashtile_error_stops_the_run():
    s = small()
    q, k, v, truth = inputs_and_truth(s)
    for name in ("flashtile", "flashtile_split_k"):
        with pytest.raises(ValueError, match="a bug"):
            forward.measure_provider(name, s, q, k, v, truth, timer=CountingTimer(), device="cpu",
                                     build=fake_build({name: ValueError("a bug")}))  # fmt: skip
    row = forward.measure_provider("naive", s, q, k, v, truth, timer=CountingTimer(), device="cpu",
                                   build=fake_build({"naive": ValueError("a bug")}))  # fmt: skip
    assert row["error"] == "a bug"  # control: another provider's error is a row


def test_an_unknown_provider_is_refused():
    with pytest.raises(ValueError, match="unknown provider"):
        prov.build("sdpa_fast", small(), device="cpu")


def test_the_real_providers_that_run_on_a_cpu_agree_and_the_others_become_rows():
    """flashtile (Triton interpreter), SDPA math and flash, naive; cuDNN and efficient refuse on a CPU."""
    s = small(True, H=4, H_kv=2, T=40, D=16, layout="bthd", dtype="fp16")
    names = ["flashtile", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math", "naive"]
    timer = CountingTimer()
    rows = forward.measure(s, names, timer=timer, device="cpu")
    by = {r["provider"]: r for r in rows}
    assert list(by) == names and all(list(r)[: len(SCHEMA_FIELDS)] == SCHEMA_FIELDS for r in rows)
    for name in ("flashtile", "sdpa_math", "naive"):
        assert by[name]["ms"] == 1.0 and by[name]["max_abs_err_vs_fp32"] < prov.TOLERANCE["fp16"][0]
    for name in ("sdpa_cudnn", "sdpa_efficient"):
        assert by[name]["ms"] is None and by[name]["error"]
    assert timer.calls == sum(r["ms"] is not None for r in rows)
    assert all(r["layout"] == "bthd" and r["H_kv"] == 2 for r in rows)


def test_a_launch_config_reaches_flashtile_and_its_rows():
    s = small(False, H=2, T=40, D=16)
    rows = forward.measure(s, ["flashtile"], timer=CountingTimer(), device="cpu",
                           launch=dict(block_q=16, block_k=32, num_warps=4, num_stages=2))  # fmt: skip
    assert {k: rows[0][k] for k in forward.LAUNCH_KEYS} == dict(block_q=16, block_k=32, num_warps=4, num_stages=2)


def test_run_saves_rows_with_provenance_and_shows_progress(tmp_path, monkeypatch):
    from flashtile.bench import common

    monkeypatch.setattr(common, "provenance", lambda method: {"gpu": "test", "method": method})
    stream = io.StringIO()
    sets = [small(True, T=32), small(False, T=32)]
    result = forward.run(sets, ["naive", "sdpa_math"], tmp_path / "f.json", timer=CountingTimer(), device="cpu",
                         stream=stream, set="test")  # fmt: skip
    assert result["set"] == "test" and result["providers"] == ["naive", "sdpa_math"] and len(result["rows"]) == 4
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4 and lines[0].startswith("[1/4] ") and "sdpa_math B=1 H=4 T=32 D=16 full fp32" in lines[3]
    assert (tmp_path / "f.json").is_file()


# ---- progress ------------------------------------------------------------------------------------


def test_the_progress_line_counts_fills_and_estimates():
    line = progress.progress_line(12, 180, "flashtile D=128 T=4096 causal", elapsed_s=110.0)
    # 11 done in 110 s: 10 s each, 169 to go; 16 * 11 // 180 = 0 of the bar's 16 marks filled
    assert line == "[ 12/180] ---------------- flashtile D=128 T=4096 causal  1:50, ~28:10 left"
    assert progress.progress_line(1, 3, "x", elapsed_s=0.0) == "[1/3] ---------------- x"  # nothing done: no estimate
    assert progress.progress_line(3, 3, "x") == "[3/3] ##########------ x"
    assert progress.clock(3725) == "1:02:05"
    with pytest.raises(ValueError):
        progress.progress_line(4, 3, "x")


def test_progress_writes_one_line_per_step_into_a_log_and_redraws_on_a_terminal():
    ticks = iter([0.0, 5.0, 10.0])
    log = io.StringIO()
    bar = progress.Progress(2, stream=log, now=lambda: next(ticks))
    bar.step("a")
    bar.step("b")
    bar.close()
    assert log.getvalue() == "[1/2] ---------------- a\n[2/2] ########-------- b  0:10, ~0:10 left\n"

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty = Terminal()
    bar = progress.Progress(1, stream=tty, now=lambda: 0.0)
    bar.step("a")
    bar.close()
    assert tty.getvalue() == "\r\033[K[1/1] ---------------- a\n"


# ---- the command line ----------------------------------------------------------------------------


def test_dry_run_prints_the_plan_without_a_gpu(capsys):
    forward.main(["--dry-run"])
    out = capsys.readouterr().out
    assert "main: 25 shapes x 8 providers = 200 measurements" in out
    assert "fp16: 12 shapes" in out and "models: 10 shapes" in out and "scaleup: 8 shapes" in out
    assert "d256: 6 shapes" in out
    forward.main(["--dry-run", "--set", "scaleup", "--providers", "flashtile,naive", "--config", "128,64,8,3"])
    out = capsys.readouterr().out
    assert "8 shapes x 2 providers" in out and "sweeps/forward-config-128-64-8-3-scaleup.json" in out


def test_the_command_line_rejects_what_it_cannot_do(capsys):
    with pytest.raises(SystemExit):
        forward.main(["--dry-run", "--providers", "sdpa_fast"])
    with pytest.raises(SystemExit):
        forward.main(["--dry-run", "--config", "128,64,8"])
    with pytest.raises(SystemExit, match="exactly one --set"):
        forward.main(["--dry-run", "--out", "x.json"])
    forward.main(["--dry-run", "--set", "models", "--out", "x.json"])  # control: one set may take --out
    assert "-> x.json" in capsys.readouterr().out


def test_estimates_grow_with_shapes_providers_and_flex():
    assert forward.estimate_seconds(10, ["flashtile"]) == 10 * (0.5 + 1.0)
    assert forward.estimate_seconds(10, ["flashtile", "flex"]) == 10 * (2 * 0.5 + 10.0 + 1.0)


# ---- the host overhead probe ---------------------------------------------------------------------


def test_us_per_call_is_the_median_loop_time_per_call():
    ticks = iter([0.0, 0.001, 10.0, 10.004, 20.0, 20.002])  # loops of 1 ms, 4 ms and 2 ms for 10 calls each
    count = []
    us = overhead.us_per_call(lambda: count.append(1), calls=10, repeats=3, warmup=2, sync=lambda: None,
                              clock=lambda: next(ticks))  # fmt: skip
    assert us == pytest.approx(200.0) and len(count) == 2 + 3 * 10


def test_overhead_rows_on_a_cpu_have_the_schema_fields_mode_and_time():
    s = shapes.shape(1, 1, 128, 64, True, dtype="fp16")
    rows = overhead.measure(s, device="cpu", calls={"fwd": 1, "fwd+bwd": 1}, repeats=1, warmup=0,
                            sync=lambda: None)  # fmt: skip
    assert [(r["provider"], r["mode"], r["pass"]) for r in rows] == [
        ("flashtile", "fwd", "forward"), ("flashtile", "fwd+bwd", "backward"),
        ("flashtile_launcher", "fwd", "forward"), ("sdpa", "fwd", "forward"), ("sdpa", "fwd+bwd", "backward"),
    ]  # fmt: skip
    for r in rows:
        assert list(r)[: len(SCHEMA_FIELDS)] == SCHEMA_FIELDS and r["us_per_call"] > 0
        assert r["ms"] == pytest.approx(r["us_per_call"] / 1e3, rel=1e-3)
    assert overhead.SHAPE == shapes.shape(1, 1, 128, 64, True)

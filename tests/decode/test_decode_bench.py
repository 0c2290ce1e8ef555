"""The decode benchmark module runs end to end on the CPU at a tiny shape (timing faked), so that the
first GPU session spends its time measuring, not debugging: rows follow BENCH_SCHEMA.md, paged and
contiguous inputs agree, a backend that cannot run is recorded as a row with ``ms: null``."""

from __future__ import annotations

import pytest
import torch

from flashtile._env import is_interpreting

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not is_interpreting(), reason="a CPU-only dry run")

REQUIRED = {"pass", "provider", "B", "H", "H_kv", "Tq", "Tk", "D", "causal", "layout", "dtype", "ms"}


def test_paged_inputs_hold_the_contiguous_cache_page_by_page():
    from flashtile.bench.decode import paged

    k, v = torch.randn(2, 3, 64, 8), torch.randn(2, 3, 64, 8)
    k_pages, v_pages, table = paged(k, v, 16)
    assert sorted(table.flatten().tolist()) == list(range(8))
    for b in range(2):
        for j in range(4):
            assert torch.equal(k_pages[table[b, j]], k[b, :, j * 16 : (j + 1) * 16])
            assert torch.equal(v_pages[table[b, j]], v[b, :, j * 16 : (j + 1) * 16])


@pytest.mark.parametrize("extra", [{}, {"page_size": 16}, {"ragged": True}], ids=["contiguous", "paged", "ragged"])
def test_measure_writes_schema_rows(monkeypatch, extra):
    from flashtile.bench import decode

    monkeypatch.setattr(decode, "clean_l2_ms", lambda fn: (fn(), 1e-6)[1])  # one call, a fixed 1 ns
    monkeypatch.setattr(decode, "graph_ms", lambda fn, timer: (fn(), 2e-6)[1])  # no CUDA graphs on the CPU: 2 ns
    shape = dict(B=2, H=4, H_kv=2, Tk=64, D=16, **extra)
    rows = decode.measure(shape, device="cpu", dtype=torch.float32)
    providers = [row["provider"] for row in rows]
    assert providers[0] == "flashtile_split_k" and all(p.startswith(("flashtile", "sdpa_")) for p in providers)
    for row in rows:
        assert REQUIRED <= set(row) and row["pass"] == "decode" and row["dtype"] == "fp32"
    ours = rows[0]
    assert ours["max_abs_diff_vs_sdpa"] < 1e-4
    if not extra.get("ragged"):  # 2 caches x 2 KV heads x 128 keys x 16 dims x 4 bytes, in 1 ns
        assert ours["tbps"] == round(2 * 2 * 128 * 16 * 4 / 1e-9 / 1e12, 3) == 32.768
        assert ours["tbps_graph"] == 16.384
    for row in rows:  # a backend that cannot run here (cuDNN on the CPU) is recorded, not raised
        assert (row["ms"] is None and row["tbps"] is None and row["error"]) or row["tbps"] > 0


def test_run_takes_every_eager_time_before_the_first_graph(monkeypatch):
    from flashtile.bench import decode

    calls = []

    def fake_measure(shape, clock):
        calls.append((shape["Tk"], clock))
        row = {"provider": "flashtile_split_k", "Tk": shape["Tk"]}
        return [dict(row, ms=1.0) if clock == "eager" else dict(row, ms_graph=0.5, tbps_graph=2.0)]

    monkeypatch.setattr(decode, "measure", fake_measure)
    monkeypatch.setattr(decode, "copy_rate", lambda: {})
    monkeypatch.setattr(decode, "save_result", lambda out, rows, method, **extra: rows)
    rows = decode.run("unused.json")
    shapes = len(decode.HEADLINE)
    assert [clock for _, clock in calls] == ["eager"] * shapes + ["graph"] * shapes
    assert all(row["ms"] == 1.0 and row["ms_graph"] == 0.5 and row["tbps_graph"] == 2.0 for row in rows)


def test_streaming_fit_recovers_a_known_rate_and_fixed_cost():
    """Rows made from t = t0 + bytes / R with R = 4 TB/s and t0 = 12 µs (the bytes written out by hand:
    2 * H_kv * T * D * 2), plus rows the fit must ignore: another provider, a paged cache, another B."""
    from flashtile.bench.decode import streaming_fit

    def row(T, us, **extra):
        return dict(provider="flashtile_split_k", B=1, H_kv=8, Tk=T, D=128, ms_graph=us / 1000, **extra)

    mb = {T: 2 * 8 * T * 128 * 2 / 1e6 for T in (32768, 131072)}  # 134.2 and 536.9 MB
    rows = [row(T, 12 + mb[T] / 4) for T in mb]
    rows += [dict(row(32768, 999.0), provider="sdpa_cudnn"), row(32768, 999.0, page_size=16),
             dict(row(131072, 999.0), B=8)]  # fmt: skip
    R, t0 = streaming_fit(rows, "flashtile_split_k", H_kv=8)
    assert R == pytest.approx(4.0) and t0 == pytest.approx(12.0)


def test_the_decode_host_time_rows_run_on_the_cpu():
    from flashtile.bench.overhead import DECODE_SHAPE, measure_decode

    small = dict(DECODE_SHAPE, H=4, H_kv=2, Tk=40, D=16, dtype="fp32")
    rows = measure_decode(small, device="cpu", dtype=torch.float32, calls=2, repeats=1, warmup=1, sync=lambda: None)
    assert [r["provider"] for r in rows] == ["flashtile_decode", "flashtile_decode_launcher", "flashtile", "sdpa"]
    for row in rows:
        assert REQUIRED <= set(row) and row["pass"] == "decode" and row["us_per_call"] > 0


def test_windowed_rows_count_the_windows_bytes_and_agree_with_sdpa_on_the_window(monkeypatch):
    from flashtile.bench import decode

    monkeypatch.setattr(decode, "clean_l2_ms", lambda fn: (fn(), 1e-6)[1])
    monkeypatch.setattr(decode, "graph_ms", lambda fn, timer: (fn(), 2e-6)[1])
    rows = decode.measure(dict(B=1, H=4, H_kv=2, Tk=64, D=16, window=16), device="cpu", dtype=torch.float32)
    by = {row["provider"]: row for row in rows}
    assert {"flashtile_split_k", "flashtile_attention"} <= set(by) and by["flashtile_split_k"]["window"] == 16
    for name in ("flashtile_split_k", "flashtile_attention"):
        assert by[name]["max_abs_diff_vs_sdpa"] < 1e-4
        assert by[name]["tbps"] == round(2 * 2 * 16 * 16 * 4 / 1e-9 / 1e12, 3)  # 16 keys of 2 KV heads, K and V

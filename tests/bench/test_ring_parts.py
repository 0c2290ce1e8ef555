"""The ring's parts (``python -m flashtile.bench ring_parts``), run for real on two gloo processes with a tiny
sequence: it must write a row in the benchmark schema for every part, and the step-1 plan it reports must be
rank 0's."""

import json

import pytest

from flashtile.bench import __main__ as cli

PARTS = {"1gpu_full", "ring", "ring_nocheck", "step0_kernel", "step1_kernel", "merge", "exchange_kv",
         "step0_with_exchange", "check_shards"}  # fmt: skip


def test_cpu_smoke_writes_one_schema_row_per_part(tmp_path):
    out = tmp_path / "parts.json"
    cli.main(["ring_parts", "--out", str(out), "--cpu-smoke", "--H", "2", "--T", "16", "--D", "8", "--reps", "1"])
    result = json.loads(out.read_text())
    assert result["provenance"]["cpu_smoke"] is True and "flashtile.bench ring_parts" in result["provenance"]["method"]
    rows = result["rows"]
    for causal in (True, False):
        mine = {r["measures"].removeprefix("forward:"): r for r in rows if r["causal"] is causal}
        assert set(mine) == PARTS
        for name, r in mine.items():
            assert r["pass"] == "ring" and (r["B"], r["H"], r["Tq"], r["Tk"], r["D"]) == (1, 2, 16, 16, 8)
            assert r["ms"] > 0 and r["dtype"] == "fp32"
            assert (r["tflops"] is None) == (name in {"merge", "exchange_kv", "check_shards"})
        # rank 0's visitor: with zig-zag shards only the second half of its rows sees the visiting keys
        assert (mine["step1_kernel"]["step1_query_rows"], mine["step1_kernel"]["step1_key_rows"]) == (
            (4, 8) if causal else (8, 8)
        )
        speedup = mine["1gpu_full"]["ms"] / mine["ring"]["ms"]  # the row rounds it to 3 places
        assert mine["ring"]["speedup_vs_1gpu"] == pytest.approx(speedup, rel=1e-2, abs=1e-3)


def test_t_that_zigzag_cannot_split_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["ring_parts", "--out", str(tmp_path / "x.json"), "--cpu-smoke", "--T", "18"])

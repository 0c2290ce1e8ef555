"""The sinks and head-dims tables on the CPU: their truths against float64 formulas written here, and a
whole case run end to end with a stub clock (the GPU run times it), rows checked against the schema."""

import math

import pytest
import torch

from flashtile.bench import head_dims, rounds, sinks


def sink_column_f64(q, k, v, sink_values, L):
    """o of every row from the float64 softmax over its visible keys plus the sink, by explicit loops."""
    B, H, T, D = q.shape
    group = H // k.shape[1]
    out = torch.zeros(B, H, T, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                keys = [j for j in range(T) if j <= i and (L is None or i - j <= L)]
                scores = [float(q[b, h, i].double() @ k[b, h // group, j].double()) / math.sqrt(D) for j in keys]
                top = max(scores + [float(sink_values[h])])
                weights = [math.exp(x - top) for x in scores]
                total = sum(weights) + math.exp(float(sink_values[h]) - top)
                for w, j in zip(weights, keys):
                    out[b, h, i] += w / total * v[b, h // group, j].double()
    return out


@pytest.mark.parametrize("window", [None, (2, 0)])
def test_sink_truth_and_eager_match_float64(window):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 7, 8, generator=g) for n in (4, 2, 2))
    s = torch.randn(4, generator=g) * 2
    want = sink_column_f64(q, k, v, s, None if window is None else window[0])
    assert torch.allclose(sinks.sink_truth(q, k, v, s, window).double(), want, atol=1e-5)
    assert torch.allclose(sinks.eager_with_sinks(window)(q, k, v, s).double(), want, atol=1e-5)


def test_head_dims_truth_matches_float64():
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 2, 6, 12, generator=g) for _ in range(2))
    v = torch.randn(1, 2, 6, 5, generator=g)
    want = sink_column_f64(q, k, v, torch.full((2,), -math.inf), None)
    assert torch.allclose(head_dims.causal_truth(q, k, v).double(), want, atol=1e-5)


def stub_clock(monkeypatch):
    calls = []

    def once(fn, **_):  # run the timed function once, as the clock would, and say 1 ms
        fn()
        calls.append(1)
        return 1.0

    monkeypatch.setattr(rounds, "median_ms", once)
    return calls


def check_rows(rows, passes=("forward", "backward")):
    for row in rows:
        assert row["pass"] in passes
        for key in ("provider", "B", "H", "H_kv", "Tq", "Tk", "D", "causal", "layout", "dtype", "ms", "tflops"):
            assert key in row, (key, row)
        assert (row["ms"] is None) == ("error" in row), row


def test_sinks_case_runs_end_to_end(monkeypatch):
    calls = stub_clock(monkeypatch)
    monkeypatch.setattr(sinks, "CASES", {"tiny": (1, 16, (3, 0))})
    monkeypatch.setattr(sinks, "HEADS", 4)
    monkeypatch.setattr(sinks, "KV_HEADS", 2)
    monkeypatch.setattr(sinks, "HEAD_DIM", 8)
    # no compiled Flex with return_lse on the CPU: flex_attention itself, uncompiled, in its place; it has
    # no backward on the CPU, so its rows say so, after its forward passed the check against the truth
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def flex_uncompiled(T, window, device, rescale=True):
        L = window[0]
        band = create_block_mask(lambda b, h, qi, ki: (ki <= qi) & (qi - ki <= L), None, None, T, T, device=device)

        def attend(q, k, v, s):
            o, lse = flex_attention(q, k, v, block_mask=band, enable_gqa=True, return_lse=True)
            return o * torch.sigmoid(lse - s.float()[None, :, None]).unsqueeze(-1).to(o.dtype)

        return attend if rescale else lambda q, k, v: flex_attention(q, k, v, block_mask=band, enable_gqa=True)

    monkeypatch.setattr(sinks, "flex_with_sinks", flex_uncompiled)
    monkeypatch.setattr(sinks, "make_inputs", make_f32)
    rows = sinks.measure_case("tiny", rounds=2, device="cpu")
    check_rows(rows)
    assert {(r["provider"], r["sinks"]) for r in rows} == {("flashtile", False), ("flashtile", True), ("flex", False),
                                                            ("flex", True), ("naive", True)}  # fmt: skip
    timed = [r for r in rows if r["provider"] != "flex"]
    assert all(r["ms"] == 1.0 and len(r["rounds_ms"]) == 2 for r in timed)
    assert all("does not support backward on CPU" in r["error"] for r in rows if r["provider"] == "flex")
    assert len(calls) == 3 * 2 * 2 + 2  # three providers forward and backward in two rounds, flex's forwards once
    assert all(r["mask"] == "window:3,0" for r in rows)


def make_f32(s, device, seed=0):
    """The bench's inputs in float32: the CPU has no bf16 worth timing, and the checks get tighter."""
    from flashtile.bench.providers import make_inputs

    return make_inputs(dict(s, dtype="fp32"), device, seed)


def test_head_dims_case_runs_end_to_end(monkeypatch):
    stub_clock(monkeypatch)
    monkeypatch.setattr(head_dims, "CASES", {"tiny": (1, 16, 12, 8)})
    monkeypatch.setattr(head_dims, "HEADS", 2)
    monkeypatch.setattr(head_dims, "make_inputs", make_f32)
    rows = head_dims.measure_case("tiny", rounds=1, device="cpu")
    check_rows(rows)
    by = {(r["provider"], r["pass"]): r for r in rows}
    assert by[("flashtile", "forward")]["ms"] == 1.0 and by[("flashtile_padded", "backward")]["ms"] == 1.0
    assert all(r["D"] == 12 and r["D_v"] == 8 for r in rows)

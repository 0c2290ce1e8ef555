"""The mask table's truth and FLOP count, on the CPU: what ``python -m flashtile.bench masks`` checks and divides by."""

import pytest
import torch

from flashtile.bench import masks
from tests._truth import definition_mask, masked_truth


def test_window_truth_is_the_definitions_softmax_under_the_causal_window():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 70, 16, generator=gen) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # GQA: two query heads per key/value head
    for W in (1, 9, 100):
        keep = definition_mask(70, 70, (W - 1, 0), True, "upper_left")
        expected, _ = masked_truth(q.double(), k.double(), v.double(), keep)
        torch.testing.assert_close(masks.window_truth(q, k, v, W, rows=16).double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("provider", ["flashtile", "sdpa_cudnn"])
def test_rows_count_the_flops_of_the_pairs_their_mask_keeps(provider):
    s = dict(B=1, H=2, H_kv=2, Tq=50, Tk=50, D=8, causal=True, layout="bhtd", dtype="bf16")
    window = (9, 0) if provider == "flashtile" else None  # the window's providers, and full causal
    kept = int(definition_mask(50, 50, window, True, "upper_left").sum())
    fwd, bwd = (masks.row(s, provider, 10, which, ms=1.0) for which in ("forward", "backward"))
    assert fwd["mask"] == ("window:9,0" if window else "causal")
    assert fwd["tflops"] == round(4 * 2 * 8 * kept / 1e-3 / 1e12, 1)
    assert bwd["tflops"] == round(2.5 * 4 * 2 * 8 * kept / 1e-3 / 1e12, 1)


def fake_timer(fn, **kwargs) -> float:
    """``median_ms`` on the CPU: one call, and 2 ms whatever it took."""
    fn()
    return 2.0


def loop_case(W=5, T=24):
    """A small float32 window case for ``measure_case``: shape, (q, k, v, do) and the float64 truth under the window."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, 2, T, 8, generator=gen) for _ in range(4))
    s = dict(B=1, H=2, H_kv=2, Tq=T, Tk=T, D=8, causal=True, layout="bhtd", dtype="fp32")
    truth, _ = masked_truth(q.double(), k.double(), v.double(), definition_mask(T, T, (W - 1, 0), True, "upper_left"))
    return s, (q, k, v, do), truth.float()


def loop_provider(name, W=5, T=24):
    """The CPU's stand-ins: flashtile's reference tier, the window as a boolean SDPA mask for flex, and an SDPA
    backend that is missing."""
    import flashtile

    if name == "flashtile":
        return lambda q, k, v: flashtile.attention(q, k, v, is_causal=True, window=(W - 1, 0))
    if name == "flex":
        keep = definition_mask(T, T, (W - 1, 0), True, "upper_left")
        return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    if name == "flashtile_causal":
        return lambda q, k, v: flashtile.attention(q, k, v, is_causal=True)

    def missing(q, k, v):
        raise RuntimeError("No viable backend for scaled_dot_product_attention was found. more")

    return missing


def test_the_measuring_loop_checks_times_and_compares_every_provider(monkeypatch, capsys):
    from flashtile.api import use_backend

    monkeypatch.setattr(masks, "median_ms", fake_timer)
    s, inputs, truth = loop_case()
    row_of = lambda name, which, ms=None, error=None, **extra: masks.row(s, name, 5, which, ms, error, **extra)
    with use_backend("reference"):
        rows = masks.measure_case(masks.PROVIDERS, loop_provider, row_of, s, inputs, truth, "W=5 toy")
    passes = [(n, p) for n in masks.PROVIDERS for p in ("forward", "backward")]
    assert [(r["provider"], r["pass"]) for r in rows] == passes
    by = {(r["provider"], r["pass"]): r for r in rows}
    for name in ("flashtile", "flex", "flashtile_causal"):
        assert by[name, "forward"]["ms"] == 2.0 and by[name, "forward"]["max_abs_error_vs_fp32"] < 1e-5
        assert by[name, "backward"]["ms"] == 2.0
    assert by["flashtile", "forward"]["mask"] == "window:4,0" and by["flashtile_causal", "forward"]["mask"] == "causal"
    assert by["flashtile", "backward"]["max_abs_grad_diff_vs_flex"] < 1e-5
    assert by["flex", "backward"]["max_abs_grad_diff_vs_flashtile"] < 1e-5
    assert "max_abs_grad_diff_vs_sdpa_cudnn" not in by["flashtile_causal", "backward"]  # its partner has no gradients
    for which in ("forward", "backward"):  # a provider that cannot run is a row with its reason, not a crash
        assert by["sdpa_cudnn", which]["ms"] is None
        assert by["sdpa_cudnn", which]["error"] == "No viable backend for scaled_dot_product_attention was found"
    assert "flashtile_causal backward W=5 toy 2.000 ms" in capsys.readouterr().err


def test_the_measuring_loop_never_times_a_wrong_answer_and_never_hides_a_flashtile_error(monkeypatch):
    from flashtile.bench.providers import WrongAnswer

    monkeypatch.setattr(masks, "median_ms", fake_timer)
    s, inputs, truth = loop_case()
    row_of = lambda name, which, ms=None, error=None, **extra: masks.row(s, name, 5, which, ms, error, **extra)
    wrong = lambda name: lambda q, k, v: torch.zeros_like(q)
    with pytest.raises(WrongAnswer, match="flex disagrees"):
        masks.measure_case(["flex"], wrong, row_of, s, inputs, truth, "W=5 toy")
    with pytest.raises(RuntimeError, match="No viable backend"):  # flashtile's own failures are never a row
        masks.measure_case(["flashtile"], lambda name: loop_provider("sdpa_cudnn"), row_of, s, inputs, truth, "toy")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_the_mask_table_needs_cuda(tmp_path):
    with pytest.raises(SystemExit, match="need a CUDA device"):
        masks.main(["--out", str(tmp_path / "x.json")])


# --- the packed documents' rows ---------------------------------------------------------------------------


def test_document_lengths_are_the_issues_case_and_fixed_by_the_seed():
    lengths = masks.document_lengths()
    assert len(lengths) == 8 and sum(lengths) == 16384 and all(512 <= n <= 4096 for n in lengths)
    assert masks.document_lengths() == lengths and masks.document_lengths(seed=1) != lengths
    assert masks.cu_seqlens([3, 0, 5]).tolist() == [0, 3, 3, 8]


def test_documents_truth_is_causal_attention_within_each_document():
    from tests._varlen_truth import packed_keep

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen) for _ in range(3))
    lengths = [7, 21, 12]
    cu = masks.cu_seqlens(lengths)
    expected, _ = masked_truth(q.double(), k.double(), v.double(), packed_keep(cu, cu, causal=True))
    torch.testing.assert_close(masks.documents_truth(q, k, v, lengths).double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("provider", ["flashtile", "flex", "sdpa_cudnn"])
def test_document_rows_count_the_flops_of_the_pairs_their_mask_keeps(provider):
    lengths = [10, 25, 15]
    s = dict(B=1, H=2, H_kv=2, Tq=50, Tk=50, D=8, causal=True, layout="bhtd", dtype="bf16")
    documents = provider != "sdpa_cudnn"
    kept = sum(n * (n + 1) // 2 for n in lengths) if documents else int(definition_mask(50, 50, None, True,
                                                                                        "upper_left").sum())
    fwd, bwd = (masks.documents_row(s, provider, lengths, which, ms=1.0) for which in ("forward", "backward"))
    assert fwd["mask"] == ("documents:3" if documents else "causal") and fwd["case"] == "documents:3"
    assert fwd["tflops"] == round(4 * 2 * 8 * kept / 1e-3 / 1e12, 1)
    assert bwd["tflops"] == round(2.5 * 4 * 2 * 8 * kept / 1e-3 / 1e12, 1)


def test_the_table_keeps_a_16k_window_and_16k_documents_apart():
    from tests._hooks import load_hook

    render_tables = load_hook("render_tables")

    s = dict(B=1, H=16, H_kv=16, Tq=16384, Tk=16384, D=128, causal=True, layout="bhtd", dtype="bf16")
    rows = []
    for name, ms in (("flashtile", 1.0), ("flex", 1.5), ("sdpa_cudnn", 4.0)):
        rows += [masks.row(s, name, 1024, "forward", ms), masks.documents_row(s, name, [8192, 8192], "forward", ms / 2)]
    lines = render_tables.masks_table({"rows": rows})
    body = lines[2:]
    assert len(body) == 2
    assert "| window 1023,0 |" in body[0] and "| documents 2 |" in body[1]
    assert body[0].startswith("| 1.50 |") and body[1].startswith("| 1.50 |")

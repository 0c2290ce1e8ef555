"""The benchmark package imports on a CPU machine and refuses clearly to run without CUDA."""

import pytest
import torch

from flashtile.bench import __main__ as cli
from flashtile.bench.common import attention_tflops


def test_tflops_follow_the_anchor_convention():
    shape = dict(B=8, H=16, T=2048, D=64, causal=True)
    flops = 4 * 8 * 16 * 2048 * 2048 * 64 * 0.5
    assert attention_tflops(shape, 1.0) == pytest.approx(flops / 1e-3 / 1e12)
    assert attention_tflops(shape, 1.0, "bwd") == pytest.approx(2.5 * flops / 1e-3 / 1e12)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
@pytest.mark.parametrize("table", ["forward", "overhead", "backward", "softmax", "decode", "train_step"])
def test_each_table_needs_cuda(table, tmp_path):
    with pytest.raises(SystemExit, match="need a CUDA device"):
        cli.main([table, "--out", str(tmp_path / "x.json")])


def test_help_lists_every_table_with_its_first_docstring_line(capsys):
    cli.main(["--help"])
    out = capsys.readouterr().out
    for name, module in cli.NAMES.items():
        assert f"  {name}" in out and module.__doc__.splitlines()[0] in out
    assert set(cli.NAMES) == {*cli.TABLES, "ring", "ring_parts"}  # the ring's two by name only


def test_unknown_table_name_is_rejected():
    with pytest.raises(SystemExit, match="usage: python -m flashtile.bench"):
        cli.main(["sideways"])


def test_save_result_writes_provenance_extra_keys_and_rows(tmp_path, monkeypatch):
    import json

    from flashtile.bench import common

    monkeypatch.setattr(common, "provenance", lambda method: {"gpu": "test", "method": method})
    out = tmp_path / "r.json"
    result = common.save_result(str(out), [{"provider": "x", "ms": 1.5}], "m1", main_shape={"T": 4})
    assert json.loads(out.read_text()) == result
    assert result == {"provenance": {"gpu": "test", "method": "m1"}, "main_shape": {"T": 4},
                      "rows": [{"provider": "x", "ms": 1.5}]}

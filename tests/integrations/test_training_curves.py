"""The training-curves helper of the "In a real model" chapter: the curves it compares and the figure it draws."""

import xml.etree.ElementTree as ET

import pytest

from flashtile.integrations.training_curves import TINY_LLAMA, training_curves, training_curves_svg

transformers = pytest.importorskip("transformers")


def test_eager_and_sdpa_curves_agree_and_fall_so_the_comparison_can_tell_implementations_apart():
    # The truth here is transformers' own eager attention, not flashtile: the helper must train the same
    # model on the same batches for each implementation, or two correct attentions would disagree.
    config = transformers.LlamaConfig(**TINY_LLAMA)
    curves = training_curves(config, ("eager", "sdpa"), steps=4)
    assert max(abs(a - b) for a, b in zip(curves["eager"], curves["sdpa"])) < 1e-4
    assert curves["eager"][-1] < curves["eager"][0]
    shorter = training_curves(config, ("eager",), steps=2)["eager"]
    assert shorter == curves["eager"][:2]  # the same start and batches on every call


def test_the_figure_is_an_svg_with_one_labelled_line_per_implementation():
    svg = training_curves_svg({"ftile": [4.0, 3.0, 2.5], "sdpa": [4.0, 3.1, 2.4]}, {"ftile": "flashtile"})
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    assert "flashtile" in svg and "sdpa" in svg and "AdamW step" in svg

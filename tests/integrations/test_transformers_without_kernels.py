"""The integration works whether or not Hugging Face's ``kernels`` package is installed.

transformers >= 5.25 brings ``kernels`` along and imports it when it finds it. In a fresh process the import
system is made blind to ``kernels`` (the path finder answers "not found" for it, nothing is uninstalled),
then the same tiny Llama runs on transformers' eager attention (float64) and on flashtile (float32): the
logits agree, and ``kernels`` was neither found nor imported. The same run with ``kernels`` visible is the
control: there transformers does find it, so the blinding is what made the difference.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

RUN = r"""
import importlib.machinery, json, sys

HIDE = {hide!r}


class PathFinderWithout(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if HIDE and (name == "kernels" or name.startswith("kernels.")):
            return None
        return super().find_spec(name, path, target)


sys.meta_path[:] = [PathFinderWithout if f is importlib.machinery.PathFinder else f for f in sys.meta_path]

import torch
import transformers
from transformers.utils import is_kernels_available

from flashtile.integrations.transformers import register
from tests.integrations._hf_models import llama_config, token_ids, twins

name = register()
truth, ours = twins(llama_config(), name)
ids = token_ids(2, 12)
with torch.no_grad():
    error = (ours(ids).logits.double() - truth(ids).logits).abs().max().item()
print(json.dumps({{"kernels_available": is_kernels_available(), "kernels_imported": "kernels" in sys.modules,
                   "error": error, "transformers": transformers.__version__}}))
"""


def run(hide: bool) -> dict:
    from tests._imports import REPO

    # the fresh process imports tests.integrations by full name: the repository root is its first path entry
    code = f"import sys; sys.path.insert(0, {str(REPO)!r})\n" + RUN.format(hide=hide)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_flashtile_runs_in_transformers_without_the_kernels_package():
    result = run(hide=True)
    print(f"transformers {result['transformers']}, kernels hidden")
    assert result["kernels_available"] is False and result["kernels_imported"] is False, result
    assert result["error"] < 2e-4, result


def test_with_kernels_installed_transformers_finds_it_and_flashtile_still_agrees():
    from importlib.util import find_spec

    if find_spec("kernels") is None:
        pytest.skip("the kernels package is not installed here: the control needs it")
    result = run(hide=False)
    print(f"transformers {result['transformers']}, kernels visible")
    assert result["kernels_available"] is True, result
    assert result["error"] < 2e-4, result

"""flashtile._env: the mark that tells torch.compile to treat a function's answer as a constant, set without
importing torch._dynamo when flashtile is imported. That compile still honours it is what the torch.compile
tests of tests/test_api.py run (fullgraph: the dispatch's marked functions must not break the graph)."""

import subprocess
import sys

import torch

from flashtile._env import constant_under_compile


def test_the_mark_is_the_one_torch_compiler_sets():
    def ours():
        return 1

    def torchs():
        return 1

    constant_under_compile(ours)
    torch.compiler.assume_constant_result(torchs)
    assert vars(ours) == vars(torchs) and vars(ours)  # the same attributes, and at least one


def test_importing_flashtile_does_not_import_dynamo():
    code = "import sys, flashtile; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


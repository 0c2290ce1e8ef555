"""The backward's dK/dV kernel compiles for sm_90 in both dQ modes, without a GPU.

The atomic-dQ mode (``deterministic=False``) adds ``tl.atomic_add`` of a float32 tile inside the dK/dV
kernel. The interpreter runs it on the CPU (tests/kernels/test_backward.py checks its numbers), but the
interpreter does not compile; this test does (``tests/_sm90.py``), with the H200 settings of
``backward_config`` for bf16, D = 64 (64 x 64 tiles, 4 warps, 3 stages), and checks that the atomic
mode emits float32 atomic adds (``red``/``atom`` ... ``.add.f32``) and the deterministic mode none.
Skipped only where Triton has no NVIDIA backend.
"""

from __future__ import annotations

import re

import pytest

from _sm90 import compile_in_fresh_process

BODY = """
from flashtile.kernels import backward

types = dict(Q="*bf16", K="*bf16", V="*bf16", DO="*bf16", M="*fp32", L="*fp32", DELTA="*fp32", DK="*bf16",
             DV="*bf16", DQ_ACC="*fp32", unit="fp32", scale="fp32", qk_scale="fp32")
out = {}
for atomic in (False, True):
    constexprs = dict(CAUSAL=True, BLOCK_Q=64, BLOCK_K=64, HEAD_DIM=64, HEAD_DIM_PAD=64, SIGN=1,
                      DOT_PRECISION="tf32", ATOMIC_DQ=atomic, WIDE=False, INTERPRETED=False)
    kernel = sm90(backward.backward_dkdv_kernel, types, constexprs, num_warps=4, num_stages=3)
    out["atomic" if atomic else "deterministic"] = kernel.asm["ptx"]
print(json.dumps(out))
"""
ATOMIC_ADD_F32 = re.compile(r"\b(red|atom)\.[\w.]*add\.(v\d\.)?f32")


@pytest.fixture(scope="module")
def sm90_ptx() -> dict[str, str]:
    """dQ mode ("deterministic", "atomic") -> PTX of the bf16, D = 64 dK/dV kernel for sm_90."""
    return compile_in_fresh_process(BODY)


def test_atomic_dq_compiles_to_float32_atomic_adds_and_the_default_has_none(sm90_ptx):
    assert ".target sm_90a" in sm90_ptx["atomic"]
    assert ATOMIC_ADD_F32.search(sm90_ptx["atomic"]), "no float32 atomic add in the atomic-dQ kernel"
    assert not ATOMIC_ADD_F32.search(sm90_ptx["deterministic"]), "the deterministic kernel must not use atomics"

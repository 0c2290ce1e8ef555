"""The forward kernel's ``tl.dot`` becomes Hopper's ``wgmma`` on sm_90: pinned on PTX compiled without a GPU.

The forward-kernel chapter says Triton lowers ``tl.dot`` to Hopper's asynchronous warpgroup matrix
instructions, so that what the kernel lacks against cuDNN is elsewhere (warp specialisation, overlap of
softmax and matmuls). That is a claim about the compiler, so it is checked on the compiler's output: a
fresh process, without TRITON_INTERPRET, compiles ``_forward_kernel`` to PTX for
``GPUTarget("cuda", 90, 32)`` with the H200's bf16 settings for D = 64 (``forward_config``: 128 x 64
tiles, 8 warps, 3 stages), on both load paths: pointers (USE_TMA=False) and TMA (USE_TMA=True). The
TMA path's Q, K and V are host-built tensor descriptors; the compiler needs only their type, spelled
``tensordesc<bf16[1, 1, rows, 64]>`` as Triton's launcher would mangle a ``TensorDescriptor`` argument.
Both must contain ``wgmma.mma_async``; the TMA one must also load through ``cp.async.bulk.tensor``.
The pointer path is compiled once more with attention sinks (SINK=True: each row starts from its head's
sink), and ``ptxas -v`` counts both compiles' spills: the start state must not make the kernel spill more.
Skipped only where Triton has no NVIDIA backend (no ptxas to finish the compile).
"""

from __future__ import annotations

import pytest

from tests._sm90 import compiled, register

BODY = """
import re, subprocess, tempfile
import torch
from flashtile.kernels import forward


def spills(kernel):
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([triton.knobs.nvidia.ptxas.path, "-v", "--gpu-name=sm_90a", f"{tmp}/k.ptx", "-o",
                              f"{tmp}/k.o"], capture_output=True, text=True, check=True).stderr
    return int(re.search(r"(\\d+) bytes spill stores", log).group(1))


D, BLOCK_Q, BLOCK_K = 64, 128, 64
pointers = dict(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", ROW_STATS="*fp32", qk_scale="fp32")
out = {}
for use_tma in (False, True):
    types = dict(pointers)
    if use_tma:  # what mangle_type(TensorDescriptor(x, shape, strides, [1, 1, rows, D])) gives
        types.update(Q=f"tensordesc<bf16[1, 1, {BLOCK_Q}, {D}]>", K=f"tensordesc<bf16[1, 1, {BLOCK_K}, {D}]>",
                     V=f"tensordesc<bf16[1, 1, {BLOCK_K}, {D}]>")
    constexprs = dict(HEAD_DIM=D, HEAD_DIM_PAD=D, HEAD_DIM_V=D, HEAD_DIM_V_PAD=D, BLOCK_Q=BLOCK_Q, BLOCK_K=BLOCK_K,
                      CAUSAL=True, SIGN=1, USE_TMA=use_tma, DOT_PRECISION="tf32", INTERPRETED=False, BAND=False,
                      SOFTCAP=False)
    kernel = sm90(forward._forward_kernel, types, constexprs, num_warps=8, num_stages=3)
    out["tma" if use_tma else "pointers"] = kernel.asm["ptx"]
    if not use_tma:
        out["spills"] = spills(kernel)
        sink = sm90(forward._forward_kernel, dict(types, SINKS="*fp32"), dict(constexprs, SINK=True), num_warps=8,
                    num_stages=3)  # fmt: skip
        out["sink"], out["sink_spills"] = sink.asm["ptx"], spills(sink)
# unequal head dims at their own settings (forward_config), and the wider one's equal-dims call beside them
for d_qk, d_v in ((192, 128), (256, 256), (128, 64), (128, 128)):
    config = forward.forward_config(d_qk, torch.bfloat16, causal=True, tma=False, head_dim_v=d_v)
    pad = 1 << (d_qk - 1).bit_length()
    constexprs = dict(HEAD_DIM=d_qk, HEAD_DIM_PAD=pad, HEAD_DIM_V=d_v, HEAD_DIM_V_PAD=d_v, BLOCK_Q=config["block_q"],
                      BLOCK_K=config["block_k"], CAUSAL=True, SIGN=1, USE_TMA=False, DOT_PRECISION="tf32",
                      INTERPRETED=False, BAND=False, SOFTCAP=False)
    kernel = sm90(forward._forward_kernel, pointers, constexprs, num_warps=config["num_warps"],
                  num_stages=config["num_stages"], **({"maxnreg": config["maxnreg"]} if "maxnreg" in config else {}))
    out[f"{d_qk}/{d_v}"] = kernel.asm["ptx"]
    out[f"{d_qk}/{d_v} spills"], out[f"{d_qk}/{d_v} shared"] = spills(kernel), kernel.metadata.shared
print(json.dumps(out))
"""
register("forward", BODY)
# one worker runs every sm_90 compile test, one after the other (tests/_sm90.py)
pytestmark = pytest.mark.xdist_group("sm90")


@pytest.fixture(scope="module")
def sm90_ptx(tmp_path_factory) -> dict[str, str]:
    """load path ("pointers", "tma") -> PTX of the bf16, D = 64 forward kernel for sm_90; compiled once per
    run, with the other sm_90 bodies."""
    return compiled("forward", tmp_path_factory)


@pytest.mark.parametrize("path", ["pointers", "tma"])
def test_forward_dot_lowers_to_wgmma_on_sm90(sm90_ptx, path):
    ptx = sm90_ptx[path]
    assert ".target sm_90a" in ptx, "not compiled for Hopper's arch-specific target"
    assert "wgmma.mma_async" in ptx, f"{path}: no wgmma in the PTX; the chapter's claim no longer holds"


def test_forward_tma_path_loads_through_the_copy_engine(sm90_ptx):
    """A control for the parametrisation above: the two compiles really are the two load paths."""
    assert "cp.async.bulk.tensor" in sm90_ptx["tma"]
    assert "cp.async.bulk.tensor" not in sm90_ptx["pointers"]


def test_the_sink_start_state_compiles_to_wgmma_and_spills_no_more_than_without_it(sm90_ptx):
    assert "wgmma.mma_async" in sm90_ptx["sink"]
    assert sm90_ptx["sink"] != sm90_ptx["pointers"]  # a control: SINK=True compiled the start state in
    assert sm90_ptx["sink_spills"] <= sm90_ptx["spills"], (sm90_ptx["sink_spills"], sm90_ptx["spills"])


@pytest.mark.parametrize("d_qk, d_v, wider", [(192, 128, 256), (128, 64, 128)])
def test_unequal_head_dims_compile_to_wgmma_spill_no_more_than_the_wider_dims_and_fit(sm90_ptx, d_qk, d_v,
                                                                                      wider):  # fmt: skip
    """q, k d_qk wide and v, acc, o d_v wide, at ``forward_config``'s settings for the pair (causal,
    pointers: one more stage than the wider dim's equal-dims call, whose v tiles are wider): both dots still
    lower to wgmma, the kernel spills no more than that equal-dims kernel at its own settings, and its shared
    memory fits one block of the H100 and H200."""
    key, equal = f"{d_qk}/{d_v}", f"{wider}/{wider}"
    assert "wgmma.mma_async" in sm90_ptx[key]
    assert sm90_ptx[f"{key} shared"] <= 227 * 1024, sm90_ptx[f"{key} shared"]
    assert sm90_ptx[f"{key} spills"] <= sm90_ptx[f"{equal} spills"], (sm90_ptx[f"{key} spills"], equal)

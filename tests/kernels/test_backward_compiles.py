"""The backward kernels compile for sm_90 without a GPU: atomics only where asked for, few spills.

The atomic-dQ mode (``deterministic=False``) adds ``tl.atomic_add`` of a float32 tile inside the dK/dV
kernel. The interpreter runs it on the CPU (tests/kernels/test_backward.py checks its numbers), but the
interpreter does not compile; this test does (``tests/_sm90.py``), and checks that the atomic mode emits
float32 atomic adds (``red``/``atom`` ... ``.add.f32``) and the deterministic mode none.

It also compiles both kernels with the H200 settings ``backward_config`` picks for bf16 at D = 64 and D =
128 from 1k tokens on, causal, as a launch on contiguous tensors would specialise them (head-dim strides
of 1, pointers and row strides divisible by 16), and runs ptxas on the result: a kernel that spills
registers to local memory can be slower than a smaller tile that does not. Measured on the H200 it was
not, for a few hundred bytes (230-480 with the chosen settings), but a tile's worth of spills must not
come back. (The compiled kernel's own ``n_spills`` needs a GPU driver; ``ptxas -v`` reports the same
count from the PTX.)
Skipped only where Triton has no NVIDIA backend.
"""

from __future__ import annotations

import re

import pytest

from tests._sm90 import compiled, register

BODY = """
import re, subprocess, tempfile
import torch
from flashtile.kernels import backward

POINTERS = dict(Q="*bf16", K="*bf16", V="*bf16", DO="*bf16", O="*bf16", STATS="*fp32", ROWS="*fp32", DK="*bf16",
                DV="*bf16", DQ="*bf16", DQ_ACC="*fp32", unit="fp32", scale="fp32", qk_scale="fp32")


def like_a_launch(fn, constexprs, num_warps, num_stages):
    return sm90_like_a_launch(fn, POINTERS, constexprs, num_warps=num_warps, num_stages=num_stages)


def spills(kernel):
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([triton.knobs.nvidia.ptxas.path, "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a",
                              f"{tmp}/k.ptx", "-o", f"{tmp}/k.o"], capture_output=True, text=True, check=True).stderr
    spilled = int(re.search(r"(\\d+) bytes spill stores", log).group(1))
    return spilled, int(re.search(r"Used (\\d+) registers", log).group(1))


out = {"ptx": {}, "stats": []}
for D in (64, 128):
    config = backward.backward_config(D, torch.bfloat16, 8192)  # the settings from 1k tokens on
    common = dict(CAUSAL=True, HEAD_DIM=D, HEAD_DIM_PAD=D, HEAD_DIM_V=D, HEAD_DIM_V_PAD=D, SIGN=1,
                  DOT_PRECISION="tf32", WIDE=False, USE_TMA=False, BAND=False,
                  SOFTCAP=False)  # no window, no cap: the switches compile out
    for atomic in (False, True):
        dkdv = backward.backward_config(D, torch.bfloat16, 8192, atomic_dq=atomic, work=0)["dkdv"]  # pointers
        bq, bk, warps, stages = dkdv
        kernel = like_a_launch(backward.backward_dkdv_kernel, dict(common, BLOCK_Q=bq, BLOCK_K=bk, ATOMIC_DQ=atomic,
                               INTERPRETED=False, SPLIT=1), warps, stages)
        name = "dkdv_atomic" if atomic else "dkdv"
        if D == 64:
            out["ptx"]["atomic" if atomic else "deterministic"] = kernel.asm["ptx"]
        out["stats"].append([name, D, dkdv, *spills(kernel), kernel.metadata.shared])
    bq, bk, warps, stages = config["dq"]
    kernel = like_a_launch(backward.backward_dq_kernel, dict(common, BLOCK_Q=bq, BLOCK_K=bk), warps, stages)
    out["stats"].append(["dq", D, config["dq"], *spills(kernel), kernel.metadata.shared])
    # tma=True: the streamed tiles come through descriptors, spelled as Triton's launcher mangles them
    bq, bk, warps, stages = config["dkdv"]
    POINTERS.update(Q=f"tensordesc<bf16[1, 1, {bq}, {D}]>", DO=f"tensordesc<bf16[1, 1, {bq}, {D}]>")
    kernel = like_a_launch(backward.backward_dkdv_kernel, dict(common, BLOCK_Q=bq, BLOCK_K=bk, ATOMIC_DQ=False,
                           INTERPRETED=False, USE_TMA=True, SPLIT=1), warps, stages)
    out["stats"].append(["dkdv_tma", D, config["dkdv"], *spills(kernel), kernel.metadata.shared])
    bq, bk, warps, stages = config["dq"]
    POINTERS.update(Q="*bf16", DO="*bf16", K=f"tensordesc<bf16[1, 1, {bk}, {D}]>",
                    V=f"tensordesc<bf16[1, 1, {bk}, {D}]>")
    kernel = like_a_launch(backward.backward_dq_kernel, dict(common, BLOCK_Q=bq, BLOCK_K=bk, USE_TMA=True), warps,
                           stages)
    out["stats"].append(["dq_tma", D, config["dq"], *spills(kernel), kernel.metadata.shared])
    POINTERS.update(K="*bf16", V="*bf16")
for D in (64, 128, 256):  # the atomic mode through TMA: each dQ share one bulk add through DQ_ACC's descriptor
    bq, bk, warps, stages = backward.backward_config(D, torch.bfloat16, 8192, atomic_dq=True)["dkdv"]
    tile = f"[1, 1, {bq}, {D}]>"
    POINTERS.update(Q=f"tensordesc<bf16{tile}", DO=f"tensordesc<bf16{tile}", DQ_ACC=f"tensordesc<fp32{tile}")
    kernel = like_a_launch(backward.backward_dkdv_kernel, dict(common, HEAD_DIM=D, HEAD_DIM_PAD=D, HEAD_DIM_V=D,
                           HEAD_DIM_V_PAD=D, BLOCK_Q=bq,
                           BLOCK_K=bk, ATOMIC_DQ=True, INTERPRETED=False, USE_TMA=True, SPLIT=1, DQ_REDUCE=True),
                           warps, stages)
    out["ptx"][f"bulk_{D}"] = kernel.asm["ptx"]
    out["stats"].append(["dkdv_bulk", D, (bq, bk, warps, stages), *spills(kernel), kernel.metadata.shared])
POINTERS.update(Q="*bf16", DO="*bf16", DQ_ACC="*fp32")
for d_qk, d_v in ((192, 128), (128, 64)):  # unequal head dims, at their own settings (backward_config)
    config = backward.backward_config(d_qk, torch.bfloat16, 8192, work=0, head_dim_v=d_v)  # pointers
    pads = dict(HEAD_DIM=d_qk, HEAD_DIM_PAD=1 << (d_qk - 1).bit_length(), HEAD_DIM_V=d_v, HEAD_DIM_V_PAD=d_v)
    bq, bk, warps, stages = config["dkdv"]
    kernel = like_a_launch(backward.backward_dkdv_kernel, dict(common, **pads, BLOCK_Q=bq, BLOCK_K=bk, ATOMIC_DQ=False,
                           INTERPRETED=False, SPLIT=1), warps, stages)
    out["ptx"][f"dkdv_{d_qk}_{d_v}"] = kernel.asm["ptx"]
    out["stats"].append([f"dkdv {d_qk}/{d_v}", d_qk, config["dkdv"], *spills(kernel), kernel.metadata.shared])
    bq, bk, warps, stages = config["dq"]
    kernel = like_a_launch(backward.backward_dq_kernel, dict(common, **pads, BLOCK_Q=bq, BLOCK_K=bk), warps, stages)
    out["ptx"][f"dq_{d_qk}_{d_v}"] = kernel.asm["ptx"]
    out["stats"].append([f"dq {d_qk}/{d_v}", d_qk, config["dq"], *spills(kernel), kernel.metadata.shared])
print(json.dumps(out))
"""
register("backward", BODY)
# one worker runs every sm_90 compile test, one after the other (tests/_sm90.py)
pytestmark = pytest.mark.xdist_group("sm90")
ATOMIC_ADD_F32 = re.compile(r"\b(red|atom)\.[\w.]*add\.(v\d\.)?f32")
H200_SHARED_BYTES = 227 * 1024  # the most shared memory one block may use on the H100 and H200


@pytest.fixture(scope="module")
def sm90(tmp_path_factory) -> dict:
    """{"ptx": dQ mode -> PTX of the bf16, D = 64 dK/dV kernel, "stats": [kernel, D, config, spills, regs, shared]};
    compiled once per run, with the other sm_90 bodies."""
    return compiled("backward", tmp_path_factory)


def test_atomic_dq_compiles_to_float32_atomic_adds_and_the_default_has_none(sm90):
    ptx = sm90["ptx"]
    assert ".target sm_90a" in ptx["atomic"]
    assert ATOMIC_ADD_F32.search(ptx["atomic"]), "no float32 atomic add in the atomic-dQ kernel"
    assert not ATOMIC_ADD_F32.search(ptx["deterministic"]), "the deterministic kernel must not use atomics"


def test_the_atomic_mode_through_tma_adds_each_dq_share_as_one_bulk_add(sm90):
    """With TMA the atomic mode's dQ shares go through ``cp.reduce.async.bulk.tensor`` (the copy engine adds the
    whole tile in L2), and no per-element float32 atomic is left: per element, the backward measured 0.56-0.80x the
    speed of the bulk form (bench/results/sweeps/atomic-dq-reduce.json)."""
    for D in (64, 128, 256):
        ptx = sm90["ptx"][f"bulk_{D}"]
        assert re.search(r"cp\.reduce\.async\.bulk\.tensor\.4d\.global\.shared::cta\.add", ptx), D
        assert not ATOMIC_ADD_F32.search(ptx), f"a per-element float32 atomic add is left at D = {D}"


# The measured H200 configs (4 warps) spill a few hundred bytes, and ran twice as fast as the 8-warp
# tiles that spill nothing (bench/results/sweeps/backward-v2-configs.json). What must not come back is
# a tile's worth of spills: the first backward's 64 x 64 dK/dV tiles spilled 748 bytes at D = 128, its
# fp32 dQ tiles 32 KB.
MAX_SPILL_BYTES = 512


def test_the_h200_configs_spill_at_most_a_few_registers_and_fit_in_shared_memory(sm90):
    for kernel, D, config, spill_bytes, regs, shared in sm90["stats"]:
        where = f"{kernel} at D = {D} with {config}: {regs} registers, {shared} bytes of shared memory"
        assert spill_bytes <= MAX_SPILL_BYTES, f"{where} spills {spill_bytes} bytes"
        assert shared <= H200_SHARED_BYTES, where


def test_tma_loads_free_the_registers_that_tiles_of_pointers_hold(sm90):
    """A pointer load keeps a 64-bit address per element of the tile in registers until the copy is issued;
    a descriptor load needs four coordinates. With Triton 3.7's ptxas the dK/dV kernel at the H200 configs
    spilled 232 (D = 64) and 388 (D = 128) bytes on the pointer path, 48 and 160 through descriptors."""
    stats = {(kernel, D): (spill_bytes, regs) for kernel, D, _, spill_bytes, regs, _ in sm90["stats"]}
    for D in (64, 128):
        assert stats["dkdv_tma", D][0] < stats["dkdv", D][0], (D, stats["dkdv_tma", D], stats["dkdv", D])
        assert stats["dq_tma", D][1] <= stats["dq", D][1], (D, stats["dq_tma", D], stats["dq", D])


@pytest.mark.parametrize("d_qk, d_v", [(192, 128), (128, 64)])
def test_unequal_head_dims_compile_both_kernels_to_wgmma_at_their_settings(sm90, d_qk, d_v):
    """The dK/dV and dQ kernels with q, k d_qk wide and v, do d_v wide, at ``backward_config``'s settings for
    the pair: their matmuls still lower to wgmma; their spills and shared memory are held to the limits of
    the test above, which takes their stats too."""
    for kernel in ("dkdv", "dq"):
        assert "wgmma.mma_async" in sm90["ptx"][f"{kernel}_{d_qk}_{d_v}"], (kernel, d_qk, d_v)
    assert {f"dkdv {d_qk}/{d_v}", f"dq {d_qk}/{d_v}"} <= {row[0] for row in sm90["stats"]}

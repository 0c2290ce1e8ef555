"""The decode kernels compile for the H200 (sm_90) with the installed Triton, on a machine without a GPU.

The interpreter runs the kernels' Python, not Triton's compiler, so a type error that only the
compiler sees (an int32 meeting an int64 in a loop-carried value, say) would pass every CPU test and
fail on the first GPU call. A fresh process, without TRITON_INTERPRET, compiles each kernel to PTX for
``GPUTarget("cuda", 90, 32)`` and reports its shared memory, which must fit the H200's 227 KB.
"""

from __future__ import annotations

import pytest

from tests._sm90 import compiled, register

BODY = """
from flashtile.kernels import decode

shared = {}
# the last variant: a sink in the split kernel's start state and d_qk = 192, d_v = 128 (DeepSeek's MLA)
for dtype, paged, masks, sink in [("bf16", False, False, False), ("bf16", True, False, False),
                                  ("fp32", True, False, False), ("bf16", True, True, False),
                                  ("bf16", True, False, True)]:
    types = dict(Q="*" + dtype, K="*" + dtype, V="*" + dtype, SEQLENS="*i32", BLOCK_TABLE="*i32",
                 SINKS="*fp32", O_PART="*fp32", LSE_PART="*fp32", qk_scale="fp32", unit="fp32", softcap="fp32")
    d_qk, d_v = (192, 128) if sink else (80, 80)
    constexprs = dict(HEAD_DIM=d_qk, HEAD_DIM_PAD=triton.next_power_of_2(d_qk), HEAD_DIM_V=d_v,
                      HEAD_DIM_V_PAD=triton.next_power_of_2(d_v), BLOCK_M=64,
                      BLOCK_K=32 if dtype == "fp32" or sink else 64,
                      PAGE_SIZE=16, PAGED=paged, HAS_SEQLENS=True, SIGN=1,
                      DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", BAND=masks, SOFTCAP=masks,
                      STORE_LSE=not masks, SINK=sink)
    stages = 3 if dtype == "bf16" and not sink else 2
    kernel = sm90(decode._decode_split_kernel, types, constexprs, num_warps=4, num_stages=stages)
    name = f"split-{dtype}-paged={paged}" + ("-window-softcap" if masks else "") + ("-sink-192-128" if sink else "")
    shared[name] = kernel.metadata.shared
merge_types = dict(SINKS="*bf16", O_PART="*fp32", LSE_PART="*fp32", O="*bf16", LSE="*fp32")
for d_v, sink in [(128, False), (64, True)]:
    merge = sm90(decode._decode_merge_kernel, merge_types,
                 dict(HEAD_DIM_V=d_v, HEAD_DIM_V_PAD=d_v, SPLITS_PAD=128, SINK=sink), num_warps=4)
    shared[f"merge-bf16-d_v={d_v}" + ("-sink" if sink else "")] = merge.metadata.shared

# How many K and V tiles the software pipeliner keeps in flight, contiguous and paged, at the H200 setting,
# compiled as a launch on contiguous bf16 tensors specialises it: head-dim strides of 1, and 16-divisible
# pointers and strides (without those hints no copy is asynchronous, and nothing is pipelined).
import re
names = list(inspect.signature(decode._decode_split_kernel.fn).parameters)
types = dict(Q="*bf16", K="*bf16", V="*bf16", SEQLENS="*i32", BLOCK_TABLE="*i32", SINKS="*fp32", O_PART="*fp32",
             LSE_PART="*fp32", qk_scale="fp32", unit="fp32", softcap="fp32")
buffers = {}
for paged, page in [(False, 1), (True, 16), (True, 256)]:
    fixed = dict(constexprs, BLOCK_M=16, BLOCK_K=64, PAGED=paged, PAGE_SIZE=page, HEAD_DIM=128, HEAD_DIM_PAD=128,
                 HEAD_DIM_V=128, HEAD_DIM_V_PAD=128, DOT_PRECISION="tf32", BAND=False, SOFTCAP=False, STORE_LSE=True,
                 SINK=False,
                 **{n: 1 for n in names if n.startswith("stride_") and n.endswith("d")})
    signature = {n: "constexpr" if n in fixed else types.get(n, "i32") for n in names}
    hinted = [n for n in names if n not in fixed and (types.get(n, "").startswith("*") or n.startswith("stride_"))
              and n != "stride_tp"]
    source = ASTSource(fn=decode._decode_split_kernel, signature=signature, constexprs=fixed,
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in hinted})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
    found = re.findall(r"local_alloc : \\(\\) -> !ttg.memdesc<(\\d+)x\\d+x\\d+xbf16", kernel.asm["ttgir"])
    buffers[f"paged={paged}, page={page}"] = sorted(set(int(n) for n in found))
print(json.dumps({"shared": shared, "buffers": buffers}))
"""
register("decode", BODY)
# one worker runs every sm_90 compile test, one after the other (tests/_sm90.py)
pytestmark = pytest.mark.xdist_group("sm90")


def test_decode_kernels_compile_for_sm90_without_a_gpu(tmp_path_factory):
    out = compiled("decode", tmp_path_factory)
    shared = out["shared"]
    assert len(shared) == 7, shared
    assert all(0 <= n <= 227 * 1024 for n in shared.values()), shared


def test_paged_caches_keep_as_many_tiles_in_flight_as_contiguous_ones(tmp_path_factory):
    """The block table is read one tile ahead. Read in the same iteration as the K and V loads it
    addresses, it left the pipeliner one buffer of K and V at num_stages = 3, against two for a
    contiguous cache: half the loads in flight, and paged caches read 10-20% slower (PERF_LOG)."""
    buffers = compiled("decode", tmp_path_factory)["buffers"]
    assert buffers["paged=False, page=1"] == [2], buffers
    assert buffers["paged=True, page=16"] == buffers["paged=True, page=256"] == [2], buffers

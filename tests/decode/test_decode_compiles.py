"""The decode kernels compile for the H200 (sm_90) with the installed Triton, on a machine without a GPU.

The interpreter runs the kernels' Python, not Triton's compiler, so a type error that only the
compiler sees (an int32 meeting an int64 in a loop-carried value, say) would pass every CPU test and
fail on the first GPU call. A fresh process, without TRITON_INTERPRET, compiles each kernel to PTX for
``GPUTarget("cuda", 90, 32)`` and reports its shared memory, which must fit the H200's 227 KB.
"""

from __future__ import annotations

from _sm90 import compile_in_fresh_process

BODY = """
from flashtile.kernels import decode

shared = {}
for dtype, paged in [("bf16", False), ("bf16", True), ("fp32", True)]:
    types = dict(Q="*" + dtype, K="*" + dtype, V="*" + dtype, SEQLENS="*i32", BLOCK_TABLE="*i32",
                 O_PART="*fp32", LSE_PART="*fp32", qk_scale="fp32")
    constexprs = dict(HEAD_DIM=80, HEAD_DIM_PAD=128, BLOCK_M=64, BLOCK_K=64 if dtype == "bf16" else 32,
                      PAGE_SIZE=16, PAGED=paged, HAS_SEQLENS=True, SIGN=1,
                      DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", EARLY_MERGE_LAUNCH=False)
    stages = 3 if dtype == "bf16" else 2
    kernel = sm90(decode._decode_split_kernel, types, constexprs, num_warps=4, num_stages=stages)
    shared[f"split-{dtype}-paged={paged}"] = kernel.metadata.shared
merge = sm90(decode._decode_merge_kernel, dict(O_PART="*fp32", LSE_PART="*fp32", O="*bf16", LSE="*fp32"),
             dict(HEAD_DIM=128, HEAD_DIM_PAD=128, SPLITS_PAD=128, WAIT_FOR_SPLITS=False), num_warps=4)
shared["merge-bf16"] = merge.metadata.shared

# Programmatic dependent launch: the split kernel signals at once; the merge waits before its first load.
ptx = {}
for pdl in (False, True):
    split = sm90(decode._decode_split_kernel, types, dict(constexprs, EARLY_MERGE_LAUNCH=pdl), num_warps=4,
                 num_stages=2)
    merge = sm90(decode._decode_merge_kernel, dict(O_PART="*fp32", LSE_PART="*fp32", O="*bf16", LSE="*fp32"),
                 dict(HEAD_DIM=128, HEAD_DIM_PAD=128, SPLITS_PAD=128, WAIT_FOR_SPLITS=pdl), num_warps=4)
    ptx[pdl] = {"split": split.asm["ptx"], "merge": merge.asm["ptx"]}
print(json.dumps({"shared": shared, "ptx_plain": ptx[False], "ptx_pdl": ptx[True]}))
"""


def test_decode_kernels_compile_for_sm90_without_a_gpu():
    out = compile_in_fresh_process(BODY)
    shared = out["shared"]
    assert len(shared) == 4
    assert all(0 <= n <= 227 * 1024 for n in shared.values()), shared

    # pdl=True: the merge kernel may start before the split kernel ends, so it must wait before any load.
    plain, pdl = out["ptx_plain"], out["ptx_pdl"]
    assert "griddepcontrol" not in plain["split"] + plain["merge"]
    assert "griddepcontrol.launch_dependents" in pdl["split"]
    merge = pdl["merge"]
    assert "griddepcontrol.wait" in merge
    assert merge.index("griddepcontrol.wait") < merge.index("ld.global"), "a load of the partials before the wait"

"""The FP8 forward's PV sum in two forms, for the sm_90 compile test (tests/kernels/test_fp8_forward.py).

Both sum each tile's E4M3 product in the dot's own accumulator and add it to acc in float32; PASS_ACC
passes acc into the dot with ``max_num_imprecise_acc`` (the package's form), the other adds outside the
dot. ptxas serialises every wgmma of the first (C7514) and not of the second, yet in the whole kernel the
second measured 9-16 % slower on the H200 (bench/PERF_LOG.md): a measured trade that the package takes.
"""

import triton
import triton.language as tl


@triton.jit
def pv_forms(Q, K, V, O, T, PASS_ACC: tl.constexpr):
    i = tl.arange(0, 128)
    j = tl.arange(0, 64)
    d = tl.arange(0, 128)
    q = tl.load(Q + i[:, None] * 128 + d[None, :])  # (128, 128) e4m3
    acc = tl.zeros([128, 128], dtype=tl.float32)
    for start in range(0, T, 64):
        k = tl.load(K + (start + j)[:, None] * 128 + d[None, :])  # (64, 128)
        v_t = tl.load(V + d[:, None] * T + (start + j)[None, :])  # (128, 64), keys contiguous
        p8 = tl.dot(q, tl.trans(k)).to(tl.float8e4nv)
        if PASS_ACC:
            acc = tl.dot(p8, tl.trans(v_t), acc * 0.5, max_num_imprecise_acc=64)
        else:
            acc = acc * 0.5 + tl.dot(p8, tl.trans(v_t))
    tl.store(O + i[:, None] * 128 + d[None, :], acc)

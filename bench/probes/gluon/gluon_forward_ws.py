"""A measured probe, not part of the package: the forward in Gluon, warp-specialised into two consumer
warpgroups of 64 query rows each that share the K/V stages of one 128-row tile but never wait for each
other (mbarriers only, no CTA barrier), so one can run its softmax while the other's matmuls use the
tensor cores. Consumer 0 also issues the TMA loads once both consumers released a stage; a separate
producer warp would make the CTA 12 warps, whose 168-register limit made ptxas serialise every wgmma.

D = 128, bf16/fp16, offset 0, TMA-compatible layouts. ``PYTHONPATH=src python bench/probes/gluon/gluon_forward_ws.py``
on an H200 checks it against float32 attention and times it against flashtile's kernel and cuDNN.
Results: bench/results/sweeps/forward-gluon-probe.json (provider "gluon_ws_probe"), bench/PERF_LOG.md.
"""

import functools

import torch
import triton
from gluon_forward import _program, _softmax_tile, _write_rows, launch_arguments, sdpa, time_against_baselines
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)


@gluon.jit
def _load_tile(t, args, STAGES: gl.constexpr, BLOCK_K: gl.constexpr):
    """Consumer 0's producer duty: once both consumers released its stage, fetch K and V tile t (if t < n)."""
    (q_desc, k_desc, v_desc, o_desc, ROW_STATS, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
     b, h, h_kv, q_start, n, n_full, H, Tq, Tk, offset, qk_scale, n_rows) = args
    stage = t % STAGES
    phase = (t // STAGES) & 1
    live = t < n
    mbarrier.wait(k_empty.index(stage), phase ^ 1, pred=live)
    mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes, pred=live)
    tma.async_copy_global_to_shared(k_desc, [b, h_kv, t * BLOCK_K, 0], k_ready.index(stage), k_smem.index(stage),
                                    pred=live)
    mbarrier.wait(v_empty.index(stage), phase ^ 1, pred=live)
    mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes, pred=live)
    tma.async_copy_global_to_shared(v_desc, [b, h_kv, t * BLOCK_K, 0], v_ready.index(stage), v_smem.index(stage),
                                    pred=live)


@gluon.jit
def _consume_tile(j, m, l, acc, q, rows, args, s_layout: gl.constexpr, o_layout: gl.constexpr,
                  MASKED: gl.constexpr, LOADS: gl.constexpr, STAGES: gl.constexpr, BLOCK_Q: gl.constexpr,
                  BLOCK_K: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, SIGN: gl.constexpr,
                  FUSED: gl.constexpr):
    (q_desc, k_desc, v_desc, o_desc, ROW_STATS, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
     b, h, h_kv, q_start, n, n_full, H, Tq, Tk, offset, qk_scale, n_rows) = args
    HALF: gl.constexpr = BLOCK_Q // 2
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    stage = j % STAGES
    phase = (j // STAGES) & 1
    mbarrier.wait(k_ready.index(stage), phase)
    zero_s = gl.zeros([HALF, BLOCK_K], gl.float32, layout=s_layout)
    s = warpgroup_mma(q, k_smem.index(stage).reshape([BLOCK_K, HEAD_DIM]).permute((1, 0)), zero_s, use_acc=False)
    mbarrier.arrive(k_empty.index(stage), count=1)
    p, alpha, m, l = _softmax_tile(s, m, l, j * BLOCK_K, 0, rows, Tk, offset, qk_scale, s_layout, BLOCK_K, CAUSAL,
                                   SIGN, MASKED, FUSED)
    acc = warpgroup_mma_wait(0, deps=(acc,))  # the previous tile's P V
    mbarrier.arrive(v_empty.index((j + STAGES - 1) % STAGES), count=1, pred=j > 0)
    if LOADS:  # consumer 0 also streams the tiles: tile j + STAGES - 1 into the stage tile j - 1 used
        _load_tile(j + STAGES - 1, args, STAGES, BLOCK_K)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_op = gl.convert_layout(p.to(q_desc.dtype), p_layout)
    mbarrier.wait(v_ready.index(stage), phase)
    acc = warpgroup_mma(p_op, v_smem.index(stage).reshape([BLOCK_K, HEAD_DIM]), acc, is_async=True)
    return m, l, acc


@gluon.jit
def _consumer(args, c: gl.constexpr, STAGES: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_K: gl.constexpr,
              HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, SIGN: gl.constexpr, FUSED: gl.constexpr):
    (q_desc, k_desc, v_desc, o_desc, ROW_STATS, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
     b, h, h_kv, q_start, n, n_full, H, Tq, Tk, offset, qk_scale, n_rows) = args
    HALF: gl.constexpr = BLOCK_Q // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_K, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows = q_start + c * HALF + gl.arange(0, HALF, layout=row_s)
    m = gl.full([HALF], float("-inf"), gl.float32, layout=row_s)
    l = gl.zeros([HALF], gl.float32, layout=row_s)
    acc = warpgroup_mma_init(gl.zeros([HALF, HEAD_DIM], gl.float32, layout=o_layout))
    if c == 0:
        for i in gl.static_range(2):
            mbarrier.expect(q_bars.index(i), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [b, h, q_start + i * HALF, 0], q_bars.index(i), q_smem.index(i))
        for t in gl.static_range(STAGES - 1):
            _load_tile(t, args, STAGES, BLOCK_K)
    mbarrier.wait(q_bars.index(c), 0)
    q = q_smem.index(c).reshape([HALF, HEAD_DIM])
    for j in range(0, n_full):
        m, l, acc = _consume_tile(j, m, l, acc, q, rows, args, s_layout, o_layout, False, c == 0,
                                  STAGES, BLOCK_Q, BLOCK_K, HEAD_DIM, CAUSAL, SIGN, FUSED)
    for j in range(n_full, n):
        m, l, acc = _consume_tile(j, m, l, acc, q, rows, args, s_layout, o_layout, True, c == 0,
                                  STAGES, BLOCK_Q, BLOCK_K, HEAD_DIM, CAUSAL, SIGN, FUSED)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    _write_rows(acc, m, l, rows, q_smem.index(c), o_desc, [b, h, q_start + c * HALF, 0], ROW_STATS, b * H + h, Tq,
                n_rows, qk_scale)


@gluon.jit
def _consumer0(args, STAGES: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_K: gl.constexpr,
              HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, SIGN: gl.constexpr, FUSED: gl.constexpr):
    _consumer(args, 0, STAGES, BLOCK_Q, BLOCK_K, HEAD_DIM, CAUSAL, SIGN, FUSED)


@gluon.jit
def _consumer1(args, STAGES: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_K: gl.constexpr,
              HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, SIGN: gl.constexpr, FUSED: gl.constexpr):
    _consumer(args, 1, STAGES, BLOCK_Q, BLOCK_K, HEAD_DIM, CAUSAL, SIGN, FUSED)


@gluon.jit
def ws_forward_kernel(
    q_desc, k_desc, v_desc, o_desc, ROW_STATS, H, group, Tq, Tk, offset, qk_scale, n_rows,
    BLOCK_Q: gl.constexpr, BLOCK_K: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
    SIGN: gl.constexpr, FUSED: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):
    b, h, h_kv, q_start = _program(group, BLOCK_Q, CAUSAL)
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival from each consumer
        mbarrier.init(v_empty.index(i), count=2)
    if CAUSAL:
        n = gl.minimum(gl.cdiv(Tk, BLOCK_K), (gl.minimum(q_start + BLOCK_Q, Tq) - 1 + offset + BLOCK_K) // BLOCK_K)
        n_full = gl.minimum(gl.maximum(q_start + offset + 1, 0) // BLOCK_K, Tk // BLOCK_K)
    else:
        n = gl.cdiv(Tk, BLOCK_K)
        n_full = Tk // BLOCK_K
    args = (q_desc, k_desc, v_desc, o_desc, ROW_STATS, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready,
            v_empty, b, h, h_kv, q_start, n, n_full, H, Tq, Tk, offset, qk_scale, n_rows)
    gl.warp_specialize([(_consumer0, (args, STAGES, BLOCK_Q, BLOCK_K, HEAD_DIM, CAUSAL, SIGN, FUSED)),
                        (_consumer1, (args, STAGES, BLOCK_Q, BLOCK_K, HEAD_DIM, CAUSAL, SIGN, FUSED))], [4],
                       [CONSUMER_REGS])


def ws_forward(q, k, v, causal, BQ=128, BK=128, stages=2, fused=True, consumer_regs=240, maxnreg=240):
    """Launch the probe: o and the (3, B, H, Tq) row stats; each consumer's Q and O tiles are BQ / 2 rows."""
    o, stats, grid, args, sign = launch_arguments(q, k, v, BQ // 2, BK)
    ws_forward_kernel[(triton.cdiv(q.shape[2], BQ), *grid[1:])](
        *args, BLOCK_Q=BQ, BLOCK_K=BK, HEAD_DIM=q.shape[3], CAUSAL=causal, SIGN=sign, FUSED=fused, STAGES=stages,
        CONSUMER_REGS=consumer_regs, num_warps=4, maxnreg=maxnreg)
    return o, stats


def check(B, H, T, group, causal):
    """Max |o - o_fp32| of both tile widths on one shape."""
    q = torch.randn(B, H, T, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, H // group, T, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ref = sdpa(q.float(), *(x.float().repeat_interleave(group, 1) for x in (k, v)), is_causal=causal)
    for block_k in (128, 64):
        o, _ = ws_forward(q, k, v, causal, BK=block_k)
        err = (o.float() - ref).abs().max().item()
        print(f"check B={B} H={H} T={T} causal={causal} BK={block_k}: o err {err:.2e}")


def time_shape(B, H, T, causal):
    settings = ((128, 2), (64, 3), (64, 2))  # block_k, stages
    variants = {f"ws{bk}s{st}": functools.partial(ws_forward, BK=bk, stages=st) for bk, st in settings}
    time_against_baselines(B, H, T, causal, variants, rep=120)

def main():
    torch.manual_seed(0)
    for shape in [(1, 2, 256, 1, False), (2, 3, 1000, 3, True), (1, 4, 777, 2, False), (2, 2, 384, 1, True),
                  (1, 2, 130, 1, True)]:
        check(*shape)
    for shape in [(8, 16, 2048, False), (4, 16, 4096, False), (1, 16, 16384, False), (8, 16, 2048, True),
                  (2, 16, 8192, True), (32, 16, 512, False), (32, 16, 512, True)]:
        time_shape(*shape)


if __name__ == "__main__":
    main()

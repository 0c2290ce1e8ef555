"""A measured probe, not part of the package: the forward written in Gluon (Triton's lower-level language)
with asynchronous warpgroup matmuls, in FlashAttention-3's order: each iteration issues the next tile's
scores and this tile's P V back to back, then runs the next tile's softmax while P V is in flight.

D = 128 only, bf16/fp16, no negative scale handling beyond SIGN, every query tile sees at least one key
(offset >= 0), TMA-compatible layouts. It checks itself against float32 attention and times itself against
flashtile's Triton kernel and cuDNN: ``PYTHONPATH=src python bench/probes/gluon/gluon_forward.py`` on an H200.
Results and what they showed: bench/results/sweeps/forward-gluon-probe.json, bench/PERF_LOG.md.
"""
import functools
import math

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtile.kernels.forward import flash_attention
from flashtile.kernels.parts import kernel_scale

sdpa = torch.nn.functional.scaled_dot_product_attention
LN2: gl.constexpr = gl.constexpr(math.log(2.0))


@gluon.jit
def _issue_tile(desc, b, h, start, bar, dest, pred):
    mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, [b, h, start, 0], bar, dest, pred=pred)


@gluon.jit
def _softmax_tile(s, m, l, k_start, q_start, rows, Tk, offset, qk_scale, s_layout: gl.constexpr,
                  BLOCK_K: gl.constexpr, CAUSAL: gl.constexpr, SIGN: gl.constexpr, MASKED: gl.constexpr,
                  FUSED: gl.constexpr):
    """u (this tile's raw dots) -> p, alpha, and the new (m, l): the online-softmax update."""
    if SIGN != 1:
        s = s * SIGN
    if MASKED:
        cols = k_start + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_layout))
        visible = cols[None, :] < Tk
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + offset)
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m, gl.max(s, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2((m - m_safe) * qk_scale)
    if FUSED:  # one multiply-add per score; lse then carries the shift's rounding (a probe: not corrected)
        p = gl.exp2(s * qk_scale - (m_safe * qk_scale)[:, None])
    else:
        p = gl.exp2((s - m_safe[:, None]) * qk_scale)
    l = alpha * l + gl.sum(p, 1)
    return p, alpha, m_new, l


@gluon.jit
def _step(j, n, p, alpha, m, l, acc, q, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, b, h_kv, zero_s,
          q_start, rows, Tk, offset, qk_scale, s_layout: gl.constexpr, row_o: gl.constexpr, p_layout: gl.constexpr,
          BLOCK_K: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, SIGN: gl.constexpr,
          MASKED: gl.constexpr, FUSED: gl.constexpr):
    """P V of tile j (p holds P_j) while the softmax of tile j + 1 runs; returns P_{j+1} and the state."""
    stage = j % 2
    # the scores of tile j are done, so K stage j % 2 is free: refill it with tile j + 2
    gl.thread_barrier()
    _issue_tile(k_desc, b, h_kv, (j + 2) * BLOCK_K, k_bars.index(stage), k_smem.index(stage), j + 2 < n)
    mbarrier.wait(k_bars.index((j + 1) % 2), ((j + 1) // 2) & 1)
    s_next = warpgroup_mma(q, k_smem.index((j + 1) % 2).reshape([BLOCK_K, HEAD_DIM]).permute((1, 0)), zero_s,
                           use_acc=False, is_async=True)
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    mbarrier.wait(v_bars.index(stage), (j // 2) & 1)
    acc = warpgroup_mma(p, v_smem.index(stage).reshape([BLOCK_K, HEAD_DIM]), acc, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s_next,))  # the scores of tile j + 1; P V of tile j still running
    p, alpha, m, l = _softmax_tile(s, m, l, (j + 1) * BLOCK_K, q_start, rows, Tk, offset, qk_scale, s_layout,
                                   BLOCK_K, CAUSAL, SIGN, MASKED, FUSED)
    acc, p = warpgroup_mma_wait(0, deps=(acc, p))  # p as a dependency keeps the softmax above this wait
    gl.thread_barrier()  # both warpgroups are done with V stage j % 2: refill it with tile j + 2
    _issue_tile(v_desc, b, h_kv, (j + 2) * BLOCK_K, v_bars.index(stage), v_smem.index(stage), j + 2 < n)
    p = gl.convert_layout(p.to(q.dtype), p_layout)
    return p, alpha, m, l, acc


@gluon.jit
def _program(group, BLOCK_Q: gl.constexpr, CAUSAL: gl.constexpr):
    """(batch, head, kv head, first query row) of this program; causal grids run the longest tiles first."""
    q_index = gl.program_id(0)
    if CAUSAL:
        q_index = gl.num_programs(0) - 1 - q_index
    h = gl.program_id(1)
    return gl.program_id(2), h, h // group, q_index * BLOCK_Q


@gluon.jit
def _write_rows(acc, m, l, rows, o_tile, o_desc, coord, ROW_STATS, plane, Tq, n_rows, qk_scale):
    """o = acc / l through the (1, 1, R, D) shared tile o_tile and a TMA store at coord; lse, m and l into
    ROW_STATS (3, B, H, Tq) at plane b * H + h, with the package's rules for empty and infinite rows."""
    R: gl.constexpr = o_tile.shape[2]
    D: gl.constexpr = o_tile.shape[3]
    empty = l == 0.0
    l_safe = gl.where(empty, 1.0, l)
    o = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, acc.type.layout))[:, None]
    o_tile.reshape([R, D]).store(o.to(o_tile.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, coord, o_tile)
    lse = (m * qk_scale + gl.log2(l_safe)) * LN2
    lse = gl.where(m == float("inf"), m, lse)
    lse = gl.where(empty, float("-inf"), lse)
    ptrs = ROW_STATS + plane.to(gl.int64) * Tq + rows
    ok = rows < Tq
    gl.store(ptrs, lse, mask=ok)
    gl.store(ptrs + n_rows, m, mask=ok)
    gl.store(ptrs + 2 * n_rows, l, mask=ok)
    tma.store_wait(0)


@gluon.jit
def hopper_forward_kernel(
    q_desc, k_desc, v_desc, o_desc, ROW_STATS, H, group, Tq, Tk, offset, qk_scale, n_rows,
    BLOCK_Q: gl.constexpr, BLOCK_K: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
    SIGN: gl.constexpr, FUSED: gl.constexpr, num_warps: gl.constexpr,
):
    b, h, h_kv, q_start = _program(group, BLOCK_Q, CAUSAL)
    dtype: gl.constexpr = q_desc.dtype

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_K, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)

    if CAUSAL:
        n = gl.minimum(gl.cdiv(Tk, BLOCK_K), (gl.minimum(q_start + BLOCK_Q, Tq) - 1 + offset + BLOCK_K) // BLOCK_K)
    else:
        n = gl.cdiv(Tk, BLOCK_K)

    _issue_tile(q_desc, b, h, q_start, q_bar, q_smem, True)
    _issue_tile(k_desc, b, h_kv, 0, k_bars.index(0), k_smem.index(0), True)
    _issue_tile(v_desc, b, h_kv, 0, v_bars.index(0), v_smem.index(0), True)
    _issue_tile(k_desc, b, h_kv, BLOCK_K, k_bars.index(1), k_smem.index(1), n > 1)
    _issue_tile(v_desc, b, h_kv, BLOCK_K, v_bars.index(1), v_smem.index(1), n > 1)

    q = q_smem.reshape([BLOCK_Q, HEAD_DIM])
    rows = q_start + gl.arange(0, BLOCK_Q, layout=row_s)
    m = gl.full([BLOCK_Q], float("-inf"), gl.float32, layout=row_s)
    l = gl.zeros([BLOCK_Q], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_Q, HEAD_DIM], gl.float32, layout=o_layout)
    zero_s = gl.zeros([BLOCK_Q, BLOCK_K], gl.float32, layout=s_layout)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bars.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).reshape([BLOCK_K, HEAD_DIM]).permute((1, 0)), zero_s, use_acc=False)
    p, alpha, m, l = _softmax_tile(s, m, l, 0, q_start, rows, Tk, offset, qk_scale, s_layout, BLOCK_K, CAUSAL, SIGN,
                                   True, FUSED)
    p = gl.convert_layout(p.to(dtype), p_layout)
    if CAUSAL:
        n_full = gl.minimum(gl.maximum(q_start + offset + 1, 0) // BLOCK_K, Tk // BLOCK_K)
    else:
        n_full = Tk // BLOCK_K
    # iteration j folds in P V of tile j and the softmax of tile j + 1: unmasked while tile j + 1 is full
    for j in range(0, n_full - 1):
        p, alpha, m, l, acc = _step(j, n, p, alpha, m, l, acc, q, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, b,
                                    h_kv, zero_s, q_start, rows, Tk, offset, qk_scale, s_layout, row_o, p_layout,
                                    BLOCK_K, HEAD_DIM, CAUSAL, SIGN, False, FUSED)
    for j in range(gl.maximum(n_full - 1, 0), n - 1):
        p, alpha, m, l, acc = _step(j, n, p, alpha, m, l, acc, q, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, b,
                                    h_kv, zero_s, q_start, rows, Tk, offset, qk_scale, s_layout, row_o, p_layout,
                                    BLOCK_K, HEAD_DIM, CAUSAL, SIGN, True, FUSED)
    last = n - 1
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    mbarrier.wait(v_bars.index(last % 2), (last // 2) & 1)
    acc = warpgroup_mma(p, v_smem.index(last % 2).reshape([BLOCK_K, HEAD_DIM]), acc)

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(2):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))

    _write_rows(acc, m, l, rows, q_smem, o_desc, [b, h, q_start, 0], ROW_STATS, b * H + h, Tq, n_rows, qk_scale)


def tile_descriptor(x, rows):
    """A host TMA descriptor for (1, 1, rows, D) tiles of a (B, H, T, D) bf16 or fp16 tensor."""
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, x.shape[3]], dtype)
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, rows, x.shape[3]], layout)


def launch_arguments(q, k, v, block_q, block_k):
    """o, the row stats, the grid and the kernel's leading arguments, shared by both probes."""
    B, H, Tq, D = q.shape
    o = torch.empty_like(q)
    stats = torch.empty((3, B, H, Tq), device=q.device, dtype=torch.float32)
    sc = kernel_scale(1 / math.sqrt(D))
    args = (tile_descriptor(q, block_q), tile_descriptor(k, block_k), tile_descriptor(v, block_k),
            tile_descriptor(o, block_q), stats, H, H // k.shape[1], Tq, k.shape[2], 0, sc.qk_scale, B * H * Tq)
    return o, stats, (triton.cdiv(Tq, block_q), H, B), args, sc.sign


def gl_forward(q, k, v, causal, BQ=128, BK=128, fused=False, warps=8):
    """Launch the probe on (B, H, T, D) CUDA tensors: o and the (3, B, H, Tq) row stats (lse, m, l)."""
    o, stats, grid, args, sign = launch_arguments(q, k, v, BQ, BK)
    hopper_forward_kernel[grid](*args, BLOCK_Q=BQ, BLOCK_K=BK, HEAD_DIM=q.shape[3], CAUSAL=causal, SIGN=sign,
                                FUSED=fused, num_warps=warps)
    return o, stats


CHECKS = [(1, 2, 256, 256, 1, False), (2, 3, 1000, 1000, 3, True), (1, 4, 777, 777, 2, False),
          (2, 2, 384, 384, 1, True), (1, 2, 130, 130, 1, True), (1, 2, 64, 64, 2, False)]  # B, H, Tq, Tk, group, causal
TIMED = [(8, 16, 2048, False), (4, 16, 4096, False), (1, 16, 16384, False), (8, 16, 2048, True),
         (2, 16, 8192, True), (16, 16, 1024, False), (32, 16, 512, False), (32, 16, 512, True)]
VARIANTS = ((128, 128, 8), (128, 64, 8), (64, 64, 4), (64, 128, 4))  # block_q, block_k, warps


def check(B, H, Tq, Tk, group, causal):
    """Max |o - o_fp32| and |lse - a float32 logsumexp| for each variant."""
    q = torch.randn(B, H, Tq, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, H // group, Tk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kk, vv = (x.float().repeat_interleave(group, 1) for x in (k, v))
    ref = sdpa(q.float(), kk, vv, is_causal=causal)
    s = (q.float() @ kk.transpose(-1, -2)) / math.sqrt(128)
    if causal:
        s = s.masked_fill(torch.ones(Tq, Tk, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    lse_ref = torch.logsumexp(s, -1)
    for fused, block_q, warps in ((False, 128, 8), (True, 128, 8), (True, 64, 4)):
        o, stats = gl_forward(q, k, v, causal, BQ=block_q, fused=fused, warps=warps)
        print(f"check B={B} H={H}/{H // group} T={Tq} causal={causal} fused={fused} block_q={block_q}: "
              f"o err {(o.float() - ref).abs().max().item():.2e} lse err {(stats[0] - lse_ref).abs().max().item():.2e}")


def time_against_baselines(B, H, T, causal, variants, rep=150):
    """Time cuDNN, flashtile's kernel and each of ``variants`` ({label: f(q, k, v, causal)}) on one shape
    and print one line: times in µs and r = cuDNN time / time."""
    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=rep)

    q, k, v = (torch.randn(B, H, T, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        t_cudnn = bench(lambda: sdpa(q, k, v, is_causal=causal))
    t_flashtile = bench(lambda: flash_attention(q, k, v, causal=causal))
    parts = []
    for label, fn in variants.items():
        t = bench(lambda f=fn: f(q, k, v, causal))
        parts.append(f"{label} {t * 1e3:.1f}us r={t_cudnn / t:.3f}")
    print(f"B={B} H={H} T={T} causal={causal}: cudnn {t_cudnn * 1e3:.1f} flashtile {t_flashtile * 1e3:.1f} "
          f"(r={t_cudnn / t_flashtile:.3f}) | " + " | ".join(parts), flush=True)


def time_shape(B, H, T, causal):
    variants = {f"gl{bq}x{bk}": functools.partial(gl_forward, BQ=bq, BK=bk, fused=True, warps=w)
                for bq, bk, w in VARIANTS}
    time_against_baselines(B, H, T, causal, variants)

def main():
    torch.manual_seed(0)
    for shape in CHECKS:
        check(*shape)
    for shape in TIMED:
        time_shape(*shape)


if __name__ == "__main__":
    main()

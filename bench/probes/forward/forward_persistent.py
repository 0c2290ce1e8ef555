"""A measured probe, not part of the package: a persistent forward for short non-causal sequences.

Why (bench/PERF_LOG.md, "What a program pays once"): at D = 128, T = 512 flashtile's grid pays about
68 µs whatever the key count, cuDNN's about 29; cuDNN launches one program per SM that walks many
query tiles, so it can fetch the next tile's Q while it finishes the current one. Here each of
``programs`` programs walks query tiles ``pid, pid + programs, ...``; with ``flatten`` Triton's
pipeliner flattens the tile loop and the key loop into one, so the loads of the next tile's first
key tiles are issued while the current tile ends (it compiles only with Q loaded through pointers:
with a descriptor load of Q, Triton 3.7's TMA lowering fails on the flattened loop; and compiled for
sm_90 offline, the flattened 64 x 64 loop spills 4.9 KB, the 128 x 128 one needs 328 KB of shared
memory). The body is the package's fused online-softmax
step and epilogue (``parts.fused_softmax_step``, ``parts.write_rows``); the prototype takes full
tiles only (Tq and Tk multiples of the tiles, no mask) and has no exact rerun for huge scores.

``PYTHONPATH=src python bench/probes/forward/forward_persistent.py OUT.json`` on an H200 times the prototype;
``... OUT.json ablation`` times its lean body with the package's extras added one at a time. The package's
own persistent launch (``flash_attention(..., persistent=)``, forced on and off over the standard sweep:
``sweeps/forward-persistent-package.json``) was measured with this file's ``package`` mode at commit
6b77767; it did not help, and both were removed (they stay in that commit).
"""
import sys

import torch
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from flashtile.bench.common import attention_tflops, median_ms, save_result
from flashtile.bench.providers import make_inputs
from flashtile.kernels.forward import flash_attention
from flashtile.kernels.parts import delta_of_shift, fused_softmax_step, kernel_scale, tile_descriptor, tma_strides
from flashtile.kernels.parts import write_rows as _write_rows


@triton.jit
def _persistent_forward(Q, QP, K, V, O, ROW_STATS, H, Tq, Tk, qk_scale, n_rows, n_tiles, n_q_tiles,
                        stride_ob, stride_oh, stride_ot, PROGRAMS: tl.constexpr, BLOCK_Q: tl.constexpr,
                        BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr, FLATTEN: tl.constexpr,
                        Q_POINTERS: tl.constexpr, MASKED_LOOP: tl.constexpr = False,
                        RERUN_CHECK: tl.constexpr = False):  # fmt: skip
    d = tl.arange(0, HEAD_DIM)
    n_key_tiles = Tk // BLOCK_K
    for tile in tl.range(tl.program_id(0), n_tiles, PROGRAMS, flatten=FLATTEN):
        q_index = tile % n_q_tiles
        h = (tile // n_q_tiles) % H
        b = tile // (n_q_tiles * H)
        q_start = q_index * BLOCK_Q
        i = q_start + tl.arange(0, BLOCK_Q)
        if Q_POINTERS:  # the flattened loop does not compile with a descriptor load of Q (Triton 3.7: TMA lowering)
            q = tl.load(QP + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                        + i[:, None].to(tl.int64) * stride_ot + d[None, :])  # fmt: skip
        else:
            q = Q.load([b, h, q_start, 0]).reshape(BLOCK_Q, HEAD_DIM)
        m = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_Q], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)
        shift = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
        largest = tl.zeros([BLOCK_Q], dtype=tl.float32)
        for k_index in range(n_key_tiles):
            k = tl.trans(K.load([b, h, k_index * BLOCK_K, 0]).reshape(BLOCK_K, HEAD_DIM))
            v = V.load([b, h, k_index * BLOCK_K, 0]).reshape(BLOCK_K, HEAD_DIM)
            u = tl.dot(q, k)
            acc, l, m, shift, largest = fused_softmax_step(acc, l, m, shift, largest, u, v, qk_scale, "tf32", False)
        if MASKED_LOOP:  # the package's second loop, for a ragged last key tile: no steps here, its code is there
            for k_index in range(n_key_tiles, tl.cdiv(Tk, BLOCK_K)):
                k = tl.trans(K.load([b, h, k_index * BLOCK_K, 0]).reshape(BLOCK_K, HEAD_DIM))
                v = V.load([b, h, k_index * BLOCK_K, 0]).reshape(BLOCK_K, HEAD_DIM)
                j = k_index * BLOCK_K + tl.arange(0, BLOCK_K)
                u = tl.where(j[None, :] < Tk, tl.dot(q, k), float("-inf"))
                acc, l, m, shift, largest = fused_softmax_step(acc, l, m, shift, largest, u, v, qk_scale, "tf32",
                                                               False)  # fmt: skip
        delta = delta_of_shift(m, shift, l, qk_scale, False)
        out = (O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + i[:, None].to(tl.int64) * stride_ot
               + d[None, :])  # fmt: skip
        rows = ROW_STATS + (b * H + h).to(tl.int64) * Tq + i
        if RERUN_CHECK:  # the package's check for huge scores: a reduction over the tile and a second epilogue
            if tl.max(largest, 0) < 16777216.0:
                _write_rows(acc, l, m, delta, qk_scale, out, rows, n_rows, i[:, None] < Tq, i < Tq)
            else:
                _write_rows(acc * 0.5, l, m, delta, qk_scale, out, rows, n_rows, i[:, None] < Tq, i < Tq)
        else:
            _write_rows(acc, l, m, delta, qk_scale, out, rows, n_rows, i[:, None] < Tq, i < Tq)


def persistent(q, k, v, block_q, block_k, num_warps, num_stages, per_sm, flatten, masked_loop=False,
               rerun_check=False):  # fmt: skip
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    assert Tq % block_q == 0 and Tk % block_k == 0 and k.shape[1] == H
    # per_sm = 0: one program per tile (the loop takes one step), the plain grid's launch
    programs = per_sm * torch.cuda.get_device_properties(q.device).multi_processor_count or B * H * (Tq // block_q)
    o = torch.empty_like(q)
    stats = torch.empty((3, B, H, Tq), dtype=torch.float32, device=q.device)
    loads = [tile_descriptor(x, tma_strides(x), rows, D) for x, rows in ((q, block_q), (k, block_k), (v, block_k))]
    n_q_tiles = Tq // block_q
    assert q.stride() == o.stride()  # Q through pointers uses o's strides (both contiguous here)
    qk_scale = kernel_scale(D**-0.5).qk_scale
    _persistent_forward[(programs,)](loads[0], q, *loads[1:], o, stats, H, Tq, Tk, qk_scale, B * H * Tq,
                                     B * H * n_q_tiles, n_q_tiles, *o.stride()[:3], PROGRAMS=programs,
                                     BLOCK_Q=block_q, BLOCK_K=block_k, HEAD_DIM=D, FLATTEN=flatten, Q_POINTERS=flatten,
                                     MASKED_LOOP=masked_loop, RERUN_CHECK=rerun_check,
                                     num_warps=num_warps, num_stages=num_stages)  # fmt: skip
    return o


VARIANTS = [  # (block_q, block_k, num_warps, num_stages, programs per SM, flatten)
    (64, 64, 4, 3, 2, False), (64, 64, 4, 3, 2, True), (128, 128, 8, 3, 1, False), (64, 64, 4, 3, 1, False),
]
SHAPES = [(32, 512), (16, 1024), (8, 2048)]
# The prototype's lean body against the package's: one program per tile (per_sm = 0) or persistent, with the
# package's empty masked loop and its check for huge scores added one at a time
ABLATION = [(bq, bk, w, 3, per_sm, False, masked, rerun) for bq, bk, w, per_sm in ((64, 64, 4, 0), (64, 64, 4, 2),
            (128, 128, 8, 0), (128, 128, 8, 1)) for masked, rerun in ((False, False), (True, False), (False, True),
            (True, True))]  # fmt: skip  # (B, T) at H = 16, D = 128, no mask: the standard sweep


def measure_shape(B, T, variants) -> list[dict]:
    shape = dict(B=B, H=16, H_kv=16, Tq=T, Tk=T, D=128, causal=False, layout="bhtd", dtype="bf16")
    q, k, v = make_inputs(shape)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        truth = scaled_dot_product_attention(q, k, v)
        cudnn = median_ms(lambda: scaled_dot_product_attention(q, k, v), warmup=25, rep=100)
    plain = median_ms(lambda: flash_attention(q, k, v), warmup=25, rep=100)
    rows = [{"pass": "forward", "provider": provider, **shape, "ms": round(ms, 4),
             "tflops": round(attention_tflops(shape, ms), 1)} for provider, ms in (("sdpa_cudnn", cudnn),
                                                                                  ("flashtile", plain))]  # fmt: skip
    print(f"T{T}: cuDNN {cudnn * 1e3:.1f} us, flashtile {plain * 1e3:.1f} us ({cudnn / plain:.3f})", flush=True)
    for variant in variants:
        try:
            err = (persistent(q, k, v, *variant).float() - truth.float()).abs().max().item()
            assert err < 0.05, err
            ms = median_ms(lambda variant=variant: persistent(q, k, v, *variant), warmup=25, rep=100)
        except Exception as exc:  # a variant the compiler refuses is a result too
            print(f"  {variant}: failed: {str(exc)[-300:]}", flush=True)
            rows.append({"pass": "forward", "provider": "flashtile_persistent", **shape, "ms": None,
                         "error": str(exc)[-300:], "variant": list(variant)})  # fmt: skip
            continue
        rows.append({"pass": "forward", "provider": "flashtile_persistent", **shape, "ms": round(ms, 4),
                     "tflops": round(attention_tflops(shape, ms), 1), "variant": list(variant),
                     "max_abs_diff_vs_cudnn": err, "ratio_to_cudnn": round(cudnn / ms, 3)})  # fmt: skip
        print(f"  {variant}: {ms * 1e3:.1f} us ({cudnn / ms:.3f} of cuDNN)", flush=True)
    return rows


def main(out, variants=None):
    torch.cuda.set_device(0)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    shapes = SHAPES if variants is None else [(32, 512), (8, 2048)]
    rows = [row for B, T in shapes for row in measure_shape(B, T, variants or VARIANTS)]
    save_result(out, rows, "do_bench median (warmup 25 ms, rep 100 ms, L2 cleared before each repetition); "
                "variant = (block_q, block_k, num_warps, num_stages, programs per SM (0: one per tile), flatten"
                "[, empty masked loop, huge-score check])")


if __name__ == "__main__":
    main(sys.argv[1], ABLATION if sys.argv[2:] == ["ablation"] else None)

"""A measured probe, not part of the package: forward launch settings beyond the default table, at the
standard-sweep cells that miss issue 10's targets (D = 128 at T = 512 and 2k-8k, D = 64 at 2k), each
timed beside cuDNN in the same process, with the register count and spills the device's Triton gave.

What it adds to earlier sweeps: a register cap (``maxnreg``) that lets two or three programs share an
SM where the unconstrained compile holds one (or two), with tiles small enough to compile without spills
under the cap (checked offline for sm_90 first), and 128 x 128 tiles at D = 64. Every variant's output is
compared with SDPA-cuDNN's before it is timed.

``PYTHONPATH=src python bench/probes/forward/forward_config_probe.py OUT.json [wide-d64]`` on an H200; ``wide-d64``
times the D = 64 unmasked standard-sweep cells with the old and the new default instead.
"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from flashtile.bench.common import attention_tflops, median_ms, save_result
from flashtile.bench.providers import make_inputs
from flashtile.kernels.forward import checked_forward_plan, forward_with_plan
from flashtile.kernels.parts import tile_descriptor

# (block_q, block_k, num_warps, num_stages, maxnreg, tma)
CONFIGS = {
    128: [(64, 64, 4, 3, None, True), (128, 128, 8, 3, None, True), (64, 32, 4, 3, 168, True),
          (64, 32, 4, 4, 168, True), (128, 32, 8, 3, 128, True), (128, 32, 8, 4, 128, True),
          (128, 64, 8, 3, None, True)],
    64: [(128, 64, 8, 3, 128, False), (128, 64, 8, 4, 128, False), (128, 64, 8, 3, 128, True),
         (256, 64, 16, 3, 128, False), (128, 128, 8, 3, 128, True), (64, 64, 4, 3, None, False)],
}
SHAPES = [(128, 512, 32, 16, True), (128, 512, 32, 16, False), (128, 2048, 8, 16, True),
          (128, 2048, 8, 16, False), (128, 4096, 4, 16, False), (128, 8192, 2, 16, False),
          (64, 2048, 8, 32, False), (64, 2048, 8, 32, True)]


def run_config(q, k, v, causal, config):
    block_q, block_k, num_warps, num_stages, maxnreg, tma = config
    plan = checked_forward_plan(q, k, v, causal=causal, scale=None, alignment="upper_left", window=None, softcap=None,
                                return_stats=False, block_q=block_q, block_k=block_k, num_warps=num_warps,
                                num_stages=num_stages, tma=tma)  # fmt: skip
    if maxnreg:
        plan.launch.options["maxnreg"] = maxnreg
    if tma and plan.tma is None:
        raise RuntimeError("TMA asked for but not taken")
    loads = (q, k, v)
    if plan.tma is not None:
        pad = plan.launch.constexprs["HEAD_DIM_PAD"]
        loads = tuple(tile_descriptor(x, s, rows, pad) for x, (s, rows) in zip(loads, plan.tma))
    o = torch.empty(plan.out_shape, dtype=q.dtype, device=q.device)
    stats = torch.empty((3, *plan.out_shape[:3]), dtype=torch.float32, device=q.device)
    compiled = plan.launch._full_launch((*loads, o, stats))
    compiled = compiled.result() if hasattr(compiled, "result") else compiled
    return plan, o, compiled.n_regs, compiled.n_spills


def measure_shape(D, T, B, H, causal, configs=CONFIGS) -> list[dict]:
    shape = dict(B=B, H=H, H_kv=H, Tq=T, Tk=T, D=D, causal=causal, layout="bhtd", dtype="bf16")
    q, k, v = make_inputs(shape)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        truth = scaled_dot_product_attention(q, k, v, is_causal=causal)
        cudnn = median_ms(lambda: scaled_dot_product_attention(q, k, v, is_causal=causal), warmup=25, rep=100)
    rows = [{"pass": "forward", "provider": "sdpa_cudnn", **shape, "ms": round(cudnn, 4),
             "tflops": round(attention_tflops(shape, cudnn), 1)}]
    for config in configs[D]:
        plan, o, regs, spills = run_config(q, k, v, causal, config)
        err = (o.float() - truth.float()).abs().max().item()
        assert err < 0.05, (shape, config, err)
        ms = median_ms(lambda plan=plan: forward_with_plan(plan, q, k, v), warmup=25, rep=100)
        block_q, block_k, num_warps, num_stages, maxnreg, tma = config
        rows.append({"pass": "forward", "provider": "flashtile", **shape, "ms": round(ms, 4),
                     "tflops": round(attention_tflops(shape, ms), 1), "block_q": block_q, "block_k": block_k,
                     "num_warps": num_warps, "num_stages": num_stages, "maxnreg": maxnreg,
                     "loads": "tma" if tma else "pointers", "n_regs": regs, "n_spills": spills,
                     "max_abs_diff_vs_cudnn": err, "ratio_to_cudnn": round(cudnn / ms, 3)})  # fmt: skip
        print(f"D{D} T{T} causal={causal} {config}: {ms * 1e3:8.1f} us  x cuDNN {cudnn / ms:.3f}  "
              f"regs {regs} spills {spills}", flush=True)
    return rows


# The D = 64 unmasked standard-sweep cells, the default before (128 x 64, pointers) and after (128 x 128, TMA)
WIDE_D64 = [(64, T, 16384 // T, 32, False) for T in (512, 1024, 2048, 4096, 8192, 16384)]
WIDE_D64_CONFIGS = [(128, 64, 8, 3, 128, False), (128, 128, 8, 3, 128, True)]


def main(out, which="probe"):
    shapes, configs = (WIDE_D64, {64: WIDE_D64_CONFIGS}) if which == "wide-d64" else (SHAPES, CONFIGS)
    rows = [row for shape in shapes for row in measure_shape(*shape, configs)]
    save_result(out, rows, "launcher with explicit settings (checked_forward_plan, maxnreg set on the launch), "
                "triton.testing.do_bench median (warmup 25 ms, rep 100 ms, L2 cleared before each repetition); "
                "cuDNN through SDPA in the same process; outputs checked against cuDNN's (max abs < 0.05)")


if __name__ == "__main__":
    main(*sys.argv[1:])

"""A measured probe, not part of the package: launch settings of the packed-documents kernels on the H200.

The varlen kernels load through pointers (a document's tiles start at any token, so no TMA descriptor fits
them), where the dense kernels' D = 128 settings were measured through TMA. This times the forward
(``flash_attention_varlen``) and the backward (``flash_attention_varlen_backward``) on the masks benchmark's
packed case (``bench.masks.document_lengths()``: 8 documents in 16k, causal within each, H = 16, D = 128,
bf16) for a few settings each, the backward's two kernels one at a time, after checking the forward's output
against the float32 truth per document and the backward's gradients against the default settings' ones. It
prints and saves ms and TFLOP/s (the pairs the documents keep). The default settings are each pass's first row.

``PYTHONPATH=src python bench/probes/varlen/varlen_configs.py OUT.json`` on an H200 (about three minutes).
"""

import sys

import torch

import flashtile.kernels.backward as backward_module
from flashtile.bench.common import median_ms, save_result
from flashtile.bench.masks import cu_seqlens, document_lengths, documents_truth
from flashtile.bench.providers import check_output, make_inputs
from flashtile.bench.shapes import shape
from flashtile.kernels.backward import flash_attention_varlen_backward
from flashtile.kernels.forward import flash_attention_varlen
from flashtile.reference.masks import document_visible_pairs

# (block_q, block_k, num_warps, num_stages); None: the launcher's default
FORWARD = [None, (128, 128, 8, 3), (128, 64, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3), (128, 32, 8, 3)]
# The backward's two kernels, each (block_q, block_k, num_warps, num_stages), the other kernel at its default:
# set through a stand-in for kernels.backward.backward_config (the launcher takes tile sizes only)
DKDV = [(32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2),
        (16, 64, 4, 3), (64, 32, 4, 3)]  # fmt: skip
DQ = [(64, 64, 4, 3), (128, 64, 8, 2), (64, 128, 4, 3), (128, 32, 8, 3), (64, 64, 4, 2), (32, 64, 4, 3)]


def main(out: str) -> None:
    lengths = document_lengths()
    s = shape(1, 16, sum(lengths), 128, True)
    q, k, v = make_inputs(s)
    truth = documents_truth(q, k, v, lengths)
    q, k, v = (x[0].transpose(0, 1) for x in (q, k, v))  # (T, H, D) views, as the benchmark passes them
    do = torch.randn_like(q)
    cu, longest = cu_seqlens(lengths, q.device), max(lengths)
    args = (cu, cu, longest, longest)
    flops = 4 * 16 * 128 * document_visible_pairs(cu.tolist(), cu.tolist(), causal=True)
    rows = []
    for config in FORWARD:
        settings = {} if config is None else dict(zip(("block_q", "block_k", "num_warps", "num_stages"), config))
        run = lambda settings=settings: flash_attention_varlen(q, k, v, *args, causal=True, checked=True, **settings)
        try:
            o, lse, stats = run()
            err = check_output("flashtile", o.transpose(0, 1)[None], truth, "bf16")
            ms = median_ms(run)
            rows.append(dict({"pass": "forward"}, config=config, ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                             max_abs_error_vs_fp32=round(err, 5)))  # fmt: skip
        except Exception as error:  # a setting past the shared memory: recorded, not fatal
            rows.append(dict({"pass": "forward"}, config=config, error=f"{type(error).__name__}: {error}"[:200]))
        print(rows[-1], file=sys.stderr, flush=True)
    o, lse, stats = flash_attention_varlen(q, k, v, *args, causal=True, checked=True)
    default_config = backward_module.backward_config
    run = lambda: flash_attention_varlen_backward(q, k, v, o, lse, do, *args, causal=True, stats=stats, checked=True)
    base = run()
    trials = [("default", None)] + [("dkdv", c) for c in DKDV] + [("dq", c) for c in DQ]
    for kernel, config in trials:

        def settings(*a, kernel=kernel, config=config, **kw):
            chosen = default_config(*a, **kw)
            return chosen if config is None else dict(chosen, **{kernel: config})

        backward_module.backward_config = settings
        try:
            grads = run()
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, base))
            ms = median_ms(run)
            row = dict(
                {"pass": "backward"},
                kernel=kernel,
                config=config,
                ms=round(ms, 4),
                tflops=round(2.5 * flops / ms / 1e9, 1),
                max_abs_grad_diff_vs_default=round(diff, 5),
            )
        except Exception as error:  # a setting past the shared memory: recorded, not fatal
            failure = f"{type(error).__name__}: {error}"[:200]
            row = dict({"pass": "backward"}, kernel=kernel, config=config, error=failure)
        finally:
            backward_module.backward_config = default_config
        rows.append(row)
        print(rows[-1], file=sys.stderr, flush=True)
    save_result(out, rows, "triton.testing.do_bench median via bench.common.median_ms; kernels called directly "
                "(checked=True: no host read of cu_seqlens)", lengths=lengths)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])

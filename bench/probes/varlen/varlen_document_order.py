"""A measured probe, not part of the package: does the order of the packed documents change the kernels' time?

The varlen grid is (tiles of the longest document, heads, documents), and the GPU starts programs about in
launch order, the document axis slowest: the last document's programs start last. If a long document
packed last leaves a tail of busy SMs, packing the same documents longest first should run faster. This
times the forward and the backward at their default settings on the masks benchmark's eight documents
(``bench.masks.document_lengths()``, H = 16, D = 128, bf16, causal within each) packed in three orders
(as drawn, longest first, shortest first), the same work each time, after checking each forward against
the float32 truth per document.

``PYTHONPATH=src python bench/probes/varlen/varlen_document_order.py OUT.json`` on an H200 (under a minute).
"""

import sys

import torch

from flashtile.bench.common import median_ms, save_result
from flashtile.bench.masks import cu_seqlens, document_lengths, documents_truth
from flashtile.bench.providers import check_output, make_inputs
from flashtile.bench.shapes import shape
from flashtile.kernels.backward import flash_attention_varlen_backward
from flashtile.kernels.forward import flash_attention_varlen
from flashtile.reference.masks import document_visible_pairs


def measure_order(order: str, lengths: list[int]) -> list[dict]:
    """Forward and backward rows of the documents packed with ``lengths`` in this order."""
    s = shape(1, 16, sum(lengths), 128, True)
    q, k, v = make_inputs(s)
    truth = documents_truth(q, k, v, lengths)
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))
    do = torch.randn_like(q)
    cu, longest = cu_seqlens(lengths, q.device), max(lengths)
    args = (cu, cu, longest, longest)
    flops = 4 * 16 * 128 * document_visible_pairs(cu.tolist(), cu.tolist(), causal=True)
    forward = lambda: flash_attention_varlen(q, k, v, *args, causal=True, checked=True)
    o, lse, stats = forward()
    err = check_output("flashtile", o.transpose(0, 1)[None], truth, "bf16")
    backward = lambda: flash_attention_varlen_backward(q, k, v, o, lse, do, *args, causal=True, stats=stats,
                                                       checked=True)  # fmt: skip
    rows = []
    for which, fn, factor in (("forward", forward, 1.0), ("backward", backward, 2.5)):
        ms = median_ms(fn)
        rows.append(dict({"pass": which}, order=order, lengths=lengths, ms=round(ms, 4),
                         tflops=round(factor * flops / ms / 1e9, 1), max_abs_error_vs_fp32=round(err, 5)))  # fmt: skip
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main(out: str) -> None:
    drawn = document_lengths()
    orders = {"as drawn": drawn, "longest first": sorted(drawn, reverse=True), "shortest first": sorted(drawn)}
    rows = [row for order, lengths in orders.items() for row in measure_order(order, lengths)]
    save_result(out, rows, "triton.testing.do_bench median via bench.common.median_ms; kernels called directly "
                "(checked=True), default settings, contiguous (T, H, D) inputs")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])

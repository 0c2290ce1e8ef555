"""The practice steps in order: each a ``battery.Step`` with its module, functions, chapter and cases.

The registry sits apart from ``battery`` (the cases, symptom rules and runner) and ``drills`` (the later
steps' cases, built on the battery's parts), so that neither imports the other back.
"""

from __future__ import annotations

from .battery import (
    Step,
    backward_cases,
    backward_kernel_cases,
    causal_cases,
    forward_cases,
    forward_kernel_cases,
    fused_softmax_cases,
    online_softmax_cases,
)
from .drills import (
    autograd_cases,
    decode_cases,
    gqa_cases,
    paged_cases,
    sink_cases,
    sink_gradient_cases,
    varlen_cases,
    window_cases,
)

# --8<-- [start:steps]
STEPS: tuple[Step, ...] = (
    Step(
        "online_softmax",
        "online_softmax",
        "flashtile.reference.online_softmax",
        ("online_softmax_update", "online_softmax_stats", "lse_from_stats", "merge"),
        "part-a/online-softmax/#the-derivation",
        "streaming (m, l), lse, merge",
        online_softmax_cases,
    ),
    Step(
        "forward",
        "forward",
        "flashtile.reference.forward",
        ("flash_attention_forward",),
        "part-a/forward/#the-derivation",
        "tiled forward with (m, l, acc)",
        forward_cases,
    ),
    Step(
        "causal",
        "forward",
        "flashtile.reference.forward",
        ("flash_attention_forward",),
        "part-a/causal-tiles/#the-derivation",
        "causal mask, both alignments, tile skipping",
        causal_cases,
    ),
    Step(
        "backward",
        "backward",
        "flashtile.reference.backward",
        ("flash_attention_backward",),
        "part-a/backward/#the-derivation",
        "recomputed P, D = rowsum(dO * O)",
        backward_cases,
    ),
    Step(
        "fused_softmax",
        "fused_softmax",
        "flashtile.kernels.softmax",
        ("softmax",),
        "part-b/fused-softmax/#the-derivation",
        "Triton row softmax",
        fused_softmax_cases,
        triton=True,
    ),
    Step(
        "forward_kernel",
        "forward_kernel",
        "flashtile.kernels.forward",
        ("flash_attention",),
        "part-b/forward-kernel/#the-derivation",
        "Triton forward kernel and launcher",
        forward_kernel_cases,
        triton=True,
    ),
    Step(
        "backward_kernel",
        "backward_kernel",
        "flashtile.kernels.backward",
        ("flash_attention_backward",),
        "part-b/backward-kernel/#the-derivation",
        "Triton dK/dV and dQ kernels, D preprocess",
        backward_kernel_cases,
        triton=True,
    ),
    Step(
        "autograd",
        "autograd",
        "flashtile.reference.autograd",
        ("reference_attention",),
        "part-a/backward/#the-listing",
        "autograd.Function: save lse, pass causal and scale on",
        autograd_cases,
    ),
    Step(
        "gqa",
        "gqa",
        "flashtile.reference.forward",
        ("flash_attention_forward",),
        "part-c/decode/#the-derivation",
        "drill: grouped-query attention (H_kv < H)",
        gqa_cases,
    ),
    Step(
        "window",
        "window",
        "flashtile.reference.forward",
        ("flash_attention_forward",),
        "part-a/beyond-causal/#the-derivation",
        "drill: a sliding window, its tiles skipped",
        window_cases,
    ),
    Step(
        "paged",
        "decode",
        "flashtile.reference.decode",
        ("gather_pages",),
        "part-c/decode/#the-derivation",
        "drill: the paged-KV gather through a block table",
        paged_cases,
    ),
    Step(
        "decode",
        "decode",
        "flashtile.reference.decode",
        ("decode_attention_reference",),
        "part-c/decode/#the-derivation",
        "drill: split-KV decode and the merge of partials",
        decode_cases,
    ),
    Step(
        "varlen",
        "varlen",
        "flashtile.reference.varlen",
        ("varlen_attention_forward",),
        "part-a/beyond-causal/#the-derivation",
        "drill: packed documents (cu_seqlens)",
        varlen_cases,
    ),
    Step(
        "sink",
        "sinks",
        "flashtile.reference.forward",
        ("flash_attention_forward",),
        "part-a/sinks-and-head-dims/#the-derivation",
        "drill: an attention sink in the tiled forward",
        sink_cases,
    ),
    Step(
        "sink_gradient",
        "sink_gradient",
        "flashtile.reference.sinks",
        ("sink_gradient",),
        "part-a/sinks-and-head-dims/#the-derivation",
        "drill: the sinks' gradient from lse and D",
        sink_gradient_cases,
    ),
)
# --8<-- [end:steps]

STEP_NAMES = tuple(s.name for s in STEPS)


def step_named(name: str) -> Step:
    """The step called ``name``; a KeyError naming the steps otherwise."""
    for step in STEPS:
        if step.name == name:
            return step
    raise KeyError(f"no step {name!r}; the steps are {', '.join(STEP_NAMES)}")
